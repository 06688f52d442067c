"""Building CUDA C++ kernels against ``cuda_emulation.h`` for the CPU tests: the kernel's source
(without its PTX helpers, which the header replaces) and a test's ``main`` compiled by the host's
C++ compiler into a program that runs one case from files."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

EMULATION_HEADER = Path(__file__).with_name("cuda_emulation.h")


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("clang++")


#: Built programs, by the hash of what went into them: the test processes of one run (and later
#: runs) build each program once.
BUILD_CACHE = Path(tempfile.gettempdir()) / f"metrale-emulated-{os.getuid()}"


def build_emulated(source: Path, code: str) -> Path:
    """Compile ``code`` (kernels and a ``main``) after the emulation header into a program (kept
    in :data:`BUILD_CACHE` by the hash of the header, the code, the compiler and its flags; the
    source is written to ``source`` for a reader); skips the test where the host has no C++20
    compiler."""
    cxx = compiler()
    if cxx is None:
        pytest.skip("no C++ compiler to build the emulated kernel")
    text = f'#include "{EMULATION_HEADER}"\n' + code
    source.write_text(text)
    flags = ["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-Wno-narrowing"]
    key = hashlib.sha256("\0".join([EMULATION_HEADER.read_text(), text, cxx, *flags]).encode()).hexdigest()[:32]
    BUILD_CACHE.mkdir(exist_ok=True)
    binary = BUILD_CACHE / key
    with open(BUILD_CACHE / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process building the same program: wait for it
        if not binary.exists():
            building = BUILD_CACHE / f"{key}.{os.getpid()}.cpp"
            building.write_text(text)
            result = subprocess.run([cxx, *flags, str(building), "-o", f"{building}.out"], capture_output=True, text=True)
            building.unlink()
            if result.returncode and "barrier: No such file" in result.stderr:
                pytest.skip("the C++ compiler lacks C++20's <barrier>")
            assert result.returncode == 0, result.stderr[-4000:]
            os.replace(f"{building}.out", binary)
    return binary
