"""The batch-invariant linear kernel (:mod:`metrale.kernels.linear_invariant`) run on the host
through the CUDA emulation: against the reference, and a row's bits alone, among other rows, at
every position of a block and past the decode tile's 16 rows."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import linear_invariant as li
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 7) emu::fail("usage: folder M N K splits has_bias");
    const std::string folder = argv[1];
    const int M = std::atoi(argv[2]), N = std::atoi(argv[3]), K = std::atoi(argv[4]), splits = std::atoi(argv[5]);
    const int has_bias = std::atoi(argv[6]);
    const unsigned short* x = read<unsigned short>(folder + "/x", (size_t)M * K);
    const unsigned short* w = read<unsigned short>(folder + "/w", (size_t)N * K);
    const float* bias = has_bias ? read<float>(folder + "/bias", (size_t)N) : nullptr;
    float* partial = allocate<float>((size_t)splits * M * N);
    float* out = allocate<float>((size_t)M * N);
    const int split_elements = std::atoi(std::getenv("SPLIT_ELEMENTS"));
    const unsigned columns = (N + 63) / 64;
    if (M <= 16) {
        emu::launch({columns, (unsigned)((M + 15) / 16), (unsigned)splits}, {128, 1, 1},
                    [&] { invariant_linear_partial<1>(x, w, partial, M, N, K, split_elements); });
    } else {
        emu::launch({columns, (unsigned)((M + 63) / 64), (unsigned)splits}, {128, 1, 1},
                    [&] { invariant_linear_partial<4>(x, w, partial, M, N, K, split_elements); });
    }
    emu::launch({(unsigned)((M * N + 255) / 256), 1, 1}, {256, 1, 1},
                [&] { invariant_linear_sum<false>(partial, bias, out, M, N, splits); });
    write(folder + "/out", out, (size_t)M * N);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("linear_invariant_emulated")
    binary = build_emulated(folder / "linear.cpp", li.KERNEL + EMULATION_MAIN)

    def run(x_bits, w_bits, bias=None):
        (m, k), n = x_bits.shape, w_bits.shape[0]
        case = folder / "case"
        case.mkdir(exist_ok=True)
        x_bits.astype(np.uint16).tofile(case / "x")
        w_bits.astype(np.uint16).tofile(case / "w")
        if bias is not None:
            bias.astype(np.float32).tofile(case / "bias")
        subprocess.run([str(binary), str(case), str(m), str(n), str(k), str(li.split_count(n, k)),
                        str(int(bias is not None))], check=True, timeout=600,
                       env={"SPLIT_ELEMENTS": str(li.split_elements(n, k))})
        return np.fromfile(case / "out", dtype=np.float32).reshape(m, n)

    return run


def bf16_bits(rng, shape, scale=1.0):
    return float32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("m, n, k, with_bias", [(1, 72, 64, False), (5, 130, 1056, True), (37, 64, 48, False),
                                                (3, 70, 400, True), (17, 8, 16, False)])
def test_the_kernel_run_emulated_matches_the_reference(emulated, m, n, k, with_bias):
    rng = np.random.default_rng(m * 1000 + n + k)
    x, w = bf16_bits(rng, (m, k)), bf16_bits(rng, (n, k), 0.1)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    got = emulated(x, w, bias)
    expected = li.invariant_linear_reference(bf16_to_float32(x), bf16_to_float32(w), bias)
    exact = bf16_to_float32(x).astype(np.float64) @ bf16_to_float32(w).astype(np.float64).T + (0 if bias is None else bias)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(exact).max()
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


def test_a_row_gives_the_same_bits_alone_and_among_other_rows(emulated):
    """K split in ranges (1056 over 130 columns), a decode tile (1 and 9 rows) and the prompts'
    tiles (40 rows: the row at several positions of its block)."""
    rng = np.random.default_rng(7)
    n, k = 130, 1056
    assert li.split_count(n, k) > 1
    w = bf16_bits(rng, (n, k), 0.1)
    bias = rng.standard_normal(n).astype(np.float32)
    row = bf16_bits(rng, (1, k))
    alone = emulated(row, w, bias)
    for m, position in ((9, 4), (40, 0), (40, 21), (40, 39)):
        others = bf16_bits(rng, (m, k), 3.0)
        others[position] = row[0]
        batch = emulated(others, w, bias)
        assert np.array_equal(batch[position].view(np.uint32), alone[0].view(np.uint32)), (m, position)


def test_the_splits_come_from_the_weight_alone():
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (64, 48)):
        splits, length = li.split_count(n, k), li.split_elements(n, k)
        assert splits >= 1 and length % 32 == 0 and (splits - 1) * length < k <= splits * length
        assert splits == 1 or length >= li.MIN_SPLIT_ELEMENTS - 31
    # One row of the 8B shape's projections: enough blocks to read the weights in parallel.
    assert -(-4096 // li.BLOCK_COLUMNS) * li.split_count(4096, 4096) >= li.TARGET_BLOCKS


def test_the_products_cover_every_k_once_in_steps():
    for start, stop in ((0, 64), (32, 160), (0, 48), (64, 80)):
        groups = li.step_groups(start, stop)
        assert all(len(group) == 16 for group in groups)
        assert sorted(np.concatenate(groups).tolist()) == list(range(start, stop))
    assert li.step_groups(0, 32)[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
    assert li.step_groups(0, 48)[-1].tolist() == list(range(32, 48))


def test_the_launcher_refuses_what_the_kernel_cannot_take():
    x = np.zeros((2, 24), np.uint16)
    with pytest.raises(KernelArgumentError, match="multiple of 16"):
        li.invariant_linear(x, np.zeros((8, 24), np.uint16), np.zeros((2, 8), np.uint16),
                            np.zeros((1, 2, 8), np.float32), None)
    with pytest.raises(KernelArgumentError, match="weight has shape"):
        li.invariant_linear(np.zeros((2, 32), np.uint16), np.zeros((8, 16), np.uint16), np.zeros((2, 8), np.uint16),
                            np.zeros((1, 2, 8), np.float32), None)
