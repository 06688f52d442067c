"""The CUDA C++ per-head linear map (:func:`metrale.kernels.head_linear.head_linear_words`) run on
the host through the CUDA emulation header against
:func:`~metrale.kernels.head_linear.head_linear_reference`: bf16 and float32 inputs (the float32
one a strided view, as MLA's query heads are), input widths past one word a lane, several rows."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import head_linear
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 9) emu::fail("usage: folder x_float rows heads in out row_stride head_stride");
    const std::string folder = argv[1];
    const int x_float = std::atoi(argv[2]), rows = std::atoi(argv[3]), heads = std::atoi(argv[4]);
    const int in_width = std::atoi(argv[5]), out_width = std::atoi(argv[6]);
    const long row_stride = std::atol(argv[7]), head_stride = std::atol(argv[8]);
    const size_t x_values = (size_t)rows * row_stride;
    const void* x = x_float ? (const void*)read<float>(folder + "/x", x_values)
                            : (const void*)read<unsigned short>(folder + "/x", x_values);
    const uint4* weight = reinterpret_cast<const uint4*>(
        read<unsigned short>(folder + "/weight", (size_t)heads * out_width * in_width));
    float* out = allocate<float>((size_t)rows * heads * out_width);
    const unsigned blocks = (heads * out_width + HEAD_WARPS_CC - 1) / HEAD_WARPS_CC;
    emu::launch({blocks, 1, 1}, {32 * HEAD_WARPS_CC, 1, 1}, [&] {
        head_linear_words(x, x_float, row_stride, head_stride, weight, out, rows, heads, in_width, out_width);
    });
    write(folder + "/out", out, (size_t)rows * heads * out_width);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head_linear_words_emulated")
    binary = build_emulated(folder / "head_linear.cpp", head_linear.HELPERS + head_linear.KERNEL + EMULATION_MAIN)

    def run(x_storage, x_float, rows, heads, in_width, weight, row_stride, head_stride):
        out_width = weight.shape[0] // heads
        case = folder / "case"
        case.mkdir(exist_ok=True)
        np.ascontiguousarray(x_storage).tofile(case / "x")
        np.ascontiguousarray(weight).tofile(case / "weight")
        subprocess.run([str(binary), str(case), str(int(x_float)), str(rows), str(heads), str(in_width), str(out_width),
                        str(row_stride), str(head_stride)], check=True, timeout=600)
        return np.fromfile(case / "out", np.float32).reshape(rows, heads, out_width)

    return run


@pytest.mark.parametrize("rows, heads, in_width, out_width", [(1, 2, 128, 24), (3, 4, 512, 16), (2, 1, 16, 9)])
def test_bf16_input(emulated, rows, heads, in_width, out_width):
    rng = np.random.default_rng(rows + in_width)
    x_bits = float32_to_bf16(rng.standard_normal((rows, heads, in_width)).astype(np.float32))
    weight_bits = float32_to_bf16((0.1 * rng.standard_normal((heads * out_width, in_width))).astype(np.float32))
    got = emulated(x_bits, False, rows, heads, in_width, weight_bits, heads * in_width, in_width)
    expected = head_linear.head_linear_reference(bf16_to_float32(x_bits), bf16_to_float32(weight_bits))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows, heads, in_width, width, out_width", [(1, 16, 128, 192, 40), (3, 2, 64, 96, 8)])
def test_float32_strided_input_is_rounded_to_bf16(emulated, rows, heads, in_width, width, out_width):
    # The first in_width values of rows [N, heads, width]: MLA's query heads' no-RoPE parts.
    rng = np.random.default_rng(rows + width)
    q = rng.standard_normal((rows, heads, width)).astype(np.float32)
    weight_bits = float32_to_bf16((0.1 * rng.standard_normal((heads * out_width, in_width))).astype(np.float32))
    got = emulated(q, True, rows, heads, in_width, weight_bits, heads * width, width)
    rounded = bf16_to_float32(float32_to_bf16(np.ascontiguousarray(q[:, :, :in_width])))
    expected = head_linear.head_linear_reference(rounded, bf16_to_float32(weight_bits))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_what_it_serves():
    weight = np.zeros((32, 128), np.uint16)
    q = np.zeros((2, 4, 192), np.float32)
    assert head_linear.words_supported(q[:, :, :128], weight)  # strided float32 heads
    assert head_linear.words_supported(np.zeros((2, 4, 128), np.uint16), weight)
    assert not head_linear.words_supported(np.zeros((2, 4, 130), np.float32)[:, :, :128], weight)  # 520-byte heads
    assert not head_linear.words_supported(np.zeros((2, 4, 130), np.float32), np.zeros((32, 130), np.uint16))
    assert not head_linear.words_supported(np.zeros((1, 1, 4096), np.uint16), np.zeros((8, 4096), np.uint16))
    with pytest.raises(KernelArgumentError, match="not served"):
        head_linear.head_linear_words(np.zeros((2, 4, 130), np.float32), np.zeros((32, 130), np.uint16),
                                      np.zeros((2, 4, 8), np.float32))
