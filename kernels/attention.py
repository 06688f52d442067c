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

from metrale.kernels.kv_cache_fp8 import cache_blocks, write_cache_rows


def paged_kv_write_reference(
    k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray
) -> None:
    """Store ``k``/``v`` ``[N, num_kv_heads, d]`` at the flat slots ``slot_mapping [N]``, in place
    (quantized, one scale per row and head, into an FP8 cache, :mod:`metrale.kernels.kv_cache_fp8`);
    a row of slot -1 (padding) is not stored, as the kernels skip it."""
    write_cache_rows(k_cache, slot_mapping, k)
    write_cache_rows(v_cache, slot_mapping, v)


def gather_sequence_kv(cache: np.ndarray, block_table: np.ndarray, length: int) -> np.ndarray:
    """Positions ``[0, length)`` of one sequence: ``[length, num_kv_heads, d]`` (float32 from an FP8 cache)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    gathered = cache_blocks(cache, block_table[:num_blocks])
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
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA attention of ``q [N, n_heads, d]`` over the paged cache -> ``[N, n_heads, d_v]``.

    Query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``; softmax in float32. With
    ``softcap`` the logits ``scale * q . k`` become ``softcap * tanh(logit / softcap)`` before the
    mask and the softmax (Gemma-2); with ``sinks [n_heads]`` head ``h``'s softmax has the extra
    logit ``sinks[h]`` in its denominator, whose value is never attended (GPT-OSS).
    """
    n_rows, n_heads, _ = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    out = np.empty((n_rows, n_heads, v_cache.shape[3]), dtype=np.float32)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float32).reshape(n_heads, 1, 1)
    for seq in np.unique(seq_index):
        rows = np.nonzero(seq_index == seq)[0]
        query_pos = positions[rows]
        length = int(query_pos.max()) + 1
        keys = gather_sequence_kv(k_cache, block_tables[seq], length)  # [S, n_kv, d]
        values = gather_sequence_kv(v_cache, block_tables[seq], length)
        keys = np.repeat(keys, group, axis=1).transpose(1, 2, 0)  # [n_heads, d, S]
        values = np.repeat(values, group, axis=1).transpose(1, 0, 2)  # [n_heads, S, d_v]
        scores = (q[rows].transpose(1, 0, 2) @ keys) * np.float32(scale)  # [n_heads, R, S]
        if softcap:
            scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
        key_pos = np.arange(length)[None, :]
        visible = key_pos <= query_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos > query_pos[:, None] - sliding_window
        scores = np.where(visible[None], scores, -np.inf).astype(np.float32)
        best = scores.max(axis=-1, keepdims=True)
        if sink is not None:
            best = np.maximum(best, sink)
        weights = np.exp(scores - best)
        denominator = weights.sum(axis=-1, keepdims=True)
        if sink is not None:
            denominator += np.exp(sink - best)
        out[rows] = ((weights / denominator) @ values).transpose(1, 0, 2)
    return out


# ------------------------------------------------------------------------------ CUDA kernels

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

from metrale.errors import KernelArgumentError  # noqa: E402
from metrale.kernels._device import (  # noqa: E402
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    block_max,
    block_sum,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)

ATTENTION_THREADS = 16 if SIMULATED else 128
# Keys per split of the per-head kernel (small, so short contexts still fill the GPU).
SPLIT_SIZE = 8 if SIMULATED else 64
KEY_TILE = 4 if SIMULATED else 32  # keys staged in shared memory at a time
DOT_PARTS = ATTENTION_THREADS // KEY_TILE  # threads that share one key's dot product
MAX_ATTENTION_HEAD_DIM = 256
TILE_STRIDE = MAX_ATTENTION_HEAD_DIM + 1  # padded row: the dot products read columns bank-free
TILE_ELEMENTS = KEY_TILE * TILE_STRIDE  # one name: numba needs a constant shared-array size
NEGATIVE_INFINITY = -math.inf


@jit_kernel
def paged_attention_split_kernel(
    q, k_cache, v_cache, block_tables, seq_index, positions, scale, sliding_window, softcap, sinks, has_sinks,
    out_acc, out_max, out_sum
):
    # Grid: (N rows, n_heads, splits); block ATTENTION_THREADS threads. Block (row, head, split)
    # covers keys [split * SPLIT_SIZE, +SPLIT_SIZE) of its sequence, clipped to the row's causal
    # (and sliding-window) range, and writes an unnormalised partial: out_max [N, nh, splits]
    # (the running max), out_sum (sum of exp), out_acc [N, nh, splits, dv] (exp-weighted V).
    # Keys are staged KEY_TILE at a time in shared memory with coalesced loads: for scores,
    # DOT_PARTS threads share each key's dot product; for values, thread t accumulates dims
    # t, t + threads, ... over the staged keys. softcap > 0 caps the scores (softcap * tanh(s /
    # softcap)); with has_sinks, split 0 counts sinks[head] as one more score whose value is zero,
    # so the merge of the splits adds it to the denominator once.
    # q [N, nh, d] f32; caches [blocks, block_size, nkv, d] bf16 bits; block_tables [S, max_blocks].
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    split = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    head_dim = q.shape[2]
    value_dim = v_cache.shape[3]
    kv_head = head // (q.shape[1] // k_cache.shape[2])
    block_size = k_cache.shape[1]
    position = positions[row]
    seq = seq_index[row]
    first = split * SPLIT_SIZE
    lo = first
    hi = min(first + SPLIT_SIZE, position + 1)
    if sliding_window > 0:
        lo = max(lo, position - sliding_window + 1)
    if lo >= hi:
        for i in range(tid, value_dim, ATTENTION_THREADS):
            out_acc[row, head, split, i] = 0.0
        if tid == 0:
            sink_here = has_sinks != 0 and split == 0
            out_max[row, head, split] = sinks[head] if sink_here else NEGATIVE_INFINITY
            out_sum[row, head, split] = 1.0 if sink_here else 0.0
        return
    query = cuda.shared.array(MAX_ATTENTION_HEAD_DIM, float32)
    scores = cuda.shared.array(SPLIT_SIZE, float32)
    partial = cuda.shared.array(ATTENTION_THREADS, float32)
    tile = cuda.shared.array(TILE_ELEMENTS, float32)
    for i in range(tid, head_dim, ATTENTION_THREADS):
        query[i] = q[row, head, i] * scale
    cuda.syncthreads()
    # Scores.
    key_in_tile = tid // DOT_PARTS
    part = tid % DOT_PARTS
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        for e in range(tid, count * head_dim, ATTENTION_THREADS):
            key = start + e // head_dim
            block = block_tables[seq, key // block_size]
            tile[(e // head_dim) * TILE_STRIDE + e % head_dim] = bf16_to_float(
                k_cache[block, key % block_size, kv_head, e % head_dim]
            )
        cuda.syncthreads()
        dot = float32(0.0)
        if key_in_tile < count:
            for i in range(part, head_dim, DOT_PARTS):
                dot += query[i] * tile[key_in_tile * TILE_STRIDE + i]
        partial[tid] = dot
        cuda.syncthreads()
        if part == 0 and key_in_tile < count:
            total_dot = float32(0.0)
            for p in range(DOT_PARTS):
                total_dot += partial[tid + p]
            if softcap > 0.0:
                total_dot = softcap * math.tanh(total_dot / softcap)
            scores[start - first + key_in_tile] = total_dot
        cuda.syncthreads()
    local_max = float32(NEGATIVE_INFINITY)
    for key in range(lo + tid, hi, ATTENTION_THREADS):
        local_max = max(local_max, scores[key - first])
    best = block_max(partial, tid, local_max, ATTENTION_THREADS)
    sink_here = has_sinks != 0 and split == 0
    if sink_here:
        best = max(best, sinks[head])
    local_sum = float32(0.0)
    for key in range(lo + tid, hi, ATTENTION_THREADS):
        weight = math.exp(scores[key - first] - best)
        scores[key - first] = weight
        local_sum += weight
    total = block_sum(partial, tid, local_sum, ATTENTION_THREADS)
    if sink_here:
        total += math.exp(sinks[head] - best)
    # Values: registers hold dims tid, tid + threads (value_dim <= 2 * threads).
    acc0 = float32(0.0)
    acc1 = float32(0.0)
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        for e in range(tid, count * value_dim, ATTENTION_THREADS):
            key = start + e // value_dim
            block = block_tables[seq, key // block_size]
            tile[(e // value_dim) * TILE_STRIDE + e % value_dim] = bf16_to_float(
                v_cache[block, key % block_size, kv_head, e % value_dim]
            )
        cuda.syncthreads()
        for k in range(count):
            weight = scores[start - first + k]
            if tid < value_dim:
                acc0 += weight * tile[k * TILE_STRIDE + tid]
            if tid + ATTENTION_THREADS < value_dim:
                acc1 += weight * tile[k * TILE_STRIDE + tid + ATTENTION_THREADS]
        cuda.syncthreads()
    if tid < value_dim:
        out_acc[row, head, split, tid] = acc0
    if tid + ATTENTION_THREADS < value_dim:
        out_acc[row, head, split, tid + ATTENTION_THREADS] = acc1
    if tid == 0:
        out_max[row, head, split] = best
        out_sum[row, head, split] = total


@jit_kernel
def attention_combine_kernel(out_acc, out_max, out_sum, out):
    # Grid: (N rows, n_heads); threads over dv. Merges the split partials by log-sum-exp and
    # writes bf16 bits to out [N, n_heads * dv].
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    splits = out_max.shape[2]
    value_dim = out_acc.shape[3]
    best = float32(NEGATIVE_INFINITY)
    for s in range(splits):
        best = max(best, out_max[row, head, s])
    denominator = float32(0.0)
    for s in range(splits):
        if out_sum[row, head, s] > 0.0:
            denominator += math.exp(out_max[row, head, s] - best) * out_sum[row, head, s]
    for i in range(tid, value_dim, ATTENTION_THREADS):
        numerator = float32(0.0)
        for s in range(splits):
            if out_sum[row, head, s] > 0.0:
                numerator += math.exp(out_max[row, head, s] - best) * out_acc[row, head, s, i]
        value = numerator / denominator if denominator > 0.0 else float32(0.0)
        out[row, head * value_dim + i] = float_to_bf16(value)


def attention_splits(max_context: int) -> int:
    """Key splits the per-head kernel needs for contexts of up to ``max_context`` tokens."""
    return max(1, -(-int(max_context) // SPLIT_SIZE))


def decode_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, scale: float, sliding_window: int | None, max_context: int, workspace: tuple,
    out: DeviceArray, stream: object = None, softcap: float | None = None, sinks: DeviceArray | None = None,
) -> DeviceArray:
    """The per-head CUDA-core kernels (:func:`paged_attention_split_kernel`, then
    :func:`attention_combine_kernel`): :func:`paged_attention_reference` of each row ``i`` of ``q``
    (its sequence ``seq_index[i]``, its position ``positions[i]``), bf16 ``out [N, nh * dv]``.
    Any geometry of whole query-head groups with heads of at most 256 dims; any row, attending as a
    row of its own.

    ``max_context`` bounds every row's position + 1 (it fixes the number of key splits,
    :func:`attention_splits`, so a captured graph stays valid for any shorter context);
    ``workspace`` is ``(acc, max, sum)`` of shapes ``[N, nh, splits, dv]``, ``[N, nh, splits]``,
    ``[N, nh, splits]`` float32. ``softcap`` (a positive number, or None) caps the logits;
    ``sinks`` (float32 ``[nh]``, or None) adds a sink logit to each head's softmax.
    """
    op = "paged_attention"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    check_array(op, "k_cache", k_cache, np.uint16, (None, None, None, head_dim))
    kv_heads, value_dim = k_cache.shape[2], v_cache.shape[3]
    check_array(op, "v_cache", v_cache, np.uint16, (k_cache.shape[0], k_cache.shape[1], kv_heads, None))
    if (
        heads % kv_heads
        or head_dim > MAX_ATTENTION_HEAD_DIM
        or value_dim > min(MAX_ATTENTION_HEAD_DIM, 2 * ATTENTION_THREADS)
    ):
        raise KernelArgumentError(f"{op}: q {list(q.shape)} with caches {list(k_cache.shape)} is unsupported")
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    if sinks is not None:
        check_array(op, "sinks", sinks, np.float32, (heads,))
    if softcap is not None and not softcap >= 0:
        raise KernelArgumentError(f"{op}: softcap must be positive (or None), got {softcap}")
    splits = attention_splits(max_context)
    acc, best, total = workspace
    check_array(op, "workspace acc", acc, np.float32, (rows, heads, splits, value_dim))
    check_array(op, "workspace max", best, np.float32, (rows, heads, splits))
    check_array(op, "workspace sum", total, np.float32, (rows, heads, splits))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if not rows:
        return out
    launch = numba_stream(stream)
    # Without sinks the kernel still takes an array (never read): one element of q.
    sink_values = sinks if sinks is not None else q.reshape(-1)[:1]
    paged_attention_split_kernel[(rows, heads, splits), ATTENTION_THREADS, launch](
        device_view(q), device_view(k_cache), device_view(v_cache), device_view(block_tables),
        device_view(seq_index), device_view(positions), np.float32(scale), np.int32(sliding_window or 0),
        np.float32(softcap or 0.0), device_view(sink_values), np.int32(sinks is not None),
        device_view(acc), device_view(best), device_view(total),
    )
    attention_combine_kernel[(rows, heads), ATTENTION_THREADS, launch](
        device_view(acc), device_view(best), device_view(total), device_view(out)
    )
    return out
