"""The CUDA C++ kernels that NVRTC compiles on the GPU, compiled here for sm_90 by NVRTC itself
(the library torch's CUDA wheels bring, through ctypes, with numba-cuda's copy of the CUDA
headers; the GPU compiles them the same way through CuPy), or by nvcc where no NVRTC is found.
NVRTC is the stricter of the two: it includes no host header (no ``INFINITY``, no ``<math.h>``)
unless a source asks. Each launcher looks its kernels up by name in the compiled module, so every
name it asks for must be an entry of the PTX (a kernel without ``extern "C"`` gets a mangled name
and is not found), and every template instantiation a launcher can ask for must compile."""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from metrale.kernels import (
    activation,
    attention_combine,
    attention_latent,
    decode_gemv,
    embedding,
    gdn_decode,
    greedy_sample,
    head_linear,
    lora,
    moe_decode,
    moe_grouped,
    moe_route_decode,
    qkv_rope,
    quantized_gemv,
    quantized_moe_decode,
    rmsnorm,
    sampling,
    token_feed,
    weight_check,
)


def nvrtc_library() -> ctypes.CDLL | None:
    """libnvrtc from an ``nvidia`` wheel of this environment or the system, or None."""
    candidates = []
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cu1*", "lib", "libnvrtc.so*")), reverse=True)
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")), reverse=True)
    candidates += ["libnvrtc.so"]
    for candidate in candidates:
        if "builtins" in os.path.basename(candidate) or "alt" in os.path.basename(candidate):
            continue
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


def cuda_headers() -> str | None:
    """A folder with ``cuda_bf16.h``: numba-cuda's copy for the newest CUDA it ships, or the toolkit's."""
    import numba.cuda

    base = os.path.join(os.path.dirname(numba.cuda.__file__), "include")
    versions = sorted((d for d in os.listdir(base) if d.isdigit()), key=int) if os.path.isdir(base) else []
    for folder in [os.path.join(base, v) for v in reversed(versions)] + ["/usr/local/cuda/include"]:
        if os.path.isfile(os.path.join(folder, "cuda_bf16.h")):
            return folder
    return None


def compile_with_nvrtc(library: ctypes.CDLL, code: str, optimize: bool = True, arch: str = "90",
                       front_end_only: bool = False) -> str:
    """PTX of ``code``; with ``front_end_only``, NVVM IR instead (``-dlto``: every template
    instantiated and checked, no code generated) and an empty string."""
    program = ctypes.c_void_p()
    assert library.nvrtcCreateProgram(ctypes.byref(program), code.encode(), b"kernels.cu", 0, None, None) == 0
    options = [b"--std=c++17", f"-arch=compute_{arch}".encode()] + ([] if optimize else [b"-G"])
    if front_end_only:
        options = [b"--std=c++17", f"-arch=compute_{arch}".encode(), b"-dlto"]
    headers = cuda_headers()
    if headers is not None:
        options.append(f"-I{headers}".encode())
    try:
        result = library.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        library.nvrtcGetProgramLog(program, log)
        assert result == 0, log.value.decode(errors="replace")[-4000:]
        if front_end_only:
            return ""
        library.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        library.nvrtcGetPTX(program, ptx)
        return ptx.value.decode()
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


def compile_to_ptx(tmp_path, code: str, optimize: bool = True, arch: str = "90") -> str:
    """PTX of ``code`` for compute capability 9.0 (``arch`` "90a": with Hopper's
    architecture-specific instructions); without ``optimize``, unoptimized device code (a check
    that it compiles, a third of the time)."""
    library = nvrtc_library()
    if library is not None:
        return compile_with_nvrtc(library, code, optimize, arch)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("neither NVRTC nor nvcc to compile the CUDA sources")
    source = tmp_path / "kernels.cu"
    source.write_text(code)
    ptx = tmp_path / "kernels.ptx"
    result = subprocess.run([nvcc, f"-arch=sm_{arch}", "-std=c++17", "-ptx", str(source), "-o", str(ptx)]
                            + ([] if optimize else ["-G"]), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return ptx.read_text()


def entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", ptx))


#: Instantiations of a list that also go through code generation (unoptimized PTX), spread over it.
PTX_SAMPLE = 8


def check_instantiations(tmp_path, source: str, lines: list[str], plain_entries: int = 0) -> None:
    """Every explicit instantiation of ``lines`` compiles: all of them through NVRTC's front end
    (instantiated and type-checked into NVVM IR; an instantiation of a template that does not
    exist, or with arguments it cannot take, fails there), and :data:`PTX_SAMPLE` of them spread
    over the list through code generation to unoptimized PTX, which must hold an entry for each
    of them and for the ``plain_entries`` kernels of ``source`` that are no template. Where no
    NVRTC is loadable, all of them to PTX with nvcc."""
    assert len(set(lines)) == len(lines), "an instantiation is listed twice"
    library = nvrtc_library()
    if library is None:
        assert len(entries(compile_to_ptx(tmp_path, source + "".join(lines), optimize=False))) == len(lines) + plain_entries
        return
    compile_with_nvrtc(library, source + "".join(lines), front_end_only=True)
    sample = lines[:: max(1, len(lines) // PTX_SAMPLE)]
    assert len(entries(compile_with_nvrtc(library, source + "".join(sample), optimize=False))) == len(sample) + plain_entries


@pytest.mark.parametrize("module", [activation, attention_combine, attention_latent, embedding, gdn_decode, greedy_sample,
                                    head_linear, lora, moe_decode, moe_grouped, moe_route_decode, qkv_rope, rmsnorm, sampling,
                                    token_feed, weight_check],
                         ids=lambda m: m.__name__.split(".")[-1])
def test_every_kernel_name_is_an_entry(tmp_path, module):
    assert set(module.KERNEL_NAMES) <= entries(compile_to_ptx(tmp_path, module.source()))


def test_every_decode_gemv_instantiation_compiles(tmp_path):
    signature = ("const void*, const float*, const unsigned short*, float, float, float*, const uint4*, const float*, "
                 "void*, int, int, int")
    names = [decode_gemv.kernel_name(mode, bf16_out, split, unroll, tiles) for mode in decode_gemv.MODES
             for bf16_out in (False, True) for split in decode_gemv.SPLITS for unroll in decode_gemv.UNROLLS
             for tiles in decode_gemv.ROW_TILES]
    # (Every combination of the template arguments must instantiate: a front-end check. The
    # optimized build is the GPU's, at the kernels' first launch.)
    check_instantiations(tmp_path, decode_gemv.source(), [f"template __global__ void {name}({signature});\n" for name in names])


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_decode_attention_compiles_for_every_head_size(tmp_path, head_dim, fp8):
    from metrale.kernels import attention_decode_mma

    code = attention_decode_mma.kernel_source(head_dim, fp8=fp8)
    assert "decode_attention_mma" in entries(compile_to_ptx(tmp_path, code))


@pytest.mark.parametrize("fp8", [False, True])
def test_the_latent_attention_compiles_over_either_cache(tmp_path, fp8):
    from metrale.kernels import attention_latent_mma

    assert "latent_attention_mma" in entries(compile_to_ptx(tmp_path, attention_latent_mma.kernel_source(fp8)))


@pytest.mark.parametrize("head_dim, value_dim", [(32, 32), (64, 64), (192, 128), (256, 256)])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_rows", [False, True])
def test_the_prompt_attention_compiles_for_every_head_size(tmp_path, head_dim, value_dim, softcap, fp8, head_rows):
    from metrale.kernels import attention_mma

    code = attention_mma.kernel_source(head_dim, value_dim, softcap, fp8=fp8, head_rows=head_rows)
    assert "prefill_attention_mma" in entries(compile_to_ptx(tmp_path, code, optimize=False))


@pytest.mark.parametrize("head_dim, value_dim", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("softcap", [False, True])
def test_the_hopper_prompt_attention_compiles_for_sm_90a(tmp_path, head_dim, value_dim, softcap):
    from metrale.kernels import attention_hopper

    code = attention_hopper.kernel_source(head_dim, value_dim, softcap)
    ptx = compile_to_ptx(tmp_path, code, arch="90a")
    assert "prefill_attention_wgmma" in entries(ptx)
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.3d" in ptx and "setmaxnreg" in ptx


def test_every_quantized_gemv_instantiation_compiles(tmp_path):
    gemv = ("const float*, const int*, float, int, const uint4*, const float*, const unsigned char*, const float*, "
            "const float*, int, int, int, const float*, float*, int, int, int")
    names = [quantized_gemv.kernel_name(codes, activations, split, tiles, exact, shared, load)
             for codes in quantized_gemv.CODES for activations in quantized_gemv.ACTIVATIONS
             for split in quantized_gemv.SPLITS for tiles in quantized_gemv.ROW_TILES for exact in (False, True)
             for shared in (False, True) for load in quantized_gemv.LOAD_CHUNKS
             if load <= (4 if codes in ("int4", "mxfp4") else 2)]
    instantiations = "".join(f"template __global__ void {name}({gemv});\n" for name in names)
    # With bf16 input rows: every code and scheme at one split and row tile (the input's reads are
    # the prologue's, the same in every instance).
    bf16_names = [quantized_gemv.kernel_name(codes, activations, 1, 1, exact, shared, 1, bf16_input=True)
                  for codes in quantized_gemv.CODES for activations in quantized_gemv.ACTIVATIONS
                  for exact in (False, True) for shared in (False, True)]
    instantiations += "".join(f"template __global__ void {name}(const unsigned short*{gemv[len('const float*'):]});\n"
                              for name in bf16_names)
    names += bf16_names
    stagers = []
    for input_type, bf16_input in (("const float*", False), ("const unsigned short*", True)):
        stage_rows = f"{input_type}, const int*, float, int, uint4*, float*, int"
        typed = sorted({quantized_gemv.stage_rows_name(activations, exact, bf16_input)
                        for activations in quantized_gemv.ACTIVATIONS for exact in (False, True)})
        instantiations += "".join(f"template __global__ void {name}({stage_rows});\n" for name in typed)
        stagers += typed
    dequantize = "const unsigned char*, const float*, const float*, int, int, int, uint4*, int, int"
    instantiations += "".join(f"template __global__ void dequantize_bf16<{number}>({dequantize});\n"
                              for number in quantized_gemv.CODES.values())
    staging = "const float*, const int*, float, int, unsigned short*, int, int"
    instantiations += "".join(f"template __global__ void stage_activations<{number}>({staging});\n"
                              for number in quantized_gemv.ACTIVATIONS.values())
    fp8_rows = "{input}, const int*, float, unsigned char*, float*, int"
    instantiations += "".join(f"template __global__ void quantize_rows_fp8<{quantized_gemv.ACTIVATIONS[a]}, "
                              f"{quantized_gemv.input_type(bf16)}>"
                              f"({fp8_rows.format(input=quantized_gemv.input_type(bf16) + ' const*')});\n"
                              for a in ("fp8_token", "fp8_tensor") for bf16 in (False, True))
    silu_rows = "const uint4*, float, unsigned char*, float*, int"
    norm_rows = "const float*, float*, const unsigned short*, float, float, int, float, unsigned char*, float*, int"
    instantiations += "".join(f"template __global__ void {kernel}<{quantized_gemv.ACTIVATIONS[a]}>({signature});\n"
                              for kernel, signature in (("silu_and_mul_fp8_rows", silu_rows),
                                                        ("rmsnorm_fp8_rows", norm_rows))
                              for a in ("fp8_token", "fp8_tensor"))
    lines = instantiations.splitlines(keepends=True)
    assert len(lines) == len(names) + len(stagers) + len(quantized_gemv.CODES) + len(quantized_gemv.ACTIVATIONS) + 8
    check_instantiations(tmp_path, quantized_gemv.source(), lines, plain_entries=1)   # scale_product


def test_every_fp8_gemv_instantiation_compiles(tmp_path):
    from metrale.kernels import fp8_gemv

    arguments = ("{input}, float, const uint4*, const float*, const unsigned char*, const float*, int, const float*, "
                 "float*, int, int, int, const float*, const unsigned short*, float, float, float*, const int*, int")
    names = [(fp8_gemv.kernel_name(activations, split, tiles, shared, unroll, bf16_input, swiglu),
              arguments.format(input="const unsigned short*" if bf16_input else "const float*"))
             for activations in fp8_gemv.ACTIVATIONS for split in quantized_gemv.SPLITS
             for tiles in quantized_gemv.ROW_TILES for shared in (False, True) for unroll in (2, fp8_gemv.UNROLL)
             for bf16_input in (False, True) for swiglu in (False, True)]
    # The norm prologue: float32 rows staged in shared memory (one row tile).
    names += [(fp8_gemv.kernel_name(activations, split, 1, True, fp8_gemv.UNROLL, False, swiglu, True),
               arguments.format(input="const float*"))
              for activations in ("fp8_token", "fp8_tensor") for split in quantized_gemv.SPLITS for swiglu in (False, True)]
    # The routed-expert form: one row, staged in shared memory; float32 or bf16 rows into the gated
    # product, bf16 rows into the down product.
    names += [(fp8_gemv.kernel_name(activations, split, 1, True, fp8_gemv.UNROLL, bf16_input, swiglu, False, True),
               arguments.format(input="const unsigned short*" if bf16_input else "const float*"))
              for activations in fp8_gemv.ACTIVATIONS for split in quantized_gemv.SPLITS
              for swiglu, bf16_input in ((True, False), (True, True), (False, True))]
    check_instantiations(tmp_path, fp8_gemv.source(),
                         [f"template __global__ void {name}({signature});\n" for name, signature in names],
                         plain_entries=1)  # expert_slot_sum


def test_every_int4_gemv_instantiation_compiles(tmp_path):
    from metrale.kernels import int4_gemv

    arguments = ("{input}, const int*, const uint4*, const unsigned char*, const float*, const float*, int, "
                 "const float*, float*, int, int, int")
    tilings = sorted({(1, 2), (1, int4_gemv.UNROLL)} | set(int4_gemv.UNROLL_BY_WEIGHT_TILES.items()))
    assert {int4_gemv.warp_tiling(rows) for rows in range(1, int4_gemv.MAX_ROWS + 1)} <= set(tilings)
    names = [(int4_gemv.kernel_name(split, tiles, shared, zeros, unroll, bf16_input, swiglu, weight_tiles),
              arguments.format(input="const unsigned short*" if bf16_input else "const float*"))
             for split in quantized_gemv.SPLITS for tiles in quantized_gemv.ROW_TILES for shared in (False, True)
             for zeros in (False, True) for weight_tiles, unroll in tilings for bf16_input in (False, True)
             for swiglu in (False, True)]
    names += [(int4_gemv.stage_name(bf16_input), f"{'const unsigned short*' if bf16_input else 'const float*'}, "
               "const int*, uint4*, int") for bf16_input in (False, True)]
    check_instantiations(tmp_path, int4_gemv.source(),
                         [f"template __global__ void {name}({signature});\n" for name, signature in names])


def test_every_quantized_moe_instantiation_compiles(tmp_path):
    weight = "float, int, const unsigned char*, const float*, const float*, int, int, int"
    gate_up = f"const float*, const int*, {weight}, unsigned short*, int, int, int"
    down = f"const unsigned short*, const int*, const float*, {weight}, float*, int, int, int"
    pairs = [(codes, act) for codes in quantized_gemv.CODES.values() for act in quantized_gemv.ACTIVATIONS.values()]
    lines = [line for c, a in pairs for line in (f"template __global__ void quantized_moe_gate_up<{c}, {a}>({gate_up});\n",
                                                   f"template __global__ void quantized_moe_down<{c}, {a}>({down});\n")]
    check_instantiations(tmp_path, quantized_moe_decode.source(), lines)


def test_the_batch_invariant_linear_compiles(tmp_path):
    from metrale.kernels import linear_invariant

    signature = "const unsigned short*, const unsigned short*, const float*, float*, int, int, int, int"
    code = (linear_invariant.source()
            + "".join(f"template __global__ void {name}({signature});\n" for name in linear_invariant.INSTANTIATIONS))
    ptx = compile_to_ptx(tmp_path, code)
    assert len(entries(ptx)) == len(linear_invariant.INSTANTIATIONS) + 1  # and the sum of the slices
    assert "mma.sync.aligned.m16n8k16" in ptx and "cp.async" in ptx
