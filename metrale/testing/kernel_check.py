"""Checking a plugin's CUDA kernels on a machine without a GPU.

Two checks, each run on every CUDA kernel a plugin registers, on its op's examples and its own
(:func:`metrale.ops.check.run_kernel_examples`):

* **simulated** -- the kernel runs under numba's CUDA simulator on a
  :class:`SimulatedCudaBackend` (NumPy arrays in the dtypes the CUDA backend gives each operand
  kind, bf16 as ``uint16`` bits) and its results are compared with the op's reference within the
  op's ``cuda_tolerance``;
* **compiled** -- every numba kernel it launches is compiled, for the argument types of that
  launch, to PTX for compute capability 9.0 with NVVM (no device, no driver), which catches what
  the simulator, running kernels as Python, lets through; NVVM comes with the ``nvidia-nvvm``
  package (the ``test`` extra) or a CUDA toolkit.

numba reads ``NUMBA_ENABLE_CUDASIM`` once, when it is imported, so a process runs kernels either
simulated or compiled. :func:`run_check` runs the simulated check in this process when numba was
imported with the simulator on, and otherwise -- like the compiled check, always -- in a child
process (``python3 -m metrale.testing.kernel_check simulated|compiled``) that builds the plugin
manager the same way (installed entry points, ``METRALE_BLOCKED_PLUGINS``).

A kernel that could not be checked at all -- its ``build`` or a call raises (a CuPy ``RawKernel``
without CuPy, say), its condition accepts no example -- is a problem like a wrong result. The
conformance kit (:class:`~metrale.testing.FamilyConformance`) fails on any problem; a kernel the
simulator cannot run is named, with the reason, in the kit's ``unchecked_kernels``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Iterator

import numpy as np

from metrale.backends.base import Backend
from metrale.errors import BackendUnavailableError

#: The checks :func:`run_check` runs.
CHECKS = ("simulated", "compiled")

#: Seconds a child process of :func:`run_check` may take.
CHECK_TIMEOUT_S = 900


@dataclass
class KernelReport:
    """What one check found: the kernels it ran (``checked``) and skipped (``skipped``), every
    problem (one line each, naming the kernel), and, when the check could not run here at all,
    why (``unavailable``: NVVM missing for the compiled check)."""

    check: str
    checked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unavailable: str | None = None


class SimulatedStream:
    """The stream of a :class:`SimulatedCudaBackend`: launches run at once, nothing is captured."""

    ptr = 0

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> "SimulatedStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class HostArrays:
    """NumPy as ``backend.xp`` of a :class:`SimulatedCudaBackend`, with CuPy's ``asnumpy``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def asnumpy(array: Any, stream: Any = None) -> np.ndarray:
        return np.asarray(array)


class SimulatedCudaBackend(Backend):
    """Stands in for the CUDA backend without a GPU: named ``"cuda"``, its arrays are NumPy arrays
    in the CUDA backend's dtypes (weights and caches bf16 bits in ``uint16``, activations and
    constants float32), ``xp`` is NumPy with ``asnumpy``, and ``stream`` a stream that never
    captures. numba kernels launched on it run under the CUDA simulator. It has no built-in CUDA
    kernels (``kernels``) and no op table (``ops``): those need CuPy and a device."""

    name = "cuda"
    cache_dtype = np.uint16

    def __init__(self) -> None:
        self.xp = HostArrays()
        self.stream = SimulatedStream()

    @property
    def kernels(self) -> Any:
        raise BackendUnavailableError("the simulated CUDA backend has no built-in CUDA kernels (they need CuPy and a GPU)")

    @property
    def ops(self) -> Any:
        raise BackendUnavailableError("the simulated CUDA backend has no op table (the built-in CUDA kernels need CuPy "
                                      "and a GPU)")

    def load_weight(self, checkpoint: Any, *parts: tuple) -> np.ndarray:
        arrays = [checkpoint.tensor(*part) for part in parts]
        return self.weight(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))

    def constant(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def weight(self, host: np.ndarray) -> np.ndarray:
        from metrale.kernels.bf16 import float32_to_bf16

        return np.ascontiguousarray(float32_to_bf16(np.asarray(host, dtype=np.float32)))

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)

    def activate(self) -> Any:
        return self.stream


def simulator_enabled() -> bool:
    """Whether numba runs CUDA kernels under its simulator in this process (it reads
    ``NUMBA_ENABLE_CUDASIM`` when first imported)."""
    if "numba" not in sys.modules:
        return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def serialize_simulated_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` create each array once per block.

    The simulator keys a block's shared arrays by the source line that declares them and creates
    one on the first thread to get there, without a lock: two threads arriving together can each
    create their own, and the block's threads then disagree about the array's contents. This does
    the same lookup under a lock. Call it once, with the simulator on, before kernels run."""
    import threading
    import traceback

    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    if getattr(kernelapi.FakeCUDAShared.array, "_metrale_serialized", False):
        return
    original: Any = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's error
            return original(self, shape, dtype, alignment)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[-1])[0:2]
        with lock:
            allocated = self._allocations.get(caller)
            if allocated is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                allocated = self._allocations[caller] = np.empty(shape, dtype)
        return allocated

    array._metrale_serialized = True  # type: ignore[attr-defined]
    setattr(kernelapi.FakeCUDAShared, "array", array)


def plugin_registry(source: str | None = None) -> Any:
    """The op registry whose plugin kernels a check runs: the installed plugins' (built-in ones
    and entry points, as :func:`~metrale.model.plugin_manager.get_plugin_manager` finds them), or,
    with ``source`` ``"module:name"``, what that importable callable returns -- an
    :class:`~metrale.ops.OpRegistry`, or a plugin manager whose plugins' ops are built."""
    import importlib

    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops import OpRegistry, build_op_registry

    if source is None:
        return build_op_registry(get_plugin_manager())
    module, _, name = source.partition(":")
    made = getattr(importlib.import_module(module), name)()
    return made if isinstance(made, OpRegistry) else build_op_registry(made)


def simulate_kernels(registry: Any, skip: Collection[str] = ()) -> KernelReport:
    """The simulated check of every plugin CUDA kernel of ``registry`` not named in ``skip``,
    in this process (whose numba must run the simulator: :func:`simulator_enabled`)."""
    from metrale.ops.check import check_plugin_kernels, plugin_kernels

    if not simulator_enabled():
        raise BackendUnavailableError("the simulated kernel check needs numba imported with NUMBA_ENABLE_CUDASIM=1")
    serialize_simulated_shared_arrays()
    report = KernelReport("simulated")
    for kernel in plugin_kernels(registry, "cuda"):
        (report.skipped if kernel.name in skip else report.checked).append(kernel.name)
    report.problems = check_plugin_kernels(registry, SimulatedCudaBackend(), skip=skip)
    return report


def nvvm_unavailable_reason() -> str | None:
    """Why NVVM cannot compile here (None when it can)."""
    try:
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
    except Exception as error:
        return (f"NVVM is not available ({type(error).__name__}: {error}); install the nvidia-nvvm package "
                "(pip install 'metrale[test]') or a CUDA toolkit")
    return None


@contextlib.contextmanager
def _compiling_launches(compiled: list[str]) -> Iterator[None]:
    """numba kernel launches compile the kernel for the launch's argument types to PTX for
    compute capability 9.0 instead of running it (appending ``"name(types)"`` to ``compiled``)."""
    from types import SimpleNamespace

    from numba import cuda
    from numba.cuda import dispatcher

    device = dispatcher.get_current_device
    launch = dispatcher.CUDADispatcher.__getitem__
    done: set[tuple] = set()

    def compile_only(self: Any, configuration: Any) -> Any:
        def run(*args: Any) -> None:
            types = tuple(self.typeof_pyval(a) for a in args)
            key = (self.py_func, types)
            if key not in done:
                options = {k: v for k, v in self.targetoptions.items() if k in ("fastmath", "lineinfo", "debug")}
                cuda.compile_ptx(self.py_func, types, cc=(9, 0), **options)
                done.add(key)
                compiled.append(f"{self.py_func.__qualname__}({', '.join(str(t) for t in types)})")

        return run

    from metrale.kernels import _device

    # Device functions ask the current device for its compute capability: answer for an H200.
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
    setattr(dispatcher.CUDADispatcher, "__getitem__", compile_only)
    # Kernels launch through numba's own launcher, which compile_only replaces (the CUDA backend
    # otherwise launches them directly through CuPy).
    direct, _device.DIRECT_LAUNCH = _device.DIRECT_LAUNCH, False
    try:
        yield
    finally:
        _device.DIRECT_LAUNCH = direct
        setattr(dispatcher.CUDADispatcher, "__getitem__", launch)
        dispatcher.get_current_device = device


def compile_kernels(registry: Any, skip: Collection[str] = ()) -> KernelReport:
    """The compiled check of every plugin CUDA kernel of ``registry`` not named in ``skip``, in
    this process (whose numba must not run the simulator, and whose kernels must launch through
    numba: ``METRALE_NUMBA_LAUNCH=1``, which :func:`run_check` sets for its child)."""
    from metrale.ops.check import plugin_kernels, run_kernel_examples

    if simulator_enabled():
        raise BackendUnavailableError("the compiled kernel check needs numba imported without the CUDA simulator")
    report = KernelReport("compiled")
    kernels = plugin_kernels(registry, "cuda")
    report.unavailable = nvvm_unavailable_reason() if kernels else None
    if report.unavailable is not None:
        return report
    backend = SimulatedCudaBackend()
    for kernel in kernels:
        if kernel.name in skip:
            report.skipped.append(kernel.name)
            continue
        report.checked.append(kernel.name)
        compiled: list[str] = []
        with _compiling_launches(compiled):
            run, problems = run_kernel_examples(registry, kernel, backend, compare=False)
        if not run and not problems:
            problems = [f"its condition ({kernel.condition}) accepts none of the examples, so nothing was compiled"]
        report.problems += [f"kernel {kernel.name!r} ({kernel.origin}, compiled for sm_90): {line}" for line in problems]
    return report


def _child_environment(check: str) -> dict[str, str]:
    env = dict(os.environ)
    if check == "simulated":
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        env["METRALE_NUMBA_LAUNCH"] = "1"  # numba's own launcher, which the check replaces
    env["NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"] = "1"  # plain text in the problems reported
    # The child imports what this process can (a suite may have put its folders on sys.path).
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    return env


def run_check(check: str, skip: Collection[str] = (), source: str | None = None,
              expect: Collection[str] = ()) -> KernelReport:
    """Run ``check`` (``"simulated"`` or ``"compiled"``) on the plugin CUDA kernels of
    :func:`plugin_registry` (``source``), except those named in ``skip``: here when this process
    can, else in a child process. A child that fails to report is a problem, and so is a kernel
    named in ``expect`` that the check did not find (a plugin this process registered that the
    child, building its own plugin manager, does not have)."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    report = _run(check, skip, source)
    seen = set(report.checked) | set(report.skipped)
    report.problems += [
        f"kernel {name!r} was not checked: the {check} check found no such plugin CUDA kernel (the check builds the "
        "installed plugins' registry; is the plugin installed, with its entry point?)"
        for name in expect if name not in seen and report.unavailable is None
    ]
    return report


def _run(check: str, skip: Collection[str], source: str | None) -> KernelReport:
    if check == "simulated" and simulator_enabled():
        return simulate_kernels(plugin_registry(source), skip)
    command = [sys.executable, "-m", "metrale.testing.kernel_check", check, *[f"--skip={name}" for name in skip]]
    command += [f"--registry={source}"] if source is not None else []
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=_child_environment(check),
                                timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return KernelReport(check, problems=[f"the {check} kernel check took more than {CHECK_TIMEOUT_S} s"])
    lines = result.stdout.strip().splitlines()
    try:
        return KernelReport(**json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError):
        return KernelReport(check, problems=[
            f"the {check} kernel check ({' '.join(command[1:])}) did not report (exit status {result.returncode}):\n"
            + (result.stderr.strip() or result.stdout.strip())[-3000:]
        ])


def main(argv: list[str] | None = None) -> int:
    """``python3 -m metrale.testing.kernel_check simulated|compiled [--skip=KERNEL ...]
    [--registry=MODULE:NAME]``: run one check on the plugins' CUDA kernels and print its
    :class:`KernelReport` as one line of JSON; the exit status is 1 when it found a problem."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m metrale.testing.kernel_check",
                                     description="Check the installed plugins' CUDA kernels without a GPU.")
    parser.add_argument("check", choices=CHECKS)
    parser.add_argument("--skip", action="append", default=[], metavar="KERNEL", help="a kernel name not to check")
    parser.add_argument("--registry", metavar="MODULE:NAME",
                        help="a callable returning the op registry (or plugin manager) to check; default: the installed plugins")
    arguments = parser.parse_args(argv)
    registry = plugin_registry(arguments.registry)
    if arguments.check == "simulated":
        sys.setswitchinterval(5e-5)  # simulated threads reach their barriers sooner
        report = simulate_kernels(registry, arguments.skip)
    else:
        report = compile_kernels(registry, arguments.skip)
    print(json.dumps(asdict(report)))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
