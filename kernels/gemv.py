"""Matrix-vector products for decode batches of a few rows: ``y = x W^T`` with bf16 inputs.

The NumPy reference is :func:`metrale.kernels.linear.linear_reference`. One warp computes one
output column for every row of ``x``: its lanes stream the weight row as 64-bit words (four bf16
values each), ``GEMV_UNROLL`` words per lane issued before any is used, and reduce with warp
shuffles. ``gemv_silu_kernel`` fuses the SwiGLU gate: for a stacked ``[gate; up]`` weight the
warp of column ``c`` reads gate row ``c`` and up row ``I + c`` and writes ``silu(g) * u`` as bf16.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bits_to_float,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)

GEMV_WARPS = 2 if SIMULATED else 8  # warps per block, one output column each
GEMV_UNROLL = 2 if SIMULATED else 8  # 64-bit weight words in flight per lane
MAX_GEMV_ROWS = 4  # rows of x one launch serves
# Lanes per output column. The simulator has no warp shuffles, so there one thread serves a
# column and the reduction loop below is empty.
WARP = 1 if SIMULATED else 32
FULL_MASK = 0xFFFFFFFF


@cuda.jit(device=True)
def dot_words(w, x):
    # Dot product of two 64-bit words of four bf16 values each (low half first).
    w_lo = uint32(w & uint64(0xFFFFFFFF))
    w_hi = uint32(w >> uint64(32))
    x_lo = uint32(x & uint64(0xFFFFFFFF))
    x_hi = uint32(x >> uint64(32))
    mask = uint32(0xFFFF0000)
    return (
        bits_to_float(w_lo << uint32(16)) * bits_to_float(x_lo << uint32(16))
        + bits_to_float(w_lo & mask) * bits_to_float(x_lo & mask)
        + bits_to_float(w_hi << uint32(16)) * bits_to_float(x_hi << uint32(16))
        + bits_to_float(w_hi & mask) * bits_to_float(x_hi & mask)
    )


@cuda.jit(device=True)
def row_dots(x_words, w_words, column, lane, acc):
    # acc[r] <- this lane's share of dot(x[r], W[column]) for r < rows; then the warp's sum.
    rows = x_words.shape[0]
    words = w_words.shape[1]
    for r in range(MAX_GEMV_ROWS):
        acc[r] = float32(0.0)
    loaded = cuda.local.array(GEMV_UNROLL, uint64)
    for base in range(lane, words, WARP * GEMV_UNROLL):
        for u in range(GEMV_UNROLL):
            index = base + u * WARP
            if index < words:
                loaded[u] = w_words[column, index]
        for u in range(GEMV_UNROLL):
            index = base + u * WARP
            if index < words:
                for r in range(MAX_GEMV_ROWS):
                    if r < rows:
                        acc[r] += dot_words(loaded[u], x_words[r, index])
    for r in range(MAX_GEMV_ROWS):
        if r < rows:
            value = acc[r]
            offset = WARP // 2
            while offset > 0:
                value += cuda.shfl_down_sync(FULL_MASK, value, offset)
                offset //= 2
            acc[r] = value


@jit_kernel
def gemv_kernel(x_words, w_words, out):
    # Grid: ceil(M / GEMV_WARPS) blocks of GEMV_WARPS warps; warp -> output column.
    # x_words [N, K/4] uint64 (bf16 bits), w_words [M, K/4] uint64, out [N, M] f32; N <= MAX_GEMV_ROWS.
    column = cuda.blockIdx.x * GEMV_WARPS + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    if column >= w_words.shape[0]:
        return
    acc = cuda.local.array(MAX_GEMV_ROWS, float32)
    row_dots(x_words, w_words, column, lane, acc)
    if lane == 0:
        for r in range(MAX_GEMV_ROWS):
            if r < x_words.shape[0]:
                out[r, column] = acc[r]


@jit_kernel
def gemv_silu_kernel(x_words, w_words, out):
    # Grid: ceil(I / GEMV_WARPS) blocks; warp -> column c of out [N, I] bf16 bits, from gate row c
    # and up row I + c of w_words [2I, K/4].
    column = cuda.blockIdx.x * GEMV_WARPS + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    width = out.shape[1]
    if column >= width:
        return
    gate = cuda.local.array(MAX_GEMV_ROWS, float32)
    up = cuda.local.array(MAX_GEMV_ROWS, float32)
    row_dots(x_words, w_words, column, lane, gate)
    row_dots(x_words, w_words, width + column, lane, up)
    if lane == 0:
        for r in range(MAX_GEMV_ROWS):
            if r < x_words.shape[0]:
                g = gate[r]
                out[r, column] = float_to_bf16(g / (float32(1.0) + math.exp(-g)) * up[r])


def supports(rows: int, inner: int) -> bool:
    """Whether the GEMV kernels take ``x [rows, inner]`` (else cuBLAS runs)."""
    return 0 < rows <= MAX_GEMV_ROWS and inner % 4 == 0


def _words(op: str, x: DeviceArray, weight: DeviceArray) -> tuple[DeviceArray, DeviceArray]:
    check_array(op, "x", x, np.uint16, ndim=2)
    rows, inner = x.shape
    check_array(op, "weight", weight, np.uint16, (None, inner))
    if not supports(rows, inner):
        raise KernelArgumentError(f"{op}: x has shape {[rows, inner]}; needs 1..{MAX_GEMV_ROWS} rows and a width divisible by 4")
    return x.view(np.uint64), weight.view(np.uint64)


def gemv(x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out [N, M] <- x [N, K] @ weight [M, K]^T`` (bf16 bits in, float32 out), N <= MAX_GEMV_ROWS."""
    x_words, w_words = _words("gemv", x, weight)
    check_array("gemv", "out", out, np.float32, (x.shape[0], weight.shape[0]))
    blocks = -(-weight.shape[0] // GEMV_WARPS)
    gemv_kernel[blocks, GEMV_WARPS * WARP, numba_stream(stream)](device_view(x_words), device_view(w_words), device_view(out))
    return out


def gemv_silu(x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out [N, I] <- bf16(silu(x W_gate^T) * (x W_up^T))`` for ``weight = [W_gate; W_up] [2I, K]``."""
    x_words, w_words = _words("gemv_silu", x, weight)
    if weight.shape[0] % 2:
        raise KernelArgumentError(f"gemv_silu: weight has {weight.shape[0]} rows, expected an even count")
    check_array("gemv_silu", "out", out, np.uint16, (x.shape[0], weight.shape[0] // 2))
    blocks = -(-out.shape[1] // GEMV_WARPS)
    launch = gemv_silu_kernel[blocks, GEMV_WARPS * WARP, numba_stream(stream)]
    launch(device_view(x_words), device_view(w_words), device_view(out))
    return out
