"""RMSNorm, optionally fused with the residual add, and its zero-centred variant.

:func:`rmsnorm_residual_kernel` is the numba kernel; :func:`rmsnorm_residual_words` the CUDA C++
one the CUDA backend runs for rows of up to 8,192 values: a thread keeps its float4 words in
registers between the sum of squares and the output, and the launch is dependent, the norm's
weights fetched while the kernel ahead ends.
"""

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


# ------------------------------------------------------------------------------ CUDA C++ kernel

from typing import Any  # noqa: E402

from metrale.errors import KernelArgumentError  # noqa: E402
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch  # noqa: E402

#: Threads of a block of :func:`rmsnorm_residual_words` (a row each block).
WORD_THREADS = 256
#: float4 words of a row a thread keeps in registers: rows of at most 256 * 8 * 4 = 8,192 values.
WORD_QUADS = 8

KERNEL = r"""
#define NORM_WORD_THREADS 256
#define NORM_WORD_QUADS 8

// residual[n, :] <- x[n, :] (+ residual[n, :]); out[n, :] <- bf16(residual[n, :] * inv * (offset +
// weight)), inv = 1 / sqrt(mean(residual[n, :]^2) + eps). Grid N blocks of NORM_WORD_THREADS
// threads; x, residual float32 [N, H], weight bf16 bits [H], out bf16 bits [N, H]; H a multiple
// of 4 and at most NORM_WORD_THREADS * NORM_WORD_QUADS * 4 (a thread's values stay in registers).
extern "C" __global__ void __launch_bounds__(NORM_WORD_THREADS) rmsnorm_residual_words(
    const float* __restrict__ x, float* __restrict__ residual, const unsigned short* __restrict__ weight, float eps,
    float offset, int add_residual, unsigned short* __restrict__ out, int hidden) {
    __shared__ float partial[NORM_WORD_THREADS / 32];
    const int row = blockIdx.x, tid = threadIdx.x, quads = hidden / 4;
    uint2 gains[NORM_WORD_QUADS];   // the weight's bf16 words: constant, fetched before the wait
#pragma unroll
    for (int j = 0; j < NORM_WORD_QUADS; ++j) {
        const int quad = tid + j * NORM_WORD_THREADS;
        gains[j] = quad < quads ? reinterpret_cast<const uint2*>(weight)[quad] : uint2{0u, 0u};
    }
    wait_for_producers();   // x and the residual come from the kernels ahead
    allow_dependents();     // after the wait: see metrale.kernels._launch
    const float4* in = reinterpret_cast<const float4*>(x) + (size_t)row * quads;
    float4* sums = reinterpret_cast<float4*>(residual) + (size_t)row * quads;
    float4 kept[NORM_WORD_QUADS];
    float squares = residual_row_sums<NORM_WORD_QUADS>(in, sums, add_residual, quads, tid, NORM_WORD_THREADS, kept);
    squares = warp_sum(squares);
    if (tid % 32 == 0) partial[tid / 32] = squares;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < NORM_WORD_THREADS / 32; ++w) total += partial[w];
    const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
    uint2* target = reinterpret_cast<uint2*>(out) + (size_t)row * quads;
#pragma unroll
    for (int j = 0; j < NORM_WORD_QUADS; ++j) {
        const int quad = tid + j * NORM_WORD_THREADS;
        if (quad < quads) {
            const float4 value = kept[j];
            const uint2 gain = gains[j];
            uint2 packed;
            packed.x = (unsigned)to_bf16(value.x * inv * (offset + bf16_low(gain.x)))
                       | ((unsigned)to_bf16(value.y * inv * (offset + bf16_high(gain.x))) << 16);
            packed.y = (unsigned)to_bf16(value.z * inv * (offset + bf16_low(gain.y)))
                       | ((unsigned)to_bf16(value.w * inv * (offset + bf16_high(gain.y))) << 16);
            target[quad] = packed;
        }
    }
}
"""

KERNEL_NAMES = ("rmsnorm_residual_words",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles (with :data:`metrale.kernels._words.HELPERS`, which
    imports this module)."""
    from metrale.kernels._words import HELPERS

    return DEPENDENT_LAUNCH + HELPERS + KERNEL


def words_supported(hidden: int) -> bool:
    """Whether :func:`rmsnorm_residual_words` serves rows of ``hidden`` values."""
    return 0 < hidden <= WORD_THREADS * WORD_QUADS * 4 and hidden % 4 == 0


_word_kernels: list[Any] = []


def rmsnorm_residual_words(
    x: DeviceArray, residual: DeviceArray, weight: DeviceArray, eps: float, weight_offset: float, add_residual: bool,
    out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """:func:`rmsnorm_residual` in CUDA C++, launched dependently (the norm's weights fetched
    before it waits for the kernel ahead); rows of :func:`words_supported` sizes, contiguous
    16-byte aligned arrays."""
    op = "rmsnorm_residual"
    check_array(op, "x", x, np.float32, ndim=2)
    rows, hidden = x.shape
    check_array(op, "residual", residual, np.float32, (rows, hidden))
    check_array(op, "weight", weight, np.uint16, (hidden,))
    check_array(op, "out", out, np.uint16, (rows, hidden))
    if not words_supported(hidden):
        raise KernelArgumentError(f"{op}: rows of {hidden} values are not served by the CUDA C++ kernel "
                                  f"(a multiple of 4, at most {WORD_THREADS * WORD_QUADS * 4})")
    if not _word_kernels:
        import cupy

        _word_kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",))
                             .get_function("rmsnorm_residual_words"))
    if rows:
        launch(_word_kernels[0], (rows,), (WORD_THREADS,),
               (x, residual, weight, np.float32(eps), np.float32(weight_offset), np.int32(bool(add_residual)), out,
                np.int32(hidden)), 0, stream, dependent=True)
    return out
