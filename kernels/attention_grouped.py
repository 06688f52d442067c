"""Paged decode attention for the query heads of one KV head, one block per (row, heads, split).

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`. A block
serves up to ``HEADS_PER_BLOCK`` query heads of one KV head, so each cached key and value is read
once for all of them. The block's threads form lane groups of ``L = head_dim / 4`` lanes; a lane
holds four dims of a key (one 64-bit word of bf16 values), so a lane group reads one cached row
per load instruction, coalesced (``L`` is 8, 16 or 32: head dims 32, 64 and 128). Each lane
group takes ``KEYS_IN_FLIGHT`` consecutive keys at a time and issues all their K and V loads
before using any. The 32 (key, head) partial dot products of a step are reduce-scattered across
the lane group with shuffles, so each lane finishes ``32 / L`` of them and computes their
exponentials once; the weights are then gathered into every lane for the weighted sum of the
values. The online softmax (running max, sum and weighted values) stays in registers, and the
lane groups of a block merge through shared memory at the end.

The keys of a row are divided evenly between the ``splits`` blocks of the grid's last axis, and
the split sizes are computed on the device from the row's position, so a captured graph serves
any context length. With one split the block writes the bf16 output directly; with more, it
writes unnormalised partials that :func:`grouped_combine_kernel` merges.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from metrale.kernels._device import SIMULATED, bits_to_float, block_max, block_sum, fast_exp, float_to_bf16

DECODE_THREADS = 8 if SIMULATED else 128
HEADS_PER_BLOCK = 4
KEYS_IN_FLIGHT = 8  # with HEADS_PER_BLOCK: 32 (key, head) pairs a step, one per lane of a warp
MAX_LANES = DECODE_THREADS if SIMULATED else 32  # lanes of one key; a lane group stays in a warp
MAX_SPLITS = 8 if SIMULATED else 32  # at most COMBINE_THREADS
# Splits per row: up to TARGET_BLOCKS blocks in the grid (measured best on the H200 for batch
# 1 and 32 with tools/attention_sweep.py), at least MIN_SPLIT_KEYS keys of max_context each.
TARGET_BLOCKS = 64 if SIMULATED else 256
MIN_SPLIT_KEYS = 4 if SIMULATED else 32
COMBINE_THREADS = 16 if SIMULATED else 128
MERGE_ELEMENTS = HEADS_PER_BLOCK * 4 * DECODE_THREADS  # [heads, lane groups, head_dim] floats
STAT_ELEMENTS = HEADS_PER_BLOCK * DECODE_THREADS  # [heads, lane groups]
REGISTERS = HEADS_PER_BLOCK * 4
VALUES = KEYS_IN_FLIGHT * HEADS_PER_BLOCK  # (key, head) pairs of one step: 32
MAX_OWN = 4  # pairs one lane holds after the reduce-scatter: 32 / lanes, lanes >= 8
NEGATIVE_INFINITY = -math.inf
FULL_MASK = 0xFFFFFFFF


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel handles the geometry (else the per-head kernel runs)."""
    if heads % kv_heads or head_dim != value_dim or head_dim % 4:
        return False
    lanes = head_dim // 4
    return 8 <= lanes <= MAX_LANES and lanes & (lanes - 1) == 0


def head_blocks(heads: int, kv_heads: int) -> int:
    """Blocks per KV head: its query heads in chunks of ``HEADS_PER_BLOCK``."""
    return -(-(heads // kv_heads) // HEADS_PER_BLOCK)


def split_count(rows: int, heads: int, kv_heads: int, max_context: int) -> int:
    """Key splits per row: enough blocks to fill the GPU, each split at least MIN_SPLIT_KEYS keys
    of the longest context ``max_context``."""
    blocks = max(1, rows * kv_heads * head_blocks(heads, kv_heads))
    wanted = -(-TARGET_BLOCKS // blocks)
    return max(1, min(wanted, MAX_SPLITS, -(-int(max_context) // MIN_SPLIT_KEYS)))


if SIMULATED:

    @cuda.jit(device=True)
    def lane_xor(scratch, tid, lane, value, offset):
        # The value of lane ``lane ^ offset`` of the lane group (every thread calls this: the
        # simulator has no shuffles, so values go through shared memory).
        scratch[tid] = value
        cuda.syncthreads()
        other = scratch[tid - lane + (lane ^ offset)]
        cuda.syncthreads()
        return other

    @cuda.jit(device=True)
    def lane_read(scratch, tid, lane, value, source):
        # The value of lane ``source`` of the lane group.
        scratch[tid] = value
        cuda.syncthreads()
        other = scratch[tid - lane + source]
        cuda.syncthreads()
        return other

else:

    @cuda.jit(device=True)
    def lane_xor(scratch, tid, lane, value, offset):
        # The value of lane ``lane ^ offset`` of the lane group (a warp shuffle).
        return cuda.shfl_xor_sync(FULL_MASK, value, offset)

    @cuda.jit(device=True)
    def lane_read(scratch, tid, lane, value, source):
        # The value of lane ``source`` of the lane group (lane groups are aligned inside a warp).
        return cuda.shfl_sync(FULL_MASK, value, tid % 32 - lane + source)


@cuda.jit(device=True)
def reversed_bits(index):
    # ``index`` (0..31) with its five bits in reverse order.
    return ((index & 1) << 4) | ((index & 2) << 2) | (index & 4) | ((index & 8) >> 2) | ((index & 16) >> 4)


@cuda.jit(device=True)
def pick(values, i):
    # values[i] for i in 0..3 without a dynamic index (which would move the array to memory).
    if i == 0:
        return values[0]
    if i == 1:
        return values[1]
    if i == 2:
        return values[2]
    return values[3]


@cuda.jit(device=True)
def widen(word, c):
    # Value c (0..3) of a 64-bit word of four bf16 values, low half first.
    half = uint32(word >> uint64(32)) if c >= 2 else uint32(word & uint64(0xFFFFFFFF))
    return bits_to_float(half << uint32(16)) if c % 2 == 0 else bits_to_float(half & uint32(0xFFFF0000))


@cuda.jit(cache=True)
def paged_attention_grouped_kernel(
    q, k_words, v_words, block_tables, seq_index, positions, scale, sliding_window, out_acc, out_max, out_sum, out
):
    # Grid: (N rows, n_kv_heads * head_blocks, splits); block DECODE_THREADS threads.
    # q [N, nh, d] f32; k_words / v_words: the bf16 caches viewed as uint64 [blocks, block_size,
    # nkv, d / 4]; block_tables [S, max_blocks] int32. splits == 1: out [N, nh * d] bf16 bits.
    # Else out_acc [N, nh, splits, d] (exp-weighted V), out_max / out_sum [N, nh, splits].
    row = cuda.blockIdx.x
    split = cuda.blockIdx.z
    splits = cuda.gridDim.z
    tid = cuda.threadIdx.x
    kv_heads = k_words.shape[2]
    words = k_words.shape[3]  # = lanes per key
    head_dim = 4 * words
    group = q.shape[1] // kv_heads
    chunks = (group + HEADS_PER_BLOCK - 1) // HEADS_PER_BLOCK
    kv_head = cuda.blockIdx.y // chunks
    first_head = kv_head * group + (cuda.blockIdx.y % chunks) * HEADS_PER_BLOCK
    heads_here = min(HEADS_PER_BLOCK, kv_head * group + group - first_head)
    lane = tid % words
    lane_group = tid // words
    lane_groups = DECODE_THREADS // words
    block_size = k_words.shape[1]
    seq = seq_index[row]
    position = positions[row]
    start = 0
    if sliding_window > 0:
        start = max(0, position - sliding_window + 1)
    per_split = (position + 1 - start + splits - 1) // splits
    lo = start + split * per_split
    hi = min(position + 1, lo + per_split)

    scratch = cuda.shared.array(DECODE_THREADS, float32)
    merge = cuda.shared.array(MERGE_ELEMENTS, float32)
    stat_max = cuda.shared.array(STAT_ELEMENTS, float32)
    stat_sum = cuda.shared.array(STAT_ELEMENTS, float32)
    query = cuda.local.array(REGISTERS, float32)
    acc = cuda.local.array(REGISTERS, float32)
    running_max = cuda.local.array(HEADS_PER_BLOCK, float32)
    running_sum = cuda.local.array(HEADS_PER_BLOCK, float32)
    chunk_max = cuda.local.array(HEADS_PER_BLOCK, float32)
    correction = cuda.local.array(HEADS_PER_BLOCK, float32)
    k_loaded = cuda.local.array(KEYS_IN_FLIGHT, uint64)
    v_loaded = cuda.local.array(KEYS_IN_FLIGHT, uint64)
    block_ids = cuda.local.array(KEYS_IN_FLIGHT, int64)
    values = cuda.local.array(VALUES, float32)
    own = cuda.local.array(MAX_OWN, float32)
    for g in range(HEADS_PER_BLOCK):
        running_max[g] = NEGATIVE_INFINITY
        running_sum[g] = 0.0
        for c in range(4):
            acc[g * 4 + c] = 0.0
            query[g * 4 + c] = q[row, first_head + g, 4 * lane + c] * scale if g < heads_here else float32(0.0)
    # After the reduce-scatter below, lane l of a group of L = 2^steps lanes holds the sums of
    # the (key u, head g) pairs u * 4 + g = reversed_bits(l) + i for i < 32 / L.
    steps = 0
    while (1 << steps) < words:
        steps += 1
    owned = VALUES >> steps
    first_owned = reversed_bits(lane)

    # Uniform loop over the block (the simulator's lane exchanges synchronise every thread).
    # Loads are unconditional (keys past the end are clamped to the last one and masked later),
    # so all of them are in flight together; the block ids of the next step are fetched before
    # this step's arithmetic.
    step = lane_groups * KEYS_IN_FLIGHT
    last_key = max(hi - 1, 0)
    for u in range(KEYS_IN_FLIGHT):
        block_ids[u] = block_tables[seq, min(lo + lane_group * KEYS_IN_FLIGHT + u, last_key) // block_size]
    for base in range(lo, hi, step):
        first_key = base + lane_group * KEYS_IN_FLIGHT
        for u in range(KEYS_IN_FLIGHT):
            offset = min(first_key + u, last_key) % block_size
            k_loaded[u] = k_words[block_ids[u], offset, kv_head, lane]
            v_loaded[u] = v_words[block_ids[u], offset, kv_head, lane]
        for u in range(KEYS_IN_FLIGHT):
            block_ids[u] = block_tables[seq, min(first_key + step + u, last_key) // block_size]
        # This lane's share of every (key, head) dot product.
        for u in range(KEYS_IN_FLIGHT):
            for g in range(HEADS_PER_BLOCK):
                partial = float32(0.0)
                for c in range(4):
                    partial += query[g * 4 + c] * widen(k_loaded[u], c)
                values[u * HEADS_PER_BLOCK + g] = partial
        # Reduce-scatter over the lane group: each exchange halves the values a lane holds.
        for k in range(5):
            if k < steps:
                upper = (lane >> k) & 1
                half = (VALUES // 2) >> k
                for i in range(half):
                    send = values[i] if upper else values[i + half]
                    keep = values[i + half] if upper else values[i]
                    values[i] = keep + lane_xor(scratch, tid, lane, send, 1 << k)
        # Own scores, their maximum over the keys (lanes that differ in bits 0..2 share a head).
        for i in range(MAX_OWN):
            score = float32(NEGATIVE_INFINITY)
            if i < owned:
                pair = first_owned + i
                if first_key + pair // HEADS_PER_BLOCK < hi and pair % HEADS_PER_BLOCK < heads_here:
                    score = values[i]
            own[i] = score
        for i in range(MAX_OWN):
            if i < owned:
                best = own[i]
                for k in range(3):
                    best = max(best, lane_xor(scratch, tid, lane, best, 1 << k))
                values[i] = best
        for g in range(HEADS_PER_BLOCK):
            chunk_max[g] = lane_read(scratch, tid, lane, pick(values, g % owned), reversed_bits(g) & (words - 1))
            new_max = max(running_max[g], chunk_max[g])
            correction[g] = fast_exp(running_max[g] - new_max) if new_max > NEGATIVE_INFINITY else float32(1.0)
            chunk_max[g] = new_max
        # Own weights, then every pair's weight in every lane.
        for i in range(MAX_OWN):
            if i < owned:
                score = own[i]
                own[i] = fast_exp(score - pick(chunk_max, (first_owned + i) % HEADS_PER_BLOCK)) if score > NEGATIVE_INFINITY else float32(0.0)
        for j in range(VALUES):
            values[j] = lane_read(scratch, tid, lane, pick(own, j % owned), reversed_bits(j) & (words - 1))
        for g in range(HEADS_PER_BLOCK):
            running_sum[g] *= correction[g]
            for c in range(4):
                acc[g * 4 + c] *= correction[g]
            running_max[g] = chunk_max[g]
        for u in range(KEYS_IN_FLIGHT):
            v0 = widen(v_loaded[u], 0)
            v1 = widen(v_loaded[u], 1)
            v2 = widen(v_loaded[u], 2)
            v3 = widen(v_loaded[u], 3)
            for g in range(HEADS_PER_BLOCK):
                weight = values[u * HEADS_PER_BLOCK + g]
                running_sum[g] += weight
                acc[g * 4] += weight * v0
                acc[g * 4 + 1] += weight * v1
                acc[g * 4 + 2] += weight * v2
                acc[g * 4 + 3] += weight * v3

    # Merge the lane groups: stats per (head, lane group), weighted values per (head, group, dim).
    for g in range(HEADS_PER_BLOCK):
        if lane == 0:
            stat_max[g * lane_groups + lane_group] = running_max[g]
            stat_sum[g * lane_groups + lane_group] = running_sum[g]
        for c in range(4):
            merge[(g * lane_groups + lane_group) * head_dim + 4 * lane + c] = acc[g * 4 + c]
    cuda.syncthreads()
    for e in range(tid, heads_here * head_dim, DECODE_THREADS):
        g = e // head_dim
        dim = e % head_dim
        best = float32(NEGATIVE_INFINITY)
        for j in range(lane_groups):
            best = max(best, stat_max[g * lane_groups + j])
        total = float32(0.0)
        weighted = float32(0.0)
        if best > NEGATIVE_INFINITY:
            for j in range(lane_groups):
                factor = math.exp(stat_max[g * lane_groups + j] - best)
                total += factor * stat_sum[g * lane_groups + j]
                weighted += factor * merge[(g * lane_groups + j) * head_dim + dim]
        head = first_head + g
        if splits == 1:
            out[row, head * head_dim + dim] = float_to_bf16(weighted / total if total > 0.0 else float32(0.0))
        else:
            out_acc[row, head, split, dim] = weighted
            if dim == 0:
                out_max[row, head, split] = best
                out_sum[row, head, split] = total


@cuda.jit(cache=True)
def grouped_combine_kernel(out_acc, out_max, out_sum, out):
    # Grid: (N rows, n_heads); COMBINE_THREADS threads. Merges the splits (<= MAX_SPLITS) of the
    # grouped kernel by log-sum-exp into bf16 out [N, nh * dv]. Split weights go to shared
    # memory first; each output dim then reads all splits with independent loads.
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    splits = out_max.shape[2]
    value_dim = out_acc.shape[3]
    partial = cuda.shared.array(COMBINE_THREADS, float32)
    weights = cuda.shared.array(MAX_SPLITS, float32)
    split_max = float32(NEGATIVE_INFINITY)
    split_sum = float32(0.0)
    if tid < splits:
        split_sum = out_sum[row, head, tid]
        if split_sum > 0.0:
            split_max = out_max[row, head, tid]
    best = block_max(partial, tid, split_max, COMBINE_THREADS)
    weight = float32(0.0)
    if split_sum > 0.0:
        weight = math.exp(split_max - best)
    if tid < MAX_SPLITS:
        weights[tid] = weight
    total = block_sum(partial, tid, weight * split_sum, COMBINE_THREADS)
    for dim in range(tid, value_dim, COMBINE_THREADS):
        numerator = float32(0.0)
        for s in range(MAX_SPLITS):
            numerator += weights[s] * out_acc[row, head, min(s, splits - 1), dim]
        out[row, head * value_dim + dim] = float_to_bf16(numerator / total if total > 0.0 else float32(0.0))


def as_wide_words(cache: object) -> object:
    """The bf16 cache ``[blocks, block_size, nkv, d]`` viewed as uint64 ``[..., d / 4]``."""
    return cache.view(np.uint64)
