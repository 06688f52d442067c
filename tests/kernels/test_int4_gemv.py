"""The 4-bit weight-only decode GEMV (:mod:`metrale.kernels.int4_gemv`) run on the host through the
CUDA emulation header against its NumPy reference: groups of 128 and 256 columns, zero points,
act-order, one to four row tiles, rows staged in shared memory and in the global workspace,
splits of the inner size over warps, grids smaller than the column tiles, float32 and bf16 rows;
and the gated form (gate and up rows in one column tile, ``silu(gate) * up`` out in bf16)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import int4_gemv as ig
from metrale.kernels import quantized_gemv as qg
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import QuantizedWeight, pack_nibbles, quantized_linear_reference

# (split, row tiles, zeros, unroll, weight tiles) instantiated, each with the rows staged in shared
# memory and in the global workspace, float32 and bf16 rows.
INSTANCES = [(1, 1, False, 4, 1), (8, 1, False, 4, 1), (2, 2, True, 4, 1), (4, 1, True, 2, 1), (1, 4, False, 4, 1),
             (2, 1, False, 2, 1), (2, 1, True, 4, 1), (1, 4, False, 1, 4), (4, 4, True, 1, 4), (2, 2, False, 2, 2),
             (1, 1, True, 2, 2)]
# The gated form's instances (also both stagings, both input types; their plain forms too).
SWIGLU_INSTANCES = [(1, 1, False, 4, 1), (8, 1, False, 4, 1), (2, 2, True, 4, 1), (1, 4, False, 4, 1),
                    (2, 4, False, 1, 4), (1, 2, True, 2, 2)]


def emulation_main() -> str:
    dispatch = "\n".join(
        f"    if (split == {s} && tiles == {t} && zeros_on == {int(z)} && unroll == {u} && shared == {int(shared)} "
        f"&& bf16 == {int(b)} && swiglu == {int(g)} && weight_tiles == {m}) {{ emu::launch({{(unsigned)blocks, 1, 1}}, "
        f"{{THREADS, 1, 1}}, [&] {{ {ig.kernel_name(s, t, shared, z, u, b, g, m)}({'x16' if b else 'x'}, order, "
        f"staged_rows, code_bytes, scales, zeros, group_pieces, bias, out, rows, K, {'N / 2' if g else 'N'}); }}); "
        f"found = true; }}"
        for g, instances in ((False, sorted(set(INSTANCES + SWIGLU_INSTANCES))), (True, SWIGLU_INSTANCES))
        for s, t, z, u, m in instances
        for shared in (False, True) for b in (False, True))
    return r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 13) emu::fail("usage: folder split tiles unroll rows K N blocks group flags shared weight_tiles");
    const std::string folder = argv[1];
    const int split = std::atoi(argv[2]), tiles = std::atoi(argv[3]), unroll = std::atoi(argv[4]);
    const int rows = std::atoi(argv[5]), K = std::atoi(argv[6]), N = std::atoi(argv[7]);
    const int blocks = std::atoi(argv[8]), group = std::atoi(argv[9]), flags = std::atoi(argv[10]);
    const int shared = std::atoi(argv[11]), weight_tiles = std::atoi(argv[12]);
    const int group_pieces = group / 128, zeros_on = (flags & 2) != 0, bf16 = (flags & 4) != 0;
    const int swiglu = (flags & 16) != 0;
    const unsigned char* code_bytes = read<unsigned char>(folder + "/codes", (size_t)N * K / 2);
    const float* scales = read<float>(folder + "/scales", (size_t)N * (K / group));
    const float* zeros = zeros_on ? read<float>(folder + "/zeros", (size_t)N * (K / group)) : nullptr;
    const float* x = read<float>(folder + "/x", (size_t)rows * K);
    const unsigned short* x16 = bf16 ? read<unsigned short>(folder + "/x_bf16", (size_t)rows * K) : nullptr;
    const int* order = flags & 8 ? read<int>(folder + "/order", K) : nullptr;
    const float* bias = flags & 1 ? read<float>(folder + "/bias", N) : nullptr;
    float* out = allocate<float>((size_t)rows * N);
    uint4* staged_rows = nullptr;
    if (!shared) {
        staged_rows = allocate<uint4>((size_t)rows * K / 8);
        if (bf16) emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] {
            stage_int4_rows<unsigned short>(x16, order, staged_rows, K); });
        else emu::launch({(unsigned)rows, 1, 1}, {THREADS, 1, 1}, [&] { stage_int4_rows<float>(x, order, staged_rows, K); });
    }
    bool found = false;
""" + dispatch + r"""
    if (!found) emu::fail("no such instance");
    write(folder + "/out", out, (size_t)rows * N);   // (the gated form's bf16 [rows, N / 2] first)
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int4_gemv_emulated")
    source = qg.CONSTANTS + qg.HELPERS + qg.DEVICE_FUNCTIONS + ig.KERNELS + emulation_main()
    binary = build_emulated(folder / "int4_gemv.cpp", source)

    def run(weight: QuantizedWeight, x, bias=None, *, split=1, blocks=2, shared=True, unroll=ig.UNROLL,
            bf16_input=False, swiglu=False, weight_tiles=1):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        out_features, inner = weight.shape
        np.ascontiguousarray(weight.codes).tofile(case / "codes")
        np.ascontiguousarray(weight.scales, np.float32).tofile(case / "scales")
        np.ascontiguousarray(x, np.float32).tofile(case / "x")
        flags = 0
        if bias is not None:
            np.ascontiguousarray(bias, np.float32).tofile(case / "bias")
            flags |= 1
        if weight.zeros is not None:
            np.ascontiguousarray(weight.zeros, np.float32).tofile(case / "zeros")
            flags |= 2
        if bf16_input:
            float32_to_bf16(np.ascontiguousarray(x, np.float32)).tofile(case / "x_bf16")
            flags |= 4
        if weight.input_order is not None:
            np.ascontiguousarray(weight.input_order, np.int32).tofile(case / "order")
            flags |= 8
        if swiglu:
            flags |= 16
        rows = x.shape[0]
        arguments = [split, qg.row_tiles(rows), unroll, rows, inner, out_features, blocks, weight.block[1], flags,
                     int(shared), weight_tiles]
        subprocess.run([str(binary), str(case), *map(str, arguments)], check=True, timeout=600)
        if swiglu:
            units = out_features // 2
            return bf16_to_float32(np.fromfile(case / "out", np.uint16, count=rows * units).reshape(rows, units))
        return np.fromfile(case / "out", np.float32).reshape(rows, out_features)

    return run


def make_weight(rng: np.random.Generator, out: int, inner: int, group: int, zeros: bool,
                act_order: bool) -> QuantizedWeight:
    scales = rng.uniform(0.01, 0.05, size=(out, inner // group)).astype(np.float32)
    stored = pack_nibbles(rng.integers(0, 16, size=(out, inner), dtype=np.uint8))
    zero_points = rng.integers(0, 16, size=scales.shape).astype(np.float32) if zeros else None
    order = rng.permutation(inner).astype(np.int32) if act_order else None
    return QuantizedWeight("int4", stored, scales, (1, group), (out, inner), zeros=zero_points, input_order=order)


CASES = [
    # rows, inner, out, group, zeros, act-order, bias, split, blocks, unroll, weight tiles
    (1, 128, 37, 128, False, False, False, 1, 2, 4, 1),  # one piece, a partial column tile
    (1, 1024, 300, 128, False, False, True, 1, 3, 4, 1),  # rounds of tiles
    (1, 1152, 48, 128, False, False, False, 8, 2, 4, 1),  # 9 pieces over 8 warps: slices past the end
    (3, 512, 40, 256, True, False, True, 2, 1, 4, 1),  # zero points, groups of two pieces
    (13, 384, 40, 128, True, True, False, 2, 1, 4, 1),  # two row tiles, act-order
    (4, 768, 33, 256, True, False, False, 4, 1, 2, 1),
    (32, 256, 50, 128, False, False, True, 1, 2, 4, 1),  # four row tiles
    (2, 1408, 200, 128, False, True, False, 2, 2, 2, 1),  # 11 pieces in slices of 6: odd steps of 2
    (32, 512, 200, 128, False, False, True, 1, 2, 1, 4),  # 4 column tiles a warp: 13 tiles, a partial warp tile
    (27, 1152, 72, 128, True, True, False, 4, 1, 1, 4),  # a warp tile past the last column tile, a split
    (16, 640, 100, 128, False, False, False, 2, 2, 2, 2),  # 2 column tiles a warp, odd steps
    (3, 512, 90, 256, True, False, True, 1, 2, 2, 2),  # one row tile, 2 column tiles a warp
]

PATHS = [pytest.param(*case, shared, id=f"{'shared' if shared else 'global'}-{case[0]}x{case[1]}x{case[2]}-g{case[3]}"
                      f"{'-zeros' if case[4] else ''}{'-order' if case[5] else ''}-split{case[7]}-m{case[10]}")
         for case in CASES for shared in (True, False) if not shared or case[0] <= ig.SHARED_STAGE_MAX_ROWS]


@pytest.mark.parametrize("rows, inner, out, group, zeros, act_order, bias, split, blocks, unroll, weight_tiles, shared",
                         PATHS)
def test_emulated_int4_gemv_matches_the_reference(emulated, rows, inner, out, group, zeros, act_order, bias, split,
                                                  blocks, unroll, weight_tiles, shared):
    rng = np.random.default_rng(rows * 1000 + inner)
    weight = make_weight(rng, out, inner, group, zeros, act_order)
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    bias_values = rng.normal(size=out).astype(np.float32) if bias else None
    assert ig.serves(rows, weight)
    expected = ig.int4_gemv_reference(x, weight, bias_values)
    got = emulated(weight, x, bias_values, split=split, blocks=blocks, shared=shared, unroll=unroll,
                   weight_tiles=weight_tiles)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    # Within bf16's rounding of the input of the full-precision product.
    full_precision = quantized_linear_reference(x, weight, bias_values)
    assert np.abs(got - full_precision).max() <= 2e-2 * np.abs(full_precision).max()


@pytest.mark.parametrize("shared", [True, False])
def test_emulated_int4_gemv_reads_bf16_rows_as_their_float32_values(emulated, shared):
    rng = np.random.default_rng(7)
    weight = make_weight(rng, 70, 384, 128, True, True)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(3, 384)).astype(np.float32)))
    as_float32 = emulated(weight, x, split=4, shared=shared, unroll=2)
    as_bf16 = emulated(weight, x, split=4, shared=shared, unroll=2, bf16_input=True)
    np.testing.assert_array_equal(as_bf16, as_float32)


def test_serves():
    rng = np.random.default_rng(0)
    assert ig.serves(1, make_weight(rng, 64, 256, 128, False, False))
    assert ig.serves(32, make_weight(rng, 64, 512, 256, True, True))
    assert not ig.serves(33, make_weight(rng, 64, 256, 128, False, False))
    assert not ig.serves(1, make_weight(rng, 64, 256, 64, False, False))  # a group less than 128 columns
    per_channel = QuantizedWeight("int4", np.zeros((16, 128), np.uint8), np.ones((16, 1), np.float32), (1, 256),
                                  (16, 256))
    assert ig.serves(1, per_channel)  # one group of the whole row
    int8 = QuantizedWeight("int8", np.zeros((16, 256), np.uint8), np.ones((16, 2), np.float32), (1, 128), (16, 256))
    assert not ig.serves(1, int8)
    assert ig.shared_stage(4, make_weight(rng, 16, 14336, 128, False, False))
    assert not ig.shared_stage(5, make_weight(rng, 16, 256, 128, False, False))


SWIGLU_CASES = [
    # rows, inner, units, group, zeros, act-order, split, blocks, unroll, weight tiles
    (1, 1024, 300, 128, False, False, 1, 3, 4, 1),  # rounds of tiles; a partial last tile of 8 units
    (2, 1152, 24, 128, False, False, 8, 2, 4, 1),  # the inner size split over 8 warps
    (11, 512, 40, 256, True, True, 2, 1, 4, 1),  # two row tiles, zero points, act-order
    (32, 256, 17, 128, False, False, 1, 2, 4, 1),  # four row tiles
    (32, 640, 44, 128, False, False, 2, 1, 1, 4),  # 4 column tiles a warp, a partial warp tile
    (12, 512, 52, 128, True, False, 1, 2, 2, 2),  # 2 column tiles a warp, zero points
]

SWIGLU_PATHS = [pytest.param(*case, shared, id=f"{'shared' if shared else 'global'}-{case[0]}x{case[1]}x{case[2]}"
                             f"-split{case[6]}-m{case[9]}")
                for case in SWIGLU_CASES for shared in (True, False) if not shared or case[0] <= ig.SHARED_STAGE_MAX_ROWS]


@pytest.mark.parametrize("rows, inner, units, group, zeros, act_order, split, blocks, unroll, weight_tiles, shared",
                         SWIGLU_PATHS)
@pytest.mark.parametrize("bf16_input", [False, True])
def test_emulated_gated_int4_gemv_is_silu_and_mul_of_the_product(emulated, rows, inner, units, group, zeros, act_order,
                                                                split, blocks, unroll, weight_tiles, shared,
                                                                bf16_input):
    rng = np.random.default_rng(rows * 1000 + units)
    weight = make_weight(rng, 2 * units, inner, group, zeros, act_order)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32)))
    got = emulated(weight, x, split=split, blocks=blocks, shared=shared, unroll=unroll, bf16_input=bf16_input,
                   swiglu=True, weight_tiles=weight_tiles)
    product = ig.int4_gemv_reference(x, weight)
    expected = ig.int4_gemv_reference(x, weight, swiglu=True)
    # The bf16 values of the gate applied to the plain product: an ulp of bf16 at most apart.
    assert np.all(np.abs(got - expected) <= 2.0**-7 * np.abs(expected) + 1e-30)
    gate, up = product[:, :units], product[:, units:]
    assert np.abs(got - gate / (1 + np.exp(-gate)) * up).max() <= 2.0**-7 * np.abs(got).max()
    plain = emulated(weight, x, split=split, blocks=blocks, shared=shared, unroll=unroll, bf16_input=bf16_input,
                     weight_tiles=weight_tiles)
    assert np.abs(plain - product).max() <= 1e-5 * np.abs(product).max()
