"""NVRTC compilation for an explicit GPU architecture, for kernels that CuPy's own compilation
cannot target: CuPy asks NVRTC for the device's plain architecture (``sm_90``), while the
warpgroup instructions of Hopper (``wgmma``, ``setmaxnreg``) exist only in the
architecture-specific target ``sm_90a``. The source is compiled to a cubin by CuPy's binding of
NVRTC and loaded as a CuPy module, whose functions launch as :class:`cupy.RawKernel`'s do through
:func:`metrale.kernels._launch.launch`."""

from __future__ import annotations

from typing import Any

from metrale.errors import KernelArgumentError

_modules: dict[tuple[str, str, tuple[str, ...]], Any] = {}


def compile_module(source: str, arch: str, options: tuple[str, ...] = ("--std=c++17", "--use_fast_math")) -> Any:
    """``source`` compiled by NVRTC for ``arch`` (``sm_90a``) and loaded: a
    :class:`cupy.cuda.function.Module` (once per process, source, architecture and options).
    Raises :class:`~metrale.errors.KernelArgumentError` with NVRTC's log if it does not compile.
    The source must include no header (NVRTC's built-in types and functions only)."""
    key = (source, arch, options)
    module = _modules.get(key)
    if module is None:
        from cupy.cuda import function, nvrtc

        program = nvrtc.createProgram(source, "kernel.cu", [], [])
        try:
            try:
                nvrtc.compileProgram(program, [*options, f"--gpu-architecture={arch}"])
            except nvrtc.NVRTCError as error:
                raise KernelArgumentError(f"NVRTC could not compile a kernel for {arch}: {error}\n"
                                          f"{nvrtc.getProgramLog(program)}") from error
            cubin = nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)
        module = function.Module()
        module.load(cubin)
        _modules[key] = module
    return module
