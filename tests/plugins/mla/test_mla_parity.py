"""DeepSeek variants beyond the conformance pair, greedy generation against transformers, and the
two attention forms against each other."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import build_mla_checkpoint, mla_configs
from metrale import LLM, SamplingParams
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error
from metrale.testing.hf import hf_greedy, hf_reference_logits


def variant(name, **changes):
    cls, config = mla_configs()[name]
    config = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(config, key, value)
    return cls, config


VARIANTS = {
    "v2_greedy_routing": ("deepseek_v2", dict(topk_method="greedy", n_group=1, topk_group=1)),
    "v2_q_lora_attention_bias": ("deepseek_v2", dict(q_lora_rank=24, attention_bias=True)),
    "v3_half_split_rope": ("deepseek_v3", dict(rope_interleave=False)),
    "v3_no_renormalisation_no_q_lora": ("deepseek_v3", dict(norm_topk_prob=False, q_lora_rank=None)),
    "v3_default_rope_two_dense_layers": ("deepseek_v3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                                             first_k_dense_replace=2)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_match_transformers(tmp_path, name):
    base, changes = VARIANTS[name]
    cls, config = variant(base, **changes)
    path = build_mla_checkpoint(cls, config, tmp_path / name, seed=41)
    ids = np.random.default_rng(3).integers(0, 128, 23).tolist()
    llm = LLM(path, device="cpu", show_progress=False)
    error = max_relative_error(llm.score(ids), hf_reference_logits(path, ids))
    assert error <= 1e-4, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_greedy_generation_matches_transformers(mla_checkpoints, name):
    path = mla_checkpoints[name]
    prompt = np.random.default_rng(5).integers(0, 128, 9).tolist()
    llm = LLM(path, device="cpu", show_progress=False)
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(path, prompt, 12)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_and_expanded_forms_agree(mla_checkpoints, name):
    """The same decode steps through both attention forms (the model picks absorbed for them)."""
    llm = LLM(mla_checkpoints[name], device="cpu", show_progress=False)
    prompts = [np.random.default_rng(6 + n).integers(0, 128, n).tolist() for n in (17, 5)]
    results = []
    for absorbed in (True, False):
        llm.model.absorbed_decode = absorbed
        seqs = [SequenceState.from_prompt(p) for p in prompts]
        try:
            for prompt, seq in zip(prompts, seqs):
                llm.forward.prefill(prompt, seq)
            results.append(np.concatenate([llm.forward.decode_batch([7, 9], seqs), llm.forward.decode_batch([3, 1], seqs)]))
        finally:
            llm.model.absorbed_decode = True
            for seq in seqs:
                llm.cache.release(seq)
    assert max_relative_error(results[0], results[1]) <= 1e-5


def test_the_latent_cache_holds_r_plus_rope_dims(mla_checkpoints):
    llm = LLM(mla_checkpoints["deepseek_v2"], device="cpu", show_progress=False)
    spec = llm.forward.cache_spec()
    assert [layer.width for layer in spec.layers] == [32 + 8] * 3
    assert llm.forward.is_mla()
    assert llm.cache.layers[0].latent.shape[1:] == (llm.cache.block_size, 40)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_both_expert_paths_match_transformers(mla_checkpoints, monkeypatch, name):
    """Experts pair by pair (decode sizes) and grouped per expert (prompt sizes) give the same logits."""
    from metrale.layers import experts as moe_layers

    path = mla_checkpoints[name]
    ids = np.random.default_rng(8).integers(0, 128, 30).tolist()
    expected = hf_reference_logits(path, ids)
    llm = LLM(path, device="cpu", show_progress=False)
    for threshold in (0, 1000):
        monkeypatch.setattr(moe_layers, "MAX_PAIRWISE_TOKENS", threshold)
        assert max_relative_error(llm.score(ids), expected) <= 1e-4, f"threshold {threshold}"


def test_an_incomplete_multi_token_prediction_module_is_skipped(mla_checkpoints, tmp_path):
    """A checkpoint with part of an MTP module (model.layers.{L}.*: no decoder layer) loads, its
    MTP tensors accounted for but no module built, and scores as without them; one without them
    (the tiny checkpoints) loads too. (A complete module: tests/plugins/mla/test_mla_mtp.py.)"""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    source = mla_checkpoints["deepseek_v3"]
    folder = tmp_path / "with-mtp"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(9)
    extra = {
        f"model.layers.{layers}.enorm.weight": rng.standard_normal(hidden).astype(np.float32),
        f"model.layers.{layers}.hnorm.weight": rng.standard_normal(hidden).astype(np.float32),
        f"model.layers.{layers}.eh_proj.weight": rng.standard_normal((hidden, 2 * hidden)).astype(np.float32),
    }
    save_file({**{k: np.ascontiguousarray(v) for k, v in tensors.items()}, **extra}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with_mtp = LLM(folder, device="cpu", show_progress=False)
    assert with_mtp.model.mtp is None
    assert with_mtp.checkpoint.unconsumed() == []
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = LLM(source, device="cpu", show_progress=False)
    assert plain.model.mtp is None
    np.testing.assert_allclose(with_mtp.score(ids), plain.score(ids), rtol=1e-6, atol=1e-6)
