"""The CUDA C++ LoRA expand (:func:`metrale.kernels.lora.lora_expand`) run on the host through
the CUDA emulation header against the op's reference: mixed slots with base-model rows, fused
projections of several parts, a bias, SwiGLU's activation, widths the 16-byte loads take and
widths they do not, rows and columns that do not fill the last block, and what the launcher
refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import _words, lora
from metrale.kernels.lora_tiles import adapter_tile_capacity, adapter_tiles
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16
from metrale.ops import builtin

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 10) emu::fail("usage: folder rows out width slots tiles has_bias swiglu words");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), out = std::atoi(argv[3]), width = std::atoi(argv[4]), slots = std::atoi(argv[5]);
    const int tile_count = std::atoi(argv[6]), has_bias = std::atoi(argv[7]), swiglu = std::atoi(argv[8]);
    const int words = std::atoi(argv[9]);
    const int k = width * slots;
    const float* ext = read<float>(folder + "/ext", (size_t)rows * (out + k));
    const int* tiles = read<int>(folder + "/tiles", (size_t)tile_count * (2 + LORA_ROWS));
    const unsigned short* b = read<unsigned short>(folder + "/b", (size_t)out * k);
    const float* bias = has_bias ? read<float>(folder + "/bias", (size_t)out) : nullptr;
    const int columns = swiglu ? out / 2 : out;
    float* y = allocate<float>((size_t)rows * out);
    unsigned short* act = allocate<unsigned short>((size_t)rows * columns);
    const unsigned grid_x = (columns + LORA_COLUMNS - 1) / LORA_COLUMNS;
    emu::launch({grid_x, (unsigned)((rows + LORA_ROWS - 1) / LORA_ROWS), 1}, {LORA_COLUMNS, 1, 1},
                [&] { lora_expand(ext, tiles, tile_count, b, bias, y, act, out, width, slots, swiglu, words); });
    if (swiglu) write(folder + "/out", act, (size_t)rows * columns);
    else write(folder + "/out", y, (size_t)rows * out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_expand_emulated")
    binary = build_emulated(folder / "lora.cpp", _words.HELPERS + lora.EXPAND_KERNEL + EMULATION_MAIN)

    def run(ext, row_slots, b, width, bias=None, swiglu=False, words=True, capacity=None):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        tiles = adapter_tiles(row_slots, capacity)
        arrays = {"ext": ext, "tiles": tiles, "b": b}
        if bias is not None:
            arrays["bias"] = bias
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        rows, out = len(ext), b.shape[0]
        subprocess.run([str(binary), str(case), str(rows), str(out), str(width), str(b.shape[1] // width),
                        str(len(tiles)), str(int(bias is not None)), str(int(swiglu)), str(int(words))], check=True,
                       timeout=600)
        if swiglu:
            return bf16_to_float32(np.fromfile(case / "out", np.uint16).reshape(rows, out // 2))
        return np.fromfile(case / "out", np.float32).reshape(rows, out)

    return run


def reference(ext, b_bits, row_slots, width, bias=None, swiglu=False):
    """The op's reference on what the kernel reads: the products rounded to bf16, ``b`` as bf16."""
    out = b_bits.shape[0]
    return builtin.lora_expand(products_in_bf16(ext, out), bf16_to_float32(b_bits), row_slots,
                               adapter_tiles(row_slots), width, bias, swiglu)


def products_in_bf16(ext, out):
    """``ext`` with its shrunk products rounded to bf16, as the kernel reads them."""
    rounded = ext.copy()
    rounded[:, out:] = bf16_to_float32(float32_to_bf16(ext[:, out:]))
    return rounded


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("words", [True, False])
def test_the_expand_matches_the_reference(emulated, index, words):
    """The op's examples: 1, 7 and 33 rows; one to three projections; no bias, a bias, a bias and
    SwiGLU's activation; slots of 8, 48 and 8 columns."""
    rng = np.random.default_rng(index)
    example = builtin._lora_expand_examples(rng)[index]
    ext, b, row_slots, width, bias, swiglu = (example[k] for k in ("ext", "b", "slots", "width", "bias", "swiglu"))
    row_slots[0] = 0  # a base-model row
    b_bits = float32_to_bf16(b)
    got = emulated(ext, row_slots.astype(np.int32), b_bits, width, bias, swiglu, words)
    expected = reference(ext, b_bits, row_slots, width, bias, swiglu)
    if swiglu:  # written as bf16
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        base = ext[0, : b.shape[0]] + (0 if bias is None else bias)
        np.testing.assert_array_equal(got[0], base.astype(np.float32))


def test_a_slot_reads_its_own_columns_only(emulated):
    """Rows of slot 2 only: every other slot's products and B poisoned, the result unchanged."""
    rng = np.random.default_rng(7)
    example = builtin._lora_expand_examples(rng)[1]  # 7 rows, three projections, 3 slots
    ext, b, width = example["ext"].copy(), example["b"].copy(), example["width"]
    out = b.shape[0]
    row_slots = np.array([2, 0, 2, 2, 0, 2, 2], np.int32)
    expected = reference(ext, float32_to_bf16(b), row_slots, width)
    for slot in (0, 2):
        ext[:, out + slot * width : out + (slot + 1) * width] = np.nan
        b[:, slot * width : (slot + 1) * width] = np.nan
    got = emulated(ext, row_slots, float32_to_bf16(b), width)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_many_rows_and_many_slots(emulated):
    """300 rows of nine slots: each slot's rows over several tiles, blocks taking several tiles
    (more tiles than 300 rows fill, since each slot's last tile is partly empty)."""
    rng = np.random.default_rng(11)
    rows, inner, outs, rank, slots = 300, 32, (40, 24), 8, 9
    width = len(outs) * rank
    a = rng.standard_normal((slots, width, inner)).astype(np.float32)
    b = np.zeros((sum(outs), slots * width), np.float32)
    b[:40, ::2] = rng.standard_normal((40, slots * width // 2))
    b[40:, 1::2] = rng.standard_normal((24, slots * width // 2))
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    ext = np.concatenate([rng.standard_normal((rows, sum(outs))), x @ a.reshape(-1, inner).T], axis=1).astype(np.float32)
    row_slots = rng.integers(0, slots + 1, rows).astype(np.int32)
    b_bits = float32_to_bf16(b)
    got = emulated(ext, row_slots, b_bits, width)
    expected = reference(ext, b_bits, row_slots, width)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("swiglu", [False, True])
def test_one_adapter_on_every_row(emulated, swiglu):
    """40 rows of slot 3 (a step of one adapter): five tiles of 8 rows, a block each per column
    tile."""
    assert lora.EXPAND_ROWS == 8
    rng = np.random.default_rng(9)
    rows, out, width, slots = 40, 48, 16, 3
    b_bits = float32_to_bf16(rng.standard_normal((out, slots * width)).astype(np.float32) * 0.1)
    ext = rng.standard_normal((rows, out + slots * width)).astype(np.float32)
    row_slots = np.full(rows, 3, np.int32)
    got = emulated(ext, row_slots, b_bits, width, swiglu=swiglu)
    expected = reference(ext, b_bits, row_slots, width, swiglu=swiglu)
    tolerance = 1e-2 if swiglu else 1e-4
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


@pytest.mark.parametrize("words", [True, False])
def test_slots_wider_than_one_staged_segment(emulated, words):
    """A slot of 272 columns (two projections of rank 136): past the 256 products a block stages
    at a time, so its update is summed over two segments."""
    assert lora.EXPAND_SEGMENT == 256
    rng = np.random.default_rng(5)
    rows, out, width, slots = 6, 24, 272, 2
    b_bits = float32_to_bf16(rng.standard_normal((out, slots * width)).astype(np.float32) * 0.1)
    ext = rng.standard_normal((rows, out + slots * width)).astype(np.float32)
    row_slots = np.array([1, 2, 0, 2, 1, 1], np.int32)
    got = emulated(ext, row_slots, b_bits, width, words=words)
    expected = reference(ext, b_bits, row_slots, width)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("capacity", [None, adapter_tile_capacity(12)])
def test_blocks_that_take_two_tiles(emulated, capacity):
    """12 rows of slots 1 and 2 (5 each) and the base model (2): three tiles over the two blocks
    of a column tile, the first taking two; with a CUDA graph's table (room for any 12 rows) the
    tiles past the used ones count no row and are never read as rows."""
    rng = np.random.default_rng(13)
    rows, out, width, slots = 12, 136, 16, 2
    b_bits = float32_to_bf16(rng.standard_normal((out, slots * width)).astype(np.float32) * 0.1)
    ext = rng.standard_normal((rows, out + slots * width)).astype(np.float32)
    row_slots = np.array([1, 2, 0, 1, 2, 2, 1, 0, 1, 2, 1, 2], np.int32)
    got = emulated(ext, row_slots, b_bits, width, capacity=capacity)
    np.testing.assert_allclose(got, reference(ext, b_bits, row_slots, width), rtol=1e-4, atol=1e-4)


def test_what_the_launcher_takes():
    tiles = adapter_tiles(np.zeros(2, np.int32))
    with pytest.raises(KernelArgumentError, match="whole slots"):
        lora.lora_expand(np.zeros((2, 8 + 50), np.float32), tiles, np.zeros((8, 50), np.uint16), 16,
                         np.zeros((2, 8), np.float32))
    with pytest.raises(KernelArgumentError, match="gate and up"):
        lora.lora_expand(np.zeros((2, 7 + 64), np.float32), tiles, np.zeros((7, 64), np.uint16), 16,
                         np.zeros((2, 3), np.uint16), swiglu=True)
    with pytest.raises(KernelArgumentError, match="out"):
        lora.lora_expand(np.zeros((2, 8 + 64), np.float32), tiles, np.zeros((8, 64), np.uint16), 16,
                         np.zeros((2, 8), np.uint16))
    with pytest.raises(KernelArgumentError, match="tiles"):
        lora.lora_expand(np.zeros((2, 8 + 64), np.float32), tiles[:, :4], np.zeros((8, 64), np.uint16), 16,
                         np.zeros((2, 8), np.float32))
    with pytest.raises(KernelArgumentError, match="cannot hold 9 rows"):
        lora.lora_expand(np.zeros((9, 8 + 64), np.float32), adapter_tiles(np.zeros(1, np.int32)),
                         np.zeros((8, 64), np.uint16), 16, np.zeros((9, 8), np.float32))
