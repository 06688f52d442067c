"""The decode GEMV kernels (:mod:`metrale.kernels.decode_gemv`) run on the host through the CUDA
emulation header against :func:`~metrale.kernels.decode_gemv.decode_gemv_reference`: every
prologue (plain, RMSNorm with and without the residual, SiLU), one to four tiles of 8 rows with
padding rows,
float32 and bf16 outputs, a bias, and grids smaller than the columns (the warps loop)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import decode_gemv as dg
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

template <int MODE, bool BF16_OUT, int SPLIT, int UNROLL>
void run(const std::string& folder, int rows, int K, int N, int blocks, int has_residual, int has_bias, float eps,
         float offset) {
    const int width = MODE == MODE_SILU ? 2 * K : K;
    constexpr bool NORM = MODE == MODE_RMSNORM || MODE == MODE_RMSNORM_SWIGLU;
    void* x = NORM || MODE == MODE_PLAIN_F32 ? (void*)read<float>(folder + "/x", (size_t)rows * width)
                   : (void*)read<unsigned short>(folder + "/x", (size_t)rows * width);
    float* residual = has_residual ? read<float>(folder + "/residual", (size_t)rows * K) : nullptr;
    unsigned short* norm = NORM ? read<unsigned short>(folder + "/norm", K) : nullptr;
    float* summed = allocate<float>((size_t)rows * K);
    const size_t weight_rows = MODE == MODE_RMSNORM_SWIGLU || MODE == MODE_PLAIN_SWIGLU ? 2 * (size_t)N : (size_t)N;
    const uint4* weight = reinterpret_cast<const uint4*>(read<unsigned short>(folder + "/weight", weight_rows * K));
    float* bias = has_bias ? read<float>(folder + "/bias", N) : nullptr;
    void* out = BF16_OUT ? (void*)allocate<unsigned short>((size_t)rows * N) : (void*)allocate<float>((size_t)rows * N);
    emu::launch({(unsigned)blocks, 1, 1}, {THREADS, 1, 1}, [&] {
        if (rows > 16)
            decode_gemv<MODE, BF16_OUT, SPLIT, UNROLL, 4>(x, residual, norm, eps, offset, summed, weight, bias, out, rows, K, N);
        else if (rows > 8)
            decode_gemv<MODE, BF16_OUT, SPLIT, UNROLL, 2>(x, residual, norm, eps, offset, summed, weight, bias, out, rows, K, N);
        else
            decode_gemv<MODE, BF16_OUT, SPLIT, UNROLL, 1>(x, residual, norm, eps, offset, summed, weight, bias, out, rows, K, N);
    });
    if (BF16_OUT) write(folder + "/out", static_cast<unsigned short*>(out), (size_t)rows * N);
    else write(folder + "/out", static_cast<float*>(out), (size_t)rows * N);
    if (NORM) write(folder + "/summed", summed, (size_t)rows * K);
}

template <int MODE, bool BF16_OUT, int UNROLL>
void by_split(int split, const std::string& folder, int rows, int K, int N, int blocks, int r, int b, float e, float o) {
    if (split == 1) run<MODE, BF16_OUT, 1, UNROLL>(folder, rows, K, N, blocks, r, b, e, o);
    else if (split == 2) run<MODE, BF16_OUT, 2, UNROLL>(folder, rows, K, N, blocks, r, b, e, o);
    else if (split == 4) run<MODE, BF16_OUT, 4, UNROLL>(folder, rows, K, N, blocks, r, b, e, o);
    else run<MODE, BF16_OUT, 8, UNROLL>(folder, rows, K, N, blocks, r, b, e, o);
}

template <int MODE, bool BF16_OUT>
void by_unroll(int unroll, int split, const std::string& folder, int rows, int K, int N, int blocks, int r, int b,
               float e, float o) {
    if (unroll == 8) by_split<MODE, BF16_OUT, 8>(split, folder, rows, K, N, blocks, r, b, e, o);
    else by_split<MODE, BF16_OUT, 4>(split, folder, rows, K, N, blocks, r, b, e, o);
}

template <int MODE>
void by_output(bool bf16_out, int unroll, int split, const std::string& folder, int rows, int K, int N, int blocks,
               int r, int b, float e, float o) {
    if (bf16_out) by_unroll<MODE, true>(unroll, split, folder, rows, K, N, blocks, r, b, e, o);
    else by_unroll<MODE, false>(unroll, split, folder, rows, K, N, blocks, r, b, e, o);
}

int main(int argc, char** argv) {
    if (argc != 13) emu::fail("usage: folder mode bf16_out split unroll rows K N blocks has_residual has_bias eps");
    const std::string folder = argv[1];
    const int mode = std::atoi(argv[2]), bf16_out = std::atoi(argv[3]), split = std::atoi(argv[4]);
    const int unroll = std::atoi(argv[5]);
    const int rows = std::atoi(argv[6]), K = std::atoi(argv[7]), N = std::atoi(argv[8]), blocks = std::atoi(argv[9]);
    const int r = std::atoi(argv[10]), b = std::atoi(argv[11]);
    const float eps = std::atof(argv[12]), offset = 0.0f;
    if (mode == MODE_PLAIN) by_output<MODE_PLAIN>(bf16_out, unroll, split, folder, rows, K, N, blocks, r, b, eps, offset);
    else if (mode == MODE_RMSNORM)
        by_output<MODE_RMSNORM>(bf16_out, unroll, split, folder, rows, K, N, blocks, r, b, eps, offset);
    else if (mode == MODE_RMSNORM_SWIGLU)
        by_unroll<MODE_RMSNORM_SWIGLU, true>(unroll, split, folder, rows, K, N, blocks, r, b, eps, offset);
    else if (mode == MODE_PLAIN_F32)
        by_output<MODE_PLAIN_F32>(bf16_out, unroll, split, folder, rows, K, N, blocks, r, b, eps, offset);
    else if (mode == MODE_PLAIN_SWIGLU)
        by_unroll<MODE_PLAIN_SWIGLU, true>(unroll, split, folder, rows, K, N, blocks, r, b, eps, offset);
    else by_output<MODE_SILU>(bf16_out, unroll, split, folder, rows, K, N, blocks, r, b, eps, offset);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decode_gemv_emulated")
    binary = build_emulated(folder / "decode_gemv.cpp", dg.CONSTANTS + dg.HELPERS + dg.KERNELS + EMULATION_MAIN)

    def run(mode, x, weight, *, residual=None, norm=None, bias=None, bf16_out=False, split=1, unroll=4, blocks=2,
            eps=1e-6):
        rows, inner = x.shape[0], weight.shape[1]
        outputs = weight.shape[0] // 2 if mode in dg.SWIGLU_MODES else weight.shape[0]
        case = folder / "case"
        case.mkdir(exist_ok=True)
        arrays = dict(x=x, weight=weight, residual=residual, norm=norm, bias=bias)
        for name, array in arrays.items():
            if array is not None:
                np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binary), str(case), str(mode), str(int(bf16_out)), str(split), str(unroll), str(rows),
                        str(inner), str(outputs), str(blocks), str(int(residual is not None)),
                        str(int(bias is not None)), repr(eps)], check=True, timeout=600)
        out = np.fromfile(case / "out", np.uint16 if bf16_out else np.float32).reshape(rows, outputs)
        normed = mode in (dg.RMSNORM, dg.RMSNORM_SWIGLU)
        summed = np.fromfile(case / "summed", np.float32).reshape(rows, inner) if normed else None
        return (bf16_to_float32(out) if bf16_out else out), summed

    return run


def bf16_bits(rng, shape, scale=1.0):
    return float32_to_bf16((scale * rng.standard_normal(shape)).astype(np.float32))


# K multiples of 32; tiles of 16 columns (the last one partial); splits of K across 1 to 8 warps,
# some with nothing to do; grids smaller than the tiles (the block loops over rounds of tiles) and
# larger.
@pytest.mark.parametrize("mode, rows, inner, columns, residual, bias, bf16_out, split, unroll, blocks", [
    (dg.PLAIN, 1, 64, 37, False, False, False, 1, 4, 2),
    (dg.PLAIN, 3, 224, 150, False, True, False, 4, 4, 1),  # 10 tiles, 2 a round: 5 rounds
    (dg.PLAIN, 8, 1024, 16, False, False, True, 1, 4, 3),  # more blocks than tiles; 8 batches a tile
    (dg.PLAIN, 2, 1056, 40, False, False, False, 2, 8, 2),  # 8 words a batch; a batch past the slice's end
    (dg.RMSNORM, 1, 128, 33, True, False, False, 8, 4, 1),  # 4 chunk quads over 8 warps: half idle
    (dg.RMSNORM, 2, 96, 19, False, False, True, 2, 4, 1),  # the first layer: no residual yet
    (dg.RMSNORM, 5, 160, 40, True, True, False, 2, 8, 2),  # slices of 12 and 8 chunks
    (dg.RMSNORM, 8, 512, 300, True, False, False, 1, 4, 2),  # 19 tiles, 16 a round
    (dg.SILU, 1, 96, 29, False, False, False, 8, 4, 2),
    (dg.SILU, 6, 256, 17, False, True, False, 4, 8, 1),
    (dg.SILU, 7, 64, 300, False, False, True, 1, 4, 2),
    # Past 8 rows: two and four row tiles, the last one partial.
    (dg.PLAIN, 13, 256, 40, False, True, False, 2, 4, 2),
    (dg.PLAIN, 32, 128, 33, False, False, True, 1, 4, 1),
    (dg.RMSNORM, 16, 160, 19, True, False, False, 4, 4, 1),
    (dg.RMSNORM, 27, 96, 48, False, True, False, 8, 8, 2),
    (dg.SILU, 20, 64, 24, False, False, False, 2, 4, 1),
])
def test_emulated_kernels_match_the_reference(emulated, mode, rows, inner, columns, residual, bias, bf16_out, split,
                                              unroll, blocks):
    rng = np.random.default_rng(rows * 1000 + inner + mode)
    weight_bits = bf16_bits(rng, (columns, inner), 0.2)
    weight = bf16_to_float32(weight_bits)
    kwargs, ref_kwargs = {}, {}
    if mode == dg.RMSNORM:
        x = (3.0 * rng.standard_normal((rows, inner))).astype(np.float32)
        norm_bits = bf16_bits(rng, (inner,), 0.5)
        kwargs["norm"] = norm_bits
        ref_kwargs["norm_weight"] = bf16_to_float32(norm_bits)
        if residual:
            kwargs["residual"] = ref_kwargs["residual"] = rng.standard_normal((rows, inner)).astype(np.float32)
        x_ref = x
    else:
        width = 2 * inner if mode == dg.SILU else inner
        x = bf16_bits(rng, (rows, width), 2.0)
        x_ref = bf16_to_float32(x)
    if bias:
        kwargs["bias"] = ref_kwargs["bias"] = rng.standard_normal(columns).astype(np.float32)
    out, summed = emulated(mode, x, weight_bits, bf16_out=bf16_out, split=split, unroll=unroll, blocks=blocks, **kwargs)
    expected, expected_summed = dg.decode_gemv_reference(mode, x_ref, weight, bf16_out=bf16_out, **ref_kwargs)
    scale = np.abs(expected).max()
    # float32 sums in another order (and, for RMSNORM, a norm one ulp apart rounding a staged
    # value to the next bf16); bf16 outputs: one bf16 step.
    tolerance = 1e-2 if bf16_out or mode == dg.RMSNORM else 1e-5
    assert np.abs(out - expected).max() <= tolerance * scale
    if mode == dg.RMSNORM:
        np.testing.assert_array_equal(summed, expected_summed)


def test_supports_and_plan():
    assert dg.supports(8, 4096, dg.RMSNORM) and dg.supports(32, 2048) and not dg.supports(1, 4112)
    assert not dg.supports(33, 64) and not dg.supports(32, 4096)  # 256 KB of staged rows
    assert dg.supports(7, 14336, dg.SILU) and not dg.supports(8, 14336, dg.SILU)  # 229 KB of staged rows
    assert [dg.row_tiles(r) for r in (1, 8, 9, 16, 17, 32)] == [1, 1, 2, 2, 4, 4]
    assert not dg.supports(0, 64)
    # 132 multiprocessors: narrow projections split K over 8 warps, one tile a block; a wide one
    # is not split, its blocks (two a multiprocessor) loop over the tiles.
    assert dg.plan(1, 2048, 2048, dg.PLAIN, 132) == (8, 128)
    assert dg.plan(1, 2048, 16384, dg.RMSNORM, 132) == (2, 256)
    assert dg.plan(1, 2048, 128256, dg.RMSNORM, 132) == (1, 264)
    assert dg.plan(1, 2048, 128256, dg.RMSNORM, 132, split=4) == (4, 4008)
    assert dg.plan(1, 2048, 128256, dg.RMSNORM, 132, unroll=8) == (1, 132)  # one block a multiprocessor
    # Unroll 8 where the split grid is one wave at one block a multiprocessor: Llama-1B's down and
    # o projections (128 blocks), not its gate/up (256), Llama-8B's down (256) or a head (split 1).
    assert dg.choose_unroll(1, 8192, 2048, dg.SILU, 132) == 8
    assert dg.choose_unroll(1, 2048, 2048, dg.PLAIN, 132) == 8
    assert dg.choose_unroll(1, 2048, 16384, dg.RMSNORM, 132) == 4
    assert dg.choose_unroll(1, 14336, 4096, dg.SILU, 132) == 4
    assert dg.choose_unroll(1, 2048, 128256, dg.RMSNORM, 132) == 4


@pytest.mark.parametrize("rows, inner, mode, x_dtype, why", [
    (33, 64, dg.PLAIN, np.uint16, "not served"),  # more rows than a launch takes
    (2, 80, dg.PLAIN, np.uint16, "not served"),  # K not a multiple of 32
    (2, 64, dg.RMSNORM, np.uint16, "x"),  # the norm takes float32 rows
    (2, 64, dg.SILU, np.uint16, "x"),  # SILU takes [rows, 2K]; given [rows, K]
])
def test_the_launcher_refuses_what_it_does_not_serve(rows, inner, mode, x_dtype, why):
    from metrale.errors import KernelArgumentError

    x = np.zeros((rows, inner), x_dtype)
    weight = np.zeros((16, inner), np.uint16)
    out = np.zeros((rows, 16), np.float32)
    with pytest.raises(KernelArgumentError, match=why):
        dg.decode_gemv(mode, x, weight, out, None, norm_weight=np.zeros(inner, np.uint16),
                       summed=np.zeros((rows, inner), np.float32))


# Tiles of 8 units (gate rows, then the same units' up rows): the last one partial, splits of K
# across 1 to 8 warps, grids smaller than the tiles and larger.
@pytest.mark.parametrize("rows, inner, units, residual, split, unroll, blocks", [
    (1, 64, 40, True, 8, 4, 2),
    (2, 96, 13, False, 2, 4, 1),  # the first layer: no residual yet; a partial tile
    (5, 160, 24, True, 1, 8, 1),  # 3 tiles, 8 a block: the grid's one block
    (8, 512, 300, True, 1, 4, 2),  # 38 tiles, 16 a round
    (25, 128, 30, True, 2, 4, 1),  # four row tiles, the last holding one row
])
def test_the_swiglu_epilogue_writes_what_the_silu_prologue_stages(emulated, rows, inner, units, residual, split,
                                                                  unroll, blocks):
    rng = np.random.default_rng(rows * 100 + units)
    weight_bits = bf16_bits(rng, (2 * units, inner), 0.2)
    x = (3.0 * rng.standard_normal((rows, inner))).astype(np.float32)
    norm_bits = bf16_bits(rng, (inner,), 0.5)
    kwargs = dict(norm=norm_bits, residual=rng.standard_normal((rows, inner)).astype(np.float32) if residual else None)
    out, summed = emulated(dg.RMSNORM_SWIGLU, x, weight_bits, bf16_out=True, split=split, unroll=unroll, blocks=blocks,
                           **kwargs)
    expected, expected_summed = dg.decode_gemv_reference(
        dg.RMSNORM_SWIGLU, x, bf16_to_float32(weight_bits), residual=kwargs["residual"],
        norm_weight=bf16_to_float32(norm_bits))
    # The gate/up kernel of the SILU path, then its prologue's staging, give the same values.
    gate_up, _ = dg.decode_gemv_reference(dg.RMSNORM, x, bf16_to_float32(weight_bits), residual=kwargs["residual"],
                                          norm_weight=bf16_to_float32(norm_bits), bf16_out=True)
    staged = dg.decode_gemv_reference(dg.SILU, gate_up, np.eye(units, dtype=np.float32), bf16_out=True)[0]
    np.testing.assert_array_equal(expected, staged)
    assert out.shape == (rows, units)
    # float32 sums in another order: a product may round to the next bf16 before the gate.
    assert np.abs(out - expected).max() <= 2e-2 * np.abs(expected).max()
    assert np.abs(summed - expected_summed).max() <= 1e-6 * np.abs(expected_summed).max()


@pytest.mark.parametrize("rows, inner, units, split, unroll, blocks", [
    (1, 2048, 512, 8, 4, 2),  # a Qwen3-Next-shaped shared expert, one row
    (3, 96, 13, 2, 4, 1),  # a partial tile
    (8, 160, 24, 1, 8, 1),
])
def test_the_plain_swiglu_mode_is_linear_silu(emulated, rows, inner, units, split, unroll, blocks):
    from metrale.kernels.activation import silu_and_mul_reference

    rng = np.random.default_rng(rows * 7 + units)
    weight_bits = bf16_bits(rng, (2 * units, inner), 0.2)
    x_bits = bf16_bits(rng, (rows, inner), 2.0)
    out, summed = emulated(dg.PLAIN_SWIGLU, x_bits, weight_bits, bf16_out=True, split=split, unroll=unroll,
                           blocks=blocks)
    assert summed is None and out.shape == (rows, units)
    # linear_silu's reference: the product rounded to bf16 (what a bf16 gate/up projection writes),
    # then silu_and_mul rounded to bf16.
    x, weight = bf16_to_float32(x_bits), bf16_to_float32(weight_bits)
    gate_up = bf16_to_float32(float32_to_bf16((x @ weight.T).astype(np.float32)))
    expected = bf16_to_float32(float32_to_bf16(silu_and_mul_reference(gate_up[:, :units], gate_up[:, units:])))
    reference = dg.decode_gemv_reference(dg.PLAIN_SWIGLU, x, weight)[0]
    assert np.abs(reference - expected).max() <= 1e-2 * np.abs(expected).max()
    assert np.abs(out - expected).max() <= 2e-2 * np.abs(expected).max()


@pytest.mark.parametrize("rows, inner, columns, bf16_out, split", [(1, 2048, 40, False, 8), (5, 96, 24, True, 1)])
def test_the_float32_input_is_rounded_as_to_bf16_rounds_it(emulated, rows, inner, columns, bf16_out, split):
    rng = np.random.default_rng(rows + inner)
    weight_bits = bf16_bits(rng, (columns, inner), 0.2)
    x = (2.0 * rng.standard_normal((rows, inner))).astype(np.float32)
    out, _ = emulated(dg.PLAIN_F32, x, weight_bits, bf16_out=bf16_out, split=split)
    # The same product as the PLAIN mode's on the input rounded to bf16 first.
    plain, _ = emulated(dg.PLAIN, float32_to_bf16(x), weight_bits, bf16_out=bf16_out, split=split)
    np.testing.assert_array_equal(out, plain)
    expected, _ = dg.decode_gemv_reference(dg.PLAIN_F32, x, bf16_to_float32(weight_bits), bf16_out=bf16_out)
    assert np.abs(out - expected).max() <= 1e-2 * np.abs(expected).max()
