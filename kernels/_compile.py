"""NVRTC compilation for an explicit GPU architecture, for kernels that CuPy's own compilation
cannot target: CuPy asks NVRTC for the device's plain architecture (``sm_90``), while the
warpgroup instructions of Hopper (``wgmma``, ``setmaxnreg``) exist only in the
architecture-specific target ``sm_90a``. The source is compiled to a cubin by NVRTC (called
through ctypes: CuPy's ``getCUBIN`` drops the cubin's last byte) and loaded as a CuPy module,
whose functions launch through :func:`metrale.kernels._launch.launch`.

Cubins are kept on disk (:data:`CACHE_DIR`), keyed by the source, the architecture, the options
and NVRTC's version, so that a later process loads them instead of compiling again."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from metrale.errors import KernelArgumentError

_modules: dict[tuple[str, str, tuple[str, ...]], Any] = {}
_library: list[ctypes.CDLL] = []

#: NVRTC's shared library by the names CuPy's builds load it by, newest first.
NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
DEFAULT_OPTIONS = ("--std=c++17", "--use_fast_math")


#: Where compiled cubins are kept between processes, or None for nowhere (read at each
#: compilation). The CUDA backend sets it from its settings (``METRALE_KERNEL_CACHE``, by default
#: ``$XDG_CACHE_HOME/metrale/kernels``, :class:`~metrale.config.EnvironmentConfig`); nothing
#: here reads the environment.
CACHE_DIR: Path | None = None


def nvrtc_library() -> ctypes.CDLL:
    """The NVRTC library: the one CuPy loads where CuPy is installed (found by its name once CuPy
    has loaded it), else one from an ``nvidia`` wheel of this environment. Raises
    :class:`~metrale.errors.KernelArgumentError` where there is none."""
    if not _library:
        try:
            from cupy.cuda import nvrtc

            nvrtc.getVersion()  # CuPy loads the library
        except ImportError:
            pass
        candidates = list(NVRTC_NAMES)
        for root in sys.path:
            candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cu1*", "lib", "libnvrtc.so.*")), reverse=True)
        for candidate in candidates:
            if "builtins" in os.path.basename(candidate) or "alt" in os.path.basename(candidate):
                continue
            try:
                _library.append(ctypes.CDLL(candidate))
                break
            except OSError:
                continue
        else:
            raise KernelArgumentError(f"NVRTC is not loadable (tried {', '.join(NVRTC_NAMES)} and the nvidia wheels)")
    return _library[0]


def nvrtc_version() -> tuple[int, int]:
    library = nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    library.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _compile(source: str, arch: str, options: tuple[str, ...]) -> bytes:
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


def compile_cubin(source: str, arch: str, options: tuple[str, ...] = DEFAULT_OPTIONS, *,
                  cache: Path | None = None) -> bytes:
    """The cubin NVRTC compiles ``source`` into for ``arch`` (``sm_90a``), from the on-disk cache
    (``cache``, default :data:`CACHE_DIR`; none when both are None) where an earlier compilation
    left it. Raises :class:`~metrale.errors.KernelArgumentError` with NVRTC's log if it does not
    compile. A cache that cannot be read or written is passed over (the cubin is then compiled,
    and not kept)."""
    folder = cache if cache is not None else CACHE_DIR
    if folder is None:
        return _compile(source, arch, options)
    key = hashlib.sha256("\0".join((source, arch, *options, "nvrtc %d.%d" % nvrtc_version())).encode()).hexdigest()
    path = folder / f"{key}.cubin"
    try:
        cubin = path.read_bytes()
        if cubin[:4] == b"\x7fELF":
            return cubin
    except OSError:
        pass
    cubin = _compile(source, arch, options)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".part", delete=False) as part:
            part.write(cubin)
        os.replace(part.name, path)  # whole or absent, whatever other processes do meanwhile
    except OSError:
        pass
    return cubin


def compile_module(source: str, arch: str, options: tuple[str, ...] = DEFAULT_OPTIONS) -> Any:
    """``source`` compiled by NVRTC for ``arch`` (``sm_90a``, :func:`compile_cubin`) and loaded:
    a :class:`cupy.cuda.function.Module` (once per process, source, architecture and options).
    The source must include no header (NVRTC's built-in types and functions only)."""
    key = (source, arch, options)
    module = _modules.get(key)
    if module is None:
        from cupy.cuda import function

        module = function.Module()
        module.load(compile_cubin(source, arch, options))
        _modules[key] = module
    return module
