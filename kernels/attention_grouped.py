"""Paged decode attention for the query heads of one KV head, one block per (row, heads, split).

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`. A block
serves up to ``HEADS_PER_BLOCK`` query heads of one KV head, so each cached key and value is read
once for all of them. The block's warps walk the keys of its split in tiles of ``WARP /
LANES_PER_KEY`` keys, one tile per warp at a time:

* **scores**: the ``LANES_PER_KEY`` lanes of key ``j`` of the tile read its 64-bit words
  interleaved (lane part ``p`` reads words ``p, p + LANES_PER_KEY, ...``; together they read
  each 32-byte sector whole, all loads in flight together), compute partial dot products with
  every query head of the block (the scaled queries sit in shared memory, read as broadcasts) and
  sum them with shuffles;
* **softmax**: one warp maximum per head, then each lane turns its key's scores into weights
  (online softmax: running maximum, lane-partial sums) and stores them in shared memory;
* **values**: lane ``l`` owns four dims (word ``l % (head_dim / 4)``) and reads them for the keys
  ``l // (head_dim / 4) + i * WARP / (head_dim / 4)`` of the tile, coalesced, weighting them
  with the stored weights of every head.

The warps of a block then merge through shared memory. The keys of a row are divided evenly
between the ``splits`` blocks of the grid's last axis, and the split sizes are computed on the
device from the row's position, so a captured graph serves any context length. With one split
the block writes the bf16 output directly; with more, it writes unnormalised partials that
:func:`grouped_combine_kernel` merges.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bits_to_float,
    block_max,
    block_sum,
    check_array,
    device_view,
    fast_exp,
    float_to_bf16,
    float_to_bits,
    inline_device,
    jit_kernel,
    numba_stream,
)

WARP = 8 if SIMULATED else 32
LANES_PER_KEY = 2 if SIMULATED else 4  # lanes sharing one key's dot products
KEYS_PER_TILE = WARP // LANES_PER_KEY
DECODE_WARPS = 2 if SIMULATED else 4  # warps of a block (the launcher's choice)
MAX_DECODE_WARPS = 2 if SIMULATED else 8  # the most a launch may ask for (shared-memory sizes)
DECODE_THREADS = WARP * DECODE_WARPS
HEADS_PER_BLOCK = 4
MAX_WORDS = WARP  # 64-bit words of one key: LANES_PER_KEY <= head_dim / 4 <= WARP
# Words of a key one lane reads, and values it reads per tile (loops this long unroll fully, so
# their arrays stay in registers).
PART_WORDS = MAX_WORDS // LANES_PER_KEY
MAX_HEAD_DIM = 4 * MAX_WORDS
MAX_SPLITS = 8 if SIMULATED else 32  # at most COMBINE_THREADS
# Splits per row: up to TARGET_BLOCKS blocks in the grid, at least MIN_SPLIT_KEYS keys of
# max_context each (tuned on the H200 with tools/attention_sweep.py).
TARGET_BLOCKS = 64 if SIMULATED else 512
MIN_SPLIT_KEYS = 4 if SIMULATED else 32
COMBINE_THREADS = 16 if SIMULATED else 128
QUERY_ELEMENTS = HEADS_PER_BLOCK * MAX_HEAD_DIM  # [heads, dims]: the output values of a block
# Scaled queries [heads, dims / 2] as uint64, two float32 bit patterns each: one shared load
# brings two dims.
QUERY_PAIRS = QUERY_ELEMENTS // 2
PAIRS_PER_HEAD = MAX_HEAD_DIM // 2
# Softmax weights [warps, tile keys, heads / 2] as uint64 float pairs: two shared loads a key.
WEIGHT_PAIRS = MAX_DECODE_WARPS * KEYS_PER_TILE * HEADS_PER_BLOCK // 2
MERGE_ELEMENTS = MAX_DECODE_WARPS * HEADS_PER_BLOCK * MAX_HEAD_DIM  # [warps, heads, dims]
STAT_ELEMENTS = MAX_DECODE_WARPS * HEADS_PER_BLOCK  # [warps, heads]
SCRATCH_ELEMENTS = WARP * MAX_DECODE_WARPS
ACCUMULATORS = HEADS_PER_BLOCK * 4  # [heads, four dims]
NEGATIVE_INFINITY = -math.inf
FULL_MASK = 0xFFFFFFFF


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel handles the geometry (else the per-head kernel runs)."""
    if heads % kv_heads or head_dim != value_dim or head_dim % 4:
        return False
    words = head_dim // 4
    return LANES_PER_KEY <= words <= MAX_WORDS and words & (words - 1) == 0


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
    # The simulator has no shuffles: lane values go through shared memory, and every exchange
    # synchronises the block (all its threads call these the same number of times).

    @cuda.jit(device=True)
    def share_lane_value(scratch, tid, value):
        # Publish ``value`` for lane_value (on the GPU lane_value shuffles instead).
        scratch[tid] = value
        cuda.syncthreads()

    @cuda.jit(device=True)
    def lane_value(scratch, tid, lane, value, source):
        # The shared uint64 ``value`` of lane ``source`` of the warp.
        return scratch[tid - lane + source]

    @cuda.jit(device=True)
    def warp_max(scratch, tid, lane, value):
        # Maximum of ``value`` over the warp.
        scratch[tid] = value
        cuda.syncthreads()
        best = value
        for other in range(WARP):
            best = max(best, scratch[tid - lane + other])
        cuda.syncthreads()
        return best

    @cuda.jit(device=True)
    def lanes_sum(scratch, tid, lane, value, first, count, stride):
        # Sum of ``value`` over lanes first, first + stride, ... (count of them) of the warp.
        scratch[tid] = value
        cuda.syncthreads()
        total = float32(0.0)
        for i in range(count):
            total += scratch[tid - lane + first + i * stride]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def key_sum(scratch, tid, lane, value):
        # Sum of ``value`` over the LANES_PER_KEY lanes of one key.
        return lanes_sum(scratch, tid, lane, value, lane - lane % LANES_PER_KEY, LANES_PER_KEY, 1)

    @cuda.jit(device=True)
    def warp_sum(scratch, tid, lane, value):
        # Sum of ``value`` over the warp.
        return lanes_sum(scratch, tid, lane, value, 0, WARP, 1)

    @cuda.jit(device=True)
    def subgroup_sum(scratch, tid, lane, value, words):
        # Sum of ``value`` over the lanes of the warp with the same ``lane % words``.
        return lanes_sum(scratch, tid, lane, value, lane % words, WARP // words, words)

    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncthreads()

else:

    @cuda.jit(device=True)
    def share_lane_value(scratch, tid, value):
        pass

    @cuda.jit(device=True)
    def lane_value(scratch, tid, lane, value, source):
        return uint64(cuda.shfl_sync(FULL_MASK, int64(value), int32(source)))

    @cuda.jit(device=True)
    def warp_max(scratch, tid, lane, value):
        # (Of a value the lanes of each key share: the rounds within a key are skipped.)
        for k in range(5):
            if (1 << k) >= LANES_PER_KEY:
                value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 1 << k))
        return value

    @cuda.jit(device=True)
    def key_sum(scratch, tid, lane, value):
        for k in range(5):
            if (1 << k) < LANES_PER_KEY:
                value += cuda.shfl_xor_sync(FULL_MASK, value, 1 << k)
        return value

    @cuda.jit(device=True)
    def warp_sum(scratch, tid, lane, value):
        for k in range(5):
            value += cuda.shfl_xor_sync(FULL_MASK, value, 1 << k)
        return value

    @cuda.jit(device=True)
    def subgroup_sum(scratch, tid, lane, value, words):
        for k in range(5):
            if (words << k) < WARP:
                value += cuda.shfl_xor_sync(FULL_MASK, value, words << k)
        return value

    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncwarp(FULL_MASK)


@cuda.jit(device=True)
def widen(word, c):
    # Value c (0..3) of a 64-bit word of four bf16 values, low half first.
    half = uint32(word >> uint64(32)) if c >= 2 else uint32(word & uint64(0xFFFFFFFF))
    return bits_to_float(half << uint32(16)) if c % 2 == 0 else bits_to_float(half & uint32(0xFFFF0000))


@cuda.jit(device=True)
def pair_value(pair, c):
    # Float c (0 or 1) of a uint64 holding two float32 bit patterns, low half first.
    return bits_to_float(uint32(pair >> uint64(32)) if c else uint32(pair & uint64(0xFFFFFFFF)))


@inline_device
def load_key_words(key_words, k_rows, cache_row, part, words):
    # Words part, part + LANES_PER_KEY, ... of one cached key, all loads issued together.
    for t in range(PART_WORDS):
        if t * LANES_PER_KEY < words:
            key_words[t] = k_rows[cache_row, part + uint32(t * LANES_PER_KEY)]


@inline_device
def add_scores(scores, query, key_words, part, words):
    # scores[g] += q_g . key over the dims of this lane's words. Indices here and in the other
    # loops are unsigned: numba wraps negative signed indices around, at a cost of several
    # instructions and registers per access.
    for t in range(PART_WORDS):
        if t * LANES_PER_KEY < words:
            k0 = widen(key_words[t], 0)
            k1 = widen(key_words[t], 1)
            k2 = widen(key_words[t], 2)
            k3 = widen(key_words[t], 3)
            word = part + uint32(t * LANES_PER_KEY)
            for g in range(HEADS_PER_BLOCK):
                at = uint32(g * PAIRS_PER_HEAD) + 2 * word
                low = query[at]
                high = query[at + 1]
                scores[g] += (
                    pair_value(low, 0) * k0 + pair_value(low, 1) * k1 + pair_value(high, 0) * k2
                    + pair_value(high, 1) * k3
                )


@inline_device
def load_value_words(value_words, v_rows, row_scratch, tid, lane, cache_row, column, subgroup, key_stride, words):
    # Word ``column`` of the values of keys subgroup + i * key_stride of the tile; the cache row
    # of key j comes from its first lane (shared first).
    for i in range(PART_WORDS):
        if i * LANES_PER_KEY < words:
            j = subgroup + uint32(i) * key_stride
            value_words[i] = v_rows[lane_value(row_scratch, tid, lane, cache_row, j * LANES_PER_KEY), column]


@inline_device
def add_values(acc, weights, weight_base, value_words, subgroup, key_stride, words):
    # acc[g, c] += weight(g, key) * value(key, c) over the keys of load_value_words.
    for i in range(PART_WORDS):
        if i * LANES_PER_KEY < words:
            j = subgroup + uint32(i) * key_stride
            v0 = widen(value_words[i], 0)
            v1 = widen(value_words[i], 1)
            v2 = widen(value_words[i], 2)
            v3 = widen(value_words[i], 3)
            pair_base = weight_base + j * (HEADS_PER_BLOCK // 2)
            for g in range(HEADS_PER_BLOCK):
                weight = pair_value(weights[pair_base + g // 2], g % 2)
                acc[g * 4] += weight * v0
                acc[g * 4 + 1] += weight * v1
                acc[g * 4 + 2] += weight * v2
                acc[g * 4 + 3] += weight * v3


@inline_device
def cache_row_of(block_tables, seq, key, block_size, kv_heads, kv_head):
    # Row of (token ``key`` of sequence ``seq``, ``kv_head``) in the cache viewed by as_rows.
    key_block = uint32(key) // uint32(block_size)
    offset = uint32(key) - key_block * uint32(block_size)
    return uint64((int64(block_tables[seq, key_block]) * block_size + offset) * kv_heads + kv_head)


def _make_grouped_kernel(word_count: int):
    # The kernel for keys of ``word_count`` 64-bit words: a compile-time constant, so every loop
    # over a key's words unrolls without guards and the compiler schedules its loads together.
    @jit_kernel
    def paged_attention_grouped_kernel(
        q, k_rows, v_rows, block_size, kv_heads, block_tables, seq_index, positions, scale, sliding_window, out_acc,
        out_max, out_sum, out,
    ):
        # Grid: (N rows, n_kv_heads * head_blocks, splits); block WARP * warps threads (warps <=
        # MAX_DECODE_WARPS). q [N, nh, d] f32; k_rows / v_rows: the bf16 caches [blocks, block_size,
        # kv_heads, d] viewed as uint64 rows [blocks * block_size * kv_heads, d / 4] (as_rows);
        # block_tables [S, max_blocks] int32. splits == 1: out
        # [N, nh * d] bf16 bits. Else out_acc [N, nh, splits, d] (exp-weighted V), out_max / out_sum
        # [N, nh, splits].
        row = cuda.blockIdx.x
        split = cuda.blockIdx.z
        splits = cuda.gridDim.z
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        warps = threads // WARP
        warp = tid // WARP
        lane = tid % WARP
        words = uint32(word_count)  # (k_rows.shape[1], checked by the launcher)
        head_dim = 4 * words
        group = q.shape[1] // kv_heads
        chunks = (group + HEADS_PER_BLOCK - 1) // HEADS_PER_BLOCK
        kv_head = cuda.blockIdx.y // chunks
        first_head = kv_head * group + (cuda.blockIdx.y % chunks) * HEADS_PER_BLOCK
        heads_here = min(HEADS_PER_BLOCK, kv_head * group + group - first_head)
        seq = seq_index[row]
        position = positions[row]
        start = 0
        if sliding_window > 0:
            start = max(0, position - sliding_window + 1)
        per_split = (position + 1 - start + splits - 1) // splits
        lo = start + split * per_split
        hi = min(position + 1, lo + per_split)
        # Score layout: lane reads part ``part`` of the tile's key ``key_slot``. Value layout: lane
        # owns word ``column`` of the tile's keys ``subgroup + i * key_stride``.
        key_slot = lane // LANES_PER_KEY
        part = uint32(lane % LANES_PER_KEY)
        column = uint32(lane % words)
        subgroup = uint32(lane // words)
        key_stride = uint32(WARP // words)

        query = cuda.shared.array(QUERY_PAIRS, uint64)
        weights = cuda.shared.array(WEIGHT_PAIRS, uint64)
        lane_weights = cuda.local.array(HEADS_PER_BLOCK, float32)
        scratch = cuda.shared.array(SCRATCH_ELEMENTS, float32)
        row_scratch = cuda.shared.array(SCRATCH_ELEMENTS, uint64)
        merge = cuda.shared.array(MERGE_ELEMENTS, float32)
        stat_max = cuda.shared.array(STAT_ELEMENTS, float32)
        stat_sum = cuda.shared.array(STAT_ELEMENTS, float32)
        acc = cuda.local.array(ACCUMULATORS, float32)
        running_max = cuda.local.array(HEADS_PER_BLOCK, float32)
        running_sum = cuda.local.array(HEADS_PER_BLOCK, float32)
        scores = cuda.local.array(HEADS_PER_BLOCK, float32)
        key_words = cuda.local.array(PART_WORDS, uint64)
        value_words = cuda.local.array(PART_WORDS, uint64)
        # Each tile's block-table lookup is issued one tile ahead (the first one before the queries
        # are staged), so a tile waits on one memory round trip, not two.
        last_key = max(hi - 1, 0)
        round_keys = warps * KEYS_PER_TILE
        next_row = cache_row_of(
            block_tables, seq, min(lo + warp * KEYS_PER_TILE + key_slot, last_key), block_size, kv_heads, kv_head
        )
        # (head, dim pair) e < QUERY_PAIRS: divisions by a constant, unsigned (no wraparound).
        for e in range(uint32(tid), QUERY_PAIRS, uint32(threads)):
            g = e // PAIRS_PER_HEAD
            dim = 2 * (e % PAIRS_PER_HEAD)
            if dim < head_dim:
                first_value = q[row, first_head + g, dim] * scale if g < heads_here else float32(0.0)
                second_value = q[row, first_head + g, dim + 1] * scale if g < heads_here else float32(0.0)
                query[e] = (uint64(float_to_bits(second_value)) << uint64(32)) | uint64(float_to_bits(first_value))
        for g in range(HEADS_PER_BLOCK):
            running_max[g] = NEGATIVE_INFINITY
            running_sum[g] = 0.0
            for c in range(4):
                acc[g * 4 + c] = 0.0
        cuda.syncthreads()

        # Uniform loop over the block (the simulator's lane exchanges synchronise every thread).
        # Loads are unconditional: keys past the end are clamped to the last one and masked later.
        weight_base = uint32(warp * KEYS_PER_TILE * (HEADS_PER_BLOCK // 2))
        for base in range(lo, hi, round_keys):
            tile = base + warp * KEYS_PER_TILE
            cache_row = next_row
            next_row = cache_row_of(
                block_tables, seq, min(tile + round_keys + key_slot, last_key), block_size, kv_heads, kv_head
            )
            share_lane_value(row_scratch, tid, cache_row)
            load_key_words(key_words, k_rows, cache_row, part, words)
            for g in range(HEADS_PER_BLOCK):
                scores[g] = 0.0
            add_scores(scores, query, key_words, part, words)
            for g in range(HEADS_PER_BLOCK):
                scores[g] = key_sum(scratch, tid, lane, scores[g])
            visible = tile + key_slot < hi
            for g in range(HEADS_PER_BLOCK):
                score = scores[g] if visible and g < heads_here else float32(NEGATIVE_INFINITY)
                new_max = max(running_max[g], warp_max(scratch, tid, lane, score))
                weight = float32(0.0)
                correction = float32(1.0)
                if new_max > NEGATIVE_INFINITY:
                    correction = fast_exp(running_max[g] - new_max)
                    weight = fast_exp(score - new_max)
                running_max[g] = new_max
                # (The key's other lanes hold the same weight: one of them counts it.)
                running_sum[g] = running_sum[g] * correction + (weight if part == 0 else float32(0.0))
                for c in range(4):
                    acc[g * 4 + c] *= correction
                lane_weights[g] = weight
            if part == 0:
                for h in range(HEADS_PER_BLOCK // 2):
                    weights[weight_base + key_slot * (HEADS_PER_BLOCK // 2) + h] = (
                        (uint64(float_to_bits(lane_weights[2 * h + 1])) << uint64(32))
                        | uint64(float_to_bits(lane_weights[2 * h]))
                    )
            warp_sync()
            load_value_words(value_words, v_rows, row_scratch, tid, lane, cache_row, column, subgroup, key_stride, words)
            add_values(acc, weights, weight_base, value_words, subgroup, key_stride, words)
            warp_sync()

        # Per warp: sums over lanes, weighted values over the key subgroups; then merge the warps.
        for g in range(HEADS_PER_BLOCK):
            total = warp_sum(scratch, tid, lane, running_sum[g])
            for c in range(4):
                value = subgroup_sum(scratch, tid, lane, acc[g * 4 + c], words) if key_stride > 1 else acc[g * 4 + c]
                if subgroup == 0:
                    merge[(warp * HEADS_PER_BLOCK + g) * MAX_HEAD_DIM + 4 * column + c] = value
            if lane == 0:
                stat_max[warp * HEADS_PER_BLOCK + g] = running_max[g]
                stat_sum[warp * HEADS_PER_BLOCK + g] = total
        cuda.syncthreads()
        for e in range(uint32(tid), QUERY_ELEMENTS, uint32(threads)):
            g = e // MAX_HEAD_DIM
            dim = e % MAX_HEAD_DIM
            if g >= heads_here or dim >= head_dim:
                continue
            best = float32(NEGATIVE_INFINITY)
            for j in range(uint32(warps)):
                best = max(best, stat_max[j * HEADS_PER_BLOCK + g])
            total = float32(0.0)
            weighted = float32(0.0)
            if best > NEGATIVE_INFINITY:
                for j in range(uint32(warps)):
                    factor = fast_exp(stat_max[j * HEADS_PER_BLOCK + g] - best)
                    total += factor * stat_sum[j * HEADS_PER_BLOCK + g]
                    weighted += factor * merge[(j * HEADS_PER_BLOCK + g) * MAX_HEAD_DIM + dim]
            head = first_head + g
            if splits == 1:
                out[row, head * head_dim + dim] = float_to_bf16(weighted / total if total > 0.0 else float32(0.0))
            else:
                out_acc[row, head, split, dim] = weighted
                if dim == 0:
                    out_max[row, head, split] = best
                    out_sum[row, head, split] = total

    return paged_attention_grouped_kernel


_GROUPED_KERNELS: dict[int, object] = {}


def grouped_kernel(words: int):
    """The grouped decode kernel compiled for keys of ``words`` 64-bit words (head dim / 4)."""
    kernel = _GROUPED_KERNELS.get(words)
    if kernel is None:
        kernel = _GROUPED_KERNELS[words] = _make_grouped_kernel(words)
    return kernel


@jit_kernel
def grouped_combine_kernel(out_acc, out_max, out_sum, out):
    # Grid: (N rows, n_heads[, dim blocks]); COMBINE_THREADS threads. Merges the splits
    # (<= MAX_SPLITS) of the grouped kernel by log-sum-exp into bf16 out [N, nh * dv]. Split
    # weights go to shared memory first; each output dim then reads all splits with independent
    # loads. Wide values (MLA's latent rows) spread their dims over the grid's third axis.
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
    for dim in range(cuda.blockIdx.z * COMBINE_THREADS + tid, value_dim, COMBINE_THREADS * cuda.gridDim.z):
        numerator = float32(0.0)
        for s in range(MAX_SPLITS):
            numerator += weights[s] * out_acc[row, head, min(s, splits - 1), dim]
        out[row, head * value_dim + dim] = float_to_bf16(numerator / total if total > 0.0 else float32(0.0))


def as_rows(cache: DeviceArray) -> DeviceArray:
    """The bf16 cache ``[blocks, block_size, nkv, d]`` viewed as uint64 rows ``[blocks * block_size
    * nkv, d / 4]``: one row per cached (token, KV head)."""
    return cache.view(np.uint64).reshape(-1, cache.shape[3] // 4)


def launch_decode(
    op: str, kernel: object, threads: int, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
    block_tables: DeviceArray, seq_index: DeviceArray, positions: DeviceArray, scale: float, sliding_window: int | None,
    max_context: int, workspace: tuple, out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """Check the arguments of a decode kernel of this grid (``kernel``: :func:`grouped_kernel` or
    :func:`metrale.kernels.attention_staged.staged_kernel` for the head size, ``threads`` its
    block), launch it and, with several splits, :func:`grouped_combine_kernel`. ``max_context``
    fixes the splits (:func:`split_count`), ``workspace`` is ``(acc, max, sum)`` of shapes
    ``[N, nh, splits, d]``, ``[N, nh, splits]``, ``[N, nh, splits]`` float32."""
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    check_array(op, "k_cache", k_cache, np.uint16, (None, None, None, head_dim))
    kv_heads = k_cache.shape[2]
    check_array(op, "v_cache", v_cache, np.uint16, k_cache.shape)
    if not supports(heads, kv_heads, head_dim, head_dim):
        raise KernelArgumentError(f"{op}: q {list(q.shape)} with caches {list(k_cache.shape)} is unsupported (heads of "
                                  f"{4 * LANES_PER_KEY} to {MAX_HEAD_DIM} dims, a power of two; whole groups)")
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    splits = split_count(rows, heads, kv_heads, max_context)
    acc, best, total = workspace
    check_array(op, "workspace acc", acc, np.float32, (rows, heads, splits, head_dim))
    check_array(op, "workspace max", best, np.float32, (rows, heads, splits))
    check_array(op, "workspace sum", total, np.float32, (rows, heads, splits))
    check_array(op, "out", out, np.uint16, (rows, heads * head_dim))
    if not rows:
        return out
    launch = numba_stream(stream)
    grid = (rows, kv_heads * head_blocks(heads, kv_heads), splits)
    kernel[grid, threads, launch](  # type: ignore[index]
        device_view(q), device_view(as_rows(k_cache)), device_view(as_rows(v_cache)), np.int32(k_cache.shape[1]),
        np.int32(kv_heads), device_view(block_tables), device_view(seq_index), device_view(positions),
        np.float32(scale), np.int32(sliding_window or 0), device_view(acc), device_view(best), device_view(total),
        device_view(out),
    )
    if splits > 1:
        grouped_combine_kernel[(rows, heads), COMBINE_THREADS, launch](
            device_view(acc), device_view(best), device_view(total), device_view(out)
        )
    return out


def decode_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, scale: float, sliding_window: int | None, max_context: int, workspace: tuple,
    out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """The grouped decode kernel (:func:`grouped_kernel`): bf16 ``out [N, nh * d]`` from float32
    ``q [N, nh, d]``, each row attending as a row of its own; geometries of :func:`supports`
    (arguments as :func:`launch_decode`)."""
    return launch_decode("paged_attention_grouped", grouped_kernel(q.shape[2] // 4), DECODE_THREADS, q, k_cache,
                         v_cache, block_tables, seq_index, positions, scale, sliding_window, max_context, workspace,
                         out, stream)
