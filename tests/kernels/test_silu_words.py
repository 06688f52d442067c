"""The CUDA C++ SiLU-and-mul (:func:`metrale.kernels.activation.silu_and_mul_words`) run on the
host through the CUDA emulation header against
:func:`~metrale.kernels.activation.silu_and_mul_reference`: a row shorter than a block, rows
that span several blocks with a partial last one, and what the kernel refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import _words, activation
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 4) emu::fail("usage: folder rows width");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), width = std::atoi(argv[3]);
    const uint4* gate_up = reinterpret_cast<const uint4*>(read<unsigned short>(folder + "/gate_up", (size_t)rows * 2 * width));
    unsigned short* out = allocate<unsigned short>((size_t)rows * width);
    const unsigned blocks = (width + 8 * SILU_WORD_THREADS - 1) / (8 * SILU_WORD_THREADS);
    emu::launch({(unsigned)rows, blocks, 1}, {SILU_WORD_THREADS, 1, 1},
                [&] { silu_and_mul_words(gate_up, reinterpret_cast<uint4*>(out), width); });
    write(folder + "/out", out, (size_t)rows * width);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("silu_words_emulated")
    binary = build_emulated(folder / "silu.cpp", _words.HELPERS + activation.KERNEL + EMULATION_MAIN)

    def run(gate_up_bits):
        rows, double = gate_up_bits.shape
        case = folder / "case"
        case.mkdir(exist_ok=True)
        np.ascontiguousarray(gate_up_bits).tofile(case / "gate_up")
        subprocess.run([str(binary), str(case), str(rows), str(double // 2)], check=True, timeout=600)
        return np.fromfile(case / "out", np.uint16).reshape(rows, double // 2)

    return run


@pytest.mark.parametrize("rows, width", [(1, 40), (3, 8192), (2, 1032)])
def test_the_gate_matches_the_reference(emulated, rows, width):
    rng = np.random.default_rng(rows + width)
    gate_up = float32_to_bf16((4 * rng.standard_normal((rows, 2 * width))).astype(np.float32))
    got = bf16_to_float32(emulated(gate_up))
    values = bf16_to_float32(gate_up)
    expected = bf16_to_float32(float32_to_bf16(activation.silu_and_mul_reference(values[:, :width], values[:, width:])))
    # One bf16 rounding of the same float32 value, the exponential the device's or the library's.
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-6)
    assert np.mean(got == expected) > 0.99


def test_what_it_serves():
    assert activation.words_supported(np.zeros((4, 16384), np.uint16))
    assert not activation.words_supported(np.zeros((4, 16376), np.uint16))  # halves of 8,188 values
    assert not activation.words_supported(np.zeros((4, 16384), np.float32))
    assert not activation.words_supported(np.zeros((4, 32768), np.uint16)[:, :16384])
    with pytest.raises(KernelArgumentError, match="multiples of 8"):
        activation.silu_and_mul_words(np.zeros((1, 20), np.uint16), np.zeros((1, 10), np.uint16))
