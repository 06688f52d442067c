"""``POST /v1/embeddings`` through OpenAI's client, on an engine process and in process: every
input shape and both encodings give ``LLM.embed``'s vectors and transformers' pooled final
states; vLLM's extensions (pooling, normalisation, truncation, special tokens) do what they say;
embeddings share the engine with running completions; metrics count them; nothing stays
allocated."""

from __future__ import annotations

import asyncio
import base64
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serverkit import MODEL, Stack, async_http_client, new_llm, wait_idle  # noqa: E402

from metrale import LoRARequest  # noqa: E402
from metrale.loading.model import resolve_model_path  # noqa: E402
from metrale.testing.hf import build_peft_adapter  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog", "Hello", "Embeddings of a decoder, pooled at its last token"]
IDS = [[5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 2, 9, 3, 3, 1, 7, 5, 2, 6, 4, 11, 40], [42]]


@pytest.fixture(scope="module", params=[False, True], ids=["engine-process", "in-process"])
def stack(request):
    stack = Stack(in_process=request.param)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def llm():
    with new_llm() as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model_path(MODEL)), dtype=torch.float32).eval()


def transformers_vector(hf_model, ids, pooling="last", normalize=True):
    """transformers' final normed states (``last_hidden_state``) of ``ids``, pooled."""
    import torch

    with torch.no_grad():
        states = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = states[-1] if pooling == "last" else states.mean(axis=0)
    return vector / np.linalg.norm(vector) if normalize else vector


def close(got, want, tolerance=1e-5):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return got.shape == want.shape and np.abs(got - want).max() <= tolerance * max(np.abs(want).max(), 1.0)


def test_every_input_shape_and_encoding_gives_llm_embed_and_transformers(stack, llm, hf_model):
    client = stack.client
    expected = [o.outputs.embedding for o in llm.embed(TEXTS)]
    texts_ids = [llm.encode(text) for text in TEXTS]
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    assert floats.object == "list" and floats.model == MODEL
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(ids) for ids in texts_ids)
    for answer in (floats, decoded, raw):
        assert [item.index for item in answer.data] == [0, 1, 2]
        assert all(item.object == "embedding" for item in answer.data)
    for index, (want, ids) in enumerate(zip(expected, texts_ids)):
        from_base64 = np.frombuffer(base64.b64decode(raw.data[index].embedding), dtype="<f4")
        # The wire carries float32 values in both encodings.
        assert all(float(np.float32(value)) == value for value in floats.data[index].embedding)
        # Each request computes its vectors anew (a later one may hit the prefix cache, which sums
        # in another order), so the three requests agree to float32 rounding, not bit for bit.
        assert close(decoded.data[index].embedding, floats.data[index].embedding, 1e-6)
        assert close(from_base64, floats.data[index].embedding, 1e-6)
        assert close(floats.data[index].embedding, want)
        assert close(floats.data[index].embedding, transformers_vector(hf_model, ids))
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, expected[0])
    by_ids = client.embeddings.create(model=MODEL, input=IDS, encoding_format="float")
    single_ids = client.embeddings.create(model=MODEL, input=IDS[0], encoding_format="float", dimensions=128)
    assert by_ids.usage.prompt_tokens == sum(len(ids) for ids in IDS)
    for item, ids in zip(by_ids.data, IDS):
        assert close(item.embedding, transformers_vector(hf_model, ids))
    assert close(single_ids.data[0].embedding, by_ids.data[0].embedding)
    assert wait_idle(stack.http)["metrale_kv_cache_blocks_used"] == 0


def test_vllm_extensions(stack, llm, hf_model):
    http = stack.http
    body = {"model": MODEL, "input": IDS, "pooling_type": "MEAN", "normalize": False}
    answer = http.post("/v1/embeddings", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"].startswith("embd-")
    for item, ids in zip(answer.json()["data"], IDS):
        assert close(item["embedding"], transformers_vector(hf_model, ids, "mean", False))
        assert close(item["embedding"], llm.embed([ids], pooling="mean", normalize=False)[0].outputs.embedding)
    # Each input keeps its last 5 tokens.
    cut = http.post("/v1/embeddings", json={"model": MODEL, "input": IDS, "truncate_prompt_tokens": 5}).json()
    assert cut["usage"]["prompt_tokens"] == 5 + 1
    assert close(cut["data"][0]["embedding"], transformers_vector(hf_model, IDS[0][-5:]))
    whole = http.post("/v1/embeddings", json={"model": MODEL, "input": IDS[0], "truncate_prompt_tokens": -1}).json()
    assert close(whole["data"][0]["embedding"], transformers_vector(hf_model, IDS[0]))
    # Text without the tokenizer's special tokens (no BOS).
    plain = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[1], "add_special_tokens": False}).json()
    assert close(plain["data"][0]["embedding"], transformers_vector(hf_model, llm.encode(TEXTS[1], add_special_tokens=False)))
    explicit = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[1], "pooling_type": "last",
                                                  "normalize": True, "encoding_format": "float", "embed_dtype": "float32",
                                                  "endianness": "little", "user": "someone"}).json()
    assert close(explicit["data"][0]["embedding"], llm.embed([TEXTS[1]])[0].outputs.embedding)


def test_embeddings_beside_running_completions_and_the_metrics(stack, llm):
    expected = [o.outputs.embedding for o in llm.embed(TEXTS)]

    async def main():
        async with async_http_client(stack.url) as client:
            completions = [asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Count {i}", "max_tokens": 40, "ignore_eos": True, "temperature": 0}))
                for i in range(4)]
            await asyncio.sleep(0.05)
            embeddings = await asyncio.gather(*[client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS})
                                                for _ in range(3)])
            return await asyncio.gather(*completions), embeddings

    completions, embeddings = asyncio.run(main())
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40 for r in completions)
    for response in embeddings:
        assert response.status_code == 200
        for item, want in zip(response.json()["data"], expected):
            assert close(item["embedding"], want)
    values = wait_idle(stack.http)
    assert values["metrale_kv_cache_blocks_used"] == 0 and values["metrale_requests_active"] == 0
    text = stack.http.get("/metrics").text
    assert 'metrale_requests_total{endpoint="/v1/embeddings",status="200"}' in text
    finished = [line for line in text.splitlines()
                if line.startswith('metrale_request_finish_total{endpoint="/v1/embeddings",finish_reason="stop"}')]
    assert finished and float(finished[0].split()[-1]) >= 3 * len(TEXTS)


def test_an_adapter_s_name_is_refused_clearly():
    with tempfile.TemporaryDirectory() as root:
        build_peft_adapter(resolve_model_path(MODEL), Path(root) / "ada", seed=3, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"])
        adapter = LoRARequest("ada", 1, Path(root) / "ada")
        stack = Stack(in_process=True, engine_options={"enable_lora": True, "max_loras": 1}, lora_modules=[adapter])
        stack.engine.llm.add_lora(adapter)
        try:
            with pytest.raises(openai.BadRequestError) as raised:
                stack.client.embeddings.create(model="ada", input="Hello")
            assert raised.value.body["param"] == "model" and raised.value.body["code"] == "adapter_not_supported"
            assert stack.client.embeddings.create(model=MODEL, input="Hello").data[0].embedding
        finally:
            stack.close()
