"""Rotary position embedding, half-split ("NeoX") or adjacent-pair ("GPT-J") pairing."""

from __future__ import annotations

import numpy as np


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Angles ``fp32(p) * inv_freq`` in float32 (as transformers), scaled cos and sin ``[T, d_r/2]``."""
    angles = np.asarray(positions, dtype=np.float32)[:, None] * np.asarray(inv_freq, dtype=np.float32)[None, :]
    factor = np.float32(attention_factor)
    return (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)


def rope_reference(
    x: np.ndarray,
    positions: np.ndarray,
    inv_freq: np.ndarray,
    attention_factor: float = 1.0,
    interleaved: bool = False,
) -> np.ndarray:
    """Rotate the first ``2 * len(inv_freq)`` dims of every head of ``x [T, heads, d]``.

    Half-split pairs dims ``(i, i + d_r/2)``; ``interleaved`` pairs ``(2i, 2i+1)`` and keeps the
    interleaved layout. Dims past ``d_r`` pass through unchanged.
    """
    x = np.asarray(x, dtype=np.float32)
    half = inv_freq.shape[0]
    rotary = 2 * half
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if interleaved:
        even, odd = x[..., 0:rotary:2], x[..., 1:rotary:2]
        out[..., 0:rotary:2] = even * cos - odd * sin
        out[..., 1:rotary:2] = odd * cos + even * sin
    else:
        first, second = x[..., :half], x[..., half:rotary]
        out[..., :half] = first * cos - second * sin
        out[..., half:rotary] = second * cos + first * sin
    return out
