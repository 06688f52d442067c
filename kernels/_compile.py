"""NVRTC compilation for an explicit GPU architecture, for kernels that CuPy's own compilation
cannot target: CuPy asks NVRTC for the device's plain architecture (``sm_90``), while the
warpgroup instructions of Hopper (``wgmma``, ``setmaxnreg``) exist only in the
architecture-specific target ``sm_90a``. The source is compiled to a cubin by NVRTC (the library
CuPy loads, called through ctypes: CuPy's ``getCUBIN`` drops the cubin's last byte) and loaded as a
CuPy module, whose functions launch through :func:`metrale.kernels._launch.launch`."""

from __future__ import annotations

import ctypes
from typing import Any

from metrale.errors import KernelArgumentError

_modules: dict[tuple[str, str, tuple[str, ...]], Any] = {}
_library: list[ctypes.CDLL] = []

#: NVRTC's shared library by the names CuPy's builds load it by, newest first.
NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


def nvrtc_library() -> ctypes.CDLL:
    """The NVRTC library CuPy uses (loaded by CuPy first, then found by its name)."""
    if not _library:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()  # CuPy loads the library
        for name in NVRTC_NAMES:
            try:
                _library.append(ctypes.CDLL(name))
                break
            except OSError:
                continue
        else:
            raise KernelArgumentError(f"NVRTC is not loadable by any of {', '.join(NVRTC_NAMES)}")
    return _library[0]


def compile_cubin(source: str, arch: str, options: tuple[str, ...]) -> bytes:
    """The cubin NVRTC compiles ``source`` into for ``arch`` (``sm_90a``). Raises
    :class:`~metrale.errors.KernelArgumentError` with NVRTC's log if it does not compile."""
    library = nvrtc_library()
    program = ctypes.c_void_p()
    if library.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None):
        raise KernelArgumentError("NVRTC could not create a program")
    try:
        arguments = [option.encode() for option in (*options, f"--gpu-architecture={arch}")]
        status = library.nvrtcCompileProgram(program, len(arguments), (ctypes.c_char_p * len(arguments))(*arguments))
        if status:
            size = ctypes.c_size_t()
            library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            library.nvrtcGetProgramLog(program, log)
            raise KernelArgumentError(f"NVRTC could not compile a kernel for {arch} (status {status}):\n"
                                      f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        library.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        library.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


def compile_module(source: str, arch: str, options: tuple[str, ...] = ("--std=c++17", "--use_fast_math")) -> Any:
    """``source`` compiled by NVRTC for ``arch`` (``sm_90a``) and loaded: a
    :class:`cupy.cuda.function.Module` (once per process, source, architecture and options).
    Raises :class:`~metrale.errors.KernelArgumentError` with NVRTC's log if it does not compile.
    The source must include no header (NVRTC's built-in types and functions only)."""
    key = (source, arch, options)
    module = _modules.get(key)
    if module is None:
        from cupy.cuda import function

        module = function.Module()
        module.load(compile_cubin(source, arch, options))
        _modules[key] = module
    return module
