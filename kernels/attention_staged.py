"""Paged decode attention through shared memory: a block stages chunks of keys and values.

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`; the grid,
the split of a row's keys and the outputs are those of
:func:`metrale.kernels.attention_grouped.grouped_kernel`, so the two kernels are
interchangeable (and share the combine kernel). A block serves up to ``STAGED_WARPS`` query heads
of one KV head, one warp per head, and walks the keys of its split in chunks of ``CHUNK_KEYS``
(one key per lane):

* **staging**: every thread of the block loads its share of the chunk's keys and values (64-bit
  words, coalesced, all in flight together) into registers, and stores them to shared memory
  once they arrive. The next chunk's loads are issued before the current chunk is computed, so
  the memory latency overlaps the arithmetic; the next-but-one chunk's cache rows (the
  block-table lookup) are fetched a chunk ahead as well. One barrier per chunk.
* **scores**: lane ``l`` of warp ``g`` computes head ``g``'s score of key ``l`` from shared memory
  (key rows padded by one word, so the lanes' reads fall in distinct banks), then the warp
  updates its online softmax (running maximum by shuffles, lane-partial sums).
* **values**: each lane owns four dims (word ``l % (head_dim / 4)``) of every
  ``WARP / (head_dim / 4)``-th key and accumulates them weighted, reading the weights the warp
  stored in shared memory.

Each warp ends with its head's whole result for the block's keys, so no merge between warps is
needed: with one split it writes the bf16 output, with several the unnormalised partials that
:func:`metrale.kernels.attention_grouped.grouped_combine_kernel` merges.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int64, uint32, uint64

from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    fast_exp,
    float_to_bf16,
    float_to_bits,
    inline_device,
    jit_kernel,
)
from metrale.kernels.attention_grouped import (
    FULL_MASK,
    cache_row_of,
    launch_decode,
    pair_value,
    subgroup_sum,
    warp_sum,
    widen,
)
from metrale.kernels.attention_grouped import warp_max as _simulated_warp_max

WARP = 8 if SIMULATED else 32
STAGED_WARPS = 4  # = query heads per block (attention_grouped.HEADS_PER_BLOCK)
STAGED_THREADS = WARP * STAGED_WARPS
CHUNK_KEYS = WARP  # keys per chunk: one per lane
MAX_WORDS = WARP  # 64-bit words of one key (head_dim / 4); a word's lanes split the chunk's keys
ROW_WORDS = MAX_WORDS + 1  # shared key rows padded by a word: lanes reading one column hit distinct banks
STAGE_WORDS = CHUNK_KEYS * MAX_WORDS // STAGED_THREADS  # words of keys (and of values) a thread stages
CHUNK_ELEMENTS = 2 * CHUNK_KEYS * ROW_WORDS  # two chunk buffers
CHUNK_ROWS = 2 * CHUNK_KEYS  # cache rows of the keys of two chunks
QUERY_PAIRS = STAGED_WARPS * MAX_WORDS * 2  # [heads, dims / 2] float pairs
SCRATCH_ELEMENTS = STAGED_THREADS
NEGATIVE_INFINITY = -math.inf


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel handles the geometry (the grouped kernel's geometries)."""
    if heads % kv_heads or head_dim != value_dim or head_dim % 4:
        return False
    words = head_dim // 4
    return 1 <= words <= MAX_WORDS and words & (words - 1) == 0


if SIMULATED:
    warp_max = _simulated_warp_max
else:

    @cuda.jit(device=True)
    def warp_max(scratch, tid, lane, value):
        for k in range(5):
            value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 1 << k))
        return value


@inline_device
def load_chunk(stage_k, stage_v, k_rows, v_rows, chunk_rows, buffer, first_key, key_step, column, words):
    # The thread's words of the chunk: column ``column`` of keys first_key + i * key_step.
    for i in range(STAGE_WORDS):
        key = first_key + uint32(i) * key_step
        if key < CHUNK_KEYS:
            row = chunk_rows[buffer * uint32(CHUNK_KEYS) + key]
            stage_k[i] = k_rows[row, column]
            stage_v[i] = v_rows[row, column]


@inline_device
def store_chunk(stage_k, stage_v, keys_shared, values_shared, buffer, first_key, key_step, column):
    for i in range(STAGE_WORDS):
        key = first_key + uint32(i) * key_step
        if key < CHUNK_KEYS:
            at = (buffer * uint32(CHUNK_KEYS) + key) * uint32(ROW_WORDS) + column
            keys_shared[at] = stage_k[i]
            values_shared[at] = stage_v[i]


def _make_staged_kernel(word_count: int):
    # The kernel for keys of ``word_count`` 64-bit words (a compile-time constant: loops over a
    # key's words unroll without guards).
    @jit_kernel
    def paged_attention_staged_kernel(
        q, k_rows, v_rows, block_size, kv_heads, block_tables, seq_index, positions, scale, sliding_window, out_acc,
        out_max, out_sum, out,
    ):
        # Grid: (N rows, n_kv_heads * head_blocks, splits); STAGED_THREADS threads. Arguments as in
        # attention_grouped.paged_attention_grouped_kernel: q [N, nh, d] f32; k_rows / v_rows the
        # bf16 caches viewed as uint64 rows [blocks * block_size * kv_heads, d / 4]; splits == 1: out
        # [N, nh * d] bf16 bits, else out_acc [N, nh, splits, d], out_max / out_sum [N, nh, splits].
        row = cuda.blockIdx.x
        split = cuda.blockIdx.z
        splits = cuda.gridDim.z
        tid = uint32(cuda.threadIdx.x)
        warp = tid // uint32(WARP)
        lane = tid % uint32(WARP)
        words = uint32(word_count)  # (k_rows.shape[1], checked by the launcher)
        head_dim = 4 * words
        group = q.shape[1] // kv_heads
        chunks_per_kv = (group + STAGED_WARPS - 1) // STAGED_WARPS
        kv_head = cuda.blockIdx.y // chunks_per_kv
        head = kv_head * group + (cuda.blockIdx.y % chunks_per_kv) * STAGED_WARPS + warp
        head_valid = head < kv_head * group + group
        seq = seq_index[row]
        position = positions[row]
        start = 0
        if sliding_window > 0:
            start = max(0, position - sliding_window + 1)
        per_split = (position + 1 - start + splits - 1) // splits
        lo = start + split * per_split
        hi = min(position + 1, lo + per_split)
        chunks = max(hi - lo, 0)
        chunks = (chunks + CHUNK_KEYS - 1) // CHUNK_KEYS
        last_key = max(hi - 1, 0)
        # Staging layout: column ``column`` of keys first_key + i * key_step. Value layout: lane owns
        # word ``column`` of keys subgroup + j * key_stride.
        column = tid % words
        first_key = tid // words
        key_step = uint32(STAGED_THREADS) // words
        subgroup = lane // words
        key_stride = uint32(WARP) // words

        keys_shared = cuda.shared.array(CHUNK_ELEMENTS, uint64)
        values_shared = cuda.shared.array(CHUNK_ELEMENTS, uint64)
        chunk_rows = cuda.shared.array(CHUNK_ROWS, uint64)
        query = cuda.shared.array(QUERY_PAIRS, uint64)
        weights = cuda.shared.array(STAGED_THREADS, float32)
        scratch = cuda.shared.array(SCRATCH_ELEMENTS, float32)
        stage_k = cuda.local.array(STAGE_WORDS, uint64)
        stage_v = cuda.local.array(STAGE_WORDS, uint64)

        # Scaled queries as float pairs: pair p of head g at g * 2 * MAX_WORDS + p.
        for e in range(tid, QUERY_PAIRS, uint32(STAGED_THREADS)):
            g = uint32(e) // uint32(2 * MAX_WORDS)
            dim = uint32(2) * (uint32(e) % uint32(2 * MAX_WORDS))
            query_head = kv_head * group + (cuda.blockIdx.y % chunks_per_kv) * STAGED_WARPS + g
            first_value = float32(0.0)
            second_value = float32(0.0)
            if dim < head_dim and query_head < kv_head * group + group:
                first_value = q[row, query_head, dim] * scale
                second_value = q[row, query_head, dim + uint32(1)] * scale
            query[e] = (uint64(float_to_bits(second_value)) << uint64(32)) | uint64(float_to_bits(first_value))
        if warp == 0:
            chunk_rows[lane] = cache_row_of(block_tables, seq, min(lo + lane, last_key), block_size, kv_heads, kv_head)
        cuda.syncthreads()
        if chunks > 0:
            load_chunk(stage_k, stage_v, k_rows, v_rows, chunk_rows, uint32(0), first_key, key_step, column, words)
            store_chunk(stage_k, stage_v, keys_shared, values_shared, uint32(0), first_key, key_step, column)
        if warp == 0:
            chunk_rows[uint32(CHUNK_KEYS) + lane] = cache_row_of(
                block_tables, seq, min(lo + CHUNK_KEYS + lane, last_key), block_size, kv_heads, kv_head
            )
        cuda.syncthreads()

        running_max = float32(NEGATIVE_INFINITY)
        running_sum = float32(0.0)
        acc0 = float32(0.0)
        acc1 = float32(0.0)
        acc2 = float32(0.0)
        acc3 = float32(0.0)
        query_base = warp * uint32(2 * MAX_WORDS)
        weight_base = warp * uint32(WARP)
        next_row = uint64(0)
        for chunk in range(chunks):
            current = uint32(chunk % 2)
            following = uint32(1) - current
            # The next chunk's words are in flight while this one is computed.
            if chunk + 1 < chunks:
                load_chunk(stage_k, stage_v, k_rows, v_rows, chunk_rows, following, first_key, key_step, column, words)
            if warp == 0 and chunk + 2 < chunks:
                next_row = cache_row_of(
                    block_tables, seq, min(lo + (chunk + 2) * CHUNK_KEYS + lane, last_key), block_size, kv_heads, kv_head
                )
            key = lo + chunk * CHUNK_KEYS + lane
            score = float32(0.0)
            key_base = (current * uint32(CHUNK_KEYS) + lane) * uint32(ROW_WORDS)
            for w in range(MAX_WORDS):
                if w < words:
                    word = keys_shared[key_base + uint32(w)]
                    low = query[query_base + uint32(2 * w)]
                    high = query[query_base + uint32(2 * w + 1)]
                    score += (
                        pair_value(low, 0) * widen(word, 0) + pair_value(low, 1) * widen(word, 1)
                        + pair_value(high, 0) * widen(word, 2) + pair_value(high, 1) * widen(word, 3)
                    )
            if key >= hi or not head_valid:
                score = float32(NEGATIVE_INFINITY)
            new_max = max(running_max, warp_max(scratch, tid, lane, score))
            weight = float32(0.0)
            correction = float32(1.0)
            if new_max > NEGATIVE_INFINITY:
                correction = fast_exp(running_max - new_max)
                weight = fast_exp(score - new_max)
            running_max = new_max
            running_sum = running_sum * correction + weight
            acc0 *= correction
            acc1 *= correction
            acc2 *= correction
            acc3 *= correction
            weights[weight_base + lane] = weight
            if SIMULATED:
                cuda.syncthreads()
            else:
                cuda.syncwarp(FULL_MASK)
            for j in range(uint32(CHUNK_KEYS) // key_stride):
                k = subgroup + j * key_stride
                weight_k = weights[weight_base + k]
                value = values_shared[(current * uint32(CHUNK_KEYS) + k) * uint32(ROW_WORDS) + column]
                acc0 += weight_k * widen(value, 0)
                acc1 += weight_k * widen(value, 1)
                acc2 += weight_k * widen(value, 2)
                acc3 += weight_k * widen(value, 3)
            if chunk + 1 < chunks:
                store_chunk(stage_k, stage_v, keys_shared, values_shared, following, first_key, key_step, column)
            if warp == 0 and chunk + 2 < chunks:
                chunk_rows[current * uint32(CHUNK_KEYS) + lane] = next_row
            cuda.syncthreads()

        total = warp_sum(scratch, tid, lane, running_sum)
        if key_stride > 1:
            acc0 = subgroup_sum(scratch, tid, lane, acc0, words)
            acc1 = subgroup_sum(scratch, tid, lane, acc1, words)
            acc2 = subgroup_sum(scratch, tid, lane, acc2, words)
            acc3 = subgroup_sum(scratch, tid, lane, acc3, words)
        if head_valid and subgroup == 0:
            dim = 4 * column
            if splits == 1:
                inverse = float32(1.0) / total if total > 0.0 else float32(0.0)
                base = int64(head) * head_dim + dim
                out[row, base] = float_to_bf16(acc0 * inverse)
                out[row, base + 1] = float_to_bf16(acc1 * inverse)
                out[row, base + 2] = float_to_bf16(acc2 * inverse)
                out[row, base + 3] = float_to_bf16(acc3 * inverse)
            else:
                out_acc[row, head, split, dim] = acc0
                out_acc[row, head, split, dim + 1] = acc1
                out_acc[row, head, split, dim + 2] = acc2
                out_acc[row, head, split, dim + 3] = acc3
                if lane == 0:
                    out_max[row, head, split] = running_max
                    out_sum[row, head, split] = total

    return paged_attention_staged_kernel


_STAGED_KERNELS: dict[int, object] = {}


def staged_kernel(words: int):
    """The staged decode kernel compiled for keys of ``words`` 64-bit words (head dim / 4)."""
    kernel = _STAGED_KERNELS.get(words)
    if kernel is None:
        kernel = _STAGED_KERNELS[words] = _make_staged_kernel(words)
    return kernel


def decode_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, scale: float, sliding_window: int | None, max_context: int, workspace: tuple,
    out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """The staged decode kernel (:func:`staged_kernel`): bf16 ``out [N, nh * d]`` from float32
    ``q [N, nh, d]``, each row attending as a row of its own, on the grid, splits and workspace of
    :func:`metrale.kernels.attention_grouped.launch_decode`; geometries that both this module's and
    :mod:`metrale.kernels.attention_grouped`'s ``supports`` accept."""
    return launch_decode("paged_attention_staged", staged_kernel(q.shape[2] // 4), STAGED_THREADS, q, k_cache,
                         v_cache, block_tables, seq_index, positions, scale, sliding_window, max_context, workspace,
                         out, stream)
