"""LoRA adapters served: ``--lora-modules`` adapters named by a request's ``model`` field give
the Python API's tokens with that adapter (in an engine process and in process), ``/v1/models``
lists them beside the base model, an unknown name is a 404, a broken adapter stops the start."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("openai")

from serverkit import MODEL, ServerThread, http_client, new_llm, openai_client, wait_idle  # noqa: E402

from metrale import LoRARequest, SamplingParams  # noqa: E402
from metrale.entrypoints.async_llm import AsyncLLM  # noqa: E402
from metrale.entrypoints.engine_process import EngineProcess  # noqa: E402
from metrale.entrypoints.server import build_app  # noqa: E402
from metrale.errors import AdapterError  # noqa: E402
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
