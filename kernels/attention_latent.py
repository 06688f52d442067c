"""Absorbed MLA decode attention over the paged latent cache (docs/families.rst, "Expanded and absorbed forms").

Each cached token holds one latent row ``[c (r) | k_pe (d_r)]`` (bf16). A decode row's query heads
come already projected into the latent space, ``q = [q_latent (r) | q_pe (d_r)]`` float32, so

    score(h, j) = scale * q[h] . latent_j        value(j) = latent_j[:r]

-- multi-query attention with one key/value row per token shared by every head. The result per
head is ``sum_j softmax_j * c_j`` ``[r]``; the value half of ``kv_b_proj`` is applied after.

Kernel: grid ``(rows, head groups of HEADS, splits)``, ``THREADS`` threads a block; each block
serves ``HEADS`` heads over its split of the row's keys, ``CHUNK`` keys at a time:

1. the chunk's latent rows are gathered into registers (every load issued before any is used, so
   their latencies overlap), then stored to shared memory: one read from memory serves all the
   block's heads;
2. scores: each thread tile holds 2 heads x 2 keys and a ``1 / SUBLANES`` share of the row's
   words (the queries, pre-scaled float pairs, sit in shared memory); the tile's lanes then sum
   their partial dot products;
3. an online softmax per head over the chunk (running max, running sum, the correction that
   rescales the accumulators);
4. values: thread ``t`` owns value word ``t`` (two latent dims) for all the block's heads.

Each block writes unnormalised partials; :func:`metrale.kernels.attention_grouped.
grouped_combine_kernel` merges the splits into bf16 ``[rows, heads * r]``.

:func:`latent_cache_write_kernel` fills the cache: per row it normalises the latent (RMSNorm with
the latent norm's weight), rotates the RoPE key, and stores both as one bf16 row at the row's
cache slot. :func:`latent_query_kernel` assembles the decode queries the same way: each head's
latent query ``q_latent (r)`` followed by its rotated RoPE part ``q_pe (d_r)``, float32. The CUDA
backend runs their CUDA C++ forms, :func:`latent_cache_write_words` and :func:`latent_query_words`:
launched dependently, reading the stacked projection's views through their strides (no copy).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    bits_to_float,
    block_sum,
    check_array,
    device_view,
    fast_exp,
    float_to_bf16,
    float_to_bits,
    jit_kernel,
    numba_stream,
)
from metrale.kernels.attention_fp8 import e4m3_value
from metrale.kernels.attention_grouped import (
    COMBINE_THREADS,
    FULL_MASK,
    MAX_SPLITS,
    grouped_combine_kernel,
    subgroup_sum,
)
from metrale.kernels.kv_cache_fp8 import cache_rows, is_fp8_cache, write_cache_rows
from metrale.kernels.qkv_rope import rope_reference
from metrale.kernels.rmsnorm import rmsnorm_reference

WARP = 8 if SIMULATED else 32
WARPS = 8
THREADS = WARP * WARPS
TILES_PER_WARP = 4  # score tiles of 2 heads x 2 keys a warp holds
SUBLANES = WARP // TILES_PER_WARP  # lanes sharing one tile, each summing every SUBLANES-th word
HEADS = 8  # heads a block serves
CHUNK = 16  # keys a block stages at a time
# The tiles cover HEADS x CHUNK: (HEADS / 2) head pairs x (CHUNK / 2) key pairs = WARPS x TILES_PER_WARP.
assert (HEADS // 2) * (CHUNK // 2) == WARPS * TILES_PER_WARP
#: Widest latent row (r + d_r) in 32-bit words: 576 values, DeepSeek-V2 / V3's 512 + 64.
MAX_ROW_WORDS = 288
#: Shared row stride in words, 4 more than a multiple of 32: the key rows a warp's four tiles read
#: (2k apart) fall in distinct banks.
ROW_STRIDE = MAX_ROW_WORDS + 4
LOADS_PER_KEY = -(-MAX_ROW_WORDS // THREADS)  # words of one row a thread gathers
STAGED_WORDS = CHUNK * LOADS_PER_KEY
STAGED_QUERY = 2 * HEADS * LOADS_PER_KEY
ACCUMULATORS = 2 * HEADS  # [heads, two dims]
NEGATIVE_INFINITY = -math.inf
#: Keys per split at least, and the blocks the grid aims at.
MIN_SPLIT_KEYS = CHUNK
TARGET_BLOCKS = 64 if SIMULATED else 512
WRITE_THREADS = 32 if SIMULATED else 256
QUERY_THREADS = 16 if SIMULATED else 128


def latent_cache_write_reference(
    kv_a: np.ndarray, norm_weight: np.ndarray, eps: float, positions: np.ndarray, inv_freq: np.ndarray,
    attention_factor: float, interleaved: bool, slot_mapping: np.ndarray, latent: np.ndarray,
) -> None:
    """Store ``[rmsnorm(kv_a[:, :r]) | rope(kv_a[:, r:])]`` at each row's slot of the float32 latent
    cache ``[blocks, block_size, r + d_r]`` (or an FP8 one, each row quantized with its own scale,
    :mod:`metrale.kernels.kv_cache_fp8`); ``kv_a [N, r + d_r]``, ``d_r = 2 len(inv_freq)``."""
    rank = kv_a.shape[1] - 2 * inv_freq.shape[0]
    normed = rmsnorm_reference(kv_a[:, :rank], norm_weight, eps)
    rotated = rope_reference(kv_a[:, None, rank:], positions, inv_freq, attention_factor, interleaved)[:, 0]
    write_cache_rows(latent, np.asarray(slot_mapping, dtype=np.int64), np.concatenate([normed, rotated], axis=1))


@jit_kernel
def latent_cache_write_kernel(kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved,
                              slot_mapping, latent):
    # Grid: N rows; WRITE_THREADS threads. kv_a [N, r + d_r] f32; norm_weight [r] bf16 bits;
    # positions, slot_mapping [N] i32; inv_freq [d_r / 2] f32; latent [blocks, block_size,
    # r + d_r] bf16 bits. Adjacent pairs (2i, 2i + 1) when interleaved, else (i, i + d_r / 2).
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    half = inv_freq.shape[0]
    rank = kv_a.shape[1] - 2 * half
    partial = cuda.shared.array(WRITE_THREADS, float32)
    acc = float32(0.0)
    for i in range(tid, rank, WRITE_THREADS):
        value = kv_a[row, i]
        acc += value * value
    total = block_sum(partial, tid, acc, WRITE_THREADS)
    inv = float32(1.0) / math.sqrt(total / float32(rank) + eps)
    slot = slot_mapping[row]
    block_size = latent.shape[1]
    block = slot // block_size
    offset = slot % block_size
    for i in range(tid, rank, WRITE_THREADS):
        latent[block, offset, i] = float_to_bf16(kv_a[row, i] * inv * bf16_to_float(norm_weight[i]))
    position = float32(positions[row])
    for i in range(tid, half, WRITE_THREADS):
        angle = position * inv_freq[i]
        cos = math.cos(angle) * attention_factor
        sin = math.sin(angle) * attention_factor
        first = rank + (2 * i if interleaved else i)
        second = rank + (2 * i + 1 if interleaved else i + half)
        a = kv_a[row, first]
        b = kv_a[row, second]
        latent[block, offset, first] = float_to_bf16(a * cos - b * sin)
        latent[block, offset, second] = float_to_bf16(b * cos + a * sin)


def latent_cache_write(
    kv_a: DeviceArray, norm_weight: DeviceArray, eps: float, positions: DeviceArray, inv_freq: DeviceArray,
    attention_factor: float, interleaved: bool, slot_mapping: DeviceArray, latent: DeviceArray, stream: object = None,
) -> None:
    """CUDA launcher of :func:`latent_cache_write_reference` (bf16 cache and norm weight)."""
    op = "latent_cache_write"
    check_array(op, "kv_a", kv_a, np.float32, ndim=2)
    rows, width = kv_a.shape
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    rank = width - 2 * inv_freq.shape[0]
    if rank <= 0:
        raise KernelArgumentError(f"{op}: {2 * inv_freq.shape[0]} rotary dims leave no latent in rows of {width}")
    check_array(op, "norm_weight", norm_weight, np.uint16, (rank,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "slot_mapping", slot_mapping, np.int32, (rows,))
    check_array(op, "latent", latent, np.uint16, (None, None, width))
    if rows:
        latent_cache_write_kernel[rows, WRITE_THREADS, numba_stream(stream)](
            device_view(kv_a), device_view(norm_weight), np.float32(eps), device_view(positions),
            device_view(inv_freq), np.float32(attention_factor), np.int32(bool(interleaved)),
            device_view(slot_mapping), device_view(latent),
        )


def latent_query_reference(
    q_latent: np.ndarray, q: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float,
    interleaved: bool,
) -> np.ndarray:
    """``[N, heads, r + d_r]`` float32: ``[q_latent | rope(q[:, :, -d_r:])]`` for ``q_latent [N, heads,
    r]`` and the query projection ``q [N, heads, d_n + d_r]``, ``d_r = 2 len(inv_freq)``; adjacent
    pairs when ``interleaved``, else half-split."""
    rotary = 2 * inv_freq.shape[0]
    rotated = rope_reference(q[:, :, q.shape[2] - rotary :], positions, inv_freq, attention_factor, interleaved)
    return np.concatenate([np.asarray(q_latent, dtype=np.float32), rotated], axis=2)


@jit_kernel
def latent_query_kernel(q_latent, q, positions, inv_freq, attention_factor, interleaved, out):
    # Grid: (N rows, heads); QUERY_THREADS threads. q_latent [N, nh, r] f32; q [N, nh, d_n + d_r]
    # f32 (its last d_r dims rotate); positions [N] i32; inv_freq [d_r / 2] f32; out [N, nh,
    # r + d_r] f32. Adjacent pairs (2i, 2i + 1) when interleaved, else (i, i + d_r / 2).
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    rank = q_latent.shape[2]
    half = inv_freq.shape[0]
    rope_base = q.shape[2] - 2 * half
    for i in range(tid, rank, QUERY_THREADS):
        out[row, head, i] = q_latent[row, head, i]
    position = float32(positions[row])
    for i in range(tid, half, QUERY_THREADS):
        angle = position * inv_freq[i]
        cos = math.cos(angle) * attention_factor
        sin = math.sin(angle) * attention_factor
        first = 2 * i if interleaved else i
        second = 2 * i + 1 if interleaved else i + half
        a = q[row, head, rope_base + first]
        b = q[row, head, rope_base + second]
        out[row, head, rank + first] = a * cos - b * sin
        out[row, head, rank + second] = b * cos + a * sin


def latent_query(
    q_latent: DeviceArray, q: DeviceArray, positions: DeviceArray, inv_freq: DeviceArray, attention_factor: float,
    interleaved: bool, out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """CUDA launcher of :func:`latent_query_reference` (all float32; ``positions`` int32)."""
    op = "latent_query"
    check_array(op, "q_latent", q_latent, np.float32, ndim=3)
    rows, heads, rank = q_latent.shape
    check_array(op, "q", q, np.float32, (rows, heads, None))
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    rotary = 2 * inv_freq.shape[0]
    if rotary > q.shape[2]:
        raise KernelArgumentError(f"{op}: {rotary} rotary dims exceed the query heads' {q.shape[2]}")
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "out", out, np.float32, (rows, heads, rank + rotary))
    if rows and heads:
        latent_query_kernel[(rows, heads), QUERY_THREADS, numba_stream(stream)](
            device_view(q_latent), device_view(q), device_view(positions), device_view(inv_freq),
            np.float32(attention_factor), np.int32(bool(interleaved)), device_view(out),
        )
    return out


def latent_attention_reference(
    q: np.ndarray, latent: np.ndarray, block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
    value_dim: int, scale: float,
) -> np.ndarray:
    """``[N, heads, value_dim]`` float32 for ``q [N, heads, width]`` over the float32 latent cache
    ``[blocks, block_size, width]`` (or an FP8 one, dequantized); row i sees its sequence's positions
    ``0..positions[i]``."""
    block_size = latent.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], value_dim), dtype=np.float32)
    for row in range(q.shape[0]):
        context = np.arange(int(positions[row]) + 1)
        table = np.asarray(block_tables[seq_index[row]], dtype=np.int64)
        keys = np.asarray(cache_rows(latent, table[context // block_size] * block_size + context % block_size),
                          dtype=np.float64)
        scores = (q[row].astype(np.float64) @ keys.T) * scale
        scores -= scores.max(axis=1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=1, keepdims=True)
        out[row] = (weights @ keys[:, :value_dim]).astype(np.float32)
    return out


def head_groups(heads: int) -> int:
    return -(-heads // HEADS)


def split_count(rows: int, heads: int, max_context: int) -> int:
    """Key splits per row: enough blocks to fill the GPU, at least MIN_SPLIT_KEYS keys each."""
    blocks = max(1, rows * head_groups(heads))
    wanted = -(-TARGET_BLOCKS // blocks)
    return max(1, min(wanted, MAX_SPLITS, -(-int(max_context) // MIN_SPLIT_KEYS)))


@cuda.jit(device=True)
def low_half(word):
    return bits_to_float(word << uint32(16))


@cuda.jit(device=True)
def high_half(word):
    return bits_to_float(word & uint32(0xFFFF0000))


@cuda.jit(device=True)
def pack_pair(low, high):
    return uint64(float_to_bits(low)) | (uint64(float_to_bits(high)) << uint64(32))


@cuda.jit(device=True)
def pair_low(pair):
    return bits_to_float(uint32(pair & uint64(0xFFFFFFFF)))


@cuda.jit(device=True)
def pair_high(pair):
    return bits_to_float(uint32(pair >> uint64(32)))


if SIMULATED:

    @cuda.jit(device=True)
    def chunk_softmax(scores, weights, stats, tid, lane):
        # One thread per head, serially over the chunk's keys (the simulator has no shuffles).
        if tid < HEADS:
            best = float32(NEGATIVE_INFINITY)
            for k in range(CHUNK):
                best = max(best, scores[tid, k])
            old = stats[0, tid]
            new = max(old, best)
            total = float32(0.0)
            for k in range(CHUNK):
                weight = fast_exp(scores[tid, k] - new)
                weights[k, tid] = weight
                total += weight
            correction = fast_exp(old - new)
            stats[2, tid] = correction
            stats[1, tid] = stats[1, tid] * correction + total
            stats[0, tid] = new

else:

    @cuda.jit(device=True)
    def chunk_softmax(scores, weights, stats, tid, lane):
        # Thread (head, key) for the first HEADS * CHUNK threads: a head's CHUNK keys are CHUNK
        # consecutive lanes of one warp, reduced by shuffles within them.
        if tid < HEADS * CHUNK:
            head = tid // CHUNK
            key = tid % CHUNK
            score = scores[head, key]
            best = score
            for k in range(4):
                best = max(best, cuda.shfl_xor_sync(FULL_MASK, best, 1 << k))
            old = stats[0, head]
            new = max(old, best)
            weight = fast_exp(score - new)
            weights[key, head] = weight
            total = weight
            for k in range(4):
                total += cuda.shfl_xor_sync(FULL_MASK, total, 1 << k)
            if key == 0:
                correction = fast_exp(old - new)
                stats[2, head] = correction
                stats[1, head] = stats[1, head] * correction + total
                stats[0, head] = new


@cuda.jit(device=True)
def fp8_latent_pair(codes):
    """The bf16 pair word of two E4M3 codes' values (uint16, the even column in the low byte):
    exact, bf16 holding every E4M3 value."""
    low = e4m3_value(codes & uint16(0xFF))
    high = e4m3_value(codes >> uint16(8))
    return uint32(float_to_bf16(low)) | (uint32(float_to_bf16(high)) << uint32(16))


@jit_kernel
def latent_attention_kernel(q, latent_words, code_pairs, latent_scales, fp8, block_tables, seq_index, positions,
                            scale, value_words, out_acc, out_max, out_sum):
    # q [N, nh, width] f32; latent_words [blocks, block_size, width / 2] uint32 (bf16 pairs); or,
    # fp8 set, code_pairs [blocks, block_size, width / 2] uint16 (E4M3 pairs) with latent_scales
    # [blocks, block_size] f32 (the other operand a placeholder): the codes staged as their exact
    # bf16 values, each key's scale applied to its scores and to its probabilities in float32.
    # block_tables [S, max_blocks] int32; seq_index, positions [N] int32; value_words = r / 2.
    # out_acc [N, nh, splits, r] f32 (exp-weighted latents), out_max / out_sum [N, nh, splits].
    row = cuda.blockIdx.x
    head_base = cuda.blockIdx.y * HEADS
    split = cuda.blockIdx.z
    splits = cuda.gridDim.z
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = tid % WARP
    heads = q.shape[1]
    row_words = code_pairs.shape[2] if fp8 else latent_words.shape[2]
    block_size = code_pairs.shape[1] if fp8 else latent_words.shape[1]
    keys = cuda.shared.array((CHUNK, ROW_STRIDE), uint32)
    key_scales = cuda.shared.array(CHUNK, float32)  # 1 over a bf16 cache
    staged_scales = cuda.local.array(CHUNK, float32)
    query = cuda.shared.array((HEADS, MAX_ROW_WORDS), uint64)  # scaled float pairs
    scores = cuda.shared.array((HEADS, CHUNK), float32)
    weights = cuda.shared.array((CHUNK, HEADS), float32)
    stats = cuda.shared.array((3, HEADS), float32)  # running max, running sum, last correction
    scratch = cuda.shared.array(THREADS, float32)
    staged = cuda.local.array(STAGED_WORDS, uint32)
    staged_query = cuda.local.array(STAGED_QUERY, float32)
    acc = cuda.local.array(ACCUMULATORS, float32)

    # The queries: all loads first, then the shared stores.
    for h in range(HEADS):
        for i in range(LOADS_PER_KEY):
            word = tid + i * THREADS
            low = float32(0.0)
            high = float32(0.0)
            if head_base + h < heads and word < row_words:
                low = q[row, head_base + h, 2 * word]
                high = q[row, head_base + h, 2 * word + 1]
            staged_query[2 * (h * LOADS_PER_KEY + i)] = low
            staged_query[2 * (h * LOADS_PER_KEY + i) + 1] = high
    for h in range(HEADS):
        for i in range(LOADS_PER_KEY):
            word = tid + i * THREADS
            if word < row_words:
                query[h, word] = pack_pair(staged_query[2 * (h * LOADS_PER_KEY + i)] * scale,
                                           staged_query[2 * (h * LOADS_PER_KEY + i) + 1] * scale)
    if tid < HEADS:
        stats[0, tid] = float32(NEGATIVE_INFINITY)
        stats[1, tid] = float32(0.0)
        stats[2, tid] = float32(0.0)
    for i in range(2 * HEADS):
        acc[i] = float32(0.0)

    seq = seq_index[row]
    context = positions[row] + 1
    per_split = (context + splits - 1) // splits
    lo = split * per_split
    hi = min(context, lo + per_split)
    tile = lane % TILES_PER_WARP
    sub = lane // TILES_PER_WARP
    h0 = 2 * (warp // 2)
    k0 = 2 * ((warp % 2) * TILES_PER_WARP + tile)
    start = lo
    while start < hi:
        count = min(CHUNK, hi - start)
        # Gather the chunk's rows: block-table entries, then every row load, then the stores.
        table_index = start // block_size
        offset = start - table_index * block_size
        for k in range(CHUNK):
            block = 0
            if k < count:
                block = block_tables[seq, table_index]
            staged_scales[k] = float32(1.0)
            if fp8 and k < count and tid == 0:
                staged_scales[k] = latent_scales[block, offset]
            for i in range(LOADS_PER_KEY):
                word = tid + i * THREADS
                staged[k * LOADS_PER_KEY + i] = uint32(0)
                if k < count and word < row_words:
                    if fp8:
                        staged[k * LOADS_PER_KEY + i] = fp8_latent_pair(code_pairs[block, offset, word])
                    else:
                        staged[k * LOADS_PER_KEY + i] = latent_words[block, offset, word]
            offset += 1
            if offset == block_size:
                offset = 0
                table_index += 1
        cuda.syncthreads()  # the previous chunk's readers are done
        if tid == 0:
            for k in range(CHUNK):
                key_scales[k] = staged_scales[k]
        for k in range(CHUNK):
            for i in range(LOADS_PER_KEY):
                word = tid + i * THREADS
                if word < row_words:
                    keys[k, word] = staged[k * LOADS_PER_KEY + i]
        cuda.syncthreads()

        s00 = float32(0.0)
        s01 = float32(0.0)
        s10 = float32(0.0)
        s11 = float32(0.0)
        word = sub
        while word < row_words:
            key_a = keys[k0, word]
            key_b = keys[k0 + 1, word]
            a_low = low_half(key_a)
            a_high = high_half(key_a)
            b_low = low_half(key_b)
            b_high = high_half(key_b)
            query_0 = query[h0, word]
            query_1 = query[h0 + 1, word]
            q0_low = pair_low(query_0)
            q0_high = pair_high(query_0)
            q1_low = pair_low(query_1)
            q1_high = pair_high(query_1)
            s00 += q0_low * a_low + q0_high * a_high
            s01 += q0_low * b_low + q0_high * b_high
            s10 += q1_low * a_low + q1_high * a_high
            s11 += q1_low * b_low + q1_high * b_high
            word += SUBLANES
        s00 = subgroup_sum(scratch, tid, lane, s00, TILES_PER_WARP)
        s01 = subgroup_sum(scratch, tid, lane, s01, TILES_PER_WARP)
        s10 = subgroup_sum(scratch, tid, lane, s10, TILES_PER_WARP)
        s11 = subgroup_sum(scratch, tid, lane, s11, TILES_PER_WARP)
        if sub == 0:
            scale_a = key_scales[k0]
            scale_b = key_scales[k0 + 1]
            scores[h0, k0] = s00 * scale_a if k0 < count else float32(NEGATIVE_INFINITY)
            scores[h0, k0 + 1] = s01 * scale_b if k0 + 1 < count else float32(NEGATIVE_INFINITY)
            scores[h0 + 1, k0] = s10 * scale_a if k0 < count else float32(NEGATIVE_INFINITY)
            scores[h0 + 1, k0 + 1] = s11 * scale_b if k0 + 1 < count else float32(NEGATIVE_INFINITY)
        cuda.syncthreads()
        chunk_softmax(scores, weights, stats, tid, lane)
        cuda.syncthreads()

        if tid < value_words:
            for h in range(HEADS):
                correction = stats[2, h]
                acc[2 * h] *= correction
                acc[2 * h + 1] *= correction
            for k in range(count):
                bits = keys[k, tid]
                key_scale = key_scales[k]
                low = low_half(bits) * key_scale
                high = high_half(bits) * key_scale
                for h in range(HEADS):
                    weight = weights[k, h]
                    acc[2 * h] += weight * low
                    acc[2 * h + 1] += weight * high
        start += count

    if tid < value_words:
        for h in range(HEADS):
            if head_base + h < heads:
                out_acc[row, head_base + h, split, 2 * tid] = acc[2 * h]
                out_acc[row, head_base + h, split, 2 * tid + 1] = acc[2 * h + 1]
    if tid < HEADS and head_base + tid < heads:
        out_max[row, head_base + tid, split] = stats[0, tid]
        out_sum[row, head_base + tid, split] = stats[1, tid]


def latent_attention(
    q: DeviceArray, latent: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray, positions: DeviceArray,
    value_dim: int, scale: float, max_context: int, out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """Launch :func:`latent_attention_kernel` and the split merge: bf16 bits ``out [N, heads * r]``.

    ``latent`` is the bf16 cache ``[blocks, block_size, width]`` (uint16), or an FP8 one
    (:class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray`: codes of that shape, a scale a slot)
    whose rows the kernel reads as ``code * scale`` rounded to bf16; ``value_dim`` = r.
    """
    op = "latent_attention"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, width = q.shape
    fp8 = is_fp8_cache(latent)
    if fp8:
        check_array(op, "latent codes", latent.codes, np.uint8, (None, None, width))
        check_array(op, "latent scales", latent.scales, np.float32, latent.codes.shape[:2])
    else:
        check_array(op, "latent", latent, np.uint16, (None, None, width))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if (width % 2 or value_dim % 2 or width // 2 > MAX_ROW_WORDS or value_dim > width
            or value_dim > 2 * THREADS):
        raise ValueError(f"latent width {width} / value dim {value_dim} must be even, value dim <= width, "
                         f"width <= {2 * MAX_ROW_WORDS}, value dim <= {2 * THREADS}")
    if not rows:
        return out
    import cupy

    splits = split_count(rows, heads, max_context)
    out_acc = cupy.empty((rows, heads, splits, value_dim), dtype=np.float32)
    out_max = cupy.empty((rows, heads, splits), dtype=np.float32)
    out_sum = cupy.empty((rows, heads, splits), dtype=np.float32)
    placeholder_words, placeholder_pairs, placeholder_scales = _placeholders()
    words = placeholder_words if fp8 else latent.view(np.uint32)
    pairs = latent.codes.view(np.uint16) if fp8 else placeholder_pairs
    scales = latent.scales if fp8 else placeholder_scales
    launch_stream = numba_stream(stream)
    latent_attention_kernel[(rows, head_groups(heads), splits), THREADS, launch_stream](
        device_view(q), device_view(words), device_view(pairs), device_view(scales), np.int32(fp8),
        device_view(block_tables), device_view(seq_index), device_view(positions), np.float32(scale),
        np.int32(value_dim // 2), device_view(out_acc), device_view(out_max), device_view(out_sum),
    )
    grouped_combine_kernel[(rows, heads, -(-value_dim // COMBINE_THREADS)), COMBINE_THREADS, launch_stream](
        device_view(out_acc), device_view(out_max), device_view(out_sum), device_view(out),
    )
    return out


_PLACEHOLDERS: dict[int, tuple[Any, Any, Any]] = {}


def _placeholders() -> tuple[Any, Any, Any]:
    """The current GPU's one-element stand-ins for the cache arrays a launch does not read: bf16
    pair words, E4M3 pairs, scales."""
    import cupy

    device = cupy.cuda.Device().id
    held = _PLACEHOLDERS.get(device)
    if held is None:
        held = _PLACEHOLDERS[device] = (cupy.zeros((1, 1, 1), np.uint32), cupy.zeros((1, 1, 1), np.uint16),
                                        cupy.ones((1, 1), np.float32))
    return held


# ------------------------------------------------------------------------------ CUDA C++ kernels


from metrale.kernels._launch import DEPENDENT_LAUNCH, launch  # noqa: E402

#: Threads of a block of the CUDA C++ cache write (a row each) and query assembly (a head each).
WORD_THREADS = 256

WORD_KERNELS = r"""
#define LATENT_WORD_THREADS 256

__device__ __forceinline__ unsigned short latent_to_bf16(float value) {
    const unsigned word = __float_as_uint(value);
    if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (unsigned short)((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

// Row n of kv_a (rows kv_stride values apart; [c (rank) | k_pe (2 half)] float32) into the latent
// cache [blocks * block_size, rank + 2 half] bf16 bits at slot_mapping[n]: c RMS-normalised with the
// bf16 norm_weight [rank], k_pe rotated (pairs (i, i + half), or (2i, 2i + 1) when interleaved).
// Grid N blocks of LATENT_WORD_THREADS threads.
extern "C" __global__ void __launch_bounds__(LATENT_WORD_THREADS) latent_cache_write_words(
    const float* __restrict__ kv_a, long kv_stride, const unsigned short* __restrict__ norm_weight, float eps,
    const int* __restrict__ positions, const float* __restrict__ inv_freq, float attention_factor, int interleaved,
    const int* __restrict__ slot_mapping, unsigned short* __restrict__ latent, int rank, int half) {
    __shared__ float partial[LATENT_WORD_THREADS / 32];
    allow_dependents();
    wait_for_producers();   // kv_a comes from the projection ahead
    const int row = blockIdx.x, tid = threadIdx.x;
    const float* source = kv_a + (size_t)row * kv_stride;
    float squares = 0.0f;
    for (int i = tid; i < rank; i += LATENT_WORD_THREADS) squares += source[i] * source[i];
    for (int offset = 16; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    if (tid % 32 == 0) partial[tid / 32] = squares;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < LATENT_WORD_THREADS / 32; ++w) total += partial[w];
    const float inv = 1.0f / sqrtf(total / (float)rank + eps);
    const int slot = slot_mapping[row];
    if (slot < 0) return;
    unsigned short* target = latent + (size_t)slot * (rank + 2 * half);
    for (int i = tid; i < rank; i += LATENT_WORD_THREADS)
        target[i] = latent_to_bf16(source[i] * inv * __uint_as_float((unsigned)norm_weight[i] << 16));
    const float position = (float)positions[row];
    for (int i = tid; i < half; i += LATENT_WORD_THREADS) {
        const float angle = position * inv_freq[i];
        const float cosine = cosf(angle) * attention_factor, sine = sinf(angle) * attention_factor;
        const int first = rank + (interleaved ? 2 * i : i), second = rank + (interleaved ? 2 * i + 1 : i + half);
        const float a = source[first], b = source[second];
        target[first] = latent_to_bf16(a * cosine - b * sine);
        target[second] = latent_to_bf16(b * cosine + a * sine);
    }
}

// out[n, h] = [q_latent[n, h] (rank) | rope(the last 2 half values of q's head h)] float32. q_latent
// [N, heads, rank] contiguous; q's heads at q + n * q_row_stride + h * q_head_stride, each width
// values. Grid (N, heads) blocks of LATENT_WORD_THREADS threads.
extern "C" __global__ void __launch_bounds__(LATENT_WORD_THREADS) latent_query_words(
    const float* __restrict__ q_latent, const float* __restrict__ q, long q_row_stride, long q_head_stride, int width,
    const int* __restrict__ positions, const float* __restrict__ inv_freq, float attention_factor, int interleaved,
    float* __restrict__ out, int rank, int half) {
    allow_dependents();
    wait_for_producers();   // the latent queries and q come from the kernels ahead
    const int row = blockIdx.x, head = blockIdx.y, heads = gridDim.y, tid = threadIdx.x;
    const float* latent_row = q_latent + ((size_t)row * heads + head) * rank;
    float* target = out + ((size_t)row * heads + head) * (rank + 2 * half);
    for (int i = tid; i < rank; i += LATENT_WORD_THREADS) target[i] = latent_row[i];
    const float* rope = q + (size_t)row * q_row_stride + (size_t)head * q_head_stride + width - 2 * half;
    const float position = (float)positions[row];
    for (int i = tid; i < half; i += LATENT_WORD_THREADS) {
        const float angle = position * inv_freq[i];
        const float cosine = cosf(angle) * attention_factor, sine = sinf(angle) * attention_factor;
        const int first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
        const float a = rope[first], b = rope[second];
        target[rank + first] = a * cosine - b * sine;
        target[rank + second] = b * cosine + a * sine;
    }
}
"""

KERNEL_NAMES = ("latent_cache_write_words", "latent_query_words")


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DEPENDENT_LAUNCH + WORD_KERNELS


_word_kernels: dict[str, Any] = {}


def _word_kernel(name: str) -> Any:
    if not _word_kernels:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",))
        for each in KERNEL_NAMES:
            _word_kernels[each] = module.get_function(each)
    return _word_kernels[name]


def _row_stride(op: str, name: str, array: Any) -> int:
    """The row stride in elements of a float32 2-D or 3-D view whose last axis is contiguous."""
    if array.dtype != np.float32 or array.strides[-1] != 4 or any(stride % 4 for stride in array.strides):
        raise KernelArgumentError(f"{op}: {name} must be float32 with its last axis contiguous "
                                  f"(strides {list(array.strides)})")
    return array.strides[0] // 4


def latent_cache_write_words(
    kv_a: DeviceArray, norm_weight: DeviceArray, eps: float, positions: DeviceArray, inv_freq: DeviceArray,
    attention_factor: float, interleaved: bool, slot_mapping: DeviceArray, latent: DeviceArray, stream: object = None,
) -> None:
    """:func:`latent_cache_write` in CUDA C++, launched dependently; ``kv_a`` may be a view of a
    wider projection's rows (its last axis contiguous)."""
    op = "latent_cache_write"
    if getattr(kv_a, "ndim", 0) != 2:
        raise KernelArgumentError(f"{op}: kv_a must be [N, r + d_r]")
    rows, width = kv_a.shape
    stride = _row_stride(op, "kv_a", kv_a)
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    half = inv_freq.shape[0]
    rank = width - 2 * half
    if rank <= 0:
        raise KernelArgumentError(f"{op}: {2 * half} rotary dims leave no latent in rows of {width}")
    check_array(op, "norm_weight", norm_weight, np.uint16, (rank,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "slot_mapping", slot_mapping, np.int32, (rows,))
    check_array(op, "latent", latent, np.uint16, (None, None, width))
    if rows:
        launch(_word_kernel("latent_cache_write_words"), (rows,), (WORD_THREADS,), (
            kv_a, np.int64(stride), norm_weight, np.float32(eps), positions, inv_freq, np.float32(attention_factor),
            np.int32(bool(interleaved)), slot_mapping, latent, np.int32(rank), np.int32(half)), 0, stream, dependent=True)


def latent_query_words(
    q_latent: DeviceArray, q: DeviceArray, positions: DeviceArray, inv_freq: DeviceArray, attention_factor: float,
    interleaved: bool, out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """:func:`latent_query` in CUDA C++, launched dependently; ``q`` may be a strided view of the
    query projection (its last axis contiguous)."""
    op = "latent_query"
    check_array(op, "q_latent", q_latent, np.float32, ndim=3)
    rows, heads, rank = q_latent.shape
    if getattr(q, "ndim", 0) != 3 or tuple(q.shape[:2]) != (rows, heads):
        raise KernelArgumentError(f"{op}: q has shape {list(q.shape)}, expected [{rows}, {heads}, *]")
    row_stride = _row_stride(op, "q", q)
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    half = inv_freq.shape[0]
    if 2 * half > q.shape[2]:
        raise KernelArgumentError(f"{op}: {2 * half} rotary dims exceed the query heads' {q.shape[2]}")
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "out", out, np.float32, (rows, heads, rank + 2 * half))
    if rows and heads:
        launch(_word_kernel("latent_query_words"), (rows, heads), (WORD_THREADS,), (
            q_latent, q, np.int64(row_stride), np.int64(q.strides[1] // 4), np.int32(q.shape[2]), positions, inv_freq,
            np.float32(attention_factor), np.int32(bool(interleaved)), out, np.int32(rank), np.int32(half)),
            0, stream, dependent=True)
    return out
