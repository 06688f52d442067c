"""RMSNorm, optionally fused with the residual add, and its zero-centred variant."""

from __future__ import annotations

import numpy as np


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float, weight_offset: float = 0.0) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * (weight_offset + weight)`` over the last axis, float32.

    ``weight_offset`` is 1 for zero-centred norms (Qwen3-Next), 0 otherwise.
    """
    x = np.asarray(x, dtype=np.float32)
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    normed = x / np.sqrt(variance + np.float32(eps))
    return (normed * (np.float32(weight_offset) + weight)).astype(np.float32)


def rmsnorm_residual_reference(
    x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float, weight_offset: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Fused residual add and norm: ``s = x + residual``; returns ``(rmsnorm(s), s)``.

    With ``residual`` None the sum is ``x`` itself (the first layer).
    """
    summed = np.asarray(x, dtype=np.float32) if residual is None else (x + residual).astype(np.float32)
    return rmsnorm_reference(summed, weight, eps, weight_offset), summed


# ------------------------------------------------------------------------------ CUDA kernel

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

from metrale.kernels._device import (  # noqa: E402
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    block_sum,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)

NORM_THREADS = 16 if SIMULATED else 512
KEPT_PER_THREAD = 2 if SIMULATED else 8  # hidden sizes up to 4,096 never re-read the residual


@jit_kernel
def rmsnorm_residual_kernel(x, residual, weight, eps, weight_offset, add_residual, out):
    # Grid: N rows, one block of NORM_THREADS per row; threads stride over H.
    # x [N, H] f32; residual [N, H] f32, updated in place to x + residual (or x when
    # add_residual == 0); weight [H] bf16 bits; out [N, H] bf16 bits = rms(sum) * (offset + w).
    # The first KEPT_PER_THREAD values of each thread stay in registers between the two passes.
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    hidden = x.shape[1]
    partial = cuda.shared.array(NORM_THREADS, float32)
    kept = cuda.local.array(KEPT_PER_THREAD, float32)
    scales = cuda.local.array(KEPT_PER_THREAD, float32)
    acc = float32(0.0)
    # Unconditional loads (indices past the row clamped to its last element, their values
    # dropped), so every thread's loads are in flight together instead of one after another.
    for j in range(KEPT_PER_THREAD):
        i = min(tid + j * NORM_THREADS, hidden - 1)
        value = x[row, i]
        if add_residual:
            value += residual[row, i]
        kept[j] = value
        # The weights too, before the reduction, so their loads overlap the row's.
        scales[j] = weight_offset + bf16_to_float(weight[i])
    for j in range(KEPT_PER_THREAD):
        i = tid + j * NORM_THREADS
        if i < hidden:
            residual[row, i] = kept[j]
            acc += kept[j] * kept[j]
    for i in range(tid + KEPT_PER_THREAD * NORM_THREADS, hidden, NORM_THREADS):
        value = x[row, i]
        if add_residual:
            value += residual[row, i]
        residual[row, i] = value
        acc += value * value
    total = block_sum(partial, tid, acc, NORM_THREADS)
    inv = float32(1.0) / math.sqrt(total / float32(hidden) + eps)
    for j in range(KEPT_PER_THREAD):
        i = tid + j * NORM_THREADS
        if i < hidden:
            out[row, i] = float_to_bf16(kept[j] * inv * scales[j])
    for i in range(tid + KEPT_PER_THREAD * NORM_THREADS, hidden, NORM_THREADS):
        out[row, i] = float_to_bf16(residual[row, i] * inv * (weight_offset + bf16_to_float(weight[i])))


def rmsnorm_residual(
    x: DeviceArray, residual: DeviceArray, weight: DeviceArray, eps: float, weight_offset: float, add_residual: bool,
    out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """``residual <- x (+ residual)``; ``out <- bf16(rmsnorm(residual) * (offset + weight))``."""
    check_array("rmsnorm_residual", "x", x, np.float32, ndim=2)
    rows, hidden = x.shape
    check_array("rmsnorm_residual", "residual", residual, np.float32, (rows, hidden))
    check_array("rmsnorm_residual", "weight", weight, np.uint16, (hidden,))
    check_array("rmsnorm_residual", "out", out, np.uint16, (rows, hidden))
    if rows:
        rmsnorm_residual_kernel[rows, NORM_THREADS, numba_stream(stream)](
            device_view(x), device_view(residual), device_view(weight), np.float32(eps),
            np.float32(weight_offset), np.int32(bool(add_residual)), device_view(out),
        )
    return out
