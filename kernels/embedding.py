"""Embedding gather: ``out[t] = weight[ids[t]]``, a bf16 table widened to float32 (CUDA C++,
compiled by NVRTC through CuPy).

A few lines with no header, so a fresh install's first prompt waits a fraction of a second for
it. ``tests/kernels`` runs it on the host through the CUDA emulation header and on the GPU
(``-m gpu``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array

EMBEDDING_THREADS = 128

KERNEL = r"""
// Grid: (N rows, ceil(H / (4 * 128))); 128 threads, four columns each: one 8-byte load and one
// 16-byte store where H is a multiple of 4 (the rows then aligned), else four of each.
// weight [V, H] bf16 bits, ids [N] int32, out [N, H] float32.
extern "C" __global__ void __launch_bounds__(128)
embedding_bf16(const unsigned short* __restrict__ weight, const int* __restrict__ ids, float* __restrict__ out, int hidden) {
    const long long row = blockIdx.x;
    const unsigned short* __restrict__ source = weight + (long long)ids[row] * hidden;
    float* __restrict__ target = out + row * hidden;
    const int first = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (hidden % 4 == 0) {
        if (first < hidden) {
            const uint2 bits = *reinterpret_cast<const uint2*>(source + first);
            float4 values;
            values.x = __uint_as_float(bits.x << 16);
            values.y = __uint_as_float(bits.x & 0xffff0000u);
            values.z = __uint_as_float(bits.y << 16);
            values.w = __uint_as_float(bits.y & 0xffff0000u);
            *reinterpret_cast<float4*>(target + first) = values;
        }
        return;
    }
#pragma unroll
    for (int c = first; c < first + 4; ++c) {
        if (c < hidden) target[c] = __uint_as_float((unsigned)source[c] << 16);
    }
}
"""

KERNEL_NAMES = ("embedding_bf16",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return KERNEL


def embedding_reference(weight: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``weight [V, H]``, ``ids [T]`` int -> ``[T, H]`` float32."""
    return np.asarray(weight[np.asarray(ids, dtype=np.int64)], dtype=np.float32)


def grid(rows: int, hidden: int) -> tuple[int, int]:
    """The launch's grid for ``rows`` ids of ``hidden`` columns."""
    return rows, max(1, -(-hidden // (4 * EMBEDDING_THREADS)))


_kernels: list[Any] = []


def _kernel() -> Any:
    if not _kernels:
        import cupy

        _kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",)).get_function(KERNEL_NAMES[0]))
    return _kernels[0]


def embedding(weight: DeviceArray, ids: DeviceArray, out: DeviceArray, stream: Any = None) -> DeviceArray:
    """Gather rows of a bf16 ``weight [V, H]`` (``uint16`` bits) into float32 ``out [N, H]`` on
    ``stream`` (a CuPy stream; None: the current one). ``ids`` must lie in ``[0, V)``: they are
    not checked on the device. Raises :class:`~metrale.errors.KernelArgumentError` for arrays of
    other dtypes, shapes or layouts, or host arrays."""
    op = "embedding"
    check_array(op, "weight", weight, np.uint16, ndim=2)
    rows, hidden = ids.shape[0], weight.shape[1]
    check_array(op, "ids", ids, np.int32, (rows,))
    check_array(op, "out", out, np.float32, (rows, hidden))
    if any(isinstance(array, np.ndarray) for array in (weight, ids, out)):
        raise KernelArgumentError(f"{op}: the arrays must be on the device (CuPy arrays), not host arrays")
    if rows and hidden:
        import contextlib

        with stream if stream is not None else contextlib.nullcontext():
            _kernel()(grid(rows, hidden), (EMBEDDING_THREADS,), (weight, ids, out, np.int32(hidden)))
    return out
