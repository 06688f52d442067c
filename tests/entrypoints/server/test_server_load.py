"""Load, disconnects and shutdown: 64 concurrent streams each equal to its solo greedy run, clients
that go away mid-stream leave nothing allocated, and a shutdown drains, aborts and stops."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from serverkit import (  # noqa: E402
    MODEL,
    Stack,
    async_http_client,
    engine_stopped,
    http_client,
    idle_report,
    metric_values,
    new_llm,
    read_stream,
    wait_idle,
)

from metrale import SamplingParams  # noqa: E402

WORDS = ("the list of items is sorted by the number of times each one was seen in the file and then written "
         "back to the disk before the program returns").split()


@pytest.fixture(scope="module")
def stack():
    stack = Stack()
    yield stack
    stack.close()


def load_workload(count: int = 64) -> list[tuple[str, int]]:
    """(prompt, max_tokens): prompts of 1 to 30 words, 4 to 24 tokens each."""
    return [(f"Case {i}: " + " ".join(WORDS[: (i * 7) % 31]), 4 + (i * 5) % 21) for i in range(count)]


def test_64_concurrent_streams_equal_their_solo_runs(stack):
    workload = load_workload()
    reference = new_llm()
    try:
        expected = [reference.generate(prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=m),
                                       use_tqdm=False)[0] for prompt, m in workload]
    finally:
        reference.close()

    async def run() -> tuple[list[dict], float]:
        peak = 0.0
        async with async_http_client(stack.url) as client:
            async def watch() -> None:
                nonlocal peak
                while True:
                    text = (await client.get("/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("metrale_requests_running "):
                            peak = max(peak, float(line.split()[1]))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                results = await asyncio.gather(*(read_stream(client, {
                    "model": MODEL, "prompt": prompt, "max_tokens": m, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) for prompt, m in workload))
            finally:
                watcher.cancel()
        return results, peak

    results, peak = asyncio.run(run())
    assert peak >= 8, f"the requests did not run concurrently (at most {peak} at once)"
    for (prompt, m), result, solo in zip(workload, results, expected):
        assert result["done"], prompt
        assert result["text"] == solo.text, prompt
        assert result["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == m == len(solo.token_ids)
        assert result["usage"]["prompt_tokens"] == len(solo.prompt_token_ids)
    values = wait_idle(stack.http)
    assert all(values[name] == 0 for name in idle_report(values)), idle_report(values)


def finish_count(http: httpx.Client, reason: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("metrale_request_finish_total{") and f'finish_reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_clients_that_disconnect_mid_stream_free_everything(stack):
    aborted_before = finish_count(stack.http, "abort")

    async def run() -> list[dict]:
        async with async_http_client(stack.url) as client:
            return await asyncio.gather(*(read_stream(client, {
                "model": MODEL, "prompt": f"Case {i}: " + " ".join(WORDS[:i]), "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}, stop_after=3) for i in range(20)))

    results = asyncio.run(run())
    steps = metric_values(stack.http)["metrale_engine_steps_total"]
    assert all(r["events"] == 3 and not r["done"] for r in results)
    values = wait_idle(stack.http, timeout=6.0)
    assert all(values[name] == 0 for name in idle_report(values)), idle_report(values)
    # aborted at once: not the ~400 steps the requests would have taken
    assert values["metrale_engine_steps_total"] - steps < 100
    assert finish_count(stack.http, "abort") - aborted_before == 20
    assert values["metrale_kv_cache_usage_ratio"] == 0
    answer = stack.client.completions.create(model=MODEL, prompt="Return the", max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5


def test_a_disconnect_aborts_every_request_of_a_multi_prompt_stream(stack):
    async def run() -> dict:
        async with async_http_client(stack.url) as client:
            return await read_stream(client, {"model": MODEL, "prompt": ["Return the", "Open a file", "The number"], "n": 2,
                                              "max_tokens": 900, "temperature": 0.8, "seed": 7, "ignore_eos": True,
                                              "stream": True}, stop_after=4)

    result = asyncio.run(run())
    steps = metric_values(stack.http)["metrale_engine_steps_total"]
    assert result["events"] == 4
    values = wait_idle(stack.http, timeout=6.0)
    assert all(values[name] == 0 for name in idle_report(values)), idle_report(values)
    # aborted at once: not the ~900 steps the six completions would have taken
    assert values["metrale_engine_steps_total"] - steps < 100


def test_a_non_streaming_client_that_goes_away_is_aborted(stack):
    aborted_before = finish_count(stack.http, "abort")
    with http_client(stack.url, timeout=0.5) as impatient:
        for endpoint, body in (
            ("/v1/completions", {"model": MODEL, "prompt": ["Return the", "Open a"], "max_tokens": 800, "ignore_eos": True}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3,
                                      "max_tokens": 800, "ignore_eos": True}),
        ):
            with pytest.raises(httpx.ReadTimeout):
                impatient.post(endpoint, json=body)
    steps = metric_values(stack.http)["metrale_engine_steps_total"]
    values = wait_idle(stack.http, timeout=6.0)
    assert all(values[name] == 0 for name in idle_report(values)), idle_report(values)
    assert values["metrale_engine_steps_total"] - steps < 100  # aborted, not run to the end
    assert finish_count(stack.http, "abort") - aborted_before == 5  # 2 prompts, then 3 completions
    assert stack.http.get("/health").status_code == 200


def test_shutdown_drains_then_aborts_then_stops_the_engine():
    own = Stack(drain_timeout=0.4)
    engine, url = own.engine, own.url

    async def run() -> tuple[dict, dict, float]:
        async with async_http_client(url) as client:
            short = asyncio.create_task(read_stream(client, {"model": MODEL, "prompt": "Return the", "max_tokens": 12,
                                                             "temperature": 0, "ignore_eos": True, "stream": True}))
            long = asyncio.create_task(read_stream(client, {"model": MODEL, "prompt": "Open a file", "max_tokens": 1000,
                                                            "temperature": 0, "ignore_eos": True, "stream": True}))
            while engine.stats().running < 2:
                await asyncio.sleep(0.01)
            own.thread.server.should_exit = True
            started = time.monotonic()
            done_short = await short
            try:
                done_long = await long
            except httpx.HTTPError:  # the connection was cut when the drain timed out
                done_long = {"done": False}
            return done_short, done_long, time.monotonic() - started

    try:
        short, long, took = asyncio.run(run())
        assert short["done"] and short["finish_reason"] == "length"
        assert not long["done"], "a request longer than the drain timeout must be aborted"
        assert took < 10
        own.thread.thread.join(15)
        assert not own.thread.thread.is_alive()
        assert engine_stopped(engine), "the app's shutdown must stop the engine"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        own.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_run_serve_end_to_end():
    """``run_serve`` as ``metrale serve`` runs it: the key from METRALE_API_KEY, never logged;
    SIGTERM drains and exits 0."""
    port = free_port()
    key = "env-key-3b1d9e"
    script = ("import argparse, sys; from metrale.entrypoints.server.main import add_serve_arguments, run_serve; "
              "p = add_serve_arguments(argparse.ArgumentParser()); sys.exit(run_serve(p.parse_args(sys.argv[1:])))")
    env = dict(os.environ, METRALE_API_KEY=key, METRALE_NO_PROGRESS="1")
    process = subprocess.Popen([sys.executable, "-c", script, MODEL, "--device", "cpu", "--port", str(port),
                                "--served-model-name", "tiny", "--max-num-seqs", "4", "--drain-timeout", "2",
                                "--log-level", "debug"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        with http_client(url, timeout=5) as http:
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read() if process.stdout else ""
                time.sleep(0.1)
            assert http.get("/v1/models").status_code == 401
            headers = {"authorization": f"Bearer {key}"}
            answer = http.post("/v1/completions", json={"model": "tiny", "prompt": "Return the", "max_tokens": 3},
                               headers=headers)
            assert answer.status_code == 200, answer.text
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": "a"}, headers=headers).status_code == 404
            assert metric_values(http)["metrale_kv_cache_blocks_total"] > 0
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert key not in output
    assert "POST /v1/completions" in output  # the access log
