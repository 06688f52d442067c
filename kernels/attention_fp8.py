"""The paged attention of an FP8 KV cache on the GPU (numba CUDA kernels): writing rows into an
:class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray` and attending over one.

* :func:`write_fp8_rows` -- the rows ``[N, kv_heads, d]`` (float32, or bf16 bits) into the cache
  slots ``slot_mapping`` (padding rows, slot -1, skipped): a block per (row, head) reduces the
  row's largest magnitude, takes ``scale = amax / 448`` (or the cache's static scale) and writes
  each value's E4M3 code (round to nearest, ties to the even code, saturating at 448) and the
  scale, as :meth:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray.quantize` does;
* :func:`decode_attention` -- the per-head split kernel of :mod:`metrale.kernels.attention` reading
  ``code * scale`` where it reads bf16, with the same logit soft cap, sinks, sliding windows and
  split partials (merged by :func:`metrale.kernels.attention.attention_combine_kernel`). Prompt
  rows take it a row at a time.

Each key and value row is read as one byte a value plus its scale: half the bytes of a bf16 cache.
:func:`metrale.kernels.attention.paged_attention_reference` over the dequantized cache is the
reference; the kernels run under numba's CUDA simulator in CI.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    DeviceArray,
    bf16_to_float,
    bits_to_float,
    block_max,
    block_sum,
    check_array,
    device_view,
    float_to_bits,
    jit_kernel,
    numba_stream,
)
from metrale.kernels.attention import (
    ATTENTION_THREADS,
    DOT_PARTS,
    KEY_TILE,
    MAX_ATTENTION_HEAD_DIM,
    NEGATIVE_INFINITY,
    SPLIT_SIZE,
    TILE_ELEMENTS,
    TILE_STRIDE,
    attention_combine_kernel,
    attention_splits,
)
from metrale.kernels.kv_cache_fp8 import Fp8CacheArray
from metrale.kernels.quantized import FP8_E4M3_MAX

WRITE_THREADS = 32
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


@cuda.jit(device=True)
def e4m3_value(code):
    """The float32 value of an E4M3 code (uint8)."""
    exponent = (uint32(code) >> uint32(3)) & uint32(15)
    mantissa = uint32(code) & uint32(7)
    if exponent == 0:
        magnitude = float32(mantissa) * float32(0.001953125)
    else:
        magnitude = bits_to_float(((exponent + uint32(120)) << uint32(23)) | (mantissa << uint32(20)))
    return -magnitude if (uint32(code) & uint32(0x80)) != 0 else magnitude


@cuda.jit(device=True)
def e4m3_code(value):
    """The E4M3 code of ``value``: nearest, ties to the even code, saturating at +-448."""
    magnitude = min(abs(value), float32(FP8_E4M3_MAX))
    if magnitude < float32(0.015625):
        scaled = magnitude * float32(512.0)  # subnormal codes: steps of 2**-9 (exact)
        code = uint32(math.floor(scaled + float32(0.5)))
        if float32(code) - scaled == float32(0.5) and (code & uint32(1)) != 0:
            code -= uint32(1)  # an exact tie rounds to the even code
    else:
        bits = float_to_bits(magnitude)
        rounded = (bits + uint32(0x7FFFF) + ((bits >> uint32(20)) & uint32(1))) & uint32(0xFFF00000)
        code = ((((rounded >> uint32(23)) - uint32(120)) << uint32(3)) | ((rounded >> uint32(20)) & uint32(7)))
    if (float_to_bits(value) >> uint32(31)) != 0:  # the sign bit: -0.0 keeps it, as the host's encoder
        code |= uint32(0x80)
    return np.uint8(code)


@jit_kernel
def write_fp8_rows_kernel(rows, rows_are_bits, slot_mapping, codes, scales, static_scale):
    # Grid (N rows, kv_heads); WRITE_THREADS threads. rows [N, kv_heads, d] float32, or uint16 bf16
    # bits (rows_are_bits); codes [blocks, block_size, kv_heads, d] uint8; scales [blocks,
    # block_size, kv_heads] float32; static_scale > 0 replaces the row's own scale.
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    slot = slot_mapping[row]
    if slot < 0:
        return
    width = codes.shape[3]
    block_size = codes.shape[1]
    partial = cuda.shared.array(WRITE_THREADS, float32)
    amax = float32(0.0)
    for i in range(tid, width, WRITE_THREADS):
        value = bf16_to_float(rows[row, head, i]) if rows_are_bits != 0 else rows[row, head, i]
        amax = max(amax, abs(value))
    amax = block_max(partial, tid, amax, WRITE_THREADS)
    # The host's rule (Fp8CacheArray.quantize): amax / 448, floored at the smallest normal float32;
    # an all-zero row keeps scale 1.
    scale = max(amax / float32(FP8_E4M3_MAX), float32(SMALLEST_NORMAL)) if amax > 0.0 else float32(1.0)
    if static_scale > 0.0:
        scale = static_scale
    block = slot // block_size
    offset = slot % block_size
    for i in range(tid, width, WRITE_THREADS):
        value = bf16_to_float(rows[row, head, i]) if rows_are_bits != 0 else rows[row, head, i]
        codes[block, offset, head, i] = e4m3_code(value / scale)
    if tid == 0:
        scales[block, offset, head] = scale


def write_fp8_rows(rows: DeviceArray, slot_mapping: DeviceArray, cache: Fp8CacheArray, stream: object = None) -> None:
    """Quantize ``rows [N, kv_heads, d]`` (float32 or bf16 bits) into ``cache``'s slots ``slot_mapping``
    (the module docstring)."""
    op = "write_fp8_rows"
    check_array(op, "slot_mapping", slot_mapping, np.int32, ndim=1)
    count = slot_mapping.shape[0]
    check_array(op, "codes", cache.codes, np.uint8, ndim=4)
    _, _, kv_heads, width = cache.codes.shape
    check_array(op, "scales", cache.scales, np.float32, tuple(cache.codes.shape[:3]))
    bits = rows.dtype == np.uint16
    check_array(op, "rows", rows, np.uint16 if bits else np.float32, (count, kv_heads, width))
    if not count:
        return
    write_fp8_rows_kernel[(count, kv_heads), WRITE_THREADS, numba_stream(stream)](
        device_view(rows), np.int32(bits), device_view(slot_mapping), device_view(cache.codes),
        device_view(cache.scales), np.float32(cache.static_scale or 0.0))


@jit_kernel
def fp8_attention_split_kernel(
    q, k_codes, k_scales, v_codes, v_scales, block_tables, seq_index, positions, scale, sliding_window, softcap, sinks,
    has_sinks, out_acc, out_max, out_sum
):
    # paged_attention_split_kernel (metrale.kernels.attention) over an FP8 cache: each staged key
    # and value element is code * its row's scale. Grid (N rows, n_heads, splits).
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    split = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    head_dim = q.shape[2]
    value_dim = v_codes.shape[3]
    kv_head = head // (q.shape[1] // k_codes.shape[2])
    block_size = k_codes.shape[1]
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
    key_in_tile = tid // DOT_PARTS
    part = tid % DOT_PARTS
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        for e in range(tid, count * head_dim, ATTENTION_THREADS):
            key = start + e // head_dim
            block = block_tables[seq, key // block_size]
            offset = key % block_size
            tile[(e // head_dim) * TILE_STRIDE + e % head_dim] = (
                e4m3_value(k_codes[block, offset, kv_head, e % head_dim]) * k_scales[block, offset, kv_head])
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
    acc0 = float32(0.0)
    acc1 = float32(0.0)
    for start in range(lo, hi, KEY_TILE):
        count = min(KEY_TILE, hi - start)
        for e in range(tid, count * value_dim, ATTENTION_THREADS):
            key = start + e // value_dim
            block = block_tables[seq, key // block_size]
            offset = key % block_size
            tile[(e // value_dim) * TILE_STRIDE + e % value_dim] = (
                e4m3_value(v_codes[block, offset, kv_head, e % value_dim]) * v_scales[block, offset, kv_head])
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


def decode_attention(
    q: DeviceArray, k_cache: Fp8CacheArray, v_cache: Fp8CacheArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, scale: float, sliding_window: int | None, max_context: int, workspace: tuple,
    out: DeviceArray, stream: object = None, softcap: float | None = None, sinks: DeviceArray | None = None,
) -> DeviceArray:
    """:func:`metrale.kernels.attention.decode_attention` over FP8 caches: every row of ``q [N, nh,
    d]`` (float32) attending as a row of its own, bf16 bits ``out [N, nh * dv]``; ``workspace`` the
    split partials ``(acc [N, nh, splits, dv], max [N, nh, splits], sum [N, nh, splits])``."""
    op = "paged_attention (FP8 cache)"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    check_array(op, "k codes", k_cache.codes, np.uint8, (None, None, None, head_dim))
    kv_heads, value_dim = k_cache.codes.shape[2], v_cache.codes.shape[3]
    check_array(op, "v codes", v_cache.codes, np.uint8, (k_cache.codes.shape[0], k_cache.codes.shape[1], kv_heads, None))
    check_array(op, "k scales", k_cache.scales, np.float32, tuple(k_cache.codes.shape[:3]))
    check_array(op, "v scales", v_cache.scales, np.float32, tuple(v_cache.codes.shape[:3]))
    if heads % kv_heads or head_dim > MAX_ATTENTION_HEAD_DIM or value_dim > min(MAX_ATTENTION_HEAD_DIM,
                                                                                    2 * ATTENTION_THREADS):
        raise KernelArgumentError(f"{op}: q {list(q.shape)} with caches {list(k_cache.codes.shape)} is unsupported")
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    if sinks is not None:
        check_array(op, "sinks", sinks, np.float32, (heads,))
    splits = attention_splits(max_context)
    acc, best, total = workspace
    check_array(op, "workspace acc", acc, np.float32, (rows, heads, splits, value_dim))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if not rows:
        return out
    launch = numba_stream(stream)
    sink_values = sinks if sinks is not None else q.reshape(-1)[:1]
    fp8_attention_split_kernel[(rows, heads, splits), ATTENTION_THREADS, launch](
        device_view(q), device_view(k_cache.codes), device_view(k_cache.scales), device_view(v_cache.codes),
        device_view(v_cache.scales), device_view(block_tables), device_view(seq_index), device_view(positions),
        np.float32(scale), np.int32(sliding_window or 0), np.float32(softcap or 0.0), device_view(sink_values),
        np.int32(sinks is not None), device_view(acc), device_view(best), device_view(total),
    )
    attention_combine_kernel[(rows, heads), ATTENTION_THREADS, launch](
        device_view(acc), device_view(best), device_view(total), device_view(out)
    )
    return out
