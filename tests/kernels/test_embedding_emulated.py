"""The embedding gather (:mod:`metrale.kernels.embedding`) run on the host through the CUDA
emulation header against its reference: repeated and edge ids, hidden sizes that are no multiple
of a thread's four columns or of a block's, every bf16 bit pattern widened exactly; and what the
launcher refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import embedding
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 5) emu::fail("usage: folder vocab hidden rows");
    const std::string folder = argv[1];
    const int vocab = std::atoi(argv[2]), hidden = std::atoi(argv[3]), rows = std::atoi(argv[4]);
    unsigned short* weight = read<unsigned short>(folder + "/weight", (size_t)vocab * hidden);
    int* ids = read<int>(folder + "/ids", rows);
    float* out = allocate<float>((size_t)rows * hidden);
    const unsigned column_blocks = (unsigned)std::max(1, (hidden + 4 * 128 - 1) / (4 * 128));
    emu::launch({(unsigned)rows, column_blocks, 1}, {128, 1, 1}, [&] { embedding_bf16(weight, ids, out, hidden); });
    write(folder + "/out", out, (size_t)rows * hidden);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedding_emulated")
    binary = build_emulated(folder / "embedding.cpp", embedding.KERNEL + EMULATION_MAIN)

    def run(weight, ids):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        np.ascontiguousarray(weight, dtype=np.uint16).tofile(case / "weight")
        np.ascontiguousarray(ids, dtype=np.int32).tofile(case / "ids")
        vocab, hidden = weight.shape
        assert embedding.grid(len(ids), hidden)[1] == max(1, -(-hidden // 512))
        subprocess.run([str(binary), str(case), str(vocab), str(hidden), str(len(ids))], check=True, timeout=600)
        return np.fromfile(case / "out", np.float32).reshape(len(ids), hidden)

    return run


@pytest.mark.parametrize("hidden", [1, 6, 37, 512, 1030, 1032])
def test_emulated_gather_matches_the_reference(emulated, hidden):
    rng = np.random.default_rng(hidden)
    weight = float32_to_bf16(rng.standard_normal((11, hidden)).astype(np.float32))
    ids = np.array([3, 0, 10, 3, 10], np.int32)
    np.testing.assert_array_equal(emulated(weight, ids), embedding.embedding_reference(bf16_to_float32(weight), ids))


def test_every_bit_pattern_widens_exactly(emulated):
    weight = np.arange(2**16, dtype=np.uint16).reshape(64, 1024)  # every bf16 value, NaNs and infinities too
    ids = np.arange(64, dtype=np.int32)[::-1].copy()
    out = emulated(weight, ids)
    np.testing.assert_array_equal(out.view(np.uint32), weight[ids].astype(np.uint32) << 16)


def test_the_launcher_refuses_host_arrays_and_wrong_dtypes():
    weight, ids, out = np.zeros((4, 3), np.uint16), np.zeros(2, np.int32), np.zeros((2, 3), np.float32)
    with pytest.raises(KernelArgumentError, match="on the device"):
        embedding.embedding(weight, ids, out)
    with pytest.raises(KernelArgumentError, match="ids has dtype int64, expected int32"):
        embedding.embedding(weight, np.zeros(2, np.int64), out)
    with pytest.raises(KernelArgumentError, match=r"out has shape \[2, 4\], expected \[2, 3\]"):
        embedding.embedding(weight, ids, np.zeros((2, 4), np.float32))
