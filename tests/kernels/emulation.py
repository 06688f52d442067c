"""Building CUDA C++ kernels against ``cuda_emulation.h`` for the CPU tests: the kernel's source
(without its PTX helpers, which the header replaces) and a test's ``main`` compiled by the host's
C++ compiler into a program that runs one case from files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

EMULATION_HEADER = Path(__file__).with_name("cuda_emulation.h")


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("clang++")


def build_emulated(source: Path, code: str) -> Path:
    """Compile ``code`` (kernels and a ``main``) after the emulation header into the program
    next to ``source``; skips the test where the host has no C++20 compiler."""
    if compiler() is None:
        pytest.skip("no C++ compiler to build the emulated kernel")
    source.write_text(f'#include "{EMULATION_HEADER}"\n' + code)
    binary = source.with_suffix("")
    result = subprocess.run([compiler(), "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-Wno-narrowing",
                             str(source), "-o", str(binary)], capture_output=True, text=True)
    if result.returncode and "barrier: No such file" in result.stderr:
        pytest.skip("the C++ compiler lacks C++20's <barrier>")
    assert result.returncode == 0, result.stderr[-4000:]
    return binary
