"""The load-time NaN/infinity count of a bf16 weight (:mod:`metrale.kernels.weight_check`) run on
the host through the CUDA emulation header against its reference: counts spread over blocks and
strides, the counter added to (not overwritten), every non-finite bit pattern and none of the
finite ones; on the GPU (``-m gpu``) the same cases through CuPy."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import weight_check as wc

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 4) emu::fail("usage: folder count blocks");
    const std::string folder = argv[1];
    const long long count = std::atoll(argv[2]);
    const unsigned blocks = (unsigned)std::atoi(argv[3]);
    unsigned short* bits = read<unsigned short>(folder + "/bits", (size_t)count);
    unsigned long long* found = read<unsigned long long>(folder + "/found", 1);
    emu::launch({blocks, 1, 1}, {256, 1, 1}, [&] { count_nonfinite_bf16(bits, count, found); });
    write(folder + "/found", found, 1);
    return 0;
}
"""


def cases():
    rng = np.random.default_rng(5)
    finite = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    finite[(finite & 0x7F80) == 0x7F80] = 0x3F80  # every value finite
    every_pattern = np.arange(2**16, dtype=np.uint16)  # all 65,536 bit patterns
    scattered = finite.copy()
    scattered[[0, 17, 255, 256, 4999]] = [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81]
    return {"finite": finite, "every pattern": every_pattern, "scattered": scattered, "one": scattered[:1]}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weight_check_emulated")
    binary = build_emulated(folder / "weight_check.cpp", wc.KERNEL + EMULATION_MAIN)

    def run(bits, blocks, start=0):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        np.ascontiguousarray(bits, dtype=np.uint16).tofile(case / "bits")
        np.array([start], np.uint64).tofile(case / "found")
        subprocess.run([str(binary), str(case), str(bits.size), str(blocks)], check=True, timeout=600)
        return int(np.fromfile(case / "found", np.uint64)[0])

    return run


@pytest.mark.parametrize("name", list(cases()))
def test_emulated_count_matches_the_reference(emulated, name):
    bits = cases()[name]
    expected = wc.count_nonfinite_bf16_reference(bits)
    assert emulated(bits, wc.blocks_for(bits.size)) == expected
    # Fewer blocks than the values need: the grid strides over the rest; the counter is added to.
    assert emulated(bits, 3, start=10) == expected + 10


def test_the_reference_counts_exponents_of_all_ones():
    every = np.arange(2**16, dtype=np.uint16)
    assert wc.count_nonfinite_bf16_reference(every) == 2 * 2**7  # sign x mantissa, exponent all ones
    values = (every.astype(np.uint32) << 16).view(np.float32)
    assert wc.count_nonfinite_bf16_reference(every) == int(np.count_nonzero(~np.isfinite(values)))


def test_blocks_for():
    assert [wc.blocks_for(n) for n in (0, 1, 256, 257, 10**9)] == [1, 1, 1, 2, wc.MAX_BLOCKS]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(cases()))
def test_on_the_gpu(name):
    import cupy

    bits = cases()[name]
    found = cupy.full((1,), 7, dtype=np.uint64)
    wc.add_nonfinite_count(cupy.asarray(bits.reshape(-1, 1) if name == "every pattern" else bits), found)
    assert int(found.get()[0]) == 7 + wc.count_nonfinite_bf16_reference(bits)


def test_the_launcher_refuses_other_arrays():
    with pytest.raises(KernelArgumentError, match="bits has dtype float32"):
        wc.add_nonfinite_count(np.zeros(4, np.float32), np.zeros(1, np.uint64))
    with pytest.raises(KernelArgumentError, match="found has shape"):
        wc.add_nonfinite_count(np.zeros(4, np.uint16), np.zeros(2, np.uint64))
