"""Qwen3-Next beyond the conformance kit: the two forms of the gated delta rule, greedy generation
against transformers, state slots reused, and the state check between chunks."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.errors import NonFiniteStateError
from metrale.kernels.gated_delta import CHUNK, delta_rule_chunked, delta_rule_recurrent
from metrale.sequence import SequenceState
from metrale.testing.hf import hf_greedy


@pytest.mark.parametrize("tokens", [1, 7, CHUNK, 150])
def test_chunked_rule_equals_the_recurrence(tokens):
    """From a non-zero state, over a partial last chunk too."""
    rng = np.random.default_rng(tokens)
    heads, dk, dv = 3, 8, 5
    k = rng.standard_normal((tokens, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = (rng.standard_normal((tokens, heads, dk)) * dk**-0.5).astype(np.float32)
    v = rng.standard_normal((tokens, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.7, (tokens, heads)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (tokens, heads)).astype(np.float32)
    state = rng.standard_normal((heads, dk, dv)).astype(np.float32)
    out_r, state_r = delta_rule_recurrent(np, q, k, v, g, beta, state)
    out_c, state_c = delta_rule_chunked(np, q, k, v, g, beta, state)
    np.testing.assert_allclose(out_c, out_r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state_c, state_r, rtol=1e-4, atol=1e-5)


def test_greedy_generation_matches_transformers(gdn_checkpoint):
    prompt = np.random.default_rng(5).integers(0, 128, 11).tolist()
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False)
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(gdn_checkpoint, prompt, 12)


def test_a_reused_state_slot_starts_clean(gdn_checkpoint):
    """One slot only: the second request gets the slot the first released and must equal its own
    fresh run."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, second = (np.random.default_rng(n).integers(0, 128, 9 + n).tolist() for n in (1, 2))
    fresh = LLM(gdn_checkpoint, device="cpu", show_progress=False).generate([second], params)[0].token_ids
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, max_num_seqs=1, num_state_slots=1)
    assert llm.cache.state_slots.num_slots == 1
    llm.generate([first], params)
    assert llm.generate([second], params)[0].token_ids == fresh
    assert llm.cache.state_slots.num_free == 1


def test_a_non_finite_state_is_reported_between_chunks(gdn_checkpoint):
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False)
    prompt = list(range(1, 21))
    seq = SequenceState.from_prompt(prompt)
    try:
        llm.forward.prefill_chunk(prompt, seq, 0, 8, False)
        llm.forward.normalize_ssm_states(seq)  # finite: nothing happens
        state_layer = next(layer for layer in llm.cache.layers if hasattr(layer, "state"))
        state_layer.state[seq.state_slot][0, 0, 0] = np.nan
        with pytest.raises(NonFiniteStateError, match="layer 0"):
            llm.forward.normalize_ssm_states(seq)
    finally:
        llm.cache.release(seq)


def test_tail_split_follows_the_formula(gdn_checkpoint):
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=16)
    split = llm.forward.prefill_tail_split
    assert llm.cache.snapshots.count > 0
    assert split([0] * 32772) == 32512  # tb = 32768; min(32752, floor(32516 / 16) * 16)
    assert split([0] * 300) == 32  # min(288 - 16, floor(44 / 16) * 16)
    assert split([0] * 256) is None and split([0] * 100) is None  # not positive
    off = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=16, enable_prefix_caching=False)
    assert not off.cache.snapshots.count and off.forward.prefill_tail_split([0] * 32772) is None


def test_prefix_hits_resume_only_from_snapshots(gdn_checkpoint):
    """Snapshots are taken where chunks end (and at the tail split); a hit resumes at the deepest
    matched block with one, never beyond, and changes no output."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(12)
    base = rng.integers(1, 128, 30).tolist()
    plain = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=4, enable_prefix_caching=False)
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=8)
    llm.model.min_tail = 8  # the 30-token prompt splits at 20
    first = llm.generate([base], params)[0]
    assert first.cached_tokens == 0 and first.token_ids == plain.generate([base], params)[0].token_ids
    # Its chunks were [0, 8), [8, 16), [16, 20) (the tail split), [20, 28), [28, 30): snapshots at
    # 8, 16, 20 and 28; the block [28, 32) was completed by decode steps, without one.
    assert llm.engine.snapshots.num_taken == 4
    branch = base[:20] + rng.integers(1, 128, 10).tolist()
    continued = base + first.token_ids + [7, 8, 9]  # matches 8 full blocks (32 tokens)
    for prompt, cached in ((branch, 20), (continued, 28)):
        output = llm.generate([prompt], params)[0]
        assert output.cached_tokens == cached
        assert output.token_ids == plain.generate([prompt], params)[0].token_ids
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    assert llm.cache.state_slots.num_free == llm.cache.state_slots.num_slots


def test_slots_are_released_after_a_failed_step(gdn_checkpoint, monkeypatch):
    """A forward error fails the step's requests and gives their slots back, exactly once."""
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=4)
    original = llm.model.forward_batch
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return original(batch)

    monkeypatch.setattr(llm.model, "forward_batch", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0))
    slots = llm.cache.state_slots
    assert slots.num_free == slots.num_slots and not llm.engine.has_unfinished()
    monkeypatch.setattr(llm.model, "forward_batch", original)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].finish_reason == "length"
