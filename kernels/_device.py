"""Shared pieces of the ``numba.cuda`` kernels: bf16 bit conversions, launch helpers, checks.

bf16 values live in ``uint16`` arrays (CuPy has no bf16 dtype). Kernels widen them to float32 by
shifting the bits into the top half of a 32-bit word, and narrow float32 to bf16 with
round-to-nearest-even. The bit casts use libdevice on a GPU and NumPy under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), so every kernel also runs, slowly, without a GPU.

Nothing here touches CUDA at import: numba compiles a kernel on its first launch.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import numpy as np
from numba import config, cuda, uint32, uint64

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


# ---------------------------------------------------------------------------------- launching


# Numba's launch path costs a host round trip per wrapper it builds, a stream wrapper and a
# device-array view of each argument (docs/benchmarks.rst, "a numba kernel launch"). Both are plain
# descriptors (a stream handle; a pointer, shape, strides and dtype that own no memory), so they
# are kept and reused by value.
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
        _stream_pointers[id(view)] = ptr
    return view


_stream_pointers: dict[int, int] = {}  # id of a view in _stream_views -> its stream's address


def jit_kernel(function: Any) -> Any:
    """``@cuda.jit(cache=True)``, launched through :class:`DirectKernel` on a GPU (numba's own
    launcher under the simulator, and where :data:`DIRECT_LAUNCH` is off)."""
    dispatcher = cuda.jit(cache=True)(function)
    return dispatcher if SIMULATED else DirectKernel(dispatcher)


#: Whether the kernels of :func:`jit_kernel` launch through :class:`DirectKernel` (read at each
#: launch). The CUDA backend sets it from its settings (``METRALE_NUMBA_LAUNCH=1`` keeps numba's
#: own launcher, for comparison, :class:`~metrale.config.EnvironmentConfig`); nothing here reads
#: the environment.
DIRECT_LAUNCH = True


class DirectKernel:
    """A numba kernel launched by CuPy: ``kernel[grid, block, stream, shared](*args)`` as numba's.

    Numba's launcher types every argument and builds its parameters in Python at each call (more
    host time a launch than most of these kernels run; docs/benchmarks.rst). Here numba compiles
    the kernel once per kind of arguments (its types, from numba's own typing), the compiled image
    is loaded as a CuPy module, and each launch only flattens the arguments into the kernel's
    parameters -- numba's ABI: an array is (meminfo, parent, size, itemsize, data, shape...,
    strides... in bytes), a scalar its C type -- and hands them to CuPy's launcher. Any other
    attribute is the numba dispatcher's.
    """

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self._launchers: dict[tuple, tuple[Any, tuple]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatcher, name)

    def __getitem__(self, config: tuple) -> Any:
        if not DIRECT_LAUNCH:
            return self.dispatcher[config]
        grid, block, stream = config[0], config[1], config[2] if len(config) > 2 else 0
        shared = int(config[3]) if len(config) > 3 else 0
        grid = grid if isinstance(grid, tuple) else (int(grid),)
        block = block if isinstance(block, tuple) else (int(block),)
        return lambda *args: self._launch(grid, block, stream, shared, args)

    def _launch(self, grid: tuple, block: tuple, stream: Any, shared: int, args: tuple) -> None:
        described = [describe_argument(a) for a in args]
        key = tuple(kind for kind, _ in described)
        entry = self._launchers.get(key)
        if entry is None:
            entry = self._launchers[key] = self._load(args)
        function, scalar_types = entry
        params: list[Any] = []
        for arg, (_, array_params), scalar_type in zip(args, described, scalar_types):
            if array_params is not None:
                params.extend(array_params)
            else:
                params.append(scalar_type(arg))
        function(grid, block, tuple(params), shared_mem=shared, stream=_cupy_stream(stream))

    def _load(self, args: tuple) -> tuple[Any, tuple]:
        import cupy
        from numba.core import types

        signature = tuple(self.dispatcher.typeof_pyval(a) for a in args)
        overload = self.dispatcher.compile(signature)
        scalar_types = tuple(
            None if isinstance(t, types.Array) else (np.bool_ if isinstance(t, types.Boolean) else np.dtype(str(t)).type)
            for t in overload.argument_types
        )
        image = overload._codelibrary.get_cubin()  # for the current device
        module = cupy.cuda.function.Module()
        # numba gives the image as bytes or as a cuda.core ObjectCode, by version.
        module.load(bytes(getattr(image, "code", image)))
        _modules.append(module)  # the functions keep no reference to their module
        return module.get_function(overload.entry_name), scalar_types


_modules: list[Any] = []
_cupy_streams: dict[int, Any] = {}


def _cupy_stream(stream: Any) -> Any:
    """The CuPy stream of a launcher's stream argument (a view from :func:`numba_stream`, 0)."""
    if not stream:
        return None
    ptr = _stream_pointers.get(id(stream)) or int(stream.handle.value if hasattr(stream.handle, "value") else stream.handle)
    wrapped = _cupy_streams.get(ptr)
    if wrapped is None:
        import cupy

        wrapped = _cupy_streams[ptr] = cupy.cuda.ExternalStream(ptr)
    return wrapped


def describe_argument(arg: Any) -> tuple[Any, tuple | None]:
    """A kernel argument's kind (what decides its numba type: an array's dtype, rank and order, a
    scalar's type) and, for an array, its parameters in numba's ABI: meminfo, parent, size,
    itemsize, data, shape, strides in bytes.

    Views made by :func:`device_view` carry theirs, worked out once; a CuPy array's come from
    its attributes, anything else with a CUDA array interface from that."""
    described = getattr(arg, "_launch_description", None)
    if described is not None:
        return described
    if isinstance(arg, (bool, int, float)):
        return type(arg), None
    if isinstance(arg, np.generic):
        return arg.dtype.char, None
    pointer = getattr(getattr(arg, "data", None), "ptr", None)
    if pointer is not None:  # a CuPy array
        shape, strides, typestr, itemsize = arg.shape, arg.strides, arg.dtype.str, arg.itemsize
    else:
        interface = arg.__cuda_array_interface__
        shape, typestr = tuple(interface["shape"]), interface["typestr"]
        pointer, itemsize = interface["data"][0], np.dtype(typestr).itemsize
        strides = interface["strides"]
        if strides is None:
            strides, step = [], itemsize
            for extent in reversed(shape):
                strides.append(step)
                step *= extent
            strides = tuple(reversed(strides))
    kind = (typestr, len(shape), _contiguous(shape[::-1], strides[::-1], itemsize), _contiguous(shape, strides, itemsize))
    return kind, (0, 0, math.prod(shape), itemsize, pointer, *shape, *strides)


def _contiguous(shape: tuple, strides: tuple, itemsize: int) -> bool:
    """Whether the extents, innermost first, are laid out densely by these strides."""
    expected = itemsize
    for extent, stride in zip(shape, strides):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


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
        with contextlib.suppress(AttributeError):  # the direct launcher's parameters, worked out once
            view._launch_description = describe_argument(array)
    return view


# ------------------------------------------------------------------------------------ checks


_expected_dtypes: dict[Any, np.dtype] = {}


def check_array(op: str, name: str, array: Any, dtype: Any, shape: tuple | None = None, ndim: int | None = None) -> None:
    """Raise :class:`KernelArgumentError` unless ``array`` has the dtype, shape and C layout given.

    ``None`` entries of ``shape`` accept any extent. Every eager launch checks its arrays this way
    (dozens a layer), so the passing case is kept to plain comparisons.
    """
    expected_dtype = _expected_dtypes.get(dtype)
    if expected_dtype is None:
        expected_dtype = _expected_dtypes[dtype] = np.dtype(dtype)
    found_dtype = getattr(array, "dtype", None)
    if found_dtype is not expected_dtype and found_dtype != expected_dtype:
        found_dtype = np.dtype(found_dtype or np.float64)
        if found_dtype != expected_dtype:
            raise KernelArgumentError(f"{op}: {name} has dtype {found_dtype}, expected {expected_dtype}")
    found = tuple(array.shape)
    if ndim is not None and len(found) != ndim:
        raise KernelArgumentError(f"{op}: {name} has shape {list(found)}, expected {ndim} dimensions")
    if shape is not None:
        mismatch = len(found) != len(shape)
        if not mismatch:
            for extent, found_extent in zip(shape, found):
                if extent is not None and extent != found_extent:
                    mismatch = True
                    break
        if mismatch:
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
