"""How ``metrale serve`` starts: it takes its port before the model loads (a busy port fails at
once, exit status 1, one line naming the address and the cause), logs what the engine runs with
once it is ready (the same summary from an engine process and from an engine in process), and
refuses an empty ``METRALE_API_KEY`` where the server is reachable from other machines."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from serverkit import MODEL, http_client, new_llm  # noqa: E402

from metrale.entrypoints.cli import main  # noqa: E402
from metrale.entrypoints.engine_process import EngineProcess, engine_summary  # noqa: E402
from metrale.entrypoints.server.main import API_KEY_VARIABLE, listen_sockets, resolve_api_key, summary_lines  # noqa: E402
from metrale.errors import ConfigError  # noqa: E402


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "metrale.entrypoints.cli", "serve", *args]


def environment_without_key() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != API_KEY_VARIABLE}


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ---------------------------------------------------------------------------- the port first


@pytest.mark.parametrize("model", [MODEL, "/no/such/checkpoint"])
def test_a_busy_port_fails_at_once_before_the_model_loads(busy_port, model):
    """One line and exit status 1, before anything is loaded: a model that does not exist
    would have failed with status 2 had it been read first."""
    start = time.monotonic()
    result = subprocess.run(serve_command(model, "--device", "cpu", "--port", str(busy_port)), capture_output=True,
                            text=True, timeout=60, env=environment_without_key())
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert result.stderr == (f"metrale: error: cannot listen on 127.0.0.1:{busy_port}: address already in use "
                             "(another process listens there; stop it or choose another --port)\n")
    assert elapsed < 5, elapsed  # the interpreter's start; tiny-dense would also log "loading" and its summary


def test_listen_sockets_take_the_port_and_name_the_address_they_cannot_take():
    sockets = listen_sockets("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and 0 not in ports  # every address of localhost on the one port the system picked
        with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{ports.pop()}: address already in use"):
            listen_sockets("127.0.0.1", sockets[0].getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    with pytest.raises(OSError, match=r"cannot listen on no-such-host\.invalid:8000: "):
        listen_sockets("no-such-host.invalid", 8000)


# ------------------------------------------------------------------------ start-up summary


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


@pytest.mark.parametrize("in_process", [False, True], ids=["engine process", "engine in process"])
def test_the_server_logs_its_summary_then_listens_on_the_port_it_got(in_process):
    extra = ["--engine-in-process"] if in_process else []
    process = subprocess.Popen(
        serve_command(MODEL, "--device", "cpu", "--port", "0", "--no-progress", "--max-num-seqs", "4",
                      "--served-model-name", "tiny", *extra),
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=environment_without_key())
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stderr, lines), daemon=True).start()
    try:
        log: list[str] = []
        port = None
        deadline = time.monotonic() + 60
        while port is None:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            log.append(line.rstrip("\n"))
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", line)
            if match:
                port = int(match.group(1))
        with http_client(f"http://127.0.0.1:{port}") as http:
            assert http.get("/health").status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = "\n".join(log)
    expected = [
        "engine ready:",
        "  device: cpu, backend cpu",
        "(family dense), served as 'tiny'",
        "  dtype: float32",
        "  max model len: 1024 tokens",
        "  KV cache: 256 blocks of 16 tokens (4096 tokens)",
        "  max concurrency at 1024 tokens per sequence: 4 (the KV cache holds 4.00x, max_num_seqs 4)",
        "  max batched tokens: 2048 per step",
        "  prefix caching: on",
        "  CUDA graphs: off (not on a GPU)",
        "  overlap scheduling: on",
        "  LoRA: off",
        "  speculative decoding: off",
        "  tensor parallel size: 1 (expert parallel off)",
        "  batch invariant: off",
        "listening on http://127.0.0.1:",
    ]
    positions = [text.find(part) for part in expected]
    assert -1 not in positions and positions == sorted(positions), text


@pytest.mark.parametrize("options", [
    {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}, "enable_prefix_caching": False},
], ids=["lora", "speculative"])
def test_an_engine_process_reports_the_summary_its_llm_gives(options):
    engine = EngineProcess(MODEL, device="cpu", show_progress=False, max_num_seqs=8, **options)
    try:
        remote = engine.summary
    finally:
        engine.shutdown()
    with new_llm(max_num_seqs=8, **options) as llm:
        local = engine_summary(llm)
    assert remote == local
    lines = summary_lines(local, MODEL)
    if "enable_lora" in options:
        assert "  LoRA: 0 adapters (none yet), max_loras 2, max_lora_rank 8" in lines
    else:
        assert "  speculative decoding: ngram, 3 draft tokens per step" in lines
        assert "  prefix caching: off" in lines and "  overlap scheduling: off" in lines


def test_the_concurrency_line_counts_whole_sequences_of_blocks_and_every_limit():
    summary = engine_summary_like(kv_cache_blocks=100, block_size=16, max_model_len=1000, max_num_seqs=64, state_slots=None)
    # 1000 tokens take 63 blocks: one sequence fits in 100 blocks.
    assert "  max concurrency at 1000 tokens per sequence: 1 (the KV cache holds 1.59x, max_num_seqs 64)" in \
        summary_lines(summary, "m")
    summary = engine_summary_like(kv_cache_blocks=6400, block_size=16, max_model_len=1024, max_num_seqs=64, state_slots=8)
    assert ("  max concurrency at 1024 tokens per sequence: 8 (the KV cache holds 100.00x, max_num_seqs 64, "
            "8 recurrent-state slots)") in summary_lines(summary, "m")
    summary = engine_summary_like(cuda_graphs=False, cuda_graphs_off_reason="--no-cuda-graphs", tensor_parallel_size=2,
                                  device="cuda:0 (NVIDIA H200)", backend="cuda", dtype="bfloat16")
    lines = summary_lines(summary, "m")
    assert "  CUDA graphs: off (--no-cuda-graphs)" in lines and "  device: cuda:0 (NVIDIA H200), backend cuda" in lines
    assert "  tensor parallel size: 2 (expert parallel off)" in lines and "  dtype: bfloat16" in lines


def engine_summary_like(**changes):
    with new_llm(max_num_seqs=4) as llm:
        summary = engine_summary(llm)
    return {**summary, **changes}


# --------------------------------------------------------------------------------- API key


def test_an_empty_key_variable_is_refused_beyond_this_machine(monkeypatch, capsys):
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    start = time.monotonic()
    assert main(["serve", MODEL, "--device", "cpu", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert time.monotonic() - start < 2  # refused before the port or the model is taken
    err = capsys.readouterr().err
    assert err.startswith(f"metrale: error: {API_KEY_VARIABLE} is set but empty, which means no API key, and --host "
                          "0.0.0.0 reaches beyond this machine")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_an_empty_key_variable_on_a_loopback_host_means_no_key_and_says_so(monkeypatch, caplog, host):
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    with caplog.at_level(logging.WARNING, logger="metrale.entrypoints.server.main"):
        assert resolve_api_key(None, host) is None
    assert f"{API_KEY_VARIABLE} is set but empty: the server requires NO API key" in caplog.text


def test_the_key_comes_from_the_flag_then_the_variable(monkeypatch, caplog):
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    with caplog.at_level(logging.WARNING, logger="metrale.entrypoints.server.main"):
        assert resolve_api_key(None, "0.0.0.0") is None  # unset: no key (run_serve warns beyond loopback)
        monkeypatch.setenv(API_KEY_VARIABLE, "from-env")
        assert resolve_api_key(None, "0.0.0.0") == "from-env"
        assert resolve_api_key("from-flag", "0.0.0.0") == "from-flag"
    assert caplog.text == ""
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    assert resolve_api_key("from-flag", "0.0.0.0") == "from-flag"  # the flag wins over the empty variable


@pytest.mark.parametrize("flag, variable, source", [(" key", None, "--api-key"), (None, "key\n", API_KEY_VARIABLE)])
def test_a_key_with_whitespace_around_it_is_refused(monkeypatch, flag, variable, source):
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    if variable is not None:
        monkeypatch.setenv(API_KEY_VARIABLE, variable)
    with pytest.raises(ConfigError, match=f"the API key of {source} starts or ends with whitespace"):
        resolve_api_key(flag, "127.0.0.1")
