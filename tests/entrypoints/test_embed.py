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


def vectors(outputs):
    return [np.asarray(o.outputs.embedding, dtype=np.float64) for o in outputs]


MIXED = [list(range(5, 52)), [9], [3, 14, 15, 92, 65], list(range(60, 93)), [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("mean", False)])
def test_a_batch_in_chunks_equals_each_prompt_alone_and_transformers(checkpoint, pooling, normalize):
    """Prompts of mixed lengths in one call, cut into chunks of the token budget (the longest in
    three or more), give each prompt the vector it gets alone and transformers' pooled states;
    the same call again gives the same vectors bit for bit."""
    llm = LLM(str(checkpoint), device="cpu", show_progress=False, max_num_batched_tokens=16, max_num_seqs=4)
    batch = llm.embed(MIXED, pooling=pooling, normalize=normalize)
    steps = llm.engine.calls["final_states"]
    # Several prompts share a step (one prompt a step would take a step per chunk of each).
    assert steps < sum(-(-len(p) // 16) for p in MIXED)
    alone = [llm.embed([prompt], pooling=pooling, normalize=normalize)[0] for prompt in MIXED]
    for got, solo, ids in zip(vectors(batch), vectors(alone), MIXED):
        expected = reference(checkpoint, ids, pooling, normalize)
        scale = max(np.abs(expected).max(), 1.0)
        assert np.abs(got - solo).max() <= 1e-5 * scale
        assert np.abs(got - expected).max() <= 1e-5 * scale
    again = llm.embed(MIXED, pooling=pooling, normalize=normalize)
    assert [o.outputs.embedding for o in again] == [o.outputs.embedding for o in batch]
    assert llm.engine.check() == [] and llm.cache.holdings()[1] == 0
    assert not llm.engine.has_unfinished()


def test_the_model_default_pools_as_its_sentence_transformers_config_says(tmp_path):
    """Without ``pooling`` / ``normalize``, the checkpoint's sentence-transformers modules decide
    (here: mean pooling, no Normalize module); without them, last token and normalized."""
    import json
    import shutil

    from metrale.loading.model import resolve_model_path

    plain = LLM("tiny-dense", device="cpu", show_progress=False)
    prompt = [[4, 8, 15, 16, 23, 42]]
    assert plain.embed(prompt)[0].outputs.embedding == plain.embed(prompt, pooling="last", normalize=True)[0].outputs.embedding
    folder = tmp_path / "st"
    shutil.copytree(resolve_model_path("tiny-dense"), folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": plain.embedding_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    configured = LLM(str(folder), device="cpu", show_progress=False)
    got = configured.embed(prompt)[0].outputs.embedding
    assert got == configured.embed(prompt, pooling="mean", normalize=False)[0].outputs.embedding
    assert got != configured.embed(prompt, pooling="mean", normalize=True)[0].outputs.embedding
    assert abs(np.linalg.norm(got) - 1.0) > 1e-3


def test_a_prompt_too_long_for_the_cache_fails_alone():
    llm = LLM("tiny-dense", device="cpu", show_progress=False, block_size=16, num_blocks=4)
    outputs = llm.embed([[5, 6, 7], list(range(1, 90)), [8, 9]])
    assert outputs[1].error is not None and "KV blocks" in outputs[1].error and outputs[1].outputs.embedding == []
    for output, ids in zip([outputs[0], outputs[2]], [[5, 6, 7], [8, 9]]):
        assert output.error is None
        solo = np.asarray(llm.embed([ids])[0].outputs.embedding)
        assert np.abs(np.asarray(output.outputs.embedding) - solo).max() <= 1e-5
    assert llm.cache.allocator.num_free == llm.cache.allocator.num_blocks


def test_pooling_defaults_read_sentence_transformers_modules(tmp_path, caplog):
    import json

    from metrale.entrypoints.frontend import pooling_defaults
    from metrale.params import PoolingParams

    def folder(name, modules, pooling=None):
        path = tmp_path / name
        (path / "1_Pooling").mkdir(parents=True)
        (path / "modules.json").write_text(json.dumps([
            {"idx": i, "name": str(i), "path": "1_Pooling" if kind == "Pooling" else "",
             "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]))
        if pooling is not None:
            (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return path

    assert pooling_defaults(tmp_path) == PoolingParams("last", True)  # no modules.json
    qwen3_embedding = folder("q", ["Transformer", "Pooling", "Normalize"],
                             {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    assert pooling_defaults(qwen3_embedding) == PoolingParams("last", True)
    assert pooling_defaults(folder("m", ["Transformer", "Pooling"], {"pooling_mode": "mean"})) == PoolingParams("mean", False)
    with caplog.at_level("WARNING"):
        cls = pooling_defaults(folder("c", ["Transformer", "Pooling", "Dense", "Normalize"], {"pooling_mode_cls_token": True}))
    assert cls == PoolingParams("last", True)
    assert "not served" in caplog.text and "Dense" in caplog.text
    broken = folder("b", ["Transformer", "Pooling"])  # the Pooling module's config.json is missing
    assert pooling_defaults(broken) == PoolingParams("last", True)
    (broken / "modules.json").write_text("{not json")
    assert pooling_defaults(broken) == PoolingParams("last", True)
