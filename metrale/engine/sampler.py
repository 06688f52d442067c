"""Token sampling on the host: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import numpy as np

from metrale.params import SamplingParams


def request_generator(seed: int | None, engine_seed: int, request_index: int) -> np.random.Generator:
    """The random stream of one request: its own seed, or the engine seed and its index."""
    if seed is not None:
        return np.random.default_rng(seed)
    return np.random.default_rng([engine_seed, request_index])


def sample_token(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    """Pick the next token from ``logits [vocab]`` (float32)."""
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = int(np.searchsorted(cumulative, params.top_p)) + 1
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[:keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    cumulative = np.cumsum(probs)
    choice = int(np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right"))
    return min(choice, probs.shape[0] - 1)
