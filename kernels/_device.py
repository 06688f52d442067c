"""Shared pieces of the ``numba.cuda`` kernels: bf16 bit conversions, launch helpers, checks.

bf16 values live in ``uint16`` arrays (CuPy has no bf16 dtype). Kernels widen them to float32 by
shifting the bits into the top half of a 32-bit word, and narrow float32 to bf16 with
round-to-nearest-even. The bit casts use libdevice on a GPU and NumPy under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), so every kernel also runs, slowly, without a GPU.

Nothing here touches CUDA at import: numba compiles a kernel on its first launch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from numba import config, cuda

from metrale.errors import KernelArgumentError

# numba.config sets its options at import from the environment, so they have no static declaration.
SIMULATED = bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]

# An array the launchers read or write: a CuPy array on the GPU, a NumPy array under the
# simulator (and a numba device array where a caller already holds one). Neither library types
# all three, and CuPy is an optional dependency, so the launchers' signatures name this alias
# and leave the checks to ``check_array``.
DeviceArray = Any

# Small grids are by design here (a batch-1 step launches a few blocks per kernel); numba's
# low-occupancy warning on every such launch says nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*will likely result in GPU under-utilization")

if SIMULATED:

    @cuda.jit(device=True)
    def fast_exp(value):
        """``exp`` (on the GPU: the hardware approximation)."""
        return math.exp(value)

    @cuda.jit(device=True)
    def bits_to_float(bits):
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def float_to_bits(value):
        return np.array([value], dtype=np.float32).view(np.uint32)[0]

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def fast_exp(value):
        """``exp`` through the hardware ``ex2.approx`` (a few ulp; exp(-inf) = 0)."""
        return libdevice.fast_expf(value)

    @cuda.jit(device=True)
    def bits_to_float(bits):
        return libdevice.int_as_float(np.int32(bits))

    @cuda.jit(device=True)
    def float_to_bits(value):
        return np.uint32(libdevice.float_as_int(value))


@cuda.jit(device=True)
def bf16_to_float(half_bits):
    """uint16 bf16 bits -> float32."""
    return bits_to_float(np.uint32(half_bits) << np.uint32(16))


@cuda.jit(device=True)
def float_to_bf16(value):
    """float32 -> uint16 bf16 bits, round to nearest even (NaN stays NaN)."""
    bits = float_to_bits(value)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16((bits + rounding) >> np.uint32(16))


# ---------------------------------------------------------------------------------- launching


# Numba's launch path costs a host round trip per wrapper it builds: a stream wrapper and a
# device-array view of each argument took 7-12 and 15-25 microseconds on the GPU machine's host,
# and a launch with fresh ones 240-434 microseconds against 42-69 with reused ones
# (tools/launch_overhead.py, two runs). Both are plain descriptors (a stream handle; a pointer, shape,
# strides and dtype that own no memory), so they are kept and reused by value.
VIEW_CACHE_SIZE = 4096
_stream_views: dict[int, Any] = {}
_array_views: dict[tuple, Any] = {}


def numba_stream(stream: Any) -> Any:
    """The numba view of a CuPy stream (or 0, the default stream, when None)."""
    if stream is None or SIMULATED:
        return 0
    ptr = stream if isinstance(stream, int) else stream.ptr
    if not ptr:
        return 0
    view = _stream_views.get(ptr)
    if view is None:
        view = _stream_views[ptr] = cuda.external_stream(ptr)
    return view


def new_device_view(array: Any) -> Any:
    """A fresh numba device-array view of a CuPy array that owns nothing, without synchronising."""
    return cuda.from_cuda_array_interface(array.__cuda_array_interface__, owner=None, sync=False)


def device_view(array: Any) -> Any:
    """A numba device-array view of a CuPy array, without synchronising any stream.

    Views are reused for the same address, shape, strides and dtype (a view is only a
    descriptor; the caller keeps the array alive until its kernels have run, as stream order
    already requires). NumPy arrays (the simulator's inputs) pass through unchanged.
    """
    if isinstance(array, np.ndarray):
        return array
    key = (array.data.ptr, array.shape, array.strides, array.dtype.char)
    view = _array_views.get(key)
    if view is None:
        if len(_array_views) >= VIEW_CACHE_SIZE:
            _array_views.clear()
        view = _array_views[key] = new_device_view(array)
    return view


# ------------------------------------------------------------------------------------ checks


def check_array(op: str, name: str, array: Any, dtype: Any, shape: tuple | None = None, ndim: int | None = None) -> None:
    """Raise :class:`KernelArgumentError` unless ``array`` has the dtype, shape and C layout given.

    ``None`` entries of ``shape`` accept any extent.
    """
    found_dtype = np.dtype(getattr(array, "dtype", None) or np.float64)
    if found_dtype != np.dtype(dtype):
        raise KernelArgumentError(f"{op}: {name} has dtype {found_dtype}, expected {np.dtype(dtype)}")
    found = tuple(array.shape)
    if ndim is not None and len(found) != ndim:
        raise KernelArgumentError(f"{op}: {name} has shape {list(found)}, expected {ndim} dimensions")
    if shape is not None:
        if len(found) != len(shape) or any(e is not None and e != f for e, f in zip(shape, found)):
            expected = ["*" if e is None else e for e in shape]
            raise KernelArgumentError(f"{op}: {name} has shape {list(found)}, expected {expected}")
    flags = getattr(array, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise KernelArgumentError(f"{op}: {name} (shape {list(found)}) is not C-contiguous")


# --------------------------------------------------------------------------- block reductions
#
# Every thread of the block must call these (they synchronise it); ``partial`` is shared
# scratch of at least ``threads`` floats. On the GPU each warp reduces with shuffles and the warp
# results go through shared memory (two barriers); the simulator, which has no shuffles, runs a
# shared-memory tree.

WARP_SIZE = 32

# Device functions whose local-array arguments must stay in registers: inlined into the caller,
# so their loops index the caller's arrays with constants once unrolled.
# (numba.cuda picks its implementation at import; a type checker sees the simulator's ``jit``,
# which has no ``forceinline``.)
inline_device = cuda.jit(device=True) if SIMULATED else cuda.jit(device=True, forceinline=True)  # type: ignore[call-arg]
FULL_MASK = 0xFFFFFFFF

if SIMULATED:

    @cuda.jit(device=True)
    def block_sum(partial, tid, value, threads):
        """Sum of ``value`` over the block's ``threads`` threads."""
        partial[tid] = value
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if tid < stride:
                partial[tid] += partial[tid + stride]
            cuda.syncthreads()
            stride //= 2
        total = partial[0]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def block_max(partial, tid, value, threads):
        """Maximum of ``value`` over the block's ``threads`` threads."""
        partial[tid] = value
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if tid < stride and partial[tid + stride] > partial[tid]:
                partial[tid] = partial[tid + stride]
            cuda.syncthreads()
            stride //= 2
        best = partial[0]
        cuda.syncthreads()
        return best

else:

    @cuda.jit(device=True)
    def block_sum(partial, tid, value, threads):
        """Sum of ``value`` over the block's ``threads`` threads (a multiple of 32)."""
        offset = WARP_SIZE // 2
        while offset > 0:
            value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
            offset //= 2
        if tid % WARP_SIZE == 0:
            partial[tid // WARP_SIZE] = value
        cuda.syncthreads()
        total = partial[0]
        for w in range(1, threads // WARP_SIZE):
            total += partial[w]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def block_max(partial, tid, value, threads):
        """Maximum of ``value`` over the block's ``threads`` threads (a multiple of 32)."""
        offset = WARP_SIZE // 2
        while offset > 0:
            value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
            offset //= 2
        if tid % WARP_SIZE == 0:
            partial[tid // WARP_SIZE] = value
        cuda.syncthreads()
        best = partial[0]
        for w in range(1, threads // WARP_SIZE):
            best = max(best, partial[w])
        cuda.syncthreads()
        return best
