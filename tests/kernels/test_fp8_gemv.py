"""The FP8 decode GEMV (:mod:`metrale.kernels.fp8_gemv`) run on the host through the CUDA emulation
header against its NumPy reference: per-token and static input scales, per-channel and per-tensor
weight scales, one to four row tiles, rows staged in shared memory and in the global workspace,
splits of the inner size over warps, grids smaller than the column tiles (several rounds, an odd
count of steps), inner sizes that end inside a 64-position piece, float32 and bf16 input rows; and
the gated form (gate and up rows in one column tile, ``silu(gate) * up`` out in bf16)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import fp8_gemv as fg
from metrale.kernels import quantized_gemv as qg
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import QuantizedWeight, float32_to_fp8_e4m3, quantized_linear_reference

# (activations, split, row tiles, unroll) instantiated in the emulated program, each with the rows
# staged in shared memory and in the global workspace, float32 and bf16 rows.
INSTANCES = [("fp8_token", 1, 1, 4), ("fp8_token", 8, 1, 4), ("fp8_token", 2, 2, 4), ("fp8_tensor", 4, 1, 4),
             ("fp8_token", 1, 4, 4), ("fp8_token", 2, 1, 2), ("fp8_tensor", 1, 2, 2), ("fp8_group", 1, 1, 4),
             ("fp8_group", 8, 1, 4), ("fp8_group", 2, 2, 2), ("fp8_group", 1, 1, 2)]
# The gated form's instances (also both stagings, both input types).
SWIGLU_INSTANCES = [("fp8_token", 1, 1, 4), ("fp8_token", 8, 1, 4), ("fp8_tensor", 1, 2, 2), ("fp8_token", 1, 4, 4),
                    ("fp8_group", 1, 1, 4), ("fp8_group", 8, 1, 4)]
# The norm prologue's instances (activations, split, unroll, gated): float32 rows staged in shared memory.
NORM_INSTANCES = [("fp8_token", 1, 4, False), ("fp8_token", 8, 4, False), ("fp8_token", 8, 4, True),
                  ("fp8_tensor", 4, 4, False), ("fp8_token", 1, 4, True), ("fp8_group", 1, 4, False),
                  ("fp8_group", 8, 4, True)]


def emulation_main() -> str:
    dispatch = "\n".join(
        f"    if (act == {fg.ACTIVATIONS[a]} && split == {s} && tiles == {t} && unroll == {u} && shared == "
        f"{int(shared)} && bf16 == {int(b)} && swiglu == {int(g)}) {{ emu::launch({{(unsigned)blocks, 1, 1}}, "
        f"{{THREADS, 1, 1}}, [&] {{ {fg.kernel_name(a, s, t, shared, u, b, g)}({'x16' if b else 'x'}, input_scale, "
        f"staged_rows, staged_scales, code_bytes, scales, block_rows, bias, out, rows, K, {'N / 2' if g else 'N'}, "
        f"nullptr, nullptr, 0.0f, 0.0f, nullptr, nullptr, 1); }}); found = true; }}"
        for g, instances in ((False, INSTANCES), (True, SWIGLU_INSTANCES)) for a, s, t, u in instances
        for shared in (False, True) for b in (False, True))
    dispatch += "\n" + "\n".join(
        f"    if (norm && act == {fg.ACTIVATIONS[a]} && split == {s} && unroll == {u} && swiglu == {int(g)} && shared "
        f"&& !bf16 && tiles == 1) {{ emu::launch({{(unsigned)blocks, 1, 1}}, {{THREADS, 1, 1}}, [&] {{ "
        f"{fg.kernel_name(a, s, 1, True, u, False, g, True)}(x, input_scale, nullptr, nullptr, code_bytes, scales, "
        f"block_rows, nullptr, out, rows, K, {'N / 2' if g else 'N'}, residual, gains, eps, norm_offset, summed, "
        f"nullptr, 1); "
        f"}}); found = true; }}"
        for a, s, u, g in NORM_INSTANCES)
    stage_rows = "\n".join(
        f"        if (act == {fg.ACTIVATIONS[a]} && bf16 == {int(b)}) emu::launch({{(unsigned)rows, 1, 1}}, "
        f"{{THREADS, 1, 1}}, [&] {{ {qg.stage_rows_name(a, True, b)}({'x16' if b else 'x'}, nullptr, input_scale, "
        f"{fg.SCALE_BLOCK}, staged_rows, staged_scales, K); }});"
        for a in fg.ACTIVATIONS for b in (False, True))
    return r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 16) emu::fail("usage: folder act split tiles unroll rows K N blocks block_rows input_scale flags shared "
                              "eps norm_offset");
    const std::string folder = argv[1];
    const int act = std::atoi(argv[2]), split = std::atoi(argv[3]), tiles = std::atoi(argv[4]);
    const int unroll = std::atoi(argv[5]), rows = std::atoi(argv[6]), K = std::atoi(argv[7]), N = std::atoi(argv[8]);
    const int blocks = std::atoi(argv[9]), block_rows = std::atoi(argv[10]);
    const float input_scale = std::atof(argv[11]);
    const int flags = std::atoi(argv[12]), shared = std::atoi(argv[13]);
    const unsigned char* code_bytes = read<unsigned char>(folder + "/codes", (size_t)N * K);
    const int scale_columns = act == ACT_FP8_GROUP ? (K + 127) / 128 : 1;
    const float* scales = read<float>(folder + "/scales", (size_t)(N + block_rows - 1) / block_rows * scale_columns);
    const int bf16 = (flags & 2) != 0, swiglu = (flags & 4) != 0, norm = (flags & 8) != 0;
    const float eps = std::atof(argv[14]), norm_offset = std::atof(argv[15]);
    const float* residual = flags & 16 ? read<float>(folder + "/residual", (size_t)rows * K) : nullptr;
    const unsigned short* gains = norm ? read<unsigned short>(folder + "/gains", K) : nullptr;
    float* summed = norm ? allocate<float>((size_t)rows * K) : nullptr;
    const float* x = read<float>(folder + "/x", (size_t)rows * K);
    const unsigned short* x16 = bf16 ? read<unsigned short>(folder + "/x_bf16", (size_t)rows * K) : nullptr;
    const float* bias = flags & 1 ? read<float>(folder + "/bias", N) : nullptr;
    float* out = allocate<float>((size_t)rows * N);
    uint4* staged_rows = nullptr;
    float* staged_scales = nullptr;
    if (!shared) {
        staged_rows = allocate<uint4>((size_t)rows * ((K + 63) / 64) * 8);
        // The padding past K holds what a workspace may: the GEMV must not read it.
        for (size_t i = 0; i < (size_t)rows * ((K + 63) / 64) * 8; ++i) staged_rows[i] = {0x7e007e00u, 0x7e007e00u,
                                                                                         0x7e007e00u, 0x7e007e00u};
        staged_scales = allocate<float>((size_t)rows * scale_columns);
""" + stage_rows + r"""
    }
    bool found = false;
""" + dispatch + r"""
    if (!found) emu::fail("no such instance");
    write(folder + "/out", out, (size_t)rows * N);   // (the gated form's bf16 [rows, N / 2] first)
    if (norm) write(folder + "/summed", summed, (size_t)rows * K);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8_gemv_emulated")
    source = qg.CONSTANTS + qg.HELPERS + qg.DEVICE_FUNCTIONS + qg.KERNELS + fg.KERNELS + emulation_main()
    binary = build_emulated(folder / "fp8_gemv.cpp", source)

    def run(weight: QuantizedWeight, x, bias=None, *, split=1, blocks=2, shared=True, unroll=fg.UNROLL,
            bf16_input=False, swiglu=False, norm=None):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        out_features, inner = weight.shape
        np.ascontiguousarray(weight.codes).tofile(case / "codes")
        np.ascontiguousarray(weight.scales if weight.activations == "fp8_group" else weight.scales[:, 0],
                             np.float32).tofile(case / "scales")
        np.ascontiguousarray(x, np.float32).tofile(case / "x")
        flags = 0
        if bias is not None:
            np.ascontiguousarray(bias, np.float32).tofile(case / "bias")
            flags |= 1
        if bf16_input:
            float32_to_bf16(np.ascontiguousarray(x, np.float32)).tofile(case / "x_bf16")
            flags |= 2
        if swiglu:
            flags |= 4
        eps, norm_offset = 1e-6, 0.0
        if norm is not None:  # (residual or None, bf16 gain bits, eps, offset)
            residual, gains, eps, norm_offset = norm
            np.ascontiguousarray(gains, np.uint16).tofile(case / "gains")
            flags |= 8
            if residual is not None:
                np.ascontiguousarray(residual, np.float32).tofile(case / "residual")
                flags |= 16
        rows = x.shape[0]
        input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
        arguments = [fg.ACTIVATIONS[weight.activations], split, qg.row_tiles(rows), unroll, rows, inner, out_features,
                     blocks, weight.block[0], repr(input_scale), flags, int(shared), repr(eps), repr(norm_offset)]
        subprocess.run([str(binary), str(case), *map(str, arguments)], check=True, timeout=600)
        if norm is not None:
            run.summed = np.fromfile(case / "summed", np.float32).reshape(rows, inner)
        if swiglu:
            units = out_features // 2
            return bf16_to_float32(np.fromfile(case / "out", np.uint16, count=rows * units).reshape(rows, units))
        return np.fromfile(case / "out", np.float32).reshape(rows, out_features)

    return run


def make_weight(rng: np.random.Generator, out: int, inner: int, activations: str, per_tensor: bool) -> QuantizedWeight:
    block = (out, inner) if per_tensor else (1, inner)
    scales = rng.uniform(0.01, 0.05, size=(1 if per_tensor else out, 1)).astype(np.float32)
    stored = float32_to_fp8_e4m3(rng.normal(size=(out, inner)).astype(np.float32) * 100)
    input_scale = np.asarray(0.02, np.float32) if activations == "fp8_tensor" else None
    return QuantizedWeight("fp8", stored, scales, block, (out, inner), activations=activations,
                           input_scale=input_scale)


CASES = [
    # activations, rows, inner, out, per tensor, bias, split, blocks, unroll
    ("fp8_token", 1, 64, 37, False, False, 1, 2, 4),  # a partial column tile
    ("fp8_token", 1, 1024, 300, False, True, 1, 3, 4),  # 7 rounds of 8 tiles, 4 steps each
    ("fp8_token", 1, 4160, 48, False, False, 8, 2, 4),  # 65 pieces over 8 warps: the last slice short
    ("fp8_token", 3, 80, 40, False, True, 8, 1, 4),  # K ends inside a piece; slices past K
    ("fp8_token", 13, 256, 40, False, True, 2, 1, 4),  # two row tiles
    ("fp8_tensor", 4, 208, 33, True, False, 4, 1, 4),  # one scale for the matrix, a static input scale
    ("fp8_token", 32, 192, 50, False, True, 1, 2, 4),  # four row tiles
    ("fp8_token", 2, 704, 200, False, False, 2, 2, 2),  # 11 pieces in slices of 6: odd steps of 2
    ("fp8_tensor", 9, 336, 24, True, True, 1, 1, 2),
]

PATHS = [pytest.param(*case, shared, id=f"{'shared' if shared else 'global'}-{case[0]}-{case[1]}x{case[2]}x{case[3]}"
                      f"-split{case[6]}") for case in CASES for shared in (True, False)
         if not shared or case[1] <= fg.SHARED_STAGE_MAX_ROWS]


@pytest.mark.parametrize("activations, rows, inner, out, per_tensor, bias, split, blocks, unroll, shared", PATHS)
def test_emulated_fp8_gemv_matches_the_reference(emulated, activations, rows, inner, out, per_tensor, bias, split,
                                                 blocks, unroll, shared):
    rng = np.random.default_rng(rows * 1000 + inner)
    weight = make_weight(rng, out, inner, activations, per_tensor)
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    x[0, :7] *= 50  # one row with a few large values: its scale differs from the others'
    bias_values = rng.normal(size=out).astype(np.float32) if bias else None
    assert fg.serves(rows, weight)
    expected = fg.fp8_gemv_reference(x, weight, bias_values)
    got = emulated(weight, x, bias_values, split=split, blocks=blocks, shared=shared, unroll=unroll)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 1e-5 * scale
    # The same product as the general quantized GEMV's exact path and the full-precision reference's.
    assert np.abs(got - qg.quantized_gemv_reference(x, weight, bias_values, exact=True)).max() <= 1e-5 * scale
    full_precision = quantized_linear_reference(x, weight, bias_values)
    assert np.abs(got - full_precision).max() <= 1e-5 * np.abs(full_precision).max()


@pytest.mark.parametrize("shared", [True, False])
def test_emulated_fp8_gemv_reads_bf16_rows_as_their_float32_values(emulated, shared):
    rng = np.random.default_rng(7)
    weight = make_weight(rng, 70, 320, "fp8_token", False)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(3, 320)).astype(np.float32)))
    x[1, 5] = 96.0  # exact in bf16
    as_float32 = emulated(weight, x, split=8, shared=shared)
    as_bf16 = emulated(weight, x, split=8, shared=shared, bf16_input=True)
    np.testing.assert_array_equal(as_bf16, as_float32)
    expected = fg.fp8_gemv_reference(x, weight)
    assert np.abs(as_bf16 - expected).max() <= 1e-5 * np.abs(expected).max()


def test_a_zero_row_gives_zeros(emulated):
    rng = np.random.default_rng(8)
    weight = make_weight(rng, 16, 128, "fp8_token", False)
    x = np.zeros((2, 128), np.float32)
    x[1] = rng.normal(size=128)
    got = emulated(weight, x)
    assert np.array_equal(got[0], np.zeros(16, np.float32))
    assert np.abs(got[1] - fg.fp8_gemv_reference(x, weight)[1]).max() <= 1e-5 * np.abs(got[1]).max()


def test_serves():
    rng = np.random.default_rng(0)
    weight = make_weight(rng, 64, 256, "fp8_token", False)
    assert fg.serves(1, weight) and fg.serves(32, weight)
    assert not fg.serves(0, weight) and not fg.serves(33, weight)
    assert fg.serves(2, make_weight(rng, 64, 256, "fp8_tensor", True))
    blocks = QuantizedWeight("fp8", weight.codes, np.ones((1, 2), np.float32), (128, 128), (64, 256),
                             activations="fp8_group", activation_group=128)
    assert fg.serves(1, blocks) and fg.serves(32, blocks)  # block-wise FP8: the sums scaled block by block
    narrow = QuantizedWeight("fp8", weight.codes, np.ones((1, 4), np.float32), (128, 64), (64, 256),
                             activations="fp8_group", activation_group=64)
    assert not fg.serves(1, narrow)  # scale blocks of 64 columns
    weight_only = QuantizedWeight("fp8", weight.codes, weight.scales, (1, 256), (64, 256))
    assert not fg.serves(1, weight_only)  # bf16 inputs
    odd = make_weight(rng, 16, 40, "fp8_token", False)
    assert not fg.serves(1, odd)  # the inner size is not a multiple of 16
    ordered = QuantizedWeight("fp8", weight.codes, weight.scales, (1, 256), (64, 256), activations="fp8_token",
                              input_order=np.arange(256, dtype=np.int32))
    assert not fg.serves(1, ordered)
    # The prologue stages up to four rows in shared memory where they fit.
    assert fg.shared_stage(1, make_weight(rng, 16, 14336, "fp8_token", False))
    assert fg.shared_stage(4, make_weight(rng, 16, 14336, "fp8_token", False))
    assert not fg.shared_stage(5, weight)
    wide = QuantizedWeight("fp8", np.zeros((16, 65536), np.uint8), np.ones((16, 1), np.float32), (1, 65536),
                           (16, 65536), activations="fp8_token")
    assert fg.shared_stage(1, wide) and not fg.shared_stage(2, wide)


SWIGLU_CASES = [
    # activations, rows, inner, units, per tensor, split, blocks, unroll
    ("fp8_token", 1, 1024, 300, False, 1, 3, 4),  # rounds of tiles; a partial last tile of 8 units
    ("fp8_token", 2, 4160, 24, False, 8, 2, 4),  # the inner size split over 8 warps
    ("fp8_tensor", 11, 336, 40, True, 1, 1, 2),  # two row tiles, one scale for the matrix
    ("fp8_token", 32, 192, 17, False, 1, 2, 4),  # four row tiles
]


SWIGLU_PATHS = [pytest.param(*case, shared, id=f"{'shared' if shared else 'global'}-{case[0]}-{case[1]}x{case[2]}x"
                             f"{case[3]}-split{case[5]}")
                for case in SWIGLU_CASES for shared in (True, False) if not shared or case[1] <= fg.SHARED_STAGE_MAX_ROWS]


@pytest.mark.parametrize("activations, rows, inner, units, per_tensor, split, blocks, unroll, shared", SWIGLU_PATHS)
@pytest.mark.parametrize("bf16_input", [False, True])
def test_emulated_gated_fp8_gemv_is_silu_and_mul_of_the_product(emulated, activations, rows, inner, units, per_tensor,
                                                               split, blocks, unroll, shared, bf16_input):
    rng = np.random.default_rng(rows * 1000 + units)
    weight = make_weight(rng, 2 * units, inner, activations, per_tensor)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32)))
    got = emulated(weight, x, split=split, blocks=blocks, shared=shared, unroll=unroll, bf16_input=bf16_input,
                   swiglu=True)
    product = fg.fp8_gemv_reference(x, weight)
    expected = fg.fp8_gemv_reference(x, weight, swiglu=True)
    # The bf16 values of the gate applied to the plain product: an ulp of bf16 at most apart.
    assert np.all(np.abs(got - expected) <= 2.0**-7 * np.abs(expected) + 1e-30)
    gate, up = product[:, :units], product[:, units:]
    assert np.abs(got - gate / (1 + np.exp(-gate)) * up).max() <= 2.0**-7 * np.abs(got).max()
    # The plain launch of the same weight gives the product the gate is applied to.
    plain = emulated(weight, x, split=split, blocks=blocks, shared=shared, unroll=unroll, bf16_input=bf16_input)
    assert np.abs(plain - product).max() <= 1e-5 * np.abs(product).max()


NORM_CASES = [
    # activations, rows, inner, out, split, unroll, gated, residual, offset
    ("fp8_token", 1, 1024, 300, 1, 4, False, True, 0.0),
    ("fp8_token", 2, 4160, 48, 8, 4, False, True, 0.0),  # the inner size split over 8 warps
    ("fp8_token", 3, 336, 40, 8, 4, True, True, 1.0),  # gated; zero-centred gains (offset 1)
    ("fp8_tensor", 4, 208, 33, 4, 4, False, False, 0.0),  # a static input scale; no residual
    ("fp8_token", 1, 2048, 34, 1, 4, True, False, 0.0),
    # Block-wise FP8: a scale per group of 128 normed values (a partial last group; two rows)
    ("fp8_group", 1, 2048, 300, 1, 4, False, True, 0.0),
    ("fp8_group", 2, 1088, 40, 8, 4, True, True, 1.0),
]


@pytest.mark.parametrize("activations, rows, inner, out, split, unroll, gated, with_residual, offset", NORM_CASES)
def test_emulated_norm_prologue_is_rmsnorm_residual_then_the_product(emulated, activations, rows, inner, out, split,
                                                                     unroll, gated, with_residual, offset):
    rng = np.random.default_rng(rows * 100 + inner)
    if activations == "fp8_group":
        weight = make_block_weight(rng, 2 * out if gated else out, inner, 128)
    else:
        weight = make_weight(rng, 2 * out if gated else out, inner, activations, per_tensor=activations == "fp8_tensor")
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    x[0, :3] *= 30  # a few large values: the row's (or their group's) scale is theirs
    residual = rng.normal(size=(rows, inner)).astype(np.float32) if with_residual else None
    gains = float32_to_bf16(rng.uniform(0.5, 1.5, size=inner).astype(np.float32) - np.float32(offset))
    eps = 1e-5
    got = emulated(weight, x, split=split, unroll=unroll, swiglu=gated, norm=(residual, gains, eps, offset))
    normed, summed = fg.norm_reference(x, residual, bf16_to_float32(gains), eps, offset)
    np.testing.assert_array_equal(emulated.summed, summed)
    expected = fg.fp8_gemv_reference(normed, weight, swiglu=gated)
    # The rms differs from the reference's by float32 rounding: a bf16 value of the norm may round the
    # other way, and its E4M3 code with it (a code is 2**-3 of its value apart at most).
    assert np.abs(got - expected).max() <= 2e-2 * np.abs(expected).max()
    # The unfused path: the same launch of the bf16 norm output the kernel computed.
    unfused = emulated(weight, normed, split=split, unroll=unroll, swiglu=gated)
    assert np.abs(got - unfused).max() <= 2e-2 * np.abs(unfused).max()
    assert np.mean(got == unfused) > 0.9  # most outputs identical: the norm's values are the same bf16s


def make_block_weight(rng: np.random.Generator, out: int, inner: int, block_rows: int) -> QuantizedWeight:
    """Block-wise FP8 as DeepSeek-V3 stores it: a scale per block of ``block_rows`` x 128, inputs
    quantized per group of 128."""
    scales = rng.uniform(0.01, 0.05, size=(-(-out // block_rows), -(-inner // 128))).astype(np.float32)
    stored = float32_to_fp8_e4m3(rng.normal(size=(out, inner)).astype(np.float32) * 100)
    return QuantizedWeight("fp8", stored, scales, (block_rows, 128), (out, inner), activations="fp8_group",
                           activation_group=128)


BLOCK_CASES = [
    # rows, inner, out, block rows, split, blocks, unroll, bf16
    (1, 1024, 300, 128, 1, 3, 4, False),  # rounds of tiles, 8 scale blocks
    (2, 4160, 48, 128, 8, 2, 4, True),  # 32.5 scale blocks over 8 warps: the last block a lone piece
    (3, 208, 40, 16, 1, 1, 2, False),  # 1.6 blocks; scale rows of 16
    (13, 384, 40, 128, 2, 1, 2, True),  # two row tiles, staged once for all blocks
    (4, 640, 33, 32, 1, 2, 2, False),  # a partial column tile; scale rows of 32
]


@pytest.mark.parametrize("rows, inner, out, block_rows, split, blocks, unroll, bf16_input", BLOCK_CASES)
def test_emulated_block_fp8_gemv_matches_the_reference(emulated, rows, inner, out, block_rows, split, blocks, unroll,
                                                       bf16_input):
    rng = np.random.default_rng(rows * 10 + inner + out)
    weight = make_block_weight(rng, out, inner, block_rows)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32)))
    x[0, :5] *= 32  # one group of the first row with large values (exact in bf16): its scale is theirs alone
    # (The norm prologue takes block-wise inputs too, for the rows it stages in shared memory.)
    assert fg.serves(rows, weight) and fg.serves_norm(rows, weight) == fg.shared_stage(rows, weight)
    got = emulated(weight, x, split=split, blocks=blocks, shared=fg.shared_stage(rows, weight), unroll=unroll,
                   bf16_input=bf16_input)
    expected = fg.fp8_gemv_reference(x, weight)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    full_precision = quantized_linear_reference(x, weight)
    assert np.abs(got - full_precision).max() <= 1e-5 * np.abs(full_precision).max()


@pytest.mark.parametrize("rows, inner, units, block_rows, bf16_input", [
    (1, 1024, 300, 128, True), (3, 4160, 24, 16, False), (2, 208, 40, 128, True)])
def test_emulated_gated_block_fp8_gemv(emulated, rows, inner, units, block_rows, bf16_input):
    """Gate and up rows in different scale blocks (the up rows N on)."""
    rng = np.random.default_rng(rows * 10 + inner + units + 1)
    weight = make_block_weight(rng, 2 * units, inner, block_rows)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32)))
    got = emulated(weight, x, split=1, blocks=3, shared=True, unroll=4, bf16_input=bf16_input, swiglu=True)
    expected = fg.fp8_gemv_reference(x, weight, swiglu=True)
    assert np.all(np.abs(got - expected) <= 2.0**-7 * np.abs(expected) + 1e-6 * np.abs(expected).max())
