"""The logits-processing, token-counting and logprobs kernels against their NumPy references
under numba's CUDA simulator (tiny shapes, vocabularies that are no multiple of the thread
counts)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import logits_process as lp

pytestmark = [
    pytest.mark.skipif(not __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED,
                       reason="the real-GPU variants of these tests carry the gpu marker"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def test_logit_bias_adds_sparse_entries():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 37)).astype(np.float32)
    rows, tokens = np.array([0, 0, 2, 1], np.int32), np.array([5, 36, 0, 7], np.int32)
    values = np.array([2.5, -np.inf, -100.0, 0.25], np.float32)
    expected = logits.copy()
    lp.apply_logit_bias_reference(expected, rows, tokens, values)
    assert expected[0, 36] == -np.inf and expected[0, 5] == pytest.approx(logits[0, 5] + 2.5)
    lp.apply_logit_bias(logits, rows, tokens, values)
    np.testing.assert_array_equal(logits, expected)


def test_penalties_match_the_reference():
    rng = np.random.default_rng(1)
    vocab = 203
    logits = (3 * rng.standard_normal((4, vocab))).astype(np.float32)
    counts = np.zeros((3, vocab), np.int32)
    counts[0, rng.integers(0, vocab, 30)] = lp.PROMPT_FLAG
    np.add.at(counts[0], rng.integers(0, vocab, 40), 1)
    counts[2, :5] = [1, 2, 3, lp.PROMPT_FLAG | 4, lp.PROMPT_FLAG]
    slots = np.array([0, -1, 2, 0], np.int32)
    repetition = np.array([1.3, 2.0, 1.0, 0.8], np.float32)
    frequency = np.array([0.5, 1.0, -0.5, 0.0], np.float32)
    presence = np.array([0.25, 1.0, 1.5, -1.0], np.float32)
    expected = logits.copy()
    lp.apply_penalties_reference(expected, slots, counts, repetition, frequency, presence)
    np.testing.assert_array_equal(expected[1], logits[1])  # no slot: untouched
    token = 3  # generated 4 times, in the prompt, row 2: r = 1
    assert expected[2, token] == pytest.approx(logits[2, token] + 0.5 * 4 - 1.5)
    got = logits.copy()
    lp.apply_penalties(got, slots, counts, repetition, frequency, presence)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_count_tokens_skips_rows_without_a_slot_or_a_token():
    counts = np.zeros((2, 9), np.int32)
    counts[1, 4] = lp.PROMPT_FLAG
    slots, tokens = np.array([1, -1, 0, 1], np.int32), np.array([4, 3, -1, 8], np.int32)
    expected = counts.copy()
    lp.count_tokens_reference(expected, slots, tokens)
    assert expected[1, 4] == lp.PROMPT_FLAG + 1 and expected[0].sum() == 0
    lp.count_tokens(counts, slots, tokens)
    np.testing.assert_array_equal(counts, expected)


def test_top_logprobs_match_the_reference_with_ties():
    rng = np.random.default_rng(2)
    vocab = 150
    logits = np.round(rng.standard_normal((5, vocab)) * 2).astype(np.float32)  # many ties
    tokens = np.array([3, 0, 149, -1, 77], np.int32)
    ks = np.array([4, 0, 6, 3, -1], np.int32)
    ids, values, ranks = lp.top_logprobs_reference(logits, tokens, ks, 6)
    out_ids = np.full((5, 7), -1, np.int32)
    out_values = np.zeros((5, 7), np.float32)
    out_ranks = np.zeros(5, np.int32)
    lp.top_logprobs(logits, tokens, ks, out_ids, out_values, out_ranks)
    np.testing.assert_array_equal(out_ids, ids)
    np.testing.assert_array_equal(out_ranks, ranks)
    np.testing.assert_allclose(out_values, values, atol=2e-6)
    lse = np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert values[0, 0] == pytest.approx(logits[0, 3] - lse, abs=1e-5)
    assert ids[0, 1:5].tolist() == np.lexsort((np.arange(vocab), -logits[0]))[:4].tolist()


def test_launchers_check_their_arrays():
    with pytest.raises(KernelArgumentError, match="counts"):
        lp.apply_penalties(np.zeros((2, 5), np.float32), np.zeros(2, np.int32), np.zeros((2, 6), np.int32),
                           *(np.ones(2, np.float32) for _ in range(3)))
    with pytest.raises(KernelArgumentError, match="values"):
        lp.apply_logit_bias(np.zeros((2, 5), np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float64))
