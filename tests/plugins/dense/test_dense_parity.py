"""The dense family against transformers: logits, greedy generation, cache continuity, variants."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import BASE
from metrale import LLM, SamplingParams
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error
from metrale.testing.hf import build_hf_checkpoint, hf_greedy, hf_reference_logits

TOLERANCE = 1e-4


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def random_ids(length, seed, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.mark.parametrize("length", [1, 7, 40])
def test_score_matches_transformers(dense_checkpoint, length):
    ids = random_ids(length, length)
    error = max_relative_error(load(dense_checkpoint).score(ids), hf_reference_logits(dense_checkpoint, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_greedy_generation_matches_transformers(dense_checkpoint):
    prompt = random_ids(7, 99)
    ours = load(dense_checkpoint).generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ours[0].token_ids == hf_greedy(dense_checkpoint, prompt, 24)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_then_decode_equals_score_across_block_boundaries(dense_checkpoint, block_size):
    llm = load(dense_checkpoint, block_size=block_size)
    ids = random_ids(50, 5)
    scored = llm.score(ids)
    seq = SequenceState.from_prompt(ids[:3])
    rows = [llm.forward.prefill(ids[:3], seq)[0]]
    rows += [llm.forward.decode(t, seq)[0] for t in ids[3:]]
    assert len(seq.block_table) == -(-len(ids) // block_size)
    error = max_relative_error(np.stack(rows), scored[2:])
    assert error <= 1e-5, f"relative error {error:.3g}"
    llm.cache.release(seq)


def variant_configs():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {
        "llama-biases-linear-rope": (LlamaForCausalLM, LlamaConfig(
            **BASE, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5})),
        "llama-yarn-rope": (LlamaForCausalLM, LlamaConfig(
            **BASE, num_key_value_heads=2, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
        "llama-head-dim": (LlamaForCausalLM, LlamaConfig(**BASE, num_key_value_heads=2, head_dim=24)),
        "qwen2-sliding-layers": (Qwen2ForCausalLM, Qwen2Config(
            **BASE, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
        "qwen3-attention-bias": (Qwen3ForCausalLM, Qwen3Config(
            **BASE, num_key_value_heads=1, head_dim=16, attention_bias=True)),
    }


@pytest.mark.parametrize("name", list(variant_configs()))
def test_variants_match_transformers(tmp_path, name):
    model_class, config = variant_configs()[name]
    path = build_hf_checkpoint(model_class, config, tmp_path / name, seed=21)
    ids = random_ids(40, 8)
    error = max_relative_error(load(path).score(ids), hf_reference_logits(path, ids))
    assert error <= TOLERANCE, f"{name}: relative error {error:.3g}"


def test_sliding_layers_really_slide(tmp_path):
    """Guards the variant test above: with the window off the logits must differ."""
    model_class, config = variant_configs()["qwen2-sliding-layers"]
    path = build_hf_checkpoint(model_class, config, tmp_path / "sliding", seed=21)
    no_window = tmp_path / "no-window"
    shutil.copytree(path, no_window)
    data = json.loads((no_window / "config.json").read_text())
    data["use_sliding_window"] = False
    (no_window / "config.json").write_text(json.dumps(data))
    ids = random_ids(40, 8)
    assert max_relative_error(load(no_window).score(ids), load(path).score(ids)) > 1e-3


def test_transformers_4_style_rope_config(dense_checkpoints, tmp_path):
    """A config.json written by transformers 4.x (top-level rope_theta, rope_scaling) loads alike."""
    old = tmp_path / "llama-4x"
    shutil.copytree(dense_checkpoints["llama"], old)
    data = json.loads((old / "config.json").read_text())
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (old / "config.json").write_text(json.dumps(data))
    ids = random_ids(40, 9)
    expected = hf_reference_logits(dense_checkpoints["llama"], ids)
    assert max_relative_error(load(old).score(ids), expected) <= TOLERANCE


def test_llama3_rope_scaling_holds_far_past_the_original_context(tmp_path):
    """Llama-3's RoPE scaling on a prompt sixteen times its original context (1,024 tokens against
    64): the logits of every position, the cached prompt continued by decode steps, and greedy
    tokens equal transformers'; the same model with unscaled RoPE differs there (so the scaling is
    what is checked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(**{**BASE, "max_position_embeddings": 2048}, num_key_value_heads=2, rope_parameters=scaling)
    path = build_hf_checkpoint(LlamaForCausalLM, config, tmp_path / "llama3-long", seed=23)
    ids = random_ids(1024, 12)
    llm = load(path, max_model_len=1100, block_size=16)
    scored = llm.score(ids)
    assert max_relative_error(scored, hf_reference_logits(path, ids)) <= TOLERANCE
    seq = SequenceState.from_prompt(ids[:1000])
    rows = [llm.forward.prefill(ids[:1000], seq)[0]] + [llm.forward.decode(t, seq)[0] for t in ids[1000:]]
    assert max_relative_error(np.stack(rows), scored[999:]) <= 1e-5
    llm.cache.release(seq)
    greedy = llm.generate(ids[:900], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert greedy[0].token_ids == hf_greedy(path, ids[:900], 16)
    unscaled = tmp_path / "unscaled"
    shutil.copytree(path, unscaled)
    data = json.loads((unscaled / "config.json").read_text())
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    (unscaled / "config.json").write_text(json.dumps(data))
    assert max_relative_error(load(unscaled, max_model_len=1100).score(ids)[64:], scored[64:]) > 1e-3
