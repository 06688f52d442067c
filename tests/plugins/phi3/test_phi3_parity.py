"""The Phi-3 family against transformers: logits (past the sliding window; LongRoPE's short and
long factors), greedy generation, cache continuity, speculation, LoRA against PEFT."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, LoRARequest, SamplingParams
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error
from metrale.testing.hf import build_peft_adapter, hf_greedy, hf_reference_logits

from .conftest import ORIGINAL_CONTEXT

TOLERANCE = 1e-4
SHORT = ORIGINAL_CONTEXT  # a max_model_len whose LongRoPE table takes the short factors
LONG = 128  # one whose table takes the long factors (the checkpoint's max_position_embeddings)
PHI3_PROJECTIONS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def random_ids(length, seed, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


# (checkpoint, prompt length, max_model_len): the plain model at its default context; the
# LongRoPE model with prompts within the pretraining context served with that context (short
# factors, as transformers for those prompts) and longer ones served with a longer context (long
# factors, as transformers when it scores the whole prompt at once).
SCORE_CASES = [("phi3", n, None) for n in (1, 9, 40)] + [("phi4_mini", n, SHORT) for n in (1, 9, SHORT)] + [
    ("phi4_mini", n, LONG) for n in (40, 60)]


@pytest.mark.parametrize("name, length, max_model_len", SCORE_CASES)
def test_score_matches_transformers(phi3_checkpoints, name, length, max_model_len):
    path, ids = phi3_checkpoints[name], random_ids(length, length)
    llm = load(path, **({} if max_model_len is None else {"max_model_len": max_model_len}))
    assert llm.family.name == "phi3"
    assert llm.model.long_rope_factors == (max_model_len == LONG)
    error = max_relative_error(llm.score(ids), hf_reference_logits(path, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_the_checkpoints_exercise_what_they_are_for(phi3_checkpoints):
    plain, mini = load(phi3_checkpoints["phi3"]), load(phi3_checkpoints["phi4_mini"])
    assert plain.model.config.decoder.sliding_window == 16 < 40
    assert [layer.geometry.sliding_window for layer in plain.model.layers] == [16, 16, 16]
    assert mini.model.config.rope.rotary_dim == 12 and mini.model.layers[0].geometry.head_dim == 16
    assert mini.model.ends.lm_head is mini.model.ends.embed  # tied
    assert mini.model.config.rope.rope_type == "longrope" and mini.model.config.rope.attention_factor() > 1


def transformers_with_long_factors(path):
    """transformers' model of ``path`` made to rotate every sequence with LongRoPE's long factors
    (its short-sequence table replaced by the long one)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rotary = model.model.rotary_emb
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, None, seq_len=ORIGINAL_CONTEXT + 1)
    rotary.original_inv_freq.copy_(long)
    rotary.inv_freq.copy_(long)
    return model


def test_a_short_prompt_served_with_a_long_context_takes_the_long_factors(phi3_checkpoints):
    """One RoPE table per model, chosen by max_model_len: unlike transformers' choice per forward,
    a prompt within the pretraining context is rotated with the long factors."""
    import torch

    path, ids = phi3_checkpoints["phi4_mini"], random_ids(9, 9)
    with torch.no_grad():
        expected = transformers_with_long_factors(path)(torch.tensor([ids])).logits[0].numpy()
    ours = load(path, max_model_len=LONG).score(ids)
    assert max_relative_error(ours, expected) <= TOLERANCE
    assert max_relative_error(ours, hf_reference_logits(path, ids)) > 1e-2  # transformers' own: short factors


@pytest.mark.parametrize("name, prompt_length, max_model_len", [("phi3", 11, None), ("phi4_mini", 9, SHORT),
                                                               ("phi4_mini", 40, LONG)])
def test_greedy_generation_matches_transformers(phi3_checkpoints, name, prompt_length, max_model_len):
    """Each run stays within one LongRoPE regime (9 + 20 <= 32 tokens; 40 > 32 from the first step)."""
    path, prompt = phi3_checkpoints[name], random_ids(prompt_length, 99)
    options = {} if max_model_len is None else {"max_model_len": max_model_len}
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ours = load(path, **options).generate(prompt, params)[0].token_ids
    assert ours == hf_greedy(path, prompt, 20)


def test_prefill_then_decode_equals_score(phi3_checkpoint):
    llm = load(phi3_checkpoint, block_size=4)
    ids = random_ids(50, 5)
    scored = llm.score(ids)
    seq = SequenceState.from_prompt(ids[:3])
    rows = [llm.forward.prefill(ids[:3], seq)[0]]
    rows += [llm.forward.decode(t, seq)[0] for t in ids[3:]]
    llm.cache.release(seq)
    error = max_relative_error(np.stack(rows), scored[2:])
    assert error <= 1e-5, f"relative error {error:.3g}"


def test_ngram_speculation_keeps_the_greedy_tokens(phi3_checkpoint):
    prompt = random_ids(6, 3) * 3
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = load(phi3_checkpoint).generate(prompt, params)[0].token_ids
    speculative = load(phi3_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert speculative.generate(prompt, params)[0].token_ids == plain


def peft_logits(peft, tokens):
    import torch

    with torch.no_grad():
        return peft(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("name, length, max_model_len, targets", [
    ("phi3", 12, None, PHI3_PROJECTIONS),
    ("phi3", 70, None, PHI3_PROJECTIONS),  # more rows than FOLDED_ROWS: shrink and expand apart
    ("phi3", 12, None, ["gate_up_proj"]),
    ("phi4_mini", 12, SHORT, PHI3_PROJECTIONS),
    ("phi4_mini", 50, LONG, ["qkv_proj", "down_proj"]),
])
def test_lora_on_the_fused_projections_equals_peft(phi3_checkpoints, tmp_path, name, length, max_model_len, targets):
    """PEFT adapts Phi-3's fused matrices as single modules; so do the engine's stacks."""
    path, ids = phi3_checkpoints[name], random_ids(length, 21)
    patterns = {"rank_pattern": {"o_proj": 4}} if "o_proj" in targets else {}
    peft = build_peft_adapter(path, tmp_path / "a", seed=1, r=8, lora_alpha=16, target_modules=targets, **patterns)
    options = {} if max_model_len is None else {"max_model_len": max_model_len}
    with load(path, enable_lora=True, max_lora_rank=8, max_loras=2, **options) as llm:
        adapted = llm.score(ids, lora_request=LoRARequest("a", 1, tmp_path / "a"))
        base = llm.score(ids)
    expected = peft_logits(peft, ids)
    assert max_relative_error(adapted, expected) <= TOLERANCE
    assert max_relative_error(base, expected) > 1e-2  # the adapter changes the logits


def test_lora_generation_equals_peft_greedy(phi3_checkpoints, tmp_path):
    import torch

    path, prompt = phi3_checkpoints["phi3"], random_ids(10, 4)
    peft = build_peft_adapter(path, tmp_path / "a", seed=2, r=4, lora_alpha=8, target_modules=PHI3_PROJECTIONS)
    with torch.no_grad():
        out = peft.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with load(path, enable_lora=True, max_lora_rank=4) as llm:
        ours = llm.generate(prompt, params, lora_request=LoRARequest("a", 1, tmp_path / "a"))[0].token_ids
    assert ours == out[0, len(prompt):].tolist()
