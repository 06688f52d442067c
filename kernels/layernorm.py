"""LayerNorm (``torch.nn.LayerNorm``: mean-centred, biased variance, optional bias), optionally
fused with the residual add."""

from __future__ import annotations

import numpy as np


def layernorm_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps) * weight (+ bias)`` over the last axis, float32.

    ``var`` is the biased variance (divided by the width), as ``torch.nn.LayerNorm`` computes it.
    Evaluated in float64 and rounded once: in float32, ``x - mean`` alone is off by half an ulp of
    the mean, which is 1e-5 of the result for rows of mean 40 and spread 0.05.
    """
    x = np.asarray(x, dtype=np.float64)
    centred = x - np.mean(x, axis=-1, keepdims=True)
    variance = np.mean(centred * centred, axis=-1, keepdims=True)
    out = centred / np.sqrt(variance + float(eps)) * np.asarray(weight, dtype=np.float32)
    if bias is not None:
        out = out + np.asarray(bias, dtype=np.float32)
    return out.astype(np.float32)


def layernorm_residual_reference(
    x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, bias: np.ndarray | None, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Fused residual add and norm: ``s = x + residual``; returns ``(layernorm(s), s)``.

    With ``residual`` None the sum is ``x`` itself (the first layer).
    """
    summed = np.asarray(x, dtype=np.float32) if residual is None else (x + residual).astype(np.float32)
    return layernorm_reference(summed, weight, bias, eps), summed


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
def layernorm_residual_kernel(x, residual, weight, bias, has_bias, eps, add_residual, out):
    # Grid: N rows, one block of NORM_THREADS per row; threads stride over H.
    # x [N, H] f32; residual [N, H] f32, updated in place to x + residual (or x when
    # add_residual == 0); weight [H] bf16 bits; bias [H] f32, read only when has_bias != 0;
    # out [N, H] bf16 bits = (sum - mean) / sqrt(var + eps) * w + b.
    # The mean and the variance are two reductions: the variance sums squared deviations from the
    # mean (not E[s^2] - mean^2, which cancels badly when |mean| >> std). The first
    # KEPT_PER_THREAD values of each thread stay in registers across the three passes.
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    hidden = x.shape[1]
    partial = cuda.shared.array(NORM_THREADS, float32)
    kept = cuda.local.array(KEPT_PER_THREAD, float32)
    scales = cuda.local.array(KEPT_PER_THREAD, float32)
    shifts = cuda.local.array(KEPT_PER_THREAD, float32)
    acc = float32(0.0)
    # Unconditional loads (indices past the row clamped to its last element, their values
    # dropped), so every thread's loads are in flight together instead of one after another.
    for j in range(KEPT_PER_THREAD):
        i = min(tid + j * NORM_THREADS, hidden - 1)
        value = x[row, i]
        if add_residual:
            value += residual[row, i]
        kept[j] = value
        # The weights and biases too, before the reductions, so their loads overlap the row's.
        scales[j] = bf16_to_float(weight[i])
        shifts[j] = bias[i] if has_bias else float32(0.0)
    for j in range(KEPT_PER_THREAD):
        i = tid + j * NORM_THREADS
        if i < hidden:
            residual[row, i] = kept[j]
            acc += kept[j]
    for i in range(tid + KEPT_PER_THREAD * NORM_THREADS, hidden, NORM_THREADS):
        value = x[row, i]
        if add_residual:
            value += residual[row, i]
        residual[row, i] = value
        acc += value
    mean = block_sum(partial, tid, acc, NORM_THREADS) / float32(hidden)
    acc = float32(0.0)
    for j in range(KEPT_PER_THREAD):
        i = tid + j * NORM_THREADS
        if i < hidden:
            deviation = kept[j] - mean
            acc += deviation * deviation
    # Past the kept values, each thread re-reads only the residual elements it wrote itself.
    for i in range(tid + KEPT_PER_THREAD * NORM_THREADS, hidden, NORM_THREADS):
        deviation = residual[row, i] - mean
        acc += deviation * deviation
    variance = block_sum(partial, tid, acc, NORM_THREADS) / float32(hidden)
    inv = float32(1.0) / math.sqrt(variance + eps)
    for j in range(KEPT_PER_THREAD):
        i = tid + j * NORM_THREADS
        if i < hidden:
            out[row, i] = float_to_bf16((kept[j] - mean) * inv * scales[j] + shifts[j])
    for i in range(tid + KEPT_PER_THREAD * NORM_THREADS, hidden, NORM_THREADS):
        shift = bias[i] if has_bias else float32(0.0)
        out[row, i] = float_to_bf16((residual[row, i] - mean) * inv * bf16_to_float(weight[i]) + shift)


def layernorm_residual(
    x: DeviceArray, residual: DeviceArray, weight: DeviceArray, bias: DeviceArray | None, eps: float, add_residual: bool,
    out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """``residual <- x (+ residual)``; ``out <- bf16(layernorm(residual) * weight (+ bias))``.

    ``x``, ``residual`` ``[N, H]`` float32; ``weight`` ``[H]`` bf16 bits; ``bias`` ``[H]`` float32
    or None; ``out`` ``[N, H]`` bf16 bits.
    """
    op = "layernorm_residual"
    check_array(op, "x", x, np.float32, ndim=2)
    rows, hidden = x.shape
    check_array(op, "residual", residual, np.float32, (rows, hidden))
    check_array(op, "weight", weight, np.uint16, (hidden,))
    has_bias = bias is not None
    if has_bias:
        check_array(op, "bias", bias, np.float32, (hidden,))
    check_array(op, "out", out, np.uint16, (rows, hidden))
    if rows and hidden:
        if not has_bias:
            bias = x.reshape(-1)[:hidden]  # never read; keeps one kernel specialisation
        layernorm_residual_kernel[rows, NORM_THREADS, numba_stream(stream)](
            device_view(x), device_view(residual), device_view(weight), device_view(bias), np.int32(has_bias),
            np.float32(eps), np.int32(bool(add_residual)), device_view(out),
        )
    return out
