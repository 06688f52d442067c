"""The merge of a split decode attention's partials (CUDA C++, compiled by NVRTC through CuPy),
launched dependently after the tensor-core attention kernels (:mod:`metrale.kernels._launch`).

Flash-decoding splits a row's keys between blocks; each writes, per head, its unnormalised
``P V`` (``out_acc [N, heads, splits, d]``), the largest score (``out_max``, natural-log units)
and the sum of its weights (``out_sum``). Grid ``(N, heads, ceil(d / THREADS))``: one warp of a
block loads every split's sum and maximum at once (a lane a split, at most 32), finds the row's
maximum and the splits' weights ``exp(max_s - max)`` with warp shuffles (a split without keys
weighs nothing), then every thread merges one value column over the splits, all its loads in
flight together, and writes it as bf16 bits into ``out [N, heads * d]``. The same arithmetic as
:func:`metrale.kernels.attention_grouped.grouped_combine_kernel` (the numba kernel the CUDA-core
attention keeps) and :func:`metrale.kernels.attention_latent_mma.combine_partials_model`, its
reference; ``tests/kernels`` runs it on the host through the CUDA emulation header.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch

THREADS = 128
MAX_SPLITS = 32  # a lane of the first warp per split

KERNEL = r"""
#define COMBINE_THREADS 128
#define COMBINE_MAX_SPLITS 32

__device__ __forceinline__ unsigned short combine_to_bf16(float value) {
    const unsigned bits = __float_as_uint(value);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return (unsigned short)((bits >> 16) | 0x40u);
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Grid (N, heads, ceil(value_dim / COMBINE_THREADS)); COMBINE_THREADS threads. out_acc [N, heads,
// splits, value_dim], out_max and out_sum [N, heads, splits] float32; out [N, heads * value_dim]
// bf16 bits; splits <= COMBINE_MAX_SPLITS.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) attention_combine(
    const float* __restrict__ out_acc, const float* __restrict__ out_max, const float* __restrict__ out_sum,
    unsigned short* __restrict__ out, int splits, int value_dim) {
    __shared__ float weight[COMBINE_MAX_SPLITS];
    __shared__ float total;
    wait_for_producers();   // the partials come from the attention kernel ahead
    allow_dependents();     // after the wait: see metrale.kernels._launch
    const int row = blockIdx.x, head = blockIdx.y, heads = gridDim.y, lane = threadIdx.x % 32;
    const long first = ((long)row * heads + head) * splits;
    if (threadIdx.x < 32) {
        const float split_sum = lane < splits ? out_sum[first + lane] : 0.0f;
        const float split_max = split_sum > 0.0f ? out_max[first + lane] : __int_as_float(0xff800000);
        float top = split_max;
        for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        const float mine = split_sum > 0.0f ? expf(split_max - top) : 0.0f;
        weight[lane] = mine;
        float sum = mine * split_sum;
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (lane == 0) total = sum;
    }
    __syncthreads();
    const int d = blockIdx.z * COMBINE_THREADS + threadIdx.x;
    if (d >= value_dim) return;
    float numerator = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) numerator += weight[s] * out_acc[(first + s) * value_dim + d];
    out[((long)row * heads + head) * value_dim + d] = combine_to_bf16(total > 0.0f ? numerator / total : 0.0f);
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DEPENDENT_LAUNCH + KERNEL


KERNEL_NAMES = ("attention_combine",)

_kernels: list[Any] = []


def _kernel() -> Any:
    if not _kernels:
        import cupy

        _kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",)).get_function("attention_combine"))
    return _kernels[0]


def combine(out_acc: DeviceArray, out_max: DeviceArray, out_sum: DeviceArray, out: DeviceArray,
            stream: Any = None) -> DeviceArray:
    """Merge the partials ``out_acc [N, heads, splits, d]``, ``out_max`` and ``out_sum [N, heads,
    splits]`` (float32) into bf16 bits ``out [N, heads * d]`` on ``stream``, dependently launched.
    Raises :class:`~metrale.errors.KernelArgumentError` for other shapes or more than
    :data:`MAX_SPLITS` splits."""
    op = "attention_combine"
    check_array(op, "out_acc", out_acc, np.float32, ndim=4)
    rows, heads, splits, value_dim = out_acc.shape
    check_array(op, "out_max", out_max, np.float32, (rows, heads, splits))
    check_array(op, "out_sum", out_sum, np.float32, (rows, heads, splits))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if not 0 < splits <= MAX_SPLITS:
        raise KernelArgumentError(f"{op}: {splits} splits (1 to {MAX_SPLITS})")
    if rows and heads and value_dim:
        launch(_kernel(), (rows, heads, -(-value_dim // THREADS)), (THREADS,),
               (out_acc, out_max, out_sum, out, np.int32(splits), np.int32(value_dim)), 0, stream, dependent=True)
    return out
