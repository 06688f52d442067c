"""What a plugin's CUDA kernels use: launching on the engine's stream, the dtypes they receive,
argument checks, bf16 conversions, and the rules of CUDA-graph capture.

A plugin serves an op on the GPU with ``Kernel(op, "cuda", name, build=...)``; ``build(backend)``
runs once per backend and returns the callable the engine calls with the op's parameters, held as
the CUDA backend holds each operand kind (:data:`CUDA_DTYPES`). Typical shape of a launcher::

    @jit_kernel
    def my_kernel(x, out): ...

    def build(backend):
        def run(x):
            check_operand("my_op", "x", x, "activation", ndim=2)
            out = backend.xp.empty(x.shape, dtype=np.float32)   # in the call: see below
            launch(my_kernel, blocks(x.size, 128), 128, (x, out), backend)
            return out
        return run

The rules (``docs/writing-plugins.rst``, "CUDA kernels of a plugin", says why):

* every launch goes on ``backend.stream`` (:func:`launch` with the backend); CuPy calls in the
  callable run on CuPy's current stream, which the engine sets to the backend's around every
  forward (``backend.activate()``);
* outputs are allocated in the call with ``backend.xp`` (CuPy's current allocator: the backend's
  graph pool while a graph is captured), never with numba (``cuda.device_array``,
  ``cuda.to_device``) or a raw ``cudaMalloc``; a buffer that outlives a call is made once, in
  ``build``;
* while :func:`capturing` is true nothing may wait on the device or copy to or from the host
  (``.get()``, ``int(array)``, ``xp.asnumpy``, ``xp.asarray(host_array)``, ``synchronize()``) and
  no shape or scalar argument may come from device values: the launches are recorded once and
  replayed every step. A kernel that cannot keep to this calls :func:`refuse_capture` (the
  model's steps then run eagerly) and its op says ``graph_safe=False``.

Without a GPU the same code runs under numba's CUDA simulator on NumPy arrays (``backend.xp`` is
NumPy-like there and :data:`SIMULATED` is true), which is how the conformance kit checks a
plugin's kernels (:mod:`metrale.testing.kernel_check`).

Importing this module imports numba (not CUDA): import it where the kernels are defined, which
``build`` may import lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import GraphCaptureError, KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)

__all__ = [
    "CUDA_DTYPES",
    "SIMULATED",
    "DeviceArray",
    "bf16_to_float",
    "blocks",
    "capturing",
    "check_array",
    "check_operand",
    "cuda_dtypes",
    "device_view",
    "float_to_bf16",
    "jit_kernel",
    "kernel_stream",
    "launch",
    "refuse_capture",
]

#: The dtypes a CUDA kernel receives (and an output of the kind holds) for each array operand
#: kind of :class:`~metrale.ops.Operand`, the first the usual one. ``matmul_input`` arrives as bf16
#: bits, or float32 where the producer kept float32; ``cache`` is bf16 bits for K/V and latent
#: caches and float32 for recurrent states. bf16 values live in ``uint16`` arrays (CuPy has no bf16
#: dtype): widen them with :func:`bf16_to_float` and narrow with :func:`float_to_bf16` in a kernel.
#: ``batch``, ``scalar`` and ``option`` operands are not arrays: a
#: :class:`~metrale.batch.ForwardBatch` whose row metadata is int32 on the device, a Python
#: number, a Python value.
CUDA_DTYPES: dict[str, tuple[np.dtype, ...]] = {
    "activation": (np.dtype(np.float32),),
    "matmul_input": (np.dtype(np.uint16), np.dtype(np.float32)),
    "weight": (np.dtype(np.uint16),),
    "constant": (np.dtype(np.float32),),
    "index": (np.dtype(np.int32),),
    "cache": (np.dtype(np.uint16), np.dtype(np.float32)),
}


def cuda_dtypes(kind: str) -> tuple[np.dtype, ...]:
    """The dtypes of :data:`CUDA_DTYPES` for operand ``kind``; raises
    :class:`~metrale.errors.KernelArgumentError` for a kind that is not an array."""
    try:
        return CUDA_DTYPES[kind]
    except KeyError:
        raise KernelArgumentError(
            f"operand kind {kind!r} is not an array kind; array kinds: {', '.join(CUDA_DTYPES)}"
        ) from None


def check_operand(op: str, name: str, array: Any, kind: str, shape: tuple | None = None,
                  ndim: int | None = None) -> None:
    """Raise :class:`~metrale.errors.KernelArgumentError` unless ``array`` has one of the dtypes
    of operand ``kind`` (:data:`CUDA_DTYPES`), the ``shape`` given (None entries accept any
    extent) or ``ndim`` dimensions, and a C layout. The message names ``op``, ``name`` and what
    was found."""
    accepted = cuda_dtypes(kind)
    found = getattr(array, "dtype", None)
    if found is None or np.dtype(found) not in accepted:
        raise KernelArgumentError(f"{op}: {name} ({kind}) has dtype {found}, expected "
                                  f"{' or '.join(str(d) for d in accepted)}")
    check_array(op, name, array, found, shape, ndim)


def blocks(count: int, threads: int) -> int:
    """Blocks of ``threads`` threads that cover ``count`` items (at least 1)."""
    if threads < 1:
        raise KernelArgumentError(f"blocks: threads is {threads}, expected at least 1")
    return max(1, -(-int(count) // int(threads)))


def _stream_of(target: Any) -> Any:
    """The CuPy stream of ``target``: a backend's ``stream``, or ``target`` itself."""
    return getattr(target, "stream", target)


def kernel_stream(target: Any) -> Any:
    """The stream argument of a numba launch (``kernel[grid, block, stream]``) for a backend or a
    CuPy stream: a numba view of the same stream, made once and reused (0 under the simulator)."""
    return numba_stream(_stream_of(target))


def _is_device_array(value: Any) -> bool:
    return hasattr(value, "__cuda_array_interface__") and getattr(getattr(value, "data", None), "ptr", None) is not None


def launch(kernel: Any, grid: Any, block: Any, args: tuple, stream: Any, shared_bytes: int = 0) -> None:
    """Launch ``kernel`` on ``stream`` (a backend, whose ``stream`` is used, or a CuPy stream).

    ``kernel`` is a numba kernel (:func:`jit_kernel` or ``numba.cuda.jit``): CuPy arrays among
    ``args`` are passed as numba views of the same memory (:func:`device_view`, no copy and no
    synchronisation), NumPy arrays as they are (the simulator's). Or a CuPy ``RawKernel`` (or a
    function of a ``RawModule``): ``args`` go to it unchanged (NumPy scalars of the parameters' C
    types), launched with that stream current. ``grid`` and ``block`` are ints or tuples;
    ``shared_bytes`` is the dynamic shared memory. Nothing is allocated and nothing waits, so a
    launch may be captured into a CUDA graph."""
    if not isinstance(args, tuple):
        raise KernelArgumentError(f"launch: args must be a tuple of kernel arguments, got {type(args).__name__}")
    if hasattr(type(kernel), "__getitem__"):  # numba: kernel[grid, block, stream, shared](*args)
        arguments = [device_view(a) if _is_device_array(a) else a for a in args]
        kernel[grid, block, kernel_stream(stream), int(shared_bytes)](*arguments)
        return
    if not callable(kernel):
        raise KernelArgumentError(f"launch: {type(kernel).__name__} is neither a numba kernel nor a CuPy kernel")
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    with _stream_of(stream):
        kernel(grid, block, args, shared_mem=int(shared_bytes))


def capturing(backend: Any) -> bool:
    """Whether ``backend``'s stream is recording a CUDA graph now (never on the CPU or under the
    simulator)."""
    stream = getattr(backend, "stream", None)
    is_capturing = getattr(stream, "is_capturing", None)
    return bool(is_capturing()) if callable(is_capturing) else False


def refuse_capture(backend: Any, what: str) -> None:
    """Raise :class:`~metrale.errors.GraphCaptureError` saying ``what`` cannot be captured when
    ``backend`` is recording a CUDA graph; a no-op otherwise. Call it before anything that waits
    on the device or reads device values on the host: the engine then drops the capture and runs
    the model's decode steps (or mixed steps) eagerly from then on, with a warning naming
    ``what``."""
    if capturing(backend):
        raise GraphCaptureError(f"{what} cannot run inside a CUDA graph capture")
