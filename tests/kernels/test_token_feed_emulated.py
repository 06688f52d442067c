"""The token feed (:mod:`metrale.kernels.token_feed`) run on the host through the CUDA emulation
header against its reference: rows spread over several blocks in any order, sampled tokens of -1
fed as 0, the other rows untouched; on the GPU (``-m gpu``) the same case through CuPy; and what
the launcher refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import token_feed

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 5) emu::fail("usage: folder tokens sources count");
    const std::string folder = argv[1];
    const int tokens = std::atoi(argv[2]), sources = std::atoi(argv[3]), count = std::atoi(argv[4]);
    int* token_ids = read<int>(folder + "/token_ids", tokens);
    int* source = read<int>(folder + "/source", sources);
    int* rows = read<int>(folder + "/rows", count);
    int* indices = read<int>(folder + "/indices", count);
    emu::launch({(unsigned)((count + 127) / 128), 1, 1}, {128, 1, 1},
                [&] { feed_tokens(token_ids, source, rows, indices, count); });
    write(folder + "/token_ids", token_ids, tokens);
    return 0;
}
"""


def case():
    rng = np.random.default_rng(4)
    source = rng.integers(0, 500, 40).astype(np.int32)
    source[[5, 17]] = -1
    rows = rng.permutation(400)[:300].astype(np.int32)  # more rows than a block: three blocks
    indices = rng.integers(0, 40, 300).astype(np.int32)
    indices[:2] = [5, 17]
    token_ids = rng.integers(0, 500, 400).astype(np.int32)
    return token_ids, source, rows, indices


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("token_feed_emulated")
    binary = build_emulated(folder / "token_feed.cpp", token_feed.KERNEL + EMULATION_MAIN)

    def run(token_ids, source, rows, indices):
        for name, array in (("token_ids", token_ids), ("source", source), ("rows", rows), ("indices", indices)):
            np.ascontiguousarray(array, dtype=np.int32).tofile(folder / name)
        subprocess.run([str(binary), str(folder), str(len(token_ids)), str(len(source)), str(len(rows))], check=True,
                       timeout=600)
        return np.fromfile(folder / "token_ids", np.int32)

    return run


def test_emulated_feed_matches_the_reference(emulated):
    token_ids, source, rows, indices = case()
    expected = token_feed.feed_tokens_reference(token_ids.copy(), source, rows, indices)
    assert (expected[rows[:2]] == 0).all() and expected.min() >= 0
    untouched = np.setdiff1d(np.arange(len(token_ids)), rows)
    np.testing.assert_array_equal(expected[untouched], token_ids[untouched])
    np.testing.assert_array_equal(emulated(token_ids, source, rows, indices), expected)


@pytest.mark.gpu
def test_on_the_gpu():
    import cupy

    token_ids, source, rows, indices = case()
    expected = token_feed.feed_tokens_reference(token_ids.copy(), source, rows, indices)
    on_device = cupy.asarray(token_ids)
    token_feed.feed_tokens(on_device, cupy.asarray(source), cupy.asarray(rows), cupy.asarray(indices))
    np.testing.assert_array_equal(cupy.asnumpy(on_device), expected)


def test_the_launcher_refuses_host_arrays_wrong_dtypes_and_too_many_rows():
    token_ids, source, rows, indices = case()
    with pytest.raises(KernelArgumentError, match="on the device"):
        token_feed.feed_tokens(token_ids, source, rows, indices)
    with pytest.raises(KernelArgumentError, match="rows"):
        token_feed.feed_tokens(token_ids, source, rows.astype(np.int64), indices)
    with pytest.raises(KernelArgumentError, match="300 fed rows for a batch of 10 tokens"):
        token_feed.feed_tokens(token_ids[:10], source, rows, indices)
