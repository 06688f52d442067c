"""Paged KV write and paged attention over the cache (prefill with a cached prefix, and decode).

Cache layout: ``k_cache``, ``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``. A
flat slot ``s`` is block ``s // block_size``, offset ``s % block_size``.

Batch metadata (varlen, one entry per query row ``i`` of ``N``): ``positions[i]`` is the row's
absolute position and ``seq_index[i]`` its sequence; ``block_tables[seq_index[i]]`` maps that
sequence's positions to blocks. Row ``i`` attends to its sequence's keys at positions
``j <= positions[i]`` (and ``j > positions[i] - sliding_window`` when a window is set).
"""

from __future__ import annotations

import numpy as np


def paged_kv_write_reference(
    k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray
) -> None:
    """Store ``k``/``v`` ``[N, num_kv_heads, d]`` at the flat slots ``slot_mapping [N]``, in place."""
    blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    k_flat = k_cache.reshape(blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.reshape(blocks * block_size, *v_cache.shape[2:])
    k_flat[slot_mapping] = k
    v_flat[slot_mapping] = v


def gather_sequence_kv(cache: np.ndarray, block_table: np.ndarray, length: int) -> np.ndarray:
    """Positions ``[0, length)`` of one sequence: ``[length, num_kv_heads, d]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    gathered = cache[np.asarray(block_table[:num_blocks], dtype=np.int64)]
    return gathered.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def paged_attention_reference(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_index: np.ndarray,
    positions: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Causal GQA attention of ``q [N, n_heads, d]`` over the paged cache -> ``[N, n_heads, d_v]``.

    Query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``; softmax in float32.
    """
    n_rows, n_heads, _ = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    out = np.empty((n_rows, n_heads, v_cache.shape[3]), dtype=np.float32)
    for seq in np.unique(seq_index):
        rows = np.nonzero(seq_index == seq)[0]
        query_pos = positions[rows]
        length = int(query_pos.max()) + 1
        keys = gather_sequence_kv(k_cache, block_tables[seq], length)  # [S, n_kv, d]
        values = gather_sequence_kv(v_cache, block_tables[seq], length)
        keys = np.repeat(keys, group, axis=1).transpose(1, 2, 0)  # [n_heads, d, S]
        values = np.repeat(values, group, axis=1).transpose(1, 0, 2)  # [n_heads, S, d_v]
        scores = (q[rows].transpose(1, 0, 2) @ keys) * np.float32(scale)  # [n_heads, R, S]
        key_pos = np.arange(length)[None, :]
        visible = key_pos <= query_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos > query_pos[:, None] - sliding_window
        scores = np.where(visible[None], scores, -np.inf).astype(np.float32)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[rows] = (weights @ values).transpose(1, 0, 2)
    return out
