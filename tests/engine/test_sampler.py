"""metrale/runner/sampling.py: greedy, temperature, top-k, top-p and seeding.

The allowed sets and the target distributions are computed here with NumPy, independently of
the sampler's own masking code.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.params import SamplingParams
from metrale.runner.sampling import request_seed, sample_token


def _logits(seed: int, vocab: int = 50, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale + 0.3).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _draw(logits: np.ndarray, params: SamplingParams, n: int, seed: int) -> list[int]:
    return [sample_token(logits, params, seed, step) for step in range(n)]


def _nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """Smallest set of most-likely tokens whose mass reaches ``top_p`` (a plain loop)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += probs[token]
        if mass >= top_p:
            break
    return kept


# ============================================================================== greedy / argmax


@pytest.mark.parametrize("seed", range(5))
def test_temperature_zero_is_argmax(seed):
    logits = _logits(seed, vocab=97)
    expected = int(np.argmax(logits))
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.3)
    assert _draw(logits, params, 20, seed) == [expected] * 20


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0, 50.0])
def test_top_k_one_is_argmax(temperature):
    logits = _logits(7, vocab=64, scale=0.2)  # nearly flat: sampling without top-k would wander
    expected = int(np.argmax(logits))
    assert set(_draw(logits, SamplingParams(temperature=temperature, top_k=1), 300, 3)) == {expected}
    wandering = set(_draw(logits, SamplingParams(temperature=temperature), 300, 3))
    assert len(wandering) > 1


@pytest.mark.parametrize("top_p", [1e-9, 1e-3])
@pytest.mark.parametrize("temperature", [0.7, 5.0])
def test_tiny_top_p_is_argmax(top_p, temperature):
    logits = _logits(8, vocab=64, scale=0.2)
    expected = int(np.argmax(logits))
    assert set(_draw(logits, SamplingParams(temperature=temperature, top_p=top_p), 300, 4)) == {expected}


# ==================================================================================== seeding


def test_same_seed_same_tokens():
    logits = _logits(2, vocab=40, scale=0.5)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1234)
    # A request seed fixes the stream whatever the engine seed and the request's index.
    seed_a, seed_b = request_seed(1234, 7, 0), request_seed(1234, 99, 5)
    run_a = [sample_token(logits, params, seed_a, step) for step in range(200)]
    run_b = [sample_token(logits, params, seed_b, step) for step in range(200)]
    assert run_a == run_b
    assert len(set(run_a)) > 5  # the runs are random, not trivially constant


def test_different_seeds_eventually_differ():
    logits = _logits(2, vocab=40, scale=0.5)
    params = SamplingParams(temperature=1.0)
    runs = {}
    for seed in (1, 2, 3):
        request = request_seed(seed, 0, 0)
        runs[seed] = [sample_token(logits, params, request, step) for step in range(100)]
    assert runs[1] != runs[2] and runs[2] != runs[3] and runs[1] != runs[3]


def test_unseeded_requests_follow_the_engine_seed_and_their_index():
    logits = _logits(3, vocab=40, scale=0.5)
    params = SamplingParams(temperature=1.0)

    def run(engine_seed, index):
        request = request_seed(None, engine_seed, index)
        return [sample_token(logits, params, request, step) for step in range(100)]

    assert run(0, 0) == run(0, 0)
    assert run(0, 0) != run(0, 1)
    assert run(0, 0) != run(1, 0)


# ================================================================================ top-k / top-p


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("temperature", [0.8, 4.0])
def test_top_k_stays_within_the_k_largest(k, temperature):
    logits = _logits(10 + k, vocab=60, scale=0.3)
    assert len(np.unique(logits)) == len(logits)
    allowed = set(np.argsort(-logits)[:k].tolist())
    drawn = Counter(_draw(logits, SamplingParams(temperature=temperature, top_k=k), 3000, k))
    outside = set(drawn) - allowed
    assert not outside, f"tokens {sorted(outside)} are not among the {k} largest logits"
    assert set(drawn) == allowed, f"never drew {sorted(allowed - set(drawn))} of the allowed {sorted(allowed)}"


@pytest.mark.parametrize("top_k", [0, -1, 60, 1000])
def test_disabled_or_oversized_top_k_keeps_every_token(top_k):
    logits = _logits(20, vocab=12, scale=0.2)
    drawn = set(_draw(logits, SamplingParams(temperature=1.0, top_k=top_k), 2000, 6))
    assert drawn == set(range(12))


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_top_p_stays_within_the_nucleus(top_p, temperature):
    logits = _logits(30, vocab=40, scale=1.0)
    probs = _softmax(logits.astype(np.float64) / temperature)
    nucleus = _nucleus(probs, top_p)
    assert 1 < len(nucleus) < 40
    drawn = Counter(_draw(logits, SamplingParams(temperature=temperature, top_p=top_p), 4000, 11))
    outside = set(drawn) - nucleus
    assert not outside, f"tokens {sorted(outside)} are outside the nucleus {sorted(nucleus)}"
    assert set(drawn) == nucleus, f"never drew {sorted(nucleus - set(drawn))} of the nucleus"


def test_top_k_then_top_p_renormalise_in_order():
    """top-p is taken over the top-k distribution: with k=3 the nucleus of 0.7 is computed from
    the three survivors' renormalised probabilities."""
    logits = np.array([2.0, 1.9, 1.8, 1.7, 1.6, -1.0], np.float32)
    kept = _softmax(logits[:3])  # ~[0.367, 0.332, 0.301]
    nucleus = _nucleus(kept, 0.7)  # {0, 1, 2}: 0.699 < 0.7
    assert nucleus == {0, 1, 2}
    drawn = set(_draw(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7), 2000, 13))
    assert drawn == {0, 1, 2}


# ============================================================================= distributions


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_match_softmax(temperature):
    logits = np.array([1.2, -0.4, 0.3, 2.0, -1.5], np.float32)
    n = 20000
    draws = np.array(_draw(logits, SamplingParams(temperature=temperature), n, seed=2718))
    frequencies = np.bincount(draws, minlength=5) / n
    expected = _softmax(logits.astype(np.float64) / temperature)
    worst = float(np.abs(frequencies - expected).max())
    assert worst <= 0.015, f"max abs error {worst:.4f}: frequencies {frequencies} vs softmax {expected}"


def test_top_k_frequencies_are_the_renormalised_top_k():
    logits = np.array([0.5, 1.5, -0.2, 1.0, 0.9, -2.0], np.float32)
    n = 20000
    draws = np.array(_draw(logits, SamplingParams(temperature=1.0, top_k=3), n, seed=31))
    frequencies = np.bincount(draws, minlength=6) / n
    expected = np.zeros(6)
    top = [1, 3, 4]
    expected[top] = _softmax(logits[top])
    worst = float(np.abs(frequencies - expected).max())
    assert worst <= 0.015, f"max abs error {worst:.4f}: {frequencies} vs {expected}"


# ============================================================================ property test

finite_logit = st.floats(min_value=-30.0, max_value=30.0, allow_nan=False, width=32)


@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(min_value=1, max_value=24))
    values = draw(st.lists(st.one_of(finite_logit, st.just(float("-inf"))), min_size=vocab, max_size=vocab))
    if all(v == float("-inf") for v in values):
        values[draw(st.integers(0, vocab - 1))] = draw(finite_logit)
    temperature = draw(st.one_of(st.just(0.0), st.floats(min_value=0.05, max_value=5.0)))
    top_k = draw(st.integers(min_value=-1, max_value=vocab + 2))
    top_p = draw(st.one_of(st.just(1.0), st.floats(min_value=1e-6, max_value=1.0, exclude_min=False)))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    return np.array(values, np.float32), temperature, top_k, top_p, seed


def _allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Every token some valid tie-breaking of greedy / top-k / top-p could return."""
    values = logits.astype(np.float64)
    finite = np.isfinite(values)
    if temperature == 0.0:
        return set(np.flatnonzero(values == values.max()).tolist())
    scaled = np.where(finite, values / temperature, -np.inf)
    candidates = np.flatnonzero(finite)
    if 0 < top_k < len(values):
        kth = np.sort(scaled)[::-1][top_k - 1]
        candidates = candidates[scaled[candidates] >= kth]
    probs = np.zeros(len(values))
    probs[candidates] = np.exp(scaled[candidates] - scaled[candidates].max())
    probs /= probs.sum()
    allowed = set()
    for token in candidates:
        if probs[token] == 0.0:
            continue  # underflowed to zero probability: never drawn
        ahead = probs[probs > probs[token]].sum()  # mass that must be kept before this token
        if ahead < top_p + 1e-9:
            allowed.add(int(token))
    return allowed


@settings(max_examples=300, deadline=None, derandomize=True)
@given(sampling_cases())
def test_sampled_token_is_finite_and_allowed(case):
    logits, temperature, top_k, top_p, seed = case
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    allowed = _allowed(logits, temperature, top_k, top_p)
    assert allowed
    for step in range(5):
        token = sample_token(logits, params, seed, step)
        assert 0 <= token < len(logits)
        assert np.isfinite(logits[token]), f"token {token} has logit {logits[token]}"
        assert token in allowed, f"token {token} not in the allowed set {sorted(allowed)}"
