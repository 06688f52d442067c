"""Paged attention for query heads that share a KV head, one block per (row, KV head, split).

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`; this kernel
writes the same split partials as :func:`~metrale.kernels.attention.paged_attention_split_kernel`
(the combine kernel merges them), but a block serves all ``G = n_heads / n_kv_heads`` query heads
of its KV head, so each cached key and value is read once per block instead of once per query
head. Keys are staged ``KEY_TILE`` at a time in shared memory, read from the cache as 32-bit
words (two bf16 values), ``LOADS_IN_FLIGHT`` words per thread issued before any is used.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from metrale.kernels._device import SIMULATED, bf16_to_float, bits_to_float

GROUPED_THREADS = 16 if SIMULATED else 128
KEY_TILE = 4 if SIMULATED else 32
SPLIT_SIZE = 8 if SIMULATED else 64  # keys per split; the same as the per-head kernel's
MAX_GROUP = 8
MAX_HEAD_DIM = 256
TILE_STRIDE = MAX_HEAD_DIM + 1
TILE_ELEMENTS = KEY_TILE * TILE_STRIDE
QUERY_ELEMENTS = MAX_GROUP * MAX_HEAD_DIM
SCORE_ELEMENTS = MAX_GROUP * SPLIT_SIZE
STATS_ELEMENTS = 2 * MAX_GROUP  # (max, sum) per query head
LOADS_IN_FLIGHT = 4
ACCUMULATORS = 4  # (group, dim) outputs per thread: G * dv <= ACCUMULATORS * threads
NEGATIVE_INFINITY = -math.inf


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether the grouped kernel handles this geometry (else the per-head kernel runs)."""
    group = heads // kv_heads
    return (
        group <= MAX_GROUP
        and head_dim % 2 == 0
        and value_dim % 2 == 0
        and head_dim <= MAX_HEAD_DIM
        and value_dim <= MAX_HEAD_DIM
        and group * value_dim <= ACCUMULATORS * GROUPED_THREADS
    )


@cuda.jit(device=True)
def stage_tile(cache_words, block_ids, start, count, kv_head, width, tile, tid):
    # Widen keys [start, start + count) of one KV head into tile[key * TILE_STRIDE + dim]
    # (float32). cache_words [blocks, block_size, nkv, width / 2] holds two bf16 per uint32.
    block_size = cache_words.shape[1]
    words_per_key = width // 2
    total = count * words_per_key
    loaded = cuda.local.array(LOADS_IN_FLIGHT, uint32)
    for base in range(tid, total, GROUPED_THREADS * LOADS_IN_FLIGHT):
        for u in range(LOADS_IN_FLIGHT):
            e = base + u * GROUPED_THREADS
            if e < total:
                key = e // words_per_key
                loaded[u] = cache_words[block_ids[key], (start + key) % block_size, kv_head, e % words_per_key]
        for u in range(LOADS_IN_FLIGHT):
            e = base + u * GROUPED_THREADS
            if e < total:
                key = e // words_per_key
                column = 2 * (e % words_per_key)
                word = loaded[u]
                tile[key * TILE_STRIDE + column] = bf16_to_float(word & uint32(0xFFFF))
                tile[key * TILE_STRIDE + column + 1] = bits_to_float(word & uint32(0xFFFF0000))


@cuda.jit(cache=True)
def paged_attention_grouped_kernel(
    q, k_words, v_words, block_tables, seq_index, positions, scale, sliding_window, out_acc, out_max, out_sum
):
    # Grid: (N rows, n_kv_heads, splits); block GROUPED_THREADS threads. Writes, for the G query
    # heads of its KV head, the split partials the combine kernel merges (see the per-head
    # kernel). q [N, nh, d] f32; k_words / v_words: the bf16 caches viewed as uint32
    # [blocks, block_size, nkv, d / 2]; block_tables [S, max_blocks] int32.
    row = cuda.blockIdx.x
    kv_head = cuda.blockIdx.y
    split = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    head_dim = q.shape[2]
    value_dim = 2 * v_words.shape[3]
    group = q.shape[1] // k_words.shape[2]
    block_size = k_words.shape[1]
    position = positions[row]
    seq = seq_index[row]
    first = split * SPLIT_SIZE
    lo = first
    hi = min(first + SPLIT_SIZE, position + 1)
    if sliding_window > 0:
        lo = max(lo, position - sliding_window + 1)
    if lo >= hi:
        for e in range(tid, group * value_dim, GROUPED_THREADS):
            out_acc[row, kv_head * group + e // value_dim, split, e % value_dim] = 0.0
        if tid < group:
            out_max[row, kv_head * group + tid, split] = NEGATIVE_INFINITY
            out_sum[row, kv_head * group + tid, split] = 0.0
        return
    query = cuda.shared.array(QUERY_ELEMENTS, float32)
    scores = cuda.shared.array(SCORE_ELEMENTS, float32)
    tile = cuda.shared.array(TILE_ELEMENTS, float32)
    block_ids = cuda.shared.array(KEY_TILE, int32)
    stats = cuda.shared.array(STATS_ELEMENTS, float32)
    for e in range(tid, group * head_dim, GROUPED_THREADS):
        query[e] = q[row, kv_head * group + e // head_dim, e % head_dim] * scale
    # Scores of every (query head, key) pair of the split.
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        if tid < count:
            block_ids[tid] = block_tables[seq, (start + tid) // block_size]
        cuda.syncthreads()
        stage_tile(k_words, block_ids, start, count, kv_head, head_dim, tile, tid)
        cuda.syncthreads()
        for pair in range(tid, group * KEY_TILE, GROUPED_THREADS):
            g = pair // KEY_TILE
            k = pair % KEY_TILE
            if k < count:
                dot = float32(0.0)
                for i in range(head_dim):
                    dot += query[g * head_dim + i] * tile[k * TILE_STRIDE + i]
                scores[g * SPLIT_SIZE + start - first + k] = dot
        cuda.syncthreads()
    # Softmax statistics, one thread per query head (a split holds at most SPLIT_SIZE keys).
    if tid < group:
        best = float32(NEGATIVE_INFINITY)
        for key in range(lo, hi):
            best = max(best, scores[tid * SPLIT_SIZE + key - first])
        total = float32(0.0)
        for key in range(lo, hi):
            weight = math.exp(scores[tid * SPLIT_SIZE + key - first] - best)
            scores[tid * SPLIT_SIZE + key - first] = weight
            total += weight
        stats[2 * tid] = best
        stats[2 * tid + 1] = total
    cuda.syncthreads()
    # Weighted values: thread t owns outputs t, t + threads, ... of the [G, dv] block.
    acc = cuda.local.array(ACCUMULATORS, float32)
    for j in range(ACCUMULATORS):
        acc[j] = 0.0
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        if tid < count:
            block_ids[tid] = block_tables[seq, (start + tid) // block_size]
        cuda.syncthreads()
        stage_tile(v_words, block_ids, start, count, kv_head, value_dim, tile, tid)
        cuda.syncthreads()
        for j in range(ACCUMULATORS):
            e = tid + j * GROUPED_THREADS
            if e < group * value_dim:
                g = e // value_dim
                dim = e % value_dim
                total_j = acc[j]
                for k in range(count):
                    total_j += scores[g * SPLIT_SIZE + start - first + k] * tile[k * TILE_STRIDE + dim]
                acc[j] = total_j
        cuda.syncthreads()
    for j in range(ACCUMULATORS):
        e = tid + j * GROUPED_THREADS
        if e < group * value_dim:
            out_acc[row, kv_head * group + e // value_dim, split, e % value_dim] = acc[j]
    if tid < group:
        out_max[row, kv_head * group + tid, split] = stats[2 * tid]
        out_sum[row, kv_head * group + tid, split] = stats[2 * tid + 1]


def as_words(cache: object) -> object:
    """The bf16 cache ``[blocks, block_size, nkv, d]`` viewed as uint32 ``[..., d / 2]``."""
    return cache.view(np.uint32)
