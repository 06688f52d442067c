"""The batch-invariant linear product (:mod:`metrale.kernels.linear_invariant`) run on the host
through the CUDA emulation: the tiled kernel against the reference of its order, and bit for bit
against the decode kernel (:mod:`metrale.kernels.decode_gemv`) that takes the same rows when there
are few of them -- for every split of ``K``, a last stage of one step, and rows at every position
of a block."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import decode_gemv as dg
from metrale.kernels import linear_invariant as li
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

template <int SPLIT, int TILES>
void decode(const unsigned short* x, const unsigned short* w, const float* bias, float* out, int M, int N, int K,
            int blocks) {
    emu::launch({(unsigned)blocks, 1, 1}, {THREADS, 1, 1}, [&] {
        decode_gemv<MODE_PLAIN, false, SPLIT, 4, TILES>(x, nullptr, nullptr, 0.0f, 0.0f, nullptr,
                                                       reinterpret_cast<const uint4*>(w), bias, out, M, K, N);
    });
}

template <int SPLIT>
void decode_rows(const unsigned short* x, const unsigned short* w, const float* bias, float* out, int M, int N,
                 int K, int blocks) {
    if (M > 16) decode<SPLIT, 4>(x, w, bias, out, M, N, K, blocks);
    else if (M > 8) decode<SPLIT, 2>(x, w, bias, out, M, N, K, blocks);
    else decode<SPLIT, 1>(x, w, bias, out, M, N, K, blocks);
}

int main(int argc, char** argv) {
    if (argc != 9) emu::fail("usage: folder kernel M N K split has_bias blocks");
    const std::string folder = argv[1], kernel = argv[2];
    const int M = std::atoi(argv[3]), N = std::atoi(argv[4]), K = std::atoi(argv[5]), split = std::atoi(argv[6]);
    const int has_bias = std::atoi(argv[7]), blocks = std::atoi(argv[8]);
    const unsigned short* x = read<unsigned short>(folder + "/x", (size_t)M * K);
    const unsigned short* w = read<unsigned short>(folder + "/w", (size_t)N * K);
    const float* bias = has_bias ? read<float>(folder + "/bias", (size_t)N) : nullptr;
    float* out = allocate<float>((size_t)M * N);
    const int slice_steps = (K / 32 + split - 1) / split;
    if (kernel == "wide" && split > 1) {   // as the launcher: the folded tiling, 2 x 2 warps of 64 columns by 32 rows
        emu::launch({(unsigned)((N + 127) / 128), (unsigned)((M + 63) / 64), 1}, {128, 1, 1}, [&] {
            invariant_linear_tiled<2, 2, 4, 4, 3, false, true>(x, w, bias, out, M, N, K, slice_steps);
        });
    } else if (kernel == "wide") {
        emu::launch({(unsigned)((N + 127) / 128), (unsigned)((M + 63) / 64), 1}, {256, 1, 1}, [&] {
            invariant_linear_tiled<4, 2, 2, 4, 3, false, false>(x, w, bias, out, M, N, K, slice_steps);
        });
    } else if (kernel == "wide-other") {   // 2 x 2 warps of 64 columns by 16 rows, two stages
        emu::launch({(unsigned)((N + 127) / 128), (unsigned)((M + 31) / 32), 1}, {128, 1, 1}, [&] {
            if (split > 1) invariant_linear_tiled<2, 2, 4, 2, 2, false, true>(x, w, bias, out, M, N, K, slice_steps);
            else invariant_linear_tiled<2, 2, 4, 2, 2, false, false>(x, w, bias, out, M, N, K, slice_steps);
        });
    } else if (kernel == "narrow-other") {   // 2 warps of 32 columns by 32 rows, four stages
        float* partial = allocate<float>((size_t)split * M * N);
        emu::launch({(unsigned)((N + 63) / 64), (unsigned)((M + 31) / 32), (unsigned)split}, {64, 1, 1}, [&] {
            invariant_linear_tiled<2, 1, 2, 4, 4, true, false>(x, w, nullptr, partial, M, N, K, slice_steps);
        });
        emu::launch({(unsigned)((M * N + 255) / 256), 1, 1}, {256, 1, 1},
                    [&] { invariant_linear_sum(partial, bias, out, M, N, split); });
    } else if (kernel == "narrow" && split == 1) {   // as the launcher: one slice straight to the output
        emu::launch({(unsigned)((N + 63) / 64), (unsigned)((M + 31) / 32), 1}, {128, 1, 1}, [&] {
            invariant_linear_tiled<4, 1, 1, 4, 3, false, false>(x, w, bias, out, M, N, K, slice_steps);
        });
    } else if (kernel == "narrow") {
        float* partial = allocate<float>((size_t)split * M * N);
        emu::launch({(unsigned)((N + 63) / 64), (unsigned)((M + 31) / 32), (unsigned)split}, {128, 1, 1}, [&] {
            invariant_linear_tiled<4, 1, 1, 4, 3, true, false>(x, w, nullptr, partial, M, N, K, slice_steps);
        });
        emu::launch({(unsigned)((M * N + 255) / 256), 1, 1}, {256, 1, 1},
                    [&] { invariant_linear_sum(partial, bias, out, M, N, split); });
    } else if (split == 1) decode_rows<1>(x, w, bias, out, M, N, K, blocks);
    else if (split == 2) decode_rows<2>(x, w, bias, out, M, N, K, blocks);
    else if (split == 4) decode_rows<4>(x, w, bias, out, M, N, K, blocks);
    else decode_rows<8>(x, w, bias, out, M, N, K, blocks);
    write(folder + "/out", out, (size_t)M * N);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """``run(kernel, x_bits, w_bits, bias, split)``: the tiled kernel in its wide tiling (``"wide"``)
    or its narrow one (``"narrow"``, with the sum of the slices, or straight to the output for one
    slice, as the launcher runs them), or the decode kernel's plain
    product (``"decode"``, at most 32 rows), with ``split`` slices of ``K``."""
    folder = tmp_path_factory.mktemp("linear_invariant_emulated")
    binary = build_emulated(folder / "linear.cpp", dg.CONSTANTS + dg.HELPERS + dg.KERNELS + li.KERNEL + EMULATION_MAIN)

    def run(kernel, x_bits, w_bits, bias=None, split=1):
        (m, k), n = x_bits.shape, w_bits.shape[0]
        case = folder / "case"
        case.mkdir(exist_ok=True)
        x_bits.astype(np.uint16).tofile(case / "x")
        w_bits.astype(np.uint16).tofile(case / "w")
        if bias is not None:
            bias.astype(np.float32).tofile(case / "bias")
        blocks = dg.plan(m, k, n, dg.PLAIN, 4, split)[1]
        subprocess.run([str(binary), str(case), kernel, str(m), str(n), str(k), str(split), str(int(bias is not None)),
                        str(blocks)], check=True, timeout=600)
        return np.fromfile(case / "out", dtype=np.float32).reshape(m, n)

    return run


def bf16_bits(rng, shape, scale=1.0):
    return float32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


# Row and column tiles with padding, K of an odd number of steps (a last stage of one step),
# slices of unequal lengths (1056: 33 steps in slices of 9, 9, 9, 6) and a split with empty slices
# (96 in 4: slices of 1, 1, 1 and none), in both tilings.
@pytest.mark.parametrize("kernel", ["wide", "narrow"])
@pytest.mark.parametrize("m, n, k, split, with_bias", [(40, 130, 1056, 4, True), (33, 72, 64, 1, False),
                                                       (70, 16, 96, 4, False), (9, 40, 256, 8, True)])
def test_the_tiled_kernel_run_emulated_matches_the_reference(emulated, kernel, m, n, k, split, with_bias):
    rng = np.random.default_rng(m * 1000 + n + k)
    x, w = bf16_bits(rng, (m, k)), bf16_bits(rng, (n, k), 0.1)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    got = emulated(kernel, x, w, bias, split)
    expected = li.invariant_linear_reference(bf16_to_float32(x), bf16_to_float32(w), bias, split=split)
    exact = bf16_to_float32(x).astype(np.float64) @ bf16_to_float32(w).astype(np.float64).T + (0 if bias is None else bias)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(exact).max()
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("split", [1, 4, 8])
def test_rows_give_the_same_bits_through_the_decode_kernel_and_both_tilings(emulated, split):
    """1, 9 and 32 rows through the decode kernel and two narrow tilings; the same rows at the
    start, the middle and the end of 70 through two wide ones."""
    rng = np.random.default_rng(split)
    n, k = 130, 1056
    w = bf16_bits(rng, (n, k), 0.1)
    bias = rng.standard_normal(n).astype(np.float32)
    rows = bf16_bits(rng, (70, k), 3.0)
    wide = emulated("wide", rows, w, bias, split)
    for m in (1, 9, 32):
        for kernel in ("decode", "narrow", "narrow-other"):
            got = emulated(kernel, rows[:m], w, bias, split)
            assert np.array_equal(got.view(np.uint32), wide[:m].view(np.uint32)), (kernel, m)
    assert np.array_equal(emulated("wide-other", rows, w, bias, split).view(np.uint32), wide.view(np.uint32))
    moved = np.roll(rows, 21, axis=0)  # row 0 at position 21, row 48 at 70 - 1
    assert np.array_equal(emulated("wide", moved, w, bias, split).view(np.uint32),
                          np.roll(wide, 21, axis=0).view(np.uint32))


def test_the_split_is_the_decode_kernels_and_comes_from_the_weight_and_the_device():
    for columns in (37, 4096, 6144, 28672, 128256):
        for multiprocessors in (4, 132):
            split = li.split_of(columns, multiprocessors)
            assert split == dg.plan(1, 4096, columns, dg.PLAIN, multiprocessors)[0]
            assert all(dg.plan(rows, 4096, columns, dg.PLAIN, multiprocessors)[0] == split for rows in (2, 17, 32))
    assert li.split_steps(1056, 4) == 9 and li.split_steps(96, 4) == 1 and li.split_steps(4096, 8) == 16


def test_the_products_cover_every_k_once_in_steps():
    for start, stop in ((0, 64), (32, 160)):
        groups = li.step_groups(start, stop)
        assert all(len(group) == 16 for group in groups)
        assert sorted(np.concatenate(groups).tolist()) == list(range(start, stop))
    assert li.step_groups(0, 32)[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]


def test_the_launcher_refuses_what_the_kernels_cannot_take():
    def refused(match, x, w, out, **options):
        with pytest.raises(KernelArgumentError, match=match):
            li.invariant_linear(x, w, out, None, multiprocessors=4, **options)

    refused("multiple of 32", np.zeros((2, 48), np.uint16), np.zeros((8, 48), np.uint16), np.zeros((2, 8), np.float32))
    refused("weight has shape", np.zeros((2, 32), np.uint16), np.zeros((8, 16), np.uint16), np.zeros((2, 8), np.float32))
    refused("out", np.zeros((2, 32), np.uint16), np.zeros((8, 32), np.uint16), np.zeros((2, 8), np.uint16))
    refused("partial workspace", np.zeros((2, 32), np.uint16), np.zeros((8, 32), np.uint16), np.zeros((2, 8), np.float32))
    assert li.split_of(8, 4) > 1 and li.split_of(128256, 4) == 1
    assert li.partial_shape(2, 8, 4) == (li.split_of(8, 4), 2, 8) and li.partial_shape(li.NARROW_ROWS + 1, 8, 4) is None
    assert li.partial_shape(2, 128256, 4) is None  # one slice: the narrow tiling writes the output itself
    x, w, out = np.zeros((80, 32), np.uint16), np.zeros((8, 32), np.uint16), np.zeros((80, 8), np.float32)
    for tiling in ((4, 2, 2, 4), (4, 2, 2, 4, 1), (32, 2, 1, 1, 3), (4, 2, 8, 16, 4), (4, 2, 2.0, 4, 3)):
        refused("tiling", x, w, out, tiling=tiling)
