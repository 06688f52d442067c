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


def test_absorbed_and_expanded_forms_agree(mla_checkpoints):
    """The same decode row through both attention forms (the model picks absorbed for it)."""
    llm = LLM(mla_checkpoints["deepseek_v3"], device="cpu", show_progress=False)
    model = llm.model
    prompt = np.random.default_rng(6).integers(0, 128, 17).tolist()
    results = []
    for form in ("absorbed", "expanded"):
        seq = SequenceState.from_prompt(prompt)
        original = model._absorbed
        if form == "expanded":
            model._absorbed = lambda w, q_nope, q_pe, keys: model._expanded(
                w, q_nope, q_pe, keys, np.array([keys.shape[0] - 1]))
        try:
            llm.forward.prefill(prompt, seq)
            results.append(llm.forward.decode(7, seq))
        finally:
            model._absorbed = original
            llm.cache.release(seq)
    assert max_relative_error(results[0], results[1]) <= 1e-5


def test_the_latent_cache_holds_r_plus_rope_dims(mla_checkpoints):
    llm = LLM(mla_checkpoints["deepseek_v2"], device="cpu", show_progress=False)
    spec = llm.forward.cache_spec()
    assert [layer.width for layer in spec.layers] == [32 + 8] * 3
    assert llm.forward.is_mla()
    assert llm.cache.layers[0].latent.shape[1:] == (llm.cache.block_size, 40)
