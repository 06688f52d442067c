"""Models named by Hugging Face Hub ids (:mod:`metrale.loading.hub`): resolved by huggingface_hub
itself from a cache this test writes in a temporary ``HF_HOME`` (no network), offline; revision
pins by branch, tag and commit; ``download_dir`` and ``HF_HUB_CACHE``; a tokenizer from another
id; typed errors for a model not cached offline, without safetensors, not on the Hub, gated or
refused; ``metrale generate`` and ``metrale serve`` with an id."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import (
    ConfigError,
    HubAccessError,
    HubModelNotFoundError,
    HubOfflineError,
    NoSafetensorsError,
)
from metrale.loading.hub import HUB_FILES, hub_cache_dir, looks_like_hub_id
from metrale.models import embedded_model_path
from metrale.testing.hub import cached_repo_folder, write_hub_cache

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def hub_home(tmp_path, monkeypatch):
    """A fresh ``HF_HOME`` holding ``acme/tiny`` (tiny-dense) on main and ``acme/tiny`` tag v1
    (tiny-gdn's files), offline."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_hub_id_loads_from_the_cache_offline_and_generates_as_the_folder(hub_home):
    commit = write_hub_cache(hub_home / "hub", "acme/tiny", embedded_model_path("tiny-dense"))
    llm = LLM("acme/tiny", device="cpu", show_progress=False)
    assert llm.checkpoint.path == cached_repo_folder(hub_home / "hub", "acme/tiny") / "snapshots" / commit
    reference = LLM("tiny-dense", device="cpu", show_progress=False)
    prompts = ["The river", "Once upon"]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in reference.generate(prompts, GREEDY)]


def test_revisions_pin_a_branch_a_tag_or_a_commit(hub_home):
    dense = write_hub_cache(hub_home / "hub", "acme/tiny", embedded_model_path("tiny-dense"))
    gdn = write_hub_cache(hub_home / "hub", "acme/tiny", embedded_model_path("tiny-gdn"), revision="v1")
    assert LLM("acme/tiny", device="cpu", show_progress=False).family.name == "dense"
    assert LLM("acme/tiny", device="cpu", show_progress=False, revision="v1").family.name == "gdn"
    assert LLM("acme/tiny", device="cpu", show_progress=False, revision=gdn).family.name == "gdn"
    assert LLM("acme/tiny", device="cpu", show_progress=False, revision=dense).family.name == "dense"
    with pytest.raises(HubOfflineError, match="revision 'v2'"):
        LLM("acme/tiny", device="cpu", show_progress=False, revision="v2")


def test_download_dir_and_hf_hub_cache_name_the_cache(tmp_path, hub_home, monkeypatch):
    elsewhere = tmp_path / "models"
    write_hub_cache(elsewhere, "acme/tiny", embedded_model_path("tiny-dense"))
    with pytest.raises(HubOfflineError, match=str(hub_home / "hub")):
        LLM("acme/tiny", device="cpu", show_progress=False)
    assert LLM("acme/tiny", device="cpu", show_progress=False, download_dir=str(elsewhere)).checkpoint.path.is_relative_to(
        elsewhere)
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    assert hub_cache_dir() == elsewhere
    assert LLM("acme/tiny", device="cpu", show_progress=False).checkpoint.path.is_relative_to(elsewhere)


def test_a_model_missing_from_the_cache_offline_is_a_typed_error(hub_home):
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE"):
        LLM("acme/absent", device="cpu", show_progress=False)


def test_a_model_without_safetensors_is_refused(tmp_path, hub_home):
    folder = tmp_path / "bin-only"
    folder.mkdir()
    shutil.copy(embedded_model_path("tiny-dense") / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 64)
    write_hub_cache(hub_home / "hub", "acme/old-format", folder)
    with pytest.raises(NoSafetensorsError, match="safetensors only"):
        LLM("acme/old-format", device="cpu", show_progress=False)


def test_revision_and_download_dir_apply_to_hub_ids_only(tmp_path):
    with pytest.raises(ConfigError, match="Hub ids only"):
        LLM("tiny-dense", device="cpu", show_progress=False, revision="main")
    with pytest.raises(ConfigError, match="Hub ids only"):
        LLM(str(embedded_model_path("tiny-dense")), device="cpu", show_progress=False, download_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="revision"):
        LLM("tiny-dense", device="cpu", show_progress=False, revision="")


def test_which_names_are_hub_ids():
    assert looks_like_hub_id("Qwen/Qwen3-30B-A3B") and looks_like_hub_id("gpt2") and looks_like_hub_id("a.b/c_d-1")
    for path in ("./model", "/models/qwen", "~/models/qwen", "a/b/c", "bad name/x", "org/"):
        assert not looks_like_hub_id(path), path


def test_a_tokenizer_from_another_hub_id(tmp_path, hub_home):
    weights = tmp_path / "weights-only"
    shutil.copytree(embedded_model_path("tiny-dense"), weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).unlink(missing_ok=True)
    write_hub_cache(hub_home / "hub", "acme/weights", weights)
    write_hub_cache(hub_home / "hub", "acme/tokenizer", embedded_model_path("tiny-dense"))
    bare = LLM("acme/weights", device="cpu", show_progress=False)
    assert bare.tokenizer is None
    llm = LLM("acme/weights", device="cpu", show_progress=False, tokenizer="acme/tokenizer")
    reference = LLM("tiny-dense", device="cpu", show_progress=False)
    assert llm.encode("The river bends") == reference.encode("The river bends")
    assert llm.generate(["The river"], GREEDY)[0].text == reference.generate(["The river"], GREEDY)[0].text


def test_only_the_files_the_engine_reads_are_asked_for():
    import fnmatch

    wanted = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
              "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "model.pth", "model-q4.gguf", "original/consolidated.00.pth", "README.md",
                "onnx/model.onnx"]
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILES) for name in wanted)
    assert not any(fnmatch.fnmatch(name, pattern) for name in unwanted for pattern in HUB_FILES)


def hub_http_error(kind, status, url="https://huggingface.co/api/models/acme/x/revision/main"):
    import httpx
    from huggingface_hub import errors

    response = httpx.Response(status, request=httpx.Request("GET", url))
    return getattr(errors, kind)(f"{status} Client Error for url: {url}", response=response)


@pytest.mark.parametrize("kind, status, expected, match", [
    ("RepositoryNotFoundError", 404, HubModelNotFoundError, "not a model on the Hugging Face Hub.*nor is it a checkpoint"),
    ("RevisionNotFoundError", 404, HubModelNotFoundError, "no revision"),
    ("GatedRepoError", 401, HubAccessError, "gated"),
    ("HfHubHTTPError", 403, HubAccessError, "HF_TOKEN"),
])
def test_errors_of_the_hub_become_typed_errors(monkeypatch, kind, status, expected, match):
    """What huggingface_hub raises for a missing, gated or refused model (online)."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise hub_http_error(kind, status)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(expected, match=match):
        LLM("acme/x", device="cpu", show_progress=False)


def test_generate_takes_a_hub_id(hub_home, capsys):
    from metrale.entrypoints.cli import main

    write_hub_cache(hub_home / "hub", "acme/tiny", embedded_model_path("tiny-dense"))
    assert main(["generate", "--model", "acme/tiny", "--device", "cpu", "--no-progress", "--max-tokens", "4",
                 "--temperature", "0", "The river"]) == 0
    assert capsys.readouterr().out.startswith("The river")


def test_serve_takes_a_hub_id_and_serves_it_under_that_name(hub_home):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    write_hub_cache(hub_home / "hub", "acme/tiny", embedded_model_path("tiny-dense"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    env.pop("METRALE_API_KEY", None)
    server = subprocess.Popen([sys.executable, "-m", "metrale.entrypoints.cli", "serve", "acme/tiny", "--device", "cpu",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["acme/tiny"]
        answer = httpx.post(f"{url}/v1/completions", json={"model": "acme/tiny", "prompt": "The river", "max_tokens": 3},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == "acme/tiny"
    finally:
        server.terminate()
        server.wait(timeout=60)
