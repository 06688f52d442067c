"""Absorbed MLA decode attention over the paged latent cache (FAMILIES.md §2.3, the absorbed form).

Each cached token holds one latent row ``[c (r) | k_pe (d_r)]`` (bf16). A decode row's query heads
come already projected into the latent space, ``q = [q_latent (r) | q_pe (d_r)]`` float32, so

    score(h, j) = scale * q[h] . latent_j        value(j) = latent_j[:r]

-- multi-query attention with one key/value row per token shared by every head. The result per
head is ``sum_j softmax_j * c_j`` ``[r]``; the value half of ``kv_b_proj`` is applied after.

Kernel: grid ``(rows, head blocks, splits)``; a block of ``LATENT_WARPS`` warps serves that many
heads, one warp per head, over its split of the row's keys. The keys go through shared memory in
chunks of ``CHUNK_KEYS`` cache rows (bf16 pairs as 32-bit words; every thread loads its share,
coalesced), so one row read from memory serves all the block's heads. Lane ``l`` of a warp holds
the query words ``l, l + WARP, ...`` and the value words likewise; a key's score is the warp sum
of the lanes' partial dot products, followed by an online softmax. Each block writes unnormalised
partials; :func:`metrale.kernels.attention_grouped.grouped_combine_kernel` merges the splits into
bf16 ``[rows, heads * r]``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from metrale.kernels._device import SIMULATED, bits_to_float, check_array, device_view, numba_stream
from metrale.kernels.attention_grouped import COMBINE_THREADS, MAX_SPLITS, grouped_combine_kernel, warp_sum

WARP = 8 if SIMULATED else 32
LATENT_WARPS = 2 if SIMULATED else 8  # heads per block
LATENT_THREADS = WARP * LATENT_WARPS
CHUNK_KEYS = 4 if SIMULATED else 16
#: Widest latent row (r + d_r) in 32-bit words: 576 values, DeepSeek-V2 / V3's 512 + 64.
MAX_ROW_WORDS = 288
LANE_WORDS = MAX_ROW_WORDS // WARP  # query (and value) words a lane holds at most
LANE_FLOATS = 2 * LANE_WORDS
SCRATCH = LATENT_THREADS
NEGATIVE_INFINITY = -math.inf
#: Keys per split at least, and the blocks the grid aims at (as the grouped decode kernel).
MIN_SPLIT_KEYS = 4 if SIMULATED else 64
TARGET_BLOCKS = 64 if SIMULATED else 512


def latent_attention_reference(
    q: np.ndarray, latent: np.ndarray, block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
    value_dim: int, scale: float,
) -> np.ndarray:
    """``[N, heads, value_dim]`` float32 for ``q [N, heads, width]`` over the float32 latent cache
    ``[blocks, block_size, width]``; row i sees its sequence's positions ``0..positions[i]``."""
    block_size = latent.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], value_dim), dtype=np.float32)
    for row in range(q.shape[0]):
        context = int(positions[row]) + 1
        table = block_tables[seq_index[row]]
        keys = np.stack([latent[table[j // block_size], j % block_size] for j in range(context)]).astype(np.float64)
        scores = (q[row].astype(np.float64) @ keys.T) * scale
        scores -= scores.max(axis=1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=1, keepdims=True)
        out[row] = (weights @ keys[:, :value_dim]).astype(np.float32)
    return out


def split_count(rows: int, heads: int, max_context: int) -> int:
    """Key splits per row: enough blocks to fill the GPU, at least MIN_SPLIT_KEYS keys each."""
    blocks = max(1, rows * -(-heads // LATENT_WARPS))
    wanted = -(-TARGET_BLOCKS // blocks)
    return max(1, min(wanted, MAX_SPLITS, -(-int(max_context) // MIN_SPLIT_KEYS)))


@cuda.jit(device=True)
def low_half(word):
    return bits_to_float(word << uint32(16))


@cuda.jit(device=True)
def high_half(word):
    return bits_to_float(word & uint32(0xFFFF0000))


@cuda.jit(cache=True)
def latent_attention_kernel(q, latent_words, block_tables, seq_index, positions, scale, value_words,
                            out_acc, out_max, out_sum):
    # q [N, nh, width] f32; latent_words [blocks, block_size, width / 2] uint32 (bf16 pairs);
    # block_tables [S, max_blocks] int32; seq_index, positions [N] int32; value_words = r / 2.
    # out_acc [N, nh, splits, r] f32 (exp-weighted latents), out_max / out_sum [N, nh, splits].
    row = cuda.blockIdx.x
    head_block = cuda.blockIdx.y
    split = cuda.blockIdx.z
    splits = cuda.gridDim.z
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = tid % WARP
    heads = q.shape[1]
    row_words = latent_words.shape[2]
    block_size = latent_words.shape[1]
    head = head_block * LATENT_WARPS + warp
    active = head < heads
    chunk = cuda.shared.array((CHUNK_KEYS, MAX_ROW_WORDS), uint32)
    scratch = cuda.shared.array(SCRATCH, float32)
    query = cuda.local.array(LANE_FLOATS, float32)
    acc = cuda.local.array(LANE_FLOATS, float32)
    for i in range(LANE_WORDS):
        word = lane + i * WARP
        query[2 * i] = float32(0.0)
        query[2 * i + 1] = float32(0.0)
        acc[2 * i] = float32(0.0)
        acc[2 * i + 1] = float32(0.0)
        if active and word < row_words:
            query[2 * i] = q[row, head, 2 * word] * scale
            query[2 * i + 1] = q[row, head, 2 * word + 1] * scale
    seq = seq_index[row]
    context = positions[row] + 1
    per_split = (context + splits - 1) // splits
    lo = split * per_split
    hi = min(context, lo + per_split)
    running_max = float32(NEGATIVE_INFINITY)
    total = float32(0.0)
    start = lo
    while start < hi:
        count = min(CHUNK_KEYS, hi - start)
        cuda.syncthreads()
        for e in range(tid, count * row_words, LATENT_THREADS):
            key = start + e // row_words
            block = block_tables[seq, key // block_size]
            chunk[e // row_words, e % row_words] = latent_words[block, key % block_size, e % row_words]
        cuda.syncthreads()
        for k in range(count):
            partial = float32(0.0)
            for i in range(LANE_WORDS):
                word = lane + i * WARP
                if word < row_words:
                    bits = chunk[k, word]
                    partial += query[2 * i] * low_half(bits) + query[2 * i + 1] * high_half(bits)
            score = warp_sum(scratch, tid, lane, partial)
            if score > running_max:
                correction = math.exp(running_max - score) if running_max > NEGATIVE_INFINITY else float32(0.0)
                running_max = score
                total = total * correction + float32(1.0)
                weight = float32(1.0)
                for i in range(LANE_WORDS):
                    acc[2 * i] *= correction
                    acc[2 * i + 1] *= correction
            else:
                weight = math.exp(score - running_max)
                total += weight
            for i in range(LANE_WORDS):
                word = lane + i * WARP
                if word < value_words:
                    bits = chunk[k, word]
                    acc[2 * i] += weight * low_half(bits)
                    acc[2 * i + 1] += weight * high_half(bits)
        start += count
    if active:
        for i in range(LANE_WORDS):
            word = lane + i * WARP
            if word < value_words:
                out_acc[row, head, split, 2 * word] = acc[2 * i]
                out_acc[row, head, split, 2 * word + 1] = acc[2 * i + 1]
        if lane == 0:
            out_max[row, head, split] = running_max
            out_sum[row, head, split] = total


def latent_attention(
    q: object, latent: object, block_tables: object, seq_index: object, positions: object, value_dim: int,
    scale: float, max_context: int, out: object, stream: object = None,
) -> object:
    """Launch :func:`latent_attention_kernel` and the split merge: bf16 bits ``out [N, heads * r]``.

    ``latent`` is the bf16 cache ``[blocks, block_size, width]`` (uint16); ``value_dim`` = r.
    """
    op = "latent_attention"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, width = q.shape
    check_array(op, "latent", latent, np.uint16, (None, None, width))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if width % 2 or value_dim % 2 or width // 2 > MAX_ROW_WORDS or value_dim > width:
        raise ValueError(f"latent width {width} / value dim {value_dim} must be even, value dim <= width, "
                         f"width <= {2 * MAX_ROW_WORDS}")
    if not rows:
        return out
    import cupy

    splits = split_count(rows, heads, max_context)
    out_acc = cupy.empty((rows, heads, splits, value_dim), dtype=np.float32)
    out_max = cupy.empty((rows, heads, splits), dtype=np.float32)
    out_sum = cupy.empty((rows, heads, splits), dtype=np.float32)
    words = latent.view(np.uint32)
    launch_stream = numba_stream(stream)
    latent_attention_kernel[(rows, -(-heads // LATENT_WARPS), splits), LATENT_THREADS, launch_stream](
        device_view(q), device_view(words), device_view(block_tables), device_view(seq_index),
        device_view(positions), np.float32(scale), np.int32(value_dim // 2), device_view(out_acc),
        device_view(out_max), device_view(out_sum),
    )
    grouped_combine_kernel[(rows, heads), COMBINE_THREADS, launch_stream](
        device_view(out_acc), device_view(out_max), device_view(out_sum), device_view(out),
    )
    return out
