"""LoRA adapters served: ``--lora-modules`` adapters named by a request's ``model`` field give
the Python API's tokens with that adapter (in an engine process and in process), ``/v1/models``
lists them beside the base model, an unknown name is a 404, a broken adapter stops the start.

And adapters loaded and unloaded while the server runs (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): served only when turned on, checked at load, served with the Python
API's tokens once loaded, a 404 once unloaded, never taken from a request that runs with them, and
read again by a restarted engine process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("openai")

from serverkit import (  # noqa: E402
    MODEL,
    ServerThread,
    Stack,
    http_client,
    metric_values,
    new_engine,
    new_llm,
    openai_client,
    wait_idle,
)

from metrale import LoRARequest, SamplingParams  # noqa: E402
from metrale.entrypoints.async_llm import AsyncLLM  # noqa: E402
from metrale.entrypoints.engine_process import EngineProcess  # noqa: E402
from metrale.entrypoints.server import build_app  # noqa: E402
from metrale.errors import AdapterError, ConfigError, EngineClosedError, InvalidRequestError  # noqa: E402
from metrale.loading.model import resolve_model_path  # noqa: E402
from metrale.testing.hf import build_peft_adapter  # noqa: E402

PROMPTS = ["Return the", "Open a file and"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    build_peft_adapter(resolve_model_path(MODEL), root / "ada", seed=3, scale=0.5, r=8, lora_alpha=32,
                       target_modules=targets)
    build_peft_adapter(resolve_model_path(MODEL), root / "bob", seed=4, scale=0.5, r=4, lora_alpha=16,
                       target_modules=targets[:4])
    return [LoRARequest("ada", 1, root / "ada"), LoRARequest("bob", 2, root / "bob")]


@pytest.mark.parametrize("in_process", [False, True])
def test_a_request_s_model_picks_its_adapter(adapters, in_process):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with new_llm(enable_lora=True) as reference:
        expected = {lora.lora_name: [o.outputs[0].text for o in reference.generate(PROMPTS, params, lora_request=lora)]
                    for lora in adapters}
        expected[MODEL] = [o.outputs[0].text for o in reference.generate(PROMPTS, params)]
    assert len({tuple(texts) for texts in expected.values()}) == 3  # the adapters change the text
    if in_process:
        llm = new_llm(enable_lora=True, max_loras=1)
        for lora in adapters:
            llm.add_lora(lora)
        engine = AsyncLLM(llm)
    else:
        engine = EngineProcess(MODEL, device="cpu", show_progress=False, enable_lora=True, max_loras=1,
                               lora_modules=adapters)
    server = ServerThread(build_app(engine, model_name=MODEL, lora_modules=adapters)).start()
    try:
        client, http = openai_client(server.url), http_client(server.url)
        listed = http.get("/v1/models").json()["data"]
        assert [card["id"] for card in listed] == [MODEL, "ada", "bob"]
        assert listed[1]["parent"] == MODEL and listed[1]["root"] == str(adapters[0].lora_path)
        assert http.get("/v1/models/bob").json()["id"] == "bob"
        for name, texts in expected.items():
            got = [client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text
                   for prompt in PROMPTS]
            assert got == texts, name
        chat = client.chat.completions.create(model="ada", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "ada"
        missing = http.post("/v1/completions", json={"model": "carol", "prompt": "x", "max_tokens": 2})
        assert missing.status_code == 404 and "'ada'" in missing.json()["error"]["message"]
        values = wait_idle(http)
        assert values["metrale_lora_slots_total"] == 1 and values["metrale_lora_slots_used"] == 0
        assert values["metrale_lora_adapters_loaded"] == 1  # the last adapter a request used stays in its slot
        client.close()
        http.close()
    finally:
        server.stop()
        engine.shutdown()


def test_the_engine_process_reports_a_request_s_adapter(adapters):
    import asyncio

    async def run(engine):
        outputs = [output async for output in engine.generate("Return the", SamplingParams(max_tokens=2),
                                                               lora_request=adapters[1])]
        return outputs[-1]

    engine = EngineProcess(MODEL, device="cpu", show_progress=False, enable_lora=True, lora_modules=adapters)
    try:
        last = asyncio.run(run(engine))
    finally:
        engine.shutdown()
    assert last.finished and last.lora_request == adapters[1]


def test_a_broken_adapter_stops_the_engine_process_start(tmp_path):
    (tmp_path / "broken").mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json"):
        EngineProcess(MODEL, device="cpu", show_progress=False, enable_lora=True,
                      lora_modules=[LoRARequest("broken", 1, tmp_path / "broken")])


def test_lora_module_flags_are_checked():
    import argparse

    from metrale.entrypoints.server.main import _check_server_options, add_serve_arguments, lora_modules
    from metrale.errors import ConfigError

    parser = add_serve_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora-modules", "no-equals-sign"])
    with pytest.raises(ConfigError, match="names 'sql' twice"):
        lora_modules(parser.parse_args(["m", "--lora-modules", "sql=/a", "sql=/b"]))
    with pytest.raises(ConfigError, match="base model's served name"):
        _check_server_options(parser.parse_args(["m", "--served-model-name", "base", "--lora-modules", "base=/a"]))


# ------------------------------------------------------------------- adapters loaded at run time

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
#: Tokens of the stream an adapter is unloaded under: long enough to be running when the unload
#: arrives.
LONG = 400
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def expected(adapters):
    """The Python API's greedy texts: per name (the base model's and each adapter's) those of
    ``PROMPTS``, and ``bob``'s long one of ``PROMPTS[0]``."""
    with new_llm(enable_lora=True) as reference:
        texts = {lora.lora_name: [o.outputs[0].text for o in reference.generate(PROMPTS, GREEDY, lora_request=lora)]
                 for lora in adapters}
        texts[MODEL] = [o.outputs[0].text for o in reference.generate(PROMPTS, GREEDY)]
        long = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
        texts["bob-long"] = reference.generate([PROMPTS[0]], long, lora_request=adapters[1])[0].outputs[0].text
    assert len({tuple(texts[name]) for name in ("ada", "bob", MODEL)}) == 3  # the adapters change the text
    return texts


def runtime_stack(in_process, *, lora_modules=(), **engine_options):
    """A server with the runtime LoRA endpoints on, its engine serving LoRA (``lora_modules`` at start)."""
    return Stack(in_process=in_process, engine_options={"enable_lora": True, **engine_options},
                 lora_modules=lora_modules, allow_runtime_lora_updating=True)


def texts(http, name):
    """The greedy completions of ``PROMPTS`` by the model (or adapter) ``name``."""
    answers = [http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0})
               for prompt in PROMPTS]
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [answer.json()["choices"][0]["text"] for answer in answers]


def check_error(response, status, *, param=None, code=None, says=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if says is not None:
        assert says in error["message"], error
    return error


def listed(http):
    return [card["id"] for card in http.get("/v1/models").json()["data"]]


def test_the_switch_is_read_as_vllm_reads_its_variable():
    from metrale.config import environment_allows_runtime_lora_updating as allows

    for value, on in [("1", True), ("true", True), (" TRUE ", True), ("True", True), ("0", False), ("false", False),
                      ("yes", False), ("on", False), ("", False), ("2", False)]:
        assert allows({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is on, value
    assert allows({}) is False


@pytest.mark.parametrize("in_process", [False, True])
def test_the_endpoints_are_served_only_when_turned_on(adapters, monkeypatch, in_process):
    engine = new_engine(in_process, enable_lora=True)
    try:
        # (variable, build_app's keyword, whether the endpoints are served)
        for variable, keyword, on in [(None, None, False), ("0", None, False), ("yes", None, False),
                                      ("1", False, False), ("true", None, True), (None, True, True)]:
            if variable is None:
                monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
            else:
                monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", variable)
            server = ServerThread(build_app(engine, model_name=MODEL, owns_engine=False,
                                            allow_runtime_lora_updating=keyword)).start()
            try:
                with http_client(server.url) as http:
                    name = f"bob-{variable}-{keyword}"
                    loaded = http.post(LOAD, json={"lora_name": name, "lora_path": str(adapters[1].lora_path)})
                    unloaded = http.post(UNLOAD, json={"lora_name": name})
                    if on:
                        assert loaded.status_code == 200, loaded.text
                        assert unloaded.status_code == 200, unloaded.text
                    else:
                        check_error(loaded, 404, code="not_found", says="no route POST '/v1/load_lora_adapter'")
                        check_error(unloaded, 404, code="not_found")
                        assert name not in listed(http)
            finally:
                server.stop()
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="allow_runtime_lora_updating"):
        build_app(engine, model_name=MODEL, allow_runtime_lora_updating="yes")


@pytest.mark.parametrize("in_process", [False, True])
def test_load_serve_unload_and_load_again(adapters, expected, in_process):
    ada, bob = adapters
    stack = runtime_stack(in_process, lora_modules=[ada], max_loras=1)
    http, state = stack.http, stack.app.state.metrale
    try:
        loaded = http.post(LOAD, json={"lora_name": "bob", "lora_path": str(bob.lora_path)})
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'bob' added successfully."
        assert loaded.headers["content-type"].startswith("text/plain")
        first_id = state.lora_modules["bob"].lora_int_id
        assert first_id != ada.lora_int_id  # a fresh id, apart from the --lora-modules ones
        assert sorted(lora.lora_int_id for lora in stack.engine.list_loras()) == sorted({ada.lora_int_id, first_id})
        cards = http.get("/v1/models").json()["data"]
        assert [card["id"] for card in cards] == [MODEL, "ada", "bob"]
        assert cards[2]["parent"] == MODEL and cards[2]["root"] == str(bob.lora_path)
        assert http.get("/v1/models/bob").json()["id"] == "bob"
        for name in ("bob", "ada", MODEL):
            assert texts(http, name) == expected[name], name
        chat = stack.client.chat.completions.create(model="bob", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        assert chat.model == "bob"

        # A name served already is refused: a loaded one, a --lora-modules one, the base model's.
        for name in ("bob", "ada", MODEL):
            check_error(http.post(LOAD, json={"lora_name": name, "lora_path": str(bob.lora_path)}), 400,
                        param="lora_name", code="lora_adapter_exists", says="has already been loaded")

        unloaded = http.post(UNLOAD, json={"lora_name": "bob"})
        assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'bob' removed successfully."
        gone = http.post("/v1/completions", json={"model": "bob", "prompt": "x", "max_tokens": 2})
        check_error(gone, 404, param="model", code="model_not_found")
        check_error(http.get("/v1/models/bob"), 404, code="model_not_found")
        assert listed(http) == [MODEL, "ada"]
        assert texts(http, MODEL) == expected[MODEL] and texts(http, "ada") == expected["ada"]
        check_error(http.post(UNLOAD, json={"lora_name": "bob"}), 404, param="lora_name", code="lora_adapter_not_found")

        # Loaded again under the same name: served again, under another id.
        assert http.post(LOAD, json={"lora_name": "bob", "lora_path": str(bob.lora_path)}).status_code == 200
        second_id = state.lora_modules["bob"].lora_int_id
        assert second_id not in (first_id, ada.lora_int_id)
        assert texts(http, "bob") == expected["bob"]
        check_error(http.post(UNLOAD, json={"lora_name": "bob", "lora_int_id": first_id}), 404,
                    code="lora_adapter_not_found")
        assert http.post(UNLOAD, json={"lora_name": "bob", "lora_int_id": second_id}).status_code == 200

        # load_inplace replaces an adapter under its name: 'ada' now runs bob's weights.
        replaced = http.post(LOAD, json={"lora_name": "ada", "lora_path": str(bob.lora_path), "load_inplace": True})
        assert replaced.status_code == 200, replaced.text
        assert texts(http, "ada") == expected["bob"]
        assert http.get("/v1/models/ada").json()["root"] == str(bob.lora_path)
        # The --lora-modules adapter may be unloaded too.
        assert http.post(UNLOAD, json={"lora_name": "ada"}).status_code == 200
        assert listed(http) == [MODEL] and stack.engine.list_loras() == []
        values = wait_idle(http)
        assert values["metrale_lora_slots_used"] == 0 and values["metrale_lora_adapters_loaded"] == 0
        assert 'metrale_requests_total{endpoint="/v1/load_lora_adapter",status="200"}' in http.get("/metrics").text
    finally:
        stack.close()


def spoilt_copies(bob, root):
    """Adapter folders the model cannot serve, each with a part of the reason it is refused."""
    cases = {"missing": (root / "missing", "no such folder"),
             "a file": (bob / "adapter_config.json", "not a folder"),
             "empty": (root / "empty", "no adapter_config.json")}
    (root / "empty").mkdir()
    for name, edit, why in [("torn", lambda f: (f / "adapter_model.safetensors").write_bytes(b"torn"),
                             "not a safetensors file"),
                            ("not-json", lambda f: (f / "adapter_config.json").write_text("{r: 4"), "not readable JSON"),
                            ("foreign", _rename_to_a_projection_the_model_lacks, "w_pack")]:
        shutil.copytree(bob, root / name)
        edit(root / name)
        cases[name] = (root / name, why)
    return cases


def _rename_to_a_projection_the_model_lacks(folder):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({key.replace("q_proj", "w_pack"): value for key, value in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = ["w_pack", "k_proj", "v_proj", "o_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("in_process", [False, True])
def test_an_adapter_the_model_cannot_serve_is_refused_at_load(adapters, expected, tmp_path, in_process):
    ada, bob = adapters
    # ada has rank 8: above this engine's max_lora_rank; bob (rank 4) fits.
    stack = runtime_stack(in_process, max_lora_rank=4)
    http = stack.http
    try:
        cases = spoilt_copies(bob.lora_path, tmp_path)
        cases["rank 8"] = (ada.lora_path, "above max_lora_rank=4")
        for case, (folder, why) in cases.items():
            refused = http.post(LOAD, json={"lora_name": "x", "lora_path": str(folder)})
            check_error(refused, 400, param="lora_path", code="invalid_lora_adapter", says=why)
            assert listed(http) == [MODEL], case
            check_error(http.post("/v1/completions", json={"model": "x", "prompt": "a", "max_tokens": 2}), 404,
                        code="model_not_found")
        assert stack.engine.list_loras() == []
        # A refused load reserves nothing: the name loads from a good folder.
        assert http.post(LOAD, json={"lora_name": "x", "lora_path": str(bob.lora_path)}).status_code == 200
        assert texts(http, "x") == expected["bob"]
        assert http.get("/health").status_code == 200
    finally:
        stack.close()


@pytest.mark.parametrize("in_process", [False, True])
def test_a_load_into_an_engine_without_lora_is_a_400(adapters, monkeypatch, in_process):
    # The variable alone turns the endpoints on.
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    stack = Stack(in_process=in_process)
    try:
        refused = stack.http.post(LOAD, json={"lora_name": "bob", "lora_path": str(adapters[1].lora_path)})
        check_error(refused, 400, code="lora_not_enabled", says="--enable-lora")
        check_error(stack.http.post(UNLOAD, json={"lora_name": "bob"}), 404, code="lora_adapter_not_found")
        assert listed(stack.http) == [MODEL]
    finally:
        stack.close()


def _next_text(lines):
    """The text of the next chunk of a completions stream (None at its end)."""
    for line in lines:
        if not line:
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return None
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        return chunk["choices"][0]["text"] if chunk["choices"] else ""
    return None


@pytest.mark.parametrize("in_process", [False, True])
def test_an_adapter_unloaded_under_a_running_stream_serves_it_to_its_end(adapters, expected, in_process):
    ada, bob = adapters
    # One adapter slot: the stream's adapter stays in it until the stream ends, and a request of
    # another adapter waits for it.
    stack = runtime_stack(in_process, max_loras=1)
    http = stack.http
    try:
        assert http.post(LOAD, json={"lora_name": "bob", "lora_path": str(bob.lora_path)}).status_code == 200
        bob_id = stack.app.state.metrale.lora_modules["bob"].lora_int_id
        body = {"model": "bob", "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                "stream": True}
        other: dict = {}
        with http_client(stack.url) as streamer, streamer.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            text = _next_text(lines)
            assert http.post(UNLOAD, json={"lora_name": "bob"}).status_code == 200
            values = metric_values(http)
            # The stream still runs, holding its adapter's slot.
            assert values["metrale_requests_running"] == 1 and values["metrale_lora_slots_used"] == 1, values
            check_error(http.post("/v1/completions", json={"model": "bob", "prompt": "a", "max_tokens": 2}), 404,
                        code="model_not_found")
            assert http.post(LOAD, json={"lora_name": "ada", "lora_path": str(ada.lora_path)}).status_code == 200

            def ask_ada():
                with http_client(stack.url) as client:
                    other["answer"] = client.post("/v1/completions", json={"model": "ada", "prompt": PROMPTS[1],
                                                                           "max_tokens": 8, "temperature": 0})

            asker = threading.Thread(target=ask_ada)
            asker.start()
            while (piece := _next_text(lines)) is not None:
                text += piece
        asker.join(60)
        assert text == expected["bob-long"]
        assert other["answer"].status_code == 200 and other["answer"].json()["choices"][0]["text"] == expected["ada"][1]
        values = wait_idle(http)
        assert values["metrale_lora_slots_used"] == 0 and values["metrale_lora_adapters_loaded"] == 1
        assert [lora.lora_name for lora in stack.engine.list_loras()] == ["ada"]
        if in_process:  # the engine itself forgot bob once its stream ended
            assert bob_id not in [lora.lora_int_id for lora in stack.engine.llm.list_loras()]
    finally:
        stack.close()


def test_a_restarted_engine_process_reads_the_loaded_adapters_again(adapters, expected, tmp_path):
    import asyncio

    ada, bob = adapters
    shutil.copytree(bob.lora_path, tmp_path / "doomed")
    engine = EngineProcess(MODEL, device="cpu", show_progress=False, enable_lora=True, max_restarts=1,
                           lora_modules=[ada])

    async def generate(lora):
        outputs = [o async for o in engine.generate(PROMPTS[0], GREEDY, lora_request=lora)]
        return outputs[-1].outputs[0].text

    try:
        loaded, doomed = LoRARequest("bob", 5, str(bob.lora_path)), LoRARequest("doomed", 6, str(tmp_path / "doomed"))
        asyncio.run(engine.add_lora(loaded))
        asyncio.run(engine.add_lora(doomed))
        asyncio.run(engine.add_lora(loaded))  # the same adapter again: nothing to do
        with pytest.raises(AdapterError, match="already names adapter 'bob'"):
            asyncio.run(engine.add_lora(LoRARequest("carol", 5, str(ada.lora_path))))
        with pytest.raises(InvalidRequestError):
            asyncio.run(engine.add_lora("bob"))
        assert [lora.lora_name for lora in engine.list_loras()] == ["ada", "bob", "doomed"]
        shutil.rmtree(tmp_path / "doomed")
        os.kill(engine._process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (engine.is_running and engine.restarts == 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.is_running and engine.restarts == 1
        # The adapter whose folder went away is dropped; the others are served as before.
        assert [lora.lora_name for lora in engine.list_loras()] == ["ada", "bob"]
        assert asyncio.run(generate(loaded)) == expected["bob"][0]
        assert asyncio.run(generate(ada)) == expected["ada"][0]
        with pytest.raises(InvalidRequestError, match="not one of this engine's adapters"):
            asyncio.run(generate(doomed))
        asyncio.run(engine.remove_lora("bob"))
        with pytest.raises(AdapterError, match="no LoRA adapter 'bob'"):
            asyncio.run(engine.remove_lora("bob"))
        with pytest.raises(InvalidRequestError, match="not one of this engine's adapters"):
            asyncio.run(generate(loaded))
    finally:
        engine.shutdown()
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.add_lora(loaded))


def test_the_in_process_engine_refuses_bad_lora_calls(adapters):
    import asyncio

    from metrale.entrypoints.async_llm import AsyncLLM as Engine

    plain = Engine(new_llm())
    try:
        assert not plain.serves_lora and plain.list_loras() == []
        with pytest.raises(ConfigError, match="enable_lora"):
            asyncio.run(plain.add_lora(adapters[0]))
    finally:
        plain.shutdown()
    engine = Engine(new_llm(enable_lora=True))
    try:
        asyncio.run(engine.add_lora(LoRARequest("twin", 3, str(adapters[0].lora_path))))
        asyncio.run(engine.add_lora(LoRARequest("twin", 4, str(adapters[1].lora_path))))
        with pytest.raises(AdapterError, match="2 loaded adapters are named 'twin'"):
            asyncio.run(engine.remove_lora("twin"))
        asyncio.run(engine.remove_lora(4))
        assert [(lora.lora_name, lora.lora_int_id) for lora in engine.list_loras()] == [("twin", 3)]
        with pytest.raises(AdapterError, match="no LoRA adapter"):
            asyncio.run(engine.remove_lora("nobody"))
        with pytest.raises(AdapterError, match="no such folder"):
            asyncio.run(engine.add_lora(LoRARequest("gone", 9, "/nonexistent/adapter")))
    finally:
        engine.shutdown()
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.add_lora(adapters[0]))
