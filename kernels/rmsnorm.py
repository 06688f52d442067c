"""RMSNorm, optionally fused with the residual add, and its zero-centred variant."""

from __future__ import annotations

import numpy as np


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float, weight_offset: float = 0.0) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * (weight_offset + weight)`` over the last axis, float32.

    ``weight_offset`` is 1 for zero-centred norms (Qwen3-Next), 0 otherwise.
    """
    x = np.asarray(x, dtype=np.float32)
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    normed = x / np.sqrt(variance + np.float32(eps))
    return (normed * (np.float32(weight_offset) + weight)).astype(np.float32)


def rmsnorm_residual_reference(
    x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float, weight_offset: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Fused residual add and norm: ``s = x + residual``; returns ``(rmsnorm(s), s)``.

    With ``residual`` None the sum is ``x`` itself (the first layer).
    """
    summed = np.asarray(x, dtype=np.float32) if residual is None else (x + residual).astype(np.float32)
    return rmsnorm_reference(summed, weight, eps, weight_offset), summed
