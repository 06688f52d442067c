"""The CUDA C++ merge of split attention partials (:mod:`metrale.kernels.attention_combine`) run on
the host through the CUDA emulation header against
:func:`~metrale.kernels.attention_latent_mma.combine_partials_model`: one to 32 splits, splits
without keys, a row none of whose splits has keys, value widths not a multiple of a block."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import attention_combine
from metrale.kernels.attention_latent_mma import combine_partials_model
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 6) emu::fail("usage: folder rows heads splits value_dim");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), splits = std::atoi(argv[4]);
    const int value_dim = std::atoi(argv[5]);
    float* acc = read<float>(folder + "/acc", (size_t)rows * heads * splits * value_dim);
    float* best = read<float>(folder + "/best", (size_t)rows * heads * splits);
    float* total = read<float>(folder + "/total", (size_t)rows * heads * splits);
    unsigned short* out = allocate<unsigned short>((size_t)rows * heads * value_dim);
    emu::launch({(unsigned)rows, (unsigned)heads, (unsigned)((value_dim + COMBINE_THREADS - 1) / COMBINE_THREADS)},
                {COMBINE_THREADS, 1, 1}, [&] { attention_combine(acc, best, total, out, splits, value_dim); });
    write(folder + "/out", out, (size_t)rows * heads * value_dim);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attention_combine_emulated")
    binary = build_emulated(folder / "combine.cpp", attention_combine.KERNEL + EMULATION_MAIN)

    def run(acc, best, total):
        rows, heads, splits, value_dim = acc.shape
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in dict(acc=acc, best=best, total=total).items():
            np.ascontiguousarray(array, dtype=np.float32).tofile(case / name)
        subprocess.run([str(binary), str(case), str(rows), str(heads), str(splits), str(value_dim)], check=True,
                       timeout=600)
        return bf16_to_float32(np.fromfile(case / "out", np.uint16)).reshape(rows, heads, value_dim)

    return run


@pytest.mark.parametrize("rows, heads, splits, value_dim", [
    (1, 2, 1, 64),
    (2, 3, 7, 200),  # a partial block of columns
    (1, 16, 32, 512),  # MLA's values, the most splits
])
def test_the_merge_matches_the_model(emulated, rows, heads, splits, value_dim):
    rng = np.random.default_rng(rows * 100 + splits)
    acc = rng.standard_normal((rows, heads, splits, value_dim)).astype(np.float32)
    best = (3 * rng.standard_normal((rows, heads, splits))).astype(np.float32)
    total = rng.uniform(0.5, 4.0, (rows, heads, splits)).astype(np.float32)
    if splits > 1:
        total[:, :, -1] = 0.0  # a split past the row's keys
        best[:, :, -1] = -np.inf
    if rows > 1:
        total[1, 0] = 0.0  # no split with keys: zeros
    got = emulated(acc, best, total)
    expected = bf16_to_float32(float32_to_bf16(combine_partials_model(acc, best, total)))
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()
    if rows > 1:
        assert not got[1, 0].any()


def test_shapes_are_checked():
    acc = np.zeros((1, 2, 33, 8), np.float32)
    with pytest.raises(KernelArgumentError, match="33 splits"):
        attention_combine.combine(acc, np.zeros((1, 2, 33), np.float32), np.zeros((1, 2, 33), np.float32),
                                  np.zeros((1, 16), np.uint16))
    with pytest.raises(KernelArgumentError, match="out"):
        attention_combine.combine(acc[:, :, :4], np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32),
                                  np.zeros((1, 15), np.uint16))
