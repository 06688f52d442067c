"""The CUDA C++ residual add and RMSNorm (:func:`metrale.kernels.rmsnorm.rmsnorm_residual_words`)
run on the host through the CUDA emulation header against
:func:`~metrale.kernels.rmsnorm.rmsnorm_residual_reference`: with and without the residual, a
zero-centred weight, rows shorter than a block and rows that fill every kept word."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import _words, rmsnorm
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 7) emu::fail("usage: folder rows hidden add eps offset");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), hidden = std::atoi(argv[3]), add = std::atoi(argv[4]);
    const float eps = std::atof(argv[5]), offset = std::atof(argv[6]);
    float* x = read<float>(folder + "/x", (size_t)rows * hidden);
    float* residual = read<float>(folder + "/residual", (size_t)rows * hidden);
    unsigned short* weight = read<unsigned short>(folder + "/weight", hidden);
    unsigned short* out = allocate<unsigned short>((size_t)rows * hidden);
    emu::launch({(unsigned)rows, 1, 1}, {NORM_WORD_THREADS, 1, 1},
                [&] { rmsnorm_residual_words(x, residual, weight, eps, offset, add, out, hidden); });
    write(folder + "/out", out, (size_t)rows * hidden);
    write(folder + "/residual", residual, (size_t)rows * hidden);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rmsnorm_words_emulated")
    binary = build_emulated(folder / "rmsnorm.cpp", _words.HELPERS + rmsnorm.KERNEL + EMULATION_MAIN)

    def run(x, residual, weight_bits, add, eps, offset):
        rows, hidden = x.shape
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in dict(x=x, residual=residual, weight=weight_bits).items():
            np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binary), str(case), str(rows), str(hidden), str(int(add)), repr(eps), repr(offset)],
                       check=True, timeout=600)
        out = bf16_to_float32(np.fromfile(case / "out", np.uint16)).reshape(rows, hidden)
        return out, np.fromfile(case / "residual", np.float32).reshape(rows, hidden)

    return run


@pytest.mark.parametrize("rows, hidden, add, offset", [
    (1, 2048, True, 0.0),  # DeepSeek-V2-Lite's rows: two words a thread
    (3, 100, False, 0.0),  # the first layer; a row shorter than a block
    (2, 8192, True, 1.0),  # every kept word; a zero-centred weight
])
def test_the_norm_matches_the_reference(emulated, rows, hidden, add, offset):
    rng = np.random.default_rng(rows + hidden)
    x = (3 * rng.standard_normal((rows, hidden))).astype(np.float32)
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    weight_bits = float32_to_bf16((0.5 * rng.standard_normal(hidden)).astype(np.float32))
    out, summed = emulated(x, residual, weight_bits, add, 1e-6, offset)
    expected, expected_summed = rmsnorm.rmsnorm_residual_reference(x, residual if add else None,
                                                                   bf16_to_float32(weight_bits), 1e-6, offset)
    np.testing.assert_array_equal(summed, expected_summed)
    # One bf16 rounding of the output; the sum of squares in another order.
    assert np.abs(out - expected).max() <= 1e-2 * np.abs(expected).max()


def test_what_it_serves():
    assert rmsnorm.words_supported(4096) and rmsnorm.words_supported(8192)
    assert not rmsnorm.words_supported(8196) and not rmsnorm.words_supported(2050)
    with pytest.raises(KernelArgumentError, match="not served"):
        rmsnorm.rmsnorm_residual_words(np.zeros((1, 2050), np.float32), np.zeros((1, 2050), np.float32),
                                       np.zeros(2050, np.uint16), 1e-6, 0.0, True, np.zeros((1, 2050), np.uint16))
