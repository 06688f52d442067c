"""The quantized decode GEMV and the bf16 dequantization (:mod:`metrale.kernels.quantized_gemv`) run
on the host through the CUDA emulation header against their NumPy references: every weight code
(FP8, INT4, INT8, MXFP4), every activation scheme, per-tensor, per-channel, group and block scales,
zero points, act-order, one to four row tiles, splits of the input over warps, grids smaller than
the column tiles."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import activation, rmsnorm
from metrale.kernels import quantized_gemv as qg
from metrale.kernels.activation import silu_and_mul_reference
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import (
    QuantizedWeight,
    float32_to_fp8_e4m3,
    fp8_e4m3_table,
    pack_nibbles,
    quantize_activations,
    quantized_linear_reference,
)

# (codes, activations, split, row tiles, exact) instantiated in the emulated program, each with
# the rows staged in shared memory and in the global workspace.
INSTANCES = [(*instance, exact) for instance in [
    ("fp8", "fp8_token", 1, 1), ("fp8", "fp8_token", 4, 2), ("fp8", "fp8_group", 2, 1), ("fp8", "fp8_tensor", 1, 4),
    ("fp8", "weight_only", 8, 1), ("int4", "weight_only", 1, 1), ("int4", "weight_only", 2, 4),
    ("int8", "int8_token", 4, 1), ("int8", "weight_only", 1, 2), ("mxfp4", "weight_only", 2, 1),
] for exact in (False, True)]


# Instances also built with bf16 input rows (INPUT unsigned short), each with the rows staged in
# shared memory and in the global workspace.
BF16_INSTANCES = [("fp8", "fp8_token", 1, 1, True), ("fp8", "fp8_group", 2, 1, True), ("int4", "weight_only", 1, 1, True),
                  ("int8", "int8_token", 4, 1, True), ("fp8", "fp8_token", 4, 2, False)]


def loads(codes: str) -> tuple[int, ...]:
    """The chunks a lane may load at once with these codes (qg.load_chunks picks one)."""
    return tuple(n for n in qg.LOAD_CHUNKS if n <= (4 if codes in ("int4", "mxfp4") else 2))


def emulation_main() -> str:
    dispatch = "\n".join(
        f"    if (codes == {qg.CODES[c]} && act == {qg.ACTIVATIONS[a]} && split == {s} && tiles == {t} && exact == "
        f"{int(e)} && shared == {int(shared)} && load == {n} && bf16 == {int(b)}) {{ emu::launch({{(unsigned)blocks, "
        f"1, 1}}, {{THREADS, 1, 1}}, [&] {{ {qg.kernel_name(c, a, s, t, e, shared, n, b)}({'x16' if b else 'x'}, "
        f"order, input_scale, act_group, staged_rows, staged_scales, code_bytes, scales, zeros, block_rows, "
        f"block_columns, scale_columns, bias, out, rows, K, N); }}); found = true; }}"
        for b, instances in ((False, INSTANCES), (True, BF16_INSTANCES)) for c, a, s, t, e in instances
        for shared in (False, True) for n in loads(c))
    stage_rows = "\n".join(
        f"        if (act == {qg.ACTIVATIONS[a]} && exact == {int(e)} && bf16 == {int(b)}) emu::launch("
        f"{{(unsigned)rows, 1, 1}}, {{THREADS, 1, 1}}, [&] {{ {qg.stage_rows_name(a, e, b)}({'x16' if b else 'x'}, "
        f"order, input_scale, act_group, staged_rows, staged_scales, K); }});"
        for a in qg.ACTIVATIONS for e in (False, True) for b in (False, True))
    staging = "\n".join(
        f"        if (act == {number}) emu::launch({{(unsigned)rows, (unsigned)groups, 1}}, {{THREADS, 1, 1}}, [&] {{ "
        f"stage_activations<{number}>(x, order, input_scale, act_group, staged, rows, K); }});"
        for number in qg.ACTIVATIONS.values())
    dequantize = "\n".join(
        f"        if (codes == {number}) emu::launch({{(unsigned)blocks, 1, 1}}, {{64, 1, 1}}, [&] {{ "
        f"dequantize_bf16<{number}>(code_bytes, scales, zeros, block_rows, block_columns, scale_columns, "
        f"reinterpret_cast<uint4*>(dense), N, K); }});"
        for number in qg.CODES.values())
    return r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 20) emu::fail("usage: folder codes act split tiles rows K N blocks block_rows block_columns "
                              "scale_columns act_group input_scale flags(order zeros bias) dequantize exact shared "
                              "load");
    const std::string folder = argv[1];
    const int codes = std::atoi(argv[2]), act = std::atoi(argv[3]), split = std::atoi(argv[4]);
    const int tiles = std::atoi(argv[5]), rows = std::atoi(argv[6]), K = std::atoi(argv[7]), N = std::atoi(argv[8]);
    const int blocks = std::atoi(argv[9]), block_rows = std::atoi(argv[10]), block_columns = std::atoi(argv[11]);
    const int scale_columns = std::atoi(argv[12]), act_group = std::atoi(argv[13]);
    const float input_scale = std::atof(argv[14]);
    const int flags = std::atoi(argv[15]), only_dequantize = std::atoi(argv[16]), exact = std::atoi(argv[17]);
    const int shared = std::atoi(argv[18]), load = std::atoi(argv[19]);
    if (only_dequantize == 5) {   // silu_and_mul_fp8_rows of gate_up_bf16 [rows, 2K]
        const unsigned short* gate_up = read<unsigned short>(folder + "/gate_up_bf16", (size_t)rows * 2 * K);
        unsigned char* fp8 = allocate<unsigned char>((size_t)rows * K);
        float* row_scales = allocate<float>(rows);
        const uint4* words = reinterpret_cast<const uint4*>(gate_up);
        if (act == ACT_FP8_TOKEN) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            silu_and_mul_fp8_rows<ACT_FP8_TOKEN>(words, input_scale, fp8, row_scales, K); });
        if (act == ACT_FP8_TENSOR) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            silu_and_mul_fp8_rows<ACT_FP8_TENSOR>(words, input_scale, fp8, row_scales, K); });
        // The unfused path: silu_and_mul_words, then quantize_rows_fp8 of its bf16 rows.
        unsigned short* gated = allocate<unsigned short>((size_t)rows * K);
        unsigned char* unfused = allocate<unsigned char>((size_t)rows * K);
        float* unfused_scales = allocate<float>(rows);
        emu::launch({(unsigned)rows, (unsigned)((K / 8 + 127) / 128), 1}, {128, 1, 1}, [&] {
            silu_and_mul_words(words, reinterpret_cast<uint4*>(gated), K); });
        if (act == ACT_FP8_TOKEN) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TOKEN, unsigned short>(gated, nullptr, input_scale, unfused, unfused_scales, K); });
        if (act == ACT_FP8_TENSOR) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TENSOR, unsigned short>(gated, nullptr, input_scale, unfused, unfused_scales, K); });
        write(folder + "/fp8", fp8, (size_t)rows * K);
        write(folder + "/row_scales", row_scales, rows);
        write(folder + "/fp8_unfused", unfused, (size_t)rows * K);
        write(folder + "/row_scales_unfused", unfused_scales, rows);
        return 0;
    }
    if (only_dequantize == 6) {   // rmsnorm_fp8_rows of x and residual [rows, K] (flags & 16: add the residual)
        const float* x = read<float>(folder + "/x", (size_t)rows * K);
        float* residual = read<float>(folder + "/residual", (size_t)rows * K);
        float* residual_unfused = read<float>(folder + "/residual", (size_t)rows * K);
        const unsigned short* gains = read<unsigned short>(folder + "/norm_weight", K);
        const float* norm = read<float>(folder + "/norm_params", 2);   // eps, offset
        const int add = (flags & 16) != 0;
        unsigned char* fp8 = allocate<unsigned char>((size_t)rows * K);
        float* row_scales = allocate<float>(rows);
        if (act == ACT_FP8_TOKEN) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            rmsnorm_fp8_rows<ACT_FP8_TOKEN>(x, residual, gains, norm[0], norm[1], add, input_scale, fp8, row_scales, K); });
        if (act == ACT_FP8_TENSOR) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            rmsnorm_fp8_rows<ACT_FP8_TENSOR>(x, residual, gains, norm[0], norm[1], add, input_scale, fp8, row_scales, K); });
        // The unfused path: rmsnorm_residual_words, then quantize_rows_fp8 of its bf16 rows.
        unsigned short* normed = allocate<unsigned short>((size_t)rows * K);
        unsigned char* unfused = allocate<unsigned char>((size_t)rows * K);
        float* unfused_scales = allocate<float>(rows);
        emu::launch({(unsigned)rows, 1, 1}, {NORM_WORD_THREADS, 1, 1}, [&] {
            rmsnorm_residual_words(x, residual_unfused, gains, norm[0], norm[1], add, normed, K); });
        if (act == ACT_FP8_TOKEN) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TOKEN, unsigned short>(normed, nullptr, input_scale, unfused, unfused_scales, K); });
        if (act == ACT_FP8_TENSOR) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TENSOR, unsigned short>(normed, nullptr, input_scale, unfused, unfused_scales, K); });
        write(folder + "/fp8", fp8, (size_t)rows * K);
        write(folder + "/row_scales", row_scales, rows);
        write(folder + "/summed", residual, (size_t)rows * K);
        write(folder + "/fp8_unfused", unfused, (size_t)rows * K);
        write(folder + "/row_scales_unfused", unfused_scales, rows);
        write(folder + "/summed_unfused", residual_unfused, (size_t)rows * K);
        write(folder + "/normed_unfused", normed, (size_t)rows * K);
        return 0;
    }
    if (only_dequantize == 4) {   // scale_product of x [rows, K] in place, gridDim.y = blocks
        float* product = read<float>(folder + "/x", (size_t)rows * K);
        const float* row_scales = read<float>(folder + "/row_scales_in", rows);
        const float* column_scales = read<float>(folder + "/column_scales", K);
        const unsigned wide = K % 4 == 0 ? K / 4 : K;
        emu::launch({(wide + THREADS - 1) / THREADS, (unsigned)blocks, 1}, {THREADS, 1, 1}, [&] {
            scale_product(product, row_scales, column_scales, rows, K); });
        write(folder + "/out", product, (size_t)rows * K);
        return 0;
    }
    const size_t code_count = (size_t)N * (codes == 1 || codes == 3 ? K / 2 : K);
    const unsigned char* code_bytes = read<unsigned char>(folder + "/codes", code_count);
    const size_t scale_count = (size_t)((N + block_rows - 1) / block_rows) * scale_columns;
    const float* scales = read<float>(folder + "/scales", scale_count);
    const float* zeros = flags & 2 ? read<float>(folder + "/zeros", scale_count) : nullptr;
    if (only_dequantize == 1) {
        unsigned short* dense = allocate<unsigned short>((size_t)N * K);
""" + dequantize + r"""
        write(folder + "/dense", dense, (size_t)N * K);
        return 0;
    }
    const float* x = read<float>(folder + "/x", (size_t)rows * K);
    const int bf16 = (flags & 8) != 0;   // the rows also as bf16 bits, for the bf16-input instances
    const unsigned short* x16 = bf16 ? read<unsigned short>(folder + "/x_bf16", (size_t)rows * K) : nullptr;
    const int* order = flags & 1 ? read<int>(folder + "/order", K) : nullptr;
    const float* bias = flags & 4 ? read<float>(folder + "/bias", N) : nullptr;
    float* out = allocate<float>((size_t)rows * N);
    if (only_dequantize == 3) {
        unsigned char* fp8 = allocate<unsigned char>((size_t)rows * K);
        float* row_scales = allocate<float>(rows);
        if (act == ACT_FP8_TOKEN && !bf16) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TOKEN, float>(x, order, input_scale, fp8, row_scales, K); });
        if (act == ACT_FP8_TENSOR && !bf16) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TENSOR, float>(x, order, input_scale, fp8, row_scales, K); });
        if (act == ACT_FP8_TOKEN && bf16) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TOKEN, unsigned short>(x16, order, input_scale, fp8, row_scales, K); });
        if (act == ACT_FP8_TENSOR && bf16) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            quantize_rows_fp8<ACT_FP8_TENSOR, unsigned short>(x16, order, input_scale, fp8, row_scales, K); });
        write(folder + "/fp8", fp8, (size_t)rows * K);
        write(folder + "/row_scales", row_scales, rows);
        return 0;
    }
    if (only_dequantize == 2) {
        const int groups = act == ACT_FP8_GROUP ? (K + act_group - 1) / act_group : 1;
        unsigned short* staged = allocate<unsigned short>((size_t)rows * K);
""" + staging + r"""
        write(folder + "/staged", staged, (size_t)rows * K);
        return 0;
    }
    uint4* staged_rows = nullptr;
    float* staged_scales = nullptr;
    if (!shared) {
        const int groups = act == ACT_FP8_GROUP ? (K + act_group - 1) / act_group : 1;
        staged_rows = allocate<uint4>((size_t)rows * ((K + 63) / 64) * 8);
        staged_scales = allocate<float>((size_t)rows * groups);
""" + stage_rows + r"""
    }
    bool found = false;
""" + dispatch + r"""
    if (!found) emu::fail("no such instance");
    write(folder + "/out", out, (size_t)rows * N);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized_gemv_emulated")
    source = (qg.CONSTANTS + qg.HELPERS + qg.DEVICE_FUNCTIONS + qg.KERNELS + activation.KERNEL + rmsnorm.KERNEL
              + emulation_main())
    binary = build_emulated(folder / "quantized_gemv.cpp", source)

    def run(weight: QuantizedWeight, x=None, bias=None, *, split=1, blocks=2, dequantize_only=False,
            stage_only=False, exact=None, fp8_rows=False, shared=True, load=None, bf16_input=False):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        out_features, inner = weight.shape
        np.ascontiguousarray(weight.codes).tofile(case / "codes")
        np.ascontiguousarray(weight.scales, np.float32).tofile(case / "scales")
        flags = 0
        if weight.input_order is not None:
            np.ascontiguousarray(weight.input_order, np.int32).tofile(case / "order")
            flags |= 1
        if weight.zeros is not None:
            np.ascontiguousarray(weight.zeros, np.float32).tofile(case / "zeros")
            flags |= 2
        if bias is not None:
            np.ascontiguousarray(bias, np.float32).tofile(case / "bias")
            flags |= 4
        rows = 1 if x is None else x.shape[0]
        if x is not None:
            np.ascontiguousarray(x, np.float32).tofile(case / "x")
        if bf16_input:
            float32_to_bf16(np.ascontiguousarray(x, np.float32)).tofile(case / "x_bf16")
            flags |= 8
        input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
        arguments = [qg.CODES[weight.codes_format], qg.ACTIVATIONS[weight.activations], split, qg.row_tiles(rows), rows,
                     inner, out_features, blocks, weight.block[0], weight.block[1], weight.scales.shape[1],
                     weight.activation_group, repr(input_scale), flags,
                     3 if fp8_rows else 2 if stage_only else int(dequantize_only),
                     int(qg.exact_path(weight) if exact is None else exact), int(shared)]
        arguments.append(qg.load_chunks(weight, bool(arguments[-2])) if load is None else load)
        subprocess.run([str(binary), str(case), *map(str, arguments)], check=True, timeout=600)
        if fp8_rows:
            return (np.fromfile(case / "fp8", np.uint8).reshape(rows, inner),
                    np.fromfile(case / "row_scales", np.float32))
        if stage_only:
            return bf16_to_float32(np.fromfile(case / "staged", np.uint16).reshape(rows, inner))
        if dequantize_only:
            return bf16_to_float32(np.fromfile(case / "dense", np.uint16).reshape(out_features, inner))
        return np.fromfile(case / "out", np.float32).reshape(rows, out_features)

    run.binary, run.folder = binary, folder  # type: ignore[attr-defined]
    return run


def make_weight(rng: np.random.Generator, codes: str, out: int, inner: int, block: tuple[int, int], *,
                activations: str = "weight_only", asymmetric: bool = False, act_order: bool = False) -> QuantizedWeight:
    scale_shape = (-(-out // block[0]), -(-inner // block[1]))
    scales = rng.uniform(0.01, 0.05, size=scale_shape).astype(np.float32)
    zeros = None
    if codes == "fp8":
        stored = float32_to_fp8_e4m3(rng.normal(size=(out, inner)).astype(np.float32) * 100)
    elif codes == "int8":
        stored = rng.integers(0, 256, size=(out, inner), dtype=np.uint8)
        zeros = rng.integers(100, 156, size=scale_shape).astype(np.float32) if asymmetric else None
    else:
        stored = pack_nibbles(rng.integers(0, 16, size=(out, inner), dtype=np.uint8))
        zeros = rng.integers(0, 16, size=scale_shape).astype(np.float32) if asymmetric and codes == "int4" else None
        if codes == "mxfp4":
            scales = np.exp2(rng.integers(-8, -2, size=scale_shape)).astype(np.float32)
    order = rng.permutation(inner).astype(np.int32) if act_order else None
    input_scale = np.asarray(0.02, np.float32) if activations == "fp8_tensor" else None
    return QuantizedWeight(codes, stored, scales, block, (out, inner), zeros=zeros, input_order=order,
                           activations=activations, input_scale=input_scale)


CASES = [
    # codes, activations, rows, inner, out, block, asymmetric, act_order, bias, split, blocks
    ("fp8", "fp8_token", 1, 64, 37, (1, 64), False, False, False, 1, 2),  # per channel; a partial tile
    ("fp8", "fp8_token", 13, 256, 40, (1, 256), False, False, True, 4, 1),  # two row tiles, a split
    ("fp8", "fp8_group", 3, 384, 150, (128, 128), False, False, False, 2, 3),  # DeepSeek blocks, ragged rows
    ("fp8", "fp8_tensor", 32, 128, 33, (33, 128), False, False, False, 1, 1),  # one scale for the matrix
    ("fp8", "weight_only", 5, 160, 20, (1, 32), False, False, False, 8, 2),  # 8 warps over 5 chunk quads
    ("int4", "weight_only", 1, 256, 48, (1, 128), False, False, False, 1, 1),  # W4A16, symmetric
    ("int4", "weight_only", 2, 128, 70, (1, 32), True, True, True, 1, 2),  # zero points and act-order
    ("int4", "weight_only", 27, 64, 19, (1, 64), True, False, False, 2, 2),  # four row tiles
    ("int8", "int8_token", 4, 96, 50, (1, 96), False, False, True, 4, 1),  # W8A8
    ("int8", "weight_only", 9, 128, 17, (1, 16), True, False, False, 1, 3),  # W8A16 with zero points
    ("mxfp4", "weight_only", 6, 128, 40, (1, 32), False, False, False, 2, 2),
    ("int4", "weight_only", 3, 288, 24, (1, 96), False, False, False, 1, 2),  # groups of 96: not a power of two
    ("fp8", "fp8_token", 2, 320, 300, (1, 320), False, False, True, 1, 1),  # 3 rounds of tiles, 9 steps (odd)
    ("int4", "weight_only", 1, 384, 200, (1, 128), True, False, False, 1, 1),  # 2 rounds, zero points
]


# Every case on the scaled-weights path; on the exact path too where its column blocks are whole
# steps of 32 input columns (the launcher's choice, qg.exact_path).
# Each with its rows staged in shared memory and in the global workspace.
PATHS = [pytest.param(*case, exact, shared, id=f"{'exact' if exact else 'scaled'}-{'shared' if shared else 'global'}-"
                      f"{case[0]}-{case[1]}-{case[2]}x{case[3]}")
         for case in CASES for exact in (True, False) if not exact or case[5][1] % 32 == 0 for shared in (True, False)]


@pytest.mark.parametrize("codes, activations, rows, inner, out, block, asymmetric, act_order, bias, split, blocks, "
                         "exact, shared", PATHS)
def test_emulated_gemv_matches_the_reference(emulated, codes, activations, rows, inner, out, block, asymmetric,
                                             act_order, bias, split, blocks, exact, shared):
    rng = np.random.default_rng(rows * 1000 + inner)
    weight = make_weight(rng, codes, out, inner, block, activations=activations, asymmetric=asymmetric,
                         act_order=act_order)
    assert qg.exact_path(weight) or not exact
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    x[0, :7] *= 50  # one row with a few large values: its scale differs from the others'
    bias_values = rng.normal(size=out).astype(np.float32) if bias else None
    expected = qg.quantized_gemv_reference(x, weight, bias_values, exact=exact)
    scale = np.abs(expected).max()
    full_precision = quantized_linear_reference(x, weight, bias_values)
    # The launcher's load width, and each narrower one (all serve the same scale blocks).
    widths = [n for n in loads(codes) if n <= qg.load_chunks(weight, exact)]
    assert widths[0] == qg.load_chunks(weight, exact)
    for load in widths:
        got = emulated(weight, x, bias_values, split=split, blocks=blocks, exact=exact, shared=shared, load=load)
        assert np.abs(got - expected).max() <= 1e-5 * scale, load
        # And the GPU's rounding (bf16 inputs and weights) stays within bf16's error of the exact math.
        assert np.abs(got - full_precision).max() <= 2e-2 * np.abs(full_precision).max(), load


BF16_CASES = [pytest.param(*case, exact, shared, id=f"{'exact' if exact else 'scaled'}-{'shared' if shared else 'global'}-"
                           f"{case[0]}-{case[1]}-{case[2]}x{case[3]}")
              for case in CASES for exact in (True, False) for shared in (True, False)
              if (case[0], case[1], case[9], qg.row_tiles(case[2]), exact) in BF16_INSTANCES]


@pytest.mark.parametrize("codes, activations, rows, inner, out, block, asymmetric, act_order, bias, split, blocks, "
                         "exact, shared", BF16_CASES)
def test_emulated_gemv_reads_bf16_rows_as_their_float32_values(emulated, codes, activations, rows, inner, out, block,
                                                               asymmetric, act_order, bias, split, blocks, exact,
                                                               shared):
    rng = np.random.default_rng(rows * 1000 + inner + 1)
    weight = make_weight(rng, codes, out, inner, block, activations=activations, asymmetric=asymmetric,
                         act_order=act_order)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32)))
    x[0, :7] *= 64  # exact in bf16 too
    bias_values = rng.normal(size=out).astype(np.float32) if bias else None
    as_float32 = emulated(weight, x, bias_values, split=split, blocks=blocks, exact=exact, shared=shared)
    as_bf16 = emulated(weight, x, bias_values, split=split, blocks=blocks, exact=exact, shared=shared, bf16_input=True)
    np.testing.assert_array_equal(as_bf16, as_float32)
    expected = qg.quantized_gemv_reference(x, weight, bias_values, exact=exact)
    assert np.abs(as_bf16 - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("codes, block, asymmetric", [
    ("fp8", (128, 128), False), ("int4", (1, 32), True), ("int8", (1, 64), False), ("mxfp4", (1, 32), False),
])
def test_emulated_dequantization_matches_the_reference(emulated, codes, block, asymmetric):
    weight = make_weight(np.random.default_rng(11), codes, 130, 192, block, asymmetric=asymmetric)
    assert np.array_equal(emulated(weight, dequantize_only=True, blocks=3), qg.dequantize_bf16_reference(weight))


@pytest.mark.parametrize("activations, act_order", [
    ("weight_only", True), ("fp8_token", False), ("fp8_tensor", False), ("fp8_group", True), ("int8_token", False),
])
def test_emulated_staging_quantizes_as_the_reference(emulated, activations, act_order):
    rng = np.random.default_rng(12)
    weight = make_weight(rng, "fp8", 16, 320, (1, 320), activations=activations, act_order=act_order)
    x = rng.normal(size=(3, 320)).astype(np.float32)
    x[1, 200:] *= 1000  # the second row's last groups dwarf its first: per-group scales differ
    assert np.array_equal(emulated(weight, x, stage_only=True), qg.stage_activations_reference(x, weight))


@pytest.mark.parametrize("activations", ["fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("bf16_input", [False, True])
@pytest.mark.parametrize("inner", [256, 260])  # 8 values a load, and one value a thread (rows of 260)
def test_emulated_fp8_rows_are_the_codes_the_reference_quantizes(emulated, activations, bf16_input, inner):
    rng = np.random.default_rng(13)
    weight = make_weight(rng, "fp8", 16, inner, (1, inner), activations=activations)
    x = rng.normal(size=(5, inner)).astype(np.float32) * np.array([[1.0], [300.0], [1e-3], [0.0], [2.0]], np.float32)
    if bf16_input:  # rows that bf16 holds exactly, read as bf16 bits
        x = bf16_to_float32(float32_to_bf16(x))
    codes, scales = emulated(weight, x, fp8_rows=True, bf16_input=bf16_input)
    expected_scales = (np.maximum(np.abs(x).max(axis=1) / 448.0, 1e-12).astype(np.float32)
                       if activations == "fp8_token" else np.full(5, 0.02, np.float32))
    assert np.array_equal(scales, expected_scales)
    assert np.array_equal(codes, float32_to_fp8_e4m3(x / expected_scales[:, None]))
    # The codes times the rows' scales are the inputs the reference's product takes.
    restored = fp8_e4m3_table()[codes] * scales[:, None]
    assert np.array_equal(restored, quantize_activations(x, weight))


@pytest.mark.parametrize("activations", ["fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("width", [8, 1032])
def test_emulated_silu_and_mul_fp8_rows_are_silu_and_mul_then_its_rows_codes(emulated, activations, width):
    """The fused kernel's codes and scales are those of silu_and_mul's bf16 rows quantized as
    quantize_rows_fp8 quantizes them (the unfused path), rows of very different magnitudes (enough of
    them that each position of a word holds some row's largest value)."""
    rows = 64
    rng = np.random.default_rng(width)
    magnitudes = np.resize(np.array([1.0, 30.0, 1e-3, 0.0, 4.0], np.float32), (rows, 1))
    gate_up = float32_to_bf16(rng.normal(size=(rows, 2 * width)).astype(np.float32) * magnitudes)
    weight = make_weight(rng, "fp8", 16, width, (1, width), activations=activations)
    case = emulated.folder / "silu_case"
    case.mkdir(exist_ok=True)
    gate_up.tofile(case / "gate_up_bf16")
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    arguments = [0, qg.ACTIVATIONS[activations], 1, 1, rows, width, 0, 1, 1, 1, 1, 128, repr(input_scale), 0, 5, 0, 1, 1]
    subprocess.run([str(emulated.binary), str(case), *map(str, arguments)], check=True, timeout=600)
    codes = np.fromfile(case / "fp8", np.uint8).reshape(rows, width)
    scales = np.fromfile(case / "row_scales", np.float32)
    # Bit for bit the unfused kernels' codes and scales (run in the same program).
    assert np.array_equal(codes, np.fromfile(case / "fp8_unfused", np.uint8).reshape(rows, width))
    assert np.array_equal(scales, np.fromfile(case / "row_scales_unfused", np.float32))
    # And the reference's quantized activations, up to the rare last-bit difference of the host's exp.
    values = bf16_to_float32(gate_up)
    act = bf16_to_float32(float32_to_bf16(silu_and_mul_reference(values[:, :width], values[:, width:])))
    expected = quantize_activations(act, weight)
    restored = fp8_e4m3_table()[codes] * scales[:, None]
    assert np.mean(restored != expected) < 1e-3
    assert np.allclose(restored, expected, rtol=0.07, atol=0)
    if activations == "fp8_token":
        assert np.allclose(scales, np.maximum(np.abs(act).max(axis=1) / 448.0, 1e-12), rtol=1e-2, atol=0)


@pytest.mark.parametrize("activations", ["fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("width, add_residual, offset", [(4, True, 0.0), (1028, True, 1.0), (8192, False, 0.0)])
def test_emulated_rmsnorm_fp8_rows_are_the_norm_then_its_rows_codes(emulated, activations, width, add_residual, offset):
    """The fused kernel's sums, codes and scales are those of rmsnorm_residual_words then
    quantize_rows_fp8 of its bf16 rows (the unfused path, bit for bit), rows of very different
    magnitudes, widths from one float4 word to the widest it keeps; and the reference's."""
    rows = 40
    rng = np.random.default_rng(width)
    magnitudes = np.resize(np.array([1.0, 30.0, 1e-3, 0.0, 4.0], np.float32), (rows, 1))
    x = (rng.normal(size=(rows, width)) * magnitudes).astype(np.float32)
    residual = (rng.normal(size=(rows, width)) * magnitudes).astype(np.float32)
    norm_weight = float32_to_bf16(rng.uniform(-1.5, 1.5, size=width).astype(np.float32))
    eps = 1e-5
    weight = make_weight(rng, "fp8", 16, width, (1, width), activations=activations)
    case = emulated.folder / "norm_case"
    case.mkdir(exist_ok=True)
    x.tofile(case / "x")
    residual.tofile(case / "residual")
    norm_weight.tofile(case / "norm_weight")
    np.array([eps, offset], np.float32).tofile(case / "norm_params")
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    # (codes act split tiles rows K N blocks block_rows block_columns scale_columns act_group input_scale
    # flags mode exact shared load): mode 6 is rmsnorm_fp8_rows, flags 16 adds the residual.
    arguments = [0, qg.ACTIVATIONS[activations], 1, 1, rows, width, 0, 1, 1, 1, 1, 128, repr(input_scale),
                 16 if add_residual else 0, 6, 0, 1, 1]
    subprocess.run([str(emulated.binary), str(case), *map(str, arguments)], check=True, timeout=600)
    codes = np.fromfile(case / "fp8", np.uint8).reshape(rows, width)
    scales = np.fromfile(case / "row_scales", np.float32)
    summed = np.fromfile(case / "summed", np.float32).reshape(rows, width)
    assert np.array_equal(codes, np.fromfile(case / "fp8_unfused", np.uint8).reshape(rows, width))
    assert np.array_equal(scales, np.fromfile(case / "row_scales_unfused", np.float32))
    assert np.array_equal(summed, np.fromfile(case / "summed_unfused", np.float32).reshape(rows, width))
    # And the references: the sum, the norm's bf16 rows (to their last bit), their quantized values.
    assert np.array_equal(summed, x + residual if add_residual else x)
    normed, _ = rmsnorm.rmsnorm_residual_reference(x, residual if add_residual else None,
                                                   bf16_to_float32(norm_weight), eps, offset)
    got_normed = bf16_to_float32(np.fromfile(case / "normed_unfused", np.uint16).reshape(rows, width))
    assert np.allclose(got_normed, normed, rtol=2 ** -7, atol=0)
    expected = quantize_activations(got_normed, weight)
    assert np.array_equal(fp8_e4m3_table()[codes] * scales[:, None], expected)


@pytest.mark.parametrize("rows, columns, grid_rows", [(7, 64, 3), (5, 67, 2), (3, 8, 8)])
def test_emulated_scale_product_scales_rows_then_columns(emulated, rows, columns, grid_rows):
    """Quads of columns and single columns (an odd width); fewer, and more, grid rows than rows."""
    rng = np.random.default_rng(rows * columns)
    product = rng.normal(size=(rows, columns)).astype(np.float32) * 1e3
    row_scales = rng.uniform(1e-3, 1e-1, size=rows).astype(np.float32)
    column_scales = rng.uniform(1e-4, 1e-2, size=columns).astype(np.float32)
    case = emulated.folder / "scale_case"
    case.mkdir(exist_ok=True)
    product.tofile(case / "x")
    row_scales.tofile(case / "row_scales_in")
    column_scales.tofile(case / "column_scales")
    # (codes act split tiles rows K N blocks block_rows block_columns scale_columns act_group input_scale
    # flags mode exact shared load): mode 4 is scale_product, blocks its grid's rows.
    arguments = [0, 0, 1, 1, rows, columns, 0, grid_rows, 1, 1, 1, 128, "1.0", 0, 4, 0, 1, 1]
    subprocess.run([str(emulated.binary), str(case), *map(str, arguments)], check=True, timeout=600)
    got = np.fromfile(case / "out", np.float32).reshape(rows, columns)
    expected = (product * row_scales[:, None]).astype(np.float32) * column_scales[None, :]
    assert np.array_equal(got, expected)


def test_supports_and_plan():
    weight = make_weight(np.random.default_rng(0), "fp8", 64, 256, (1, 256), activations="fp8_token")
    assert qg.supports(1, weight) and qg.supports(32, weight)
    assert not qg.supports(33, weight) and not qg.supports(0, weight)
    odd = make_weight(np.random.default_rng(0), "int4", 16, 48, (1, 16))
    assert not qg.supports(1, odd)  # the inner size is not a multiple of 32
    # The GEMV's prologue stages one row where it fits shared memory, and up to four where the
    # column tiles are not split (4,096 columns of 132 multiprocessors split 8 ways, 28,672 not);
    # stage_rows stages the rest.
    for rows, inner, columns, shared in [(1, 14336, 4096, True), (1, 4096, 28672, True), (1, 120000, 64, False),
                                         (2, 4096, 4096, False), (2, 4096, 28672, True), (4, 4096, 28672, True),
                                         (4, 14336, 4096, False), (5, 4096, 28672, False), (8, 14336, 28672, False),
                                         (32, 4096, 28672, False)]:
        wide = QuantizedWeight("fp8", np.zeros((columns, inner), np.uint8), np.ones((columns, 1), np.float32),
                               (1, inner), (columns, inner), activations="fp8_token")
        assert qg.supports(rows, wide) and qg.shared_stage(rows, wide, 132) == shared, (rows, inner, columns)
        assert qg.workspace_shapes(rows, wide) == ((rows, inner // 2), (rows, 1))
    split, blocks = qg.plan(4096, 132)
    assert (split, blocks) == (8, 256)  # 256 tiles: even split 8 leaves 132 multiprocessors short of 8 warps each
    assert qg.plan(64, 132) == (8, 4)
