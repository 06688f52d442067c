"""Prefill attention over the paged cache: one block per (tile of query rows, KV head).

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`. A block
holds ``QUERY_VECTORS`` query vectors -- ``QUERY_VECTORS // G`` consecutive rows of one sequence
times the ``G`` query heads of its KV head -- and streams that sequence's keys and values through
shared memory ``KEY_TILE`` at a time with an online softmax (flash-attention style), so each key
is read once per block instead of once per query row. Rows and keys follow the causal rule and
the optional sliding window. It writes the bf16 attention output directly.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    bits_to_float,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)

PREFILL_THREADS = 16 if SIMULATED else 128
KEY_TILE = 4 if SIMULATED else 32
MAX_TILE_HEAD_DIM = 256
TILE_STRIDE = MAX_TILE_HEAD_DIM + 1  # padded row: column reads are bank-conflict free
TILE_ELEMENTS = KEY_TILE * TILE_STRIDE
LOADS_IN_FLIGHT = 4
QUERY_VECTORS = 8 if SIMULATED else 32
MAX_PREFILL_HEAD_DIM = 128
QUERY_ELEMENTS = QUERY_VECTORS * MAX_PREFILL_HEAD_DIM
SCORE_ELEMENTS = QUERY_VECTORS * KEY_TILE
ACCUMULATORS = QUERY_VECTORS * MAX_PREFILL_HEAD_DIM // PREFILL_THREADS
NEGATIVE_INFINITY = -math.inf


@cuda.jit(device=True)
def stage_tile(cache_words, block_ids, start, count, kv_head, width, tile, tid):
    # Widen keys [start, start + count) of one KV head into tile[key * TILE_STRIDE + dim]
    # (float32). cache_words [blocks, block_size, nkv, width / 2] holds two bf16 per uint32;
    # each thread issues LOADS_IN_FLIGHT loads before using any.
    # Index arithmetic in unsigned 32 bits: numba wraps negative signed indices around (several
    # instructions per access) and divides 64-bit integers slowly.
    block_size = uint32(cache_words.shape[1])
    words_per_key = uint32(width // 2)
    total = uint32(count) * words_per_key
    first = uint32(start)
    loaded = cuda.local.array(LOADS_IN_FLIGHT, uint32)
    for base in range(uint32(tid), total, uint32(PREFILL_THREADS * LOADS_IN_FLIGHT)):
        for u in range(LOADS_IN_FLIGHT):
            e = uint32(base + uint32(u * PREFILL_THREADS))
            if e < total:
                key = e // words_per_key
                loaded[u] = cache_words[block_ids[key], (first + key) % block_size, kv_head, e - key * words_per_key]
        for u in range(LOADS_IN_FLIGHT):
            e = uint32(base + uint32(u * PREFILL_THREADS))
            if e < total:
                key = e // words_per_key
                at = key * uint32(TILE_STRIDE) + uint32(2) * (e - key * words_per_key)
                word = loaded[u]
                tile[at] = bf16_to_float(word & uint32(0xFFFF))
                tile[at + uint32(1)] = bits_to_float(word & uint32(0xFFFF0000))


def as_words(cache: DeviceArray) -> DeviceArray:
    """The bf16 cache ``[blocks, block_size, nkv, d]`` viewed as uint32 ``[..., d / 2]``."""
    return cache.view(np.uint32)


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel handles the geometry (else the split kernels run row by row)."""
    group = heads // kv_heads
    return (
        group <= QUERY_VECTORS
        and head_dim % 2 == 0
        and value_dim % 2 == 0
        and head_dim <= MAX_PREFILL_HEAD_DIM
        and value_dim <= MAX_PREFILL_HEAD_DIM
    )


def rows_per_tile(heads: int, kv_heads: int) -> int:
    return QUERY_VECTORS // (heads // kv_heads)


def query_tiles(row_starts: np.ndarray, rows: int) -> np.ndarray:
    """``[T, 2]`` int32 (first row, row count) tiles of at most ``rows`` rows within each segment."""
    tiles = [
        (first, min(rows, end - first))
        for start, end in zip(row_starts[:-1], row_starts[1:])
        for first in range(int(start), int(end), rows)
    ]
    return np.asarray(tiles, dtype=np.int32).reshape(-1, 2)


@jit_kernel
def paged_attention_prefill_kernel(
    q, k_words, v_words, block_tables, seq_index, positions, tiles, scale, sliding_window, softcap, sinks, has_sinks, out
):
    # Grid: (T query tiles, n_kv_heads); block PREFILL_THREADS threads. Query vector v of the
    # block is row tiles[t, 0] + v // G, head kv_head * G + v % G. q [N, nh, d] f32;
    # k_words / v_words: bf16 caches viewed as uint32 [blocks, block_size, nkv, d / 2];
    # out [N, nh * dv] bf16 bits. softcap > 0 caps the scores (softcap * tanh(s / softcap));
    # with has_sinks each vector's online softmax starts from its head's sink, sinks [nh], as a
    # score already seen whose value is zero.
    tile_index = cuda.blockIdx.x
    kv_head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    head_dim = q.shape[2]
    value_dim = 2 * v_words.shape[3]
    group = q.shape[1] // k_words.shape[2]
    block_size = k_words.shape[1]
    first_row = tiles[tile_index, 0]
    row_count = tiles[tile_index, 1]
    vectors = row_count * group
    seq = seq_index[first_row]
    first_position = positions[first_row]
    last_position = positions[first_row + row_count - 1]
    query = cuda.shared.array(QUERY_ELEMENTS, float32)
    scores = cuda.shared.array(SCORE_ELEMENTS, float32)
    tile = cuda.shared.array(TILE_ELEMENTS, float32)
    block_ids = cuda.shared.array(KEY_TILE, int32)
    running_max = cuda.shared.array(QUERY_VECTORS, float32)
    running_sum = cuda.shared.array(QUERY_VECTORS, float32)
    rescale = cuda.shared.array(QUERY_VECTORS, float32)
    for e in range(tid, vectors * head_dim, PREFILL_THREADS):
        v = e // head_dim
        query[e] = q[first_row + v // group, kv_head * group + v % group, e % head_dim] * scale
    if tid < QUERY_VECTORS:
        running_max[tid] = NEGATIVE_INFINITY
        running_sum[tid] = 0.0
        rescale[tid] = 1.0
        if has_sinks != 0 and tid < vectors:
            running_max[tid] = sinks[kv_head * group + tid % group]
            running_sum[tid] = 1.0
    # Accumulator j holds output element e = tid + j * PREFILL_THREADS of the block: vector
    # e // dv, dim e % dv. Its offsets into scores and tile are computed once (vectors past the
    # block's are clamped: their sums are never written). The loops over j unroll, so acc and
    # the offsets stay in registers.
    acc = cuda.local.array(ACCUMULATORS, float32)
    score_at = cuda.local.array(ACCUMULATORS, uint32)
    dim_of = cuda.local.array(ACCUMULATORS, uint32)
    for j in range(ACCUMULATORS):
        acc[j] = 0.0
        e = tid + j * PREFILL_THREADS
        score_at[j] = uint32(min(e // value_dim, QUERY_VECTORS - 1) * KEY_TILE)
        dim_of[j] = uint32(e % value_dim)
    lo = 0
    if sliding_window > 0:
        lo = max(0, first_position - sliding_window + 1)
    hi = last_position + 1
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        if tid < count:
            block_ids[tid] = block_tables[seq, (start + tid) // block_size]
        cuda.syncthreads()
        stage_tile(k_words, block_ids, start, count, kv_head, head_dim, tile, tid)
        cuda.syncthreads()
        for pair in range(tid, QUERY_VECTORS * KEY_TILE, PREFILL_THREADS):
            v = pair // KEY_TILE
            k = pair % KEY_TILE
            # (Vectors past the block's get weight 0, so the accumulators that read them stay
            # finite.)
            value = float32(NEGATIVE_INFINITY) if v < vectors else float32(0.0)
            if v < vectors and k < count:
                position = positions[first_row + v // group]
                key = start + k
                visible = key <= position
                if sliding_window > 0 and key <= position - sliding_window:
                    visible = False
                if visible:
                    # Unsigned indices in the dot product (no wraparound code per access).
                    value = float32(0.0)
                    query_at = uint32(v * head_dim)
                    tile_at = uint32(k * TILE_STRIDE)
                    for _ in range(head_dim):
                        value += query[query_at] * tile[tile_at]
                        query_at += uint32(1)
                        tile_at += uint32(1)
                    if softcap > 0.0:
                        value = softcap * math.tanh(value / softcap)
            scores[pair] = value
        cuda.syncthreads()
        if tid < vectors:
            old = running_max[tid]
            best = old
            for k in range(count):
                best = max(best, scores[tid * KEY_TILE + k])
            factor = float32(1.0)
            total = running_sum[tid]
            if best == NEGATIVE_INFINITY:
                for k in range(count):
                    scores[tid * KEY_TILE + k] = 0.0
            else:
                factor = math.exp(old - best) if old != NEGATIVE_INFINITY else float32(0.0)
                total *= factor
                for k in range(count):
                    weight = math.exp(scores[tid * KEY_TILE + k] - best)
                    scores[tid * KEY_TILE + k] = weight
                    total += weight
                running_max[tid] = best
            running_sum[tid] = total
            rescale[tid] = factor
        cuda.syncthreads()
        stage_tile(v_words, block_ids, start, count, kv_head, value_dim, tile, tid)
        cuda.syncthreads()
        for j in range(ACCUMULATORS):
            acc[j] *= rescale[score_at[j] // uint32(KEY_TILE)]
        tile_row = uint32(0)
        for k in range(count):
            for j in range(ACCUMULATORS):
                acc[j] += scores[score_at[j] + uint32(k)] * tile[tile_row + dim_of[j]]
            tile_row += uint32(TILE_STRIDE)
        cuda.syncthreads()
    for j in range(ACCUMULATORS):
        e = tid + j * PREFILL_THREADS
        if e < vectors * value_dim:
            v = e // value_dim
            denominator = running_sum[v]
            value = acc[j] / denominator if denominator > 0.0 else float32(0.0)
            row = first_row + v // group
            head = kv_head * group + v % group
            out[row, head * value_dim + e % value_dim] = float_to_bf16(value)


def paged_attention_prefill(
    q: DeviceArray, k_words: DeviceArray, v_words: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, tiles: DeviceArray, scale: float, sliding_window: int | None, out: DeviceArray,
    stream: object = None, softcap: float | None = None, sinks: DeviceArray | None = None,
) -> DeviceArray:
    """Launch :func:`paged_attention_prefill_kernel`; ``tiles`` from :func:`query_tiles` (int32).

    The caches come as uint32 word views (``as_words``). ``softcap`` (a positive number, or None)
    caps the logits; ``sinks`` (float32 ``[nh]``, or None) adds a sink logit to each head's
    softmax.
    """
    op = "paged_attention_prefill"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    check_array(op, "k_words", k_words, np.uint32, (None, None, None, head_dim // 2))
    check_array(op, "tiles", tiles, np.int32, (None, 2))
    check_array(op, "out", out, np.uint16, (rows, heads * 2 * v_words.shape[3]))
    if sinks is not None:
        check_array(op, "sinks", sinks, np.float32, (heads,))
    if softcap is not None and not softcap >= 0:
        raise KernelArgumentError(f"{op}: softcap must be positive (or None), got {softcap}")
    if not supports(heads, k_words.shape[2], head_dim, 2 * v_words.shape[3]):
        raise KernelArgumentError(f"{op}: {heads} heads over {k_words.shape[2]} KV heads of {head_dim} dims are "
                                  f"unsupported (at most {QUERY_VECTORS} heads a KV head, {MAX_PREFILL_HEAD_DIM} dims)")
    if tiles.shape[0]:
        # Without sinks the kernel still takes an array (never read): one element of q.
        sink_values = sinks if sinks is not None else q.reshape(-1)[:1]
        kernel = paged_attention_prefill_kernel
        kernel[(tiles.shape[0], k_words.shape[2]), PREFILL_THREADS, numba_stream(stream)](
            device_view(q), device_view(k_words), device_view(v_words), device_view(block_tables),
            device_view(seq_index), device_view(positions), device_view(tiles), np.float32(scale),
            np.int32(sliding_window or 0), np.float32(softcap or 0.0), device_view(sink_values),
            np.int32(sinks is not None), device_view(out),
        )
    return out
