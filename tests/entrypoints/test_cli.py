"""The ``metrale`` command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metrale.entrypoints.cli import main


def test_generate_with_the_embedded_default(capsys):
    assert main(["generate", "--max-tokens", "8", "--temperature", "0", "--no-progress", "Return the"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Return the") and len(out.strip()) > len("Return the")


def test_generate_several_prompts_is_deterministic(capsys):
    args = ["generate", "--max-tokens", "6", "--seed", "3", "--no-progress", "Open the", "Return a"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("Open the") and "\n\nReturn a" in first


@pytest.mark.parametrize("extra", [[], ["--stop", " the", "--stop", "."], ["--temperature", "0.9", "--seed", "3"]])
def test_streamed_output_equals_the_whole_output(capsys, extra):
    """The streamed continuation ends up exactly the text generate prints, stop strings included."""
    command = ["generate", "--max-tokens", "24", "--temperature", "0", "--no-progress", *extra, "Return the"]
    assert main(command) == 0
    whole = capsys.readouterr().out
    assert main([*command[:-1], "--stream", command[-1]]) == 0
    assert capsys.readouterr().out == whole


def test_speculative_generation_prints_the_same_text(capsys):
    command = ["generate", "--max-tokens", "24", "--temperature", "0.8", "--seed", "2", "--no-progress",
               "def f(x): return x\ndef g(x): return x\ndef h(x):", "Return the"]
    assert main(command) == 0
    plain = capsys.readouterr().out
    assert main([command[0], "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                 *command[1:]]) == 0
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize("model", ["tiny-mla", "tiny-gdn"])
def test_mtp_speculation_works_on_the_shipped_models(capsys, model):
    """Their MTP modules ship with them: the command the docs give prints the greedy text."""
    command = ["generate", "--model", model, "--max-tokens", "16", "--temperature", "0", "--no-progress", "Return the"]
    assert main(command) == 0
    plain = capsys.readouterr().out
    assert main([*command[:3], "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
                 *command[3:]]) == 0
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize("value, message", [("nope", "'nope' is not JSON"), ("[3]", "is not a JSON object")])
def test_a_speculative_config_that_is_not_a_json_object_is_a_usage_error(capsys, value, message):
    with pytest.raises(SystemExit):
        main(["generate", "--no-progress", "--speculative-config", value, "x"])
    assert message in capsys.readouterr().err


def test_a_bad_speculative_config_is_reported(capsys):
    assert main(["generate", "--no-progress", "--speculative-config", '{"method": "ngram"}', "x"]) == 2
    assert "num_speculative_tokens must be an int" in capsys.readouterr().err


def test_stream_takes_one_prompt(capsys):
    assert main(["generate", "--stream", "--no-progress", "one", "two"]) == 2
    assert "--stream prints one continuation; got 2 prompts" in capsys.readouterr().err


def test_generate_with_a_checkpoint_folder(capsys, tmp_path):
    import shutil

    from metrale.models import embedded_model_path

    folder = tmp_path / "my-model"
    shutil.copytree(embedded_model_path("tiny-dense"), folder)
    args = ["generate", "--model", str(folder), "--max-tokens", "5", "--temperature", "0", "--no-progress", "Open the"]
    assert main(args) == 0
    from_folder = capsys.readouterr().out
    assert main(["generate", "--max-tokens", "5", "--temperature", "0", "--no-progress", "Open the"]) == 0
    assert capsys.readouterr().out == from_folder


def test_errors_are_reported_without_a_traceback(capsys):
    assert main(["generate", "--model", "/no/such/folder", "hello"]) == 2
    err = capsys.readouterr().err
    assert "metrale: error:" in err and "/no/such/folder" in err and "Traceback" not in err
    assert main(["generate", "--max-tokens", "0", "--no-progress", "hello"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_plugins_lists_families_and_architectures(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "dense" in out and "LlamaForCausalLM" in out and "Qwen3ForCausalLM" in out and "stages" in out


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["plugins", "--help"]])
def test_help_everywhere(args, capsys):
    with pytest.raises(SystemExit) as raised:
        main(args)
    assert raised.value.code == 0
    assert "usage: metrale" in capsys.readouterr().out


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "metrale.entrypoints.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("metrale ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-sizes", "0,32"], "--batch-sizes takes positive numbers, got 0"),
        (["--context", "-5"], "--context takes positive numbers, got -5"),
        (["--prefill-lengths", "512,x"], "comma-separated ints"),
        (["--shapes", "llama-2b"], "unknown shapes ['llama-2b']"),
        (["--throughput", "--num-requests", "0"], "--num-requests takes positive numbers, got 0"),
        (["--throughput", "--max-num-seqs", "-1"], "--max-num-seqs takes positive numbers, got -1"),
        (["--prefix-chunk", "8192"], "--prefix-chunk takes CACHED,NEW (two ints), got '8192'"),
        (["--prefix-chunk", "0,512"], "--prefix-chunk takes positive numbers, got '0,512'"),
    ],
)
def test_bench_refuses_bad_options_before_touching_a_device(args, message, capsys):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_without_a_cuda_device_says_so(monkeypatch, capsys):
    from metrale.backends import devices as backend

    monkeypatch.setattr(backend, "cuda_unavailable_reason", lambda: "no CUDA device is available")
    assert main(["bench", "--shapes", "llama-1b"]) == 2
    assert "metrale bench needs a CUDA device: no CUDA device is available" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout", "--stream-idle-timeout", "--timeout-keep-alive"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_refuses_a_timeout_that_is_not_a_positive_number_of_seconds(flag, value, capsys):
    assert main(["serve", "tiny-dense", flag, value]) == 2
    assert f"{flag} must be a number of seconds > 0, got {float(value)}" in capsys.readouterr().err


def test_python_dash_m_metrale_is_the_command():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "metrale", "--version"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    from metrale._version import __version__

    assert __version__ in result.stdout


@pytest.mark.parametrize("flags, allowed, lora", [
    ([], None, False),
    (["--enable-lora"], None, True),
    (["--allow-runtime-lora-updating", "--enable-lora"], True, True),
    (["--allow-runtime-lora-updating"], True, False),
])
def test_serve_hands_the_runtime_lora_switch_to_build_app(monkeypatch, flags, allowed, lora):
    """``--allow-runtime-lora-updating`` reaches build_app's keyword (left out, build_app reads
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); ``--enable-lora`` reaches the engine's options."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from metrale.entrypoints.server import app as app_module
    from metrale.entrypoints.server import main as serve_main

    seen = {}

    class Stop(Exception):
        pass

    class Engine:
        summary = None

        def shutdown(self):
            seen["shut down"] = True

    def start_engine(args, adapters):
        seen["engine options"] = serve_main.engine_options(args)
        return Engine()

    def build_app(engine, **options):
        seen["app options"] = options
        raise Stop

    monkeypatch.setattr(serve_main, "_start_engine", start_engine)
    monkeypatch.setattr(app_module, "build_app", build_app)
    with pytest.raises(Stop):
        main(["serve", "tiny-dense", "--port", "0", *flags])
    assert seen["app options"].get("allow_runtime_lora_updating") is allowed
    assert seen["engine options"].get("enable_lora", False) is lora
    assert seen["shut down"]
