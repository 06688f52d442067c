"""Launches of the CUDA C++ decode kernels that let each start before the kernel ahead of it has
finished (programmatic dependent launch, compute capability 9.0).

A decode step is a chain of short kernels, and each one pays a few microseconds between the end
of the one before and the moment its own blocks run and its first weight loads return. Launched
with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, a kernel's blocks may be
scheduled as soon as every block of the kernel ahead has called ``griddepcontrol.launch_dependents``
(:data:`DEPENDENT_LAUNCH` gives it the name ``allow_dependents()``); they issue what does not
depend on that kernel (weight loads) and then wait in ``wait_for_producers()``
(``griddepcontrol.wait``) until it has finished and its writes are visible. Everything a kernel
launched this way reads or writes that another kernel touches must come after that wait: this
holds for every kernel source that includes :data:`DEPENDENT_LAUNCH`, and only such kernels are
launched through :func:`launch` with ``dependent=True``. One exception, argued where it is made:
the tensor-core decode attention (:mod:`metrale.kernels.attention_decode_mma`) reads its rows'
metadata (uploaded before the step) and the cached keys and values of earlier positions (written
by earlier steps, which have ended) before the wait; the step's own key and value, which the
kernel ahead writes, it reads after. A kernel launched without the attribute runs after the one
ahead as usual, and both calls are no-ops for it; so is a kernel ahead that never calls
``allow_dependents()`` (its end is the signal). Graph capture records the launch as a
programmatic edge, which replays the same way.

Where a kernel allows its dependents is a choice per kernel. The GEMVs and the decode attention
allow them first thing, so that the next kernel's weight loads overlap their own work. A kernel
with little to load before its wait (the residual RMSNorm, the split combine) allows them only
after its wait: allowing them earlier let the kernel after it start while the kernel
ahead of it still ran, a chain of three started at once, which slowed the Llama-8B decode step
(docs/notes/decode-kernels.rst, "The registry's thresholds").

:func:`launch` calls ``cuLaunchKernelEx`` of the CUDA driver through ctypes (the driver is loaded
wherever CuPy runs) unless :data:`ENABLED` is off (``METRALE_DEPENDENT_LAUNCH=0``); CuPy's own
launch when it is off, when the device is older than compute capability 9.0, or when
``dependent`` is false.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError

#: Whether :func:`launch` uses dependent launches where asked (read at each launch). The CUDA
#: backend sets it from its settings (``METRALE_DEPENDENT_LAUNCH``, on unless set to 0,
#: :class:`~metrale.config.EnvironmentConfig`); nothing here reads the environment.
ENABLED = True

#: Names of kernels (without template arguments) :func:`launch` launches in stream order even
#: where asked to launch them dependently (read at each launch): a switch for measuring what a
#: kernel's early start gains or costs in a step (``tools/decode_ab.py --independent``).
INDEPENDENT: frozenset[str] = frozenset()

#: The shared-memory carveout (percent of the unified L1 and shared memory, ``100`` the most shared
#: memory) :func:`launch` gives every kernel it launches dependently, or None to leave the driver's
#: choice (read at each launch): kernels that run on a multiprocessor at once must agree on it, so
#: a dependent kernel whose choice differs from the kernel ahead waits for multiprocessors to
#: empty (``tools/decode_ab.py --carveout``).
SHARED_CARVEOUT: int | None = None
_carveouts: dict[int, tuple[Any, int]] = {}   # id(kernel) -> (kernel, carveout set)

#: The CUDA side of a kernel source that :func:`launch` may launch dependently (the CPU emulation
#: of the tests defines both functions as no-ops).
DEPENDENT_LAUNCH = r"""
// Returns once the kernels this one depends on have finished and their writes are visible.
__device__ __forceinline__ void wait_for_producers() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next kernel, when launched dependently, may start once every block of this one got here.
__device__ __forceinline__ void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
"""

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the id, padding to 8 bytes, a 64-byte value union (whose first int
    is ``programmaticStreamSerializationAllowed``)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(LaunchAttribute)),
        ("attribute_count", ctypes.c_uint),
    ]


_SCALARS = {np.float32: ctypes.c_float, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
            np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64}


def kernel_argument(value: Any) -> Any:
    """The ctypes value a kernel parameter takes: a device array's address, or a NumPy scalar as
    its C type. Raises :class:`~metrale.errors.KernelArgumentError` for anything else."""
    if isinstance(value, ctypes.Structure):   # a parameter passed by value (a tensor map)
        return value
    data = getattr(value, "data", None)
    pointer = getattr(data, "ptr", None)
    if pointer is not None:
        return ctypes.c_void_p(int(pointer))
    converter = _SCALARS.get(type(value))
    if converter is None:
        raise KernelArgumentError(f"a dependent launch takes device arrays and NumPy scalars "
                                  f"({', '.join(t.__name__ for t in _SCALARS)}), got {type(value).__name__}")
    return converter(value.item())


_driver: list[Any] = []  # cuLaunchKernelEx, once loaded
_capable: dict[int, bool] = {}


def _launch_function() -> Any:
    if not _driver:
        library = ctypes.CDLL("libcuda.so.1")
        function = library.cuLaunchKernelEx
        function.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        function.restype = ctypes.c_int
        _driver.append(function)
    return _driver[0]


def dependent_launch_available() -> bool:
    """Whether dependent launches are on (:data:`ENABLED`) and the current device supports them."""
    if not ENABLED:
        return False
    import cupy

    device = cupy.cuda.Device().id
    if device not in _capable:
        _capable[device] = cupy.cuda.Device(device).compute_capability >= "90"
    return _capable[device]


def _base_name(kernel: Any) -> str | None:
    """A kernel's name without its template arguments (``decode_gemv<0, true, 4, 8>`` is
    ``decode_gemv``)."""
    name = getattr(kernel, "name", None)
    return name.split("<", 1)[0] if isinstance(name, str) else None


def launch(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int, stream: Any,
           dependent: bool) -> None:
    """Launch CuPy ``kernel`` (a ``RawKernel``, or a function of a module loaded by
    :func:`metrale.kernels._compile.compile_module`) on ``stream`` (a CuPy stream, or None for the
    current one); dependently (see the module docstring) when ``dependent`` and
    :func:`dependent_launch_available`. A launch with arguments passed by value as ctypes
    structures (tensor maps) always takes the driver's launch (CuPy's takes none)."""
    by_driver = any(isinstance(arg, ctypes.Structure) for arg in args)
    dependent = dependent and dependent_launch_available() and _base_name(kernel) not in INDEPENDENT
    if not dependent and not by_driver:
        with stream if stream is not None else contextlib.nullcontext():
            kernel(grid, block, args, shared_mem=shared_mem)
        return
    import cupy

    if SHARED_CARVEOUT is not None and _carveouts.get(id(kernel), (None, None))[1] != SHARED_CARVEOUT:
        kernel.preferred_shared_memory_carveout = SHARED_CARVEOUT
        _carveouts[id(kernel)] = (kernel, SHARED_CARVEOUT)
    values = [kernel_argument(arg) for arg in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values])
    attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    stream_pointer = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
    config = LaunchConfig(*grid, *block, shared_mem, stream_pointer or None, ctypes.pointer(attribute),
                          1 if dependent else 0)
    function = kernel.kernel.ptr if hasattr(kernel, "kernel") else kernel.ptr
    status = _launch_function()(ctypes.byref(config), function, ctypes.addressof(pointers), None)
    if status:
        raise cupy.cuda.driver.CUDADriverError(status)
