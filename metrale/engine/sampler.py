"""Token sampling on the host, with the semantics of the device kernel.

Both backends sample the same way (:mod:`metrale.kernels.sampling`): a request's ``seed`` and
the index of the token being drawn (``step``) fix the uniform draw, so a seed gives the same
tokens on the CPU and on the GPU wherever the two backends' logits agree.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from metrale.params import SamplingParams

# metrale.kernels.sampling holds the kernel beside the reference (it imports numba), so it is
# imported on first use: ``import metrale`` stays free of numba.


def request_seed(seed: int | None, engine_seed: int, request_index: int) -> int:
    """The seed of one request: its own, or one derived from the engine seed and its index."""
    from metrale.kernels.sampling import _splitmix64

    if seed is not None:
        return int(seed)
    return _splitmix64((int(engine_seed) << 32) ^ int(request_index)) >> 1


def parameter_arrays(params: Sequence[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(temperature, top_k, top_p)`` arrays of the rows: a temperature below
    :data:`~metrale.params.MIN_TEMPERATURE` is stored as 0 (greedy), top_k -1 as 0 (off) and a
    top_k above the vocabulary as the vocabulary size (all tokens)."""
    temperature = np.array([0.0 if p.greedy else p.temperature for p in params], dtype=np.float32)
    top_k = np.array([min(max(p.top_k, 0), vocab_size) for p in params], dtype=np.int32)
    top_p = np.array([p.top_p for p in params], dtype=np.float32)
    return temperature, top_k, top_p


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> list[int]:
    """One token per row of ``logits [R, vocab]``."""
    from metrale.kernels.sampling import request_uniform, sample_reference

    logits = np.asarray(logits, dtype=np.float32).reshape(len(params), -1)
    temperature, top_k, top_p = parameter_arrays(params, logits.shape[1])
    uniforms = np.array([request_uniform(s, t) for s, t in zip(seeds, steps)], dtype=np.float32)
    return sample_reference(logits, temperature, top_k, top_p, uniforms).tolist()


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, step: int) -> int:
    """The token drawn from ``logits [vocab]`` by a request with ``seed`` at ``step``."""
    return sample_rows(np.asarray(logits).reshape(1, -1), [params], [seed], [step])[0]
