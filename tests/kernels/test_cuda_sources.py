"""The CUDA C++ kernels that NVRTC compiles on the GPU, compiled here by nvcc for sm_90: each
launcher looks its kernels up by name in the compiled module, so every name it asks for must be
an entry of the PTX (a kernel without ``extern "C"`` gets a mangled name and is not found), and
every template instantiation a launcher can ask for must compile."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from metrale.kernels import decode_gemv, gdn_decode, moe_decode, moe_grouped, moe_route_decode


def compile_to_ptx(tmp_path, code: str) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc to compile the CUDA sources")
    source = tmp_path / "kernels.cu"
    source.write_text(code)
    ptx = tmp_path / "kernels.ptx"
    result = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-ptx", str(source), "-o", str(ptx)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return ptx.read_text()


def entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", ptx))


@pytest.mark.parametrize("module", [gdn_decode, moe_decode, moe_grouped, moe_route_decode],
                         ids=lambda m: m.__name__.split(".")[-1])
def test_every_kernel_name_is_an_entry(tmp_path, module):
    assert set(module.KERNEL_NAMES) <= entries(compile_to_ptx(tmp_path, module.source()))


def test_every_decode_gemv_instantiation_compiles(tmp_path):
    signature = ("const void*, const float*, const unsigned short*, float, float, float*, const uint4*, const float*, "
                 "void*, int, int, int")
    names = [decode_gemv.kernel_name(mode, bf16_out, split, unroll) for mode in decode_gemv.MODES
             for bf16_out in (False, True) for split in decode_gemv.SPLITS for unroll in decode_gemv.UNROLLS]
    instantiations = "".join(f"template __global__ void {name}({signature});\n" for name in names)
    ptx = compile_to_ptx(tmp_path, decode_gemv.source() + instantiations)
    assert len(entries(ptx)) == len(names)
