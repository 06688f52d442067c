"""Helpers shared by the GPU kernel tests."""

from __future__ import annotations

import numpy as np

from metrale.loading.checkpoint import float32_to_bf16


def rel_error(actual, expected):
    """Largest absolute difference over the largest magnitude of ``expected`` (float64)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def bf16(rng, shape, scale=1.0):
    """Normal values of ``shape`` times ``scale``, as bf16 bits."""
    return float32_to_bf16((scale * rng.standard_normal(shape)).astype(np.float32))
