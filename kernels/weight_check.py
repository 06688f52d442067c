"""The load-time check of a bf16 weight: how many of its values are NaN or infinite (all eight
exponent bits set, ``bits & 0x7F80 == 0x7F80``), counted on the device (CUDA C++, compiled by NVRTC
through CuPy).

A few lines with no header, so the first load of a fresh install compiles it in a fraction of a
second: a grid of blocks strides over the words, each warp sums its lanes' counts with shuffles
and adds them to one 64-bit counter. ``tests/kernels`` runs it on the host through the CUDA
emulation header and on the GPU (``-m gpu``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.kernels._device import DeviceArray, check_array

THREADS = 256
#: Blocks at most: enough to keep every multiprocessor's loads in flight; more only stride less.
MAX_BLOCKS = 4096

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256)
count_nonfinite_bf16(const unsigned short* __restrict__ bits, long long count, unsigned long long* found) {
    unsigned int mine = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        mine += (bits[i] & 0x7F80u) == 0x7F80u;
    }
    for (int offset = 16; offset > 0; offset >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, offset);
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(found, (unsigned long long)mine);
}
"""

KERNEL_NAMES = ("count_nonfinite_bf16",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return KERNEL


def count_nonfinite_bf16_reference(bits: np.ndarray) -> int:
    """NaN and infinite values among bf16 ``bits`` (``uint16``)."""
    return int(np.count_nonzero((np.asarray(bits, dtype=np.uint16) & 0x7F80) == 0x7F80))


def blocks_for(count: int) -> int:
    """Blocks of a launch over ``count`` values (at least one, at most :data:`MAX_BLOCKS`)."""
    return max(1, min(MAX_BLOCKS, -(-count // THREADS)))


_kernels: list[Any] = []


def _kernel() -> Any:
    if not _kernels:
        import cupy

        _kernels.append(cupy.RawModule(code=source()).get_function("count_nonfinite_bf16"))
    return _kernels[0]


def add_nonfinite_count(bits: DeviceArray, found: DeviceArray, stream: Any = None) -> None:
    """Add the count of NaN and infinite values among the bf16 ``bits`` (``uint16``, C-contiguous,
    any shape) to ``found`` (one ``uint64``) on ``stream``."""
    op = "count_nonfinite_bf16"
    check_array(op, "bits", bits, np.uint16)
    check_array(op, "found", found, np.uint64, (1,))
    count = int(bits.size)
    if count == 0:
        return
    import contextlib

    with stream if stream is not None else contextlib.nullcontext():
        _kernel()((blocks_for(count),), (THREADS,), (bits, np.int64(count), found))
