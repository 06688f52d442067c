"""The CUDA C++ LoRA expand (:func:`metrale.kernels.lora.lora_expand_words`) run on the host
through the CUDA emulation header against the op's reference: mixed slots with base-model rows,
fused projections of several parts, rows and columns that do not fill the last block, and what
the launcher refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.checkpoint import bf16_to_float32, float32_to_bf16
from metrale.errors import KernelArgumentError
from metrale.kernels import decode_gemv, lora
from metrale.ops import builtin

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 7) emu::fail("usage: folder rows out width slots single_slot");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), out = std::atoi(argv[3]), width = std::atoi(argv[4]), slots = std::atoi(argv[5]);
    const int single_slot = std::atoi(argv[6]);
    const int k = width * slots;
    const float* products = read<float>(folder + "/products", (size_t)rows * (single_slot > 0 ? width : k));
    const int* row_slots = read<int>(folder + "/slots", (size_t)rows);
    const unsigned short* b = read<unsigned short>(folder + "/b", (size_t)out * k);
    float* y = allocate<float>((size_t)rows * out);
    const float* y_in = read<float>(folder + "/y", (size_t)rows * out);
    for (size_t i = 0; i < (size_t)rows * out; ++i) y[i] = y_in[i];
    const unsigned columns = (out + LORA_COLUMNS - 1) / LORA_COLUMNS, row_tiles = (rows + LORA_ROWS - 1) / LORA_ROWS;
    emu::launch({columns, row_tiles, 1}, {LORA_THREADS, 1, 1},
                [&] { lora_expand_words(products, row_slots, b, y, rows, out, width, slots, single_slot); });
    write(folder + "/y_out", y, (size_t)rows * out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_expand_emulated")
    binary = build_emulated(folder / "lora.cpp", decode_gemv.HELPERS + lora.EXPAND_KERNEL + EMULATION_MAIN)

    def run(products, row_slots, b, y, width, single_slot=0):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in (("products", products), ("slots", row_slots), ("b", b), ("y", y)):
            np.ascontiguousarray(array).tofile(case / name)
        rows, out = y.shape
        subprocess.run([str(binary), str(case), str(rows), str(out), str(width), str(b.shape[1] // width),
                        str(single_slot)], check=True, timeout=600)
        return np.fromfile(case / "y_out", np.float32).reshape(rows, out)

    return run


@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_expand_matches_the_reference(emulated, index):
    rng = np.random.default_rng(index)
    example = builtin._lora_linear_examples(rng)[index]  # 1, 7 and 33 rows; one to three projections
    a, b, x, y, row_slots = (example[k] for k in ("a", "b", "x", "y", "slots"))
    row_slots[0] = 0  # a base-model row
    b_bits = float32_to_bf16(b)
    width, inner = a.shape[1], a.shape[2]
    products = (x @ a[1:].reshape(-1, inner).T).astype(np.float32)  # the cuBLAS shrink
    got = emulated(products, row_slots.astype(np.int32), b_bits, y, width)
    expected = builtin.lora_linear(y.copy(), x, a, bf16_to_float32(b_bits), row_slots)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[row_slots == 0], y[row_slots == 0])


def test_one_adapter_reads_its_slot_only(emulated):
    """The single-adapter route: the products of the one slot, only its B staged."""
    rng = np.random.default_rng(5)
    example = builtin._lora_linear_examples(rng)[2]  # 33 rows, two projections, 4 slots
    a, b, x, y = (example[k] for k in ("a", "b", "x", "y"))
    row_slots = np.where(rng.random(len(x)) < 0.7, 3, 0).astype(np.int32)
    b_bits = float32_to_bf16(b)
    products = (x @ a[3].T).astype(np.float32)  # the shrink with slot 3's A only
    got = emulated(products, row_slots, b_bits, y, a.shape[1], single_slot=3)
    expected = builtin.lora_linear(y.copy(), x, a, bf16_to_float32(b_bits), row_slots, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_what_the_launcher_takes():
    assert lora.expand_words_supported(4, 48)  # four rank-16 slots of a fused qkv weight
    assert not lora.expand_words_supported(8, 48)
    with pytest.raises(KernelArgumentError, match="whole slots"):
        lora.lora_expand_words(np.zeros((2, 50), np.float32), np.zeros(2, np.int32), np.zeros((8, 50), np.uint16),
                               np.zeros((2, 8), np.float32), 16)
    with pytest.raises(KernelArgumentError, match="one slot's"):
        lora.lora_expand_words(np.zeros((2, 64), np.float32), np.zeros(2, np.int32), np.zeros((8, 64), np.uint16),
                               np.zeros((2, 8), np.float32), 16, single_slot=2)
    with pytest.raises(KernelArgumentError, match="shared memory"):
        lora.lora_expand_words(np.zeros((2, 384), np.float32), np.zeros(2, np.int32), np.zeros((8, 384), np.uint16),
                               np.zeros((2, 8), np.float32), 48)
