"""``LLM.embed``: the pooled final normed states of each prompt against transformers' own
``last_hidden_state`` (the base model's output after its final norm), last-token and mean
pooling, with and without normalisation, for every kind of family; deterministic; bad input is a
typed error."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM
from metrale.errors import InvalidRequestError

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 23], [7, 1, 2], list(range(3, 40))]


def reference(path, ids, pooling, normalize):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        states = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = states[-1] if pooling == "last" else states.mean(axis=0)
    return vector / np.linalg.norm(vector) if normalize else vector


@pytest.fixture(params=["dense", "gemma", "mla", "gdn"])
def checkpoint(request, dense_checkpoints, gemma_checkpoints, mla_checkpoints, gdn_checkpoint):
    return {"dense": dense_checkpoints["qwen3"], "gemma": gemma_checkpoints["gemma2"],
            "mla": mla_checkpoints["deepseek_v3"], "gdn": gdn_checkpoint}[request.param]


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", False)])
def test_embeddings_are_transformers_pooled_states(checkpoint, pooling, normalize):
    llm = LLM(str(checkpoint), device="cpu", show_progress=False)
    outputs = llm.embed(PROMPTS, pooling=pooling, normalize=normalize)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for output, ids in zip(outputs, PROMPTS):
        got = np.asarray(output.outputs.embedding, dtype=np.float64)
        expected = reference(checkpoint, ids, pooling, normalize)
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-5 * max(np.abs(expected).max(), 1.0)
    again = llm.embed(PROMPTS, pooling=pooling, normalize=normalize)
    assert [o.outputs.embedding for o in again] == [o.outputs.embedding for o in outputs]
    # Generation afterwards still gets logits (the pooling mode is left).
    assert llm.score(PROMPTS[0]).shape == (len(PROMPTS[0]), llm.vocab_size)


def test_text_prompts_and_bad_input():
    llm = LLM("tiny-dense", device="cpu", show_progress=False)
    text = llm.embed("Hello world")[0]
    ids = llm.embed([llm.encode("Hello world")])[0]
    assert text.outputs.embedding == ids.outputs.embedding
    assert abs(np.linalg.norm(text.outputs.embedding) - 1.0) < 1e-5
    with pytest.raises(InvalidRequestError, match="pooling"):
        llm.embed("x", pooling="max")
    with pytest.raises(InvalidRequestError):
        llm.embed([None])
