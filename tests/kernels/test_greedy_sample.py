"""The greedy sampling kernel (:mod:`metrale.kernels.greedy_sample`) run on the host through the
CUDA emulation header against :func:`~metrale.kernels.greedy_sample.greedy_reference`: rows of one
part and of several (the last one partial), ties across parts, rows holding NaN, +infinity or only
-infinity, counters that are zero again after each launch, and what the launcher refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import greedy_sample as gs
from metrale.kernels.sampling import sample_reference

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 5) emu::fail("usage: folder rows V launches");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), V = std::atoi(argv[3]), launches = std::atoi(argv[4]);
    const int parts = (V + PART - 1) / PART;
    float* logits = read<float>(folder + "/logits", (size_t)rows * V);
    float* part_values = allocate<float>((size_t)rows * parts);
    int* part_indices = allocate<int>((size_t)rows * parts);
    int* counters = allocate<int>(rows);
    for (int r = 0; r < rows; ++r) counters[r] = 0;
    int* tokens = allocate<int>(rows);
    for (int launch = 0; launch < launches; ++launch) {
        emu::launch({(unsigned)parts, (unsigned)rows, 1}, {THREADS, 1, 1}, [&] {
            greedy_sample(logits, part_values, part_indices, counters, tokens, V);
        });
    }
    write(folder + "/tokens", tokens, rows);
    write(folder + "/counters", counters, rows);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("greedy_sample_emulated")
    binary = build_emulated(folder / "greedy_sample.cpp", gs.CONSTANTS + gs.KERNEL + EMULATION_MAIN)

    def run(logits, launches=1):
        rows, vocab = logits.shape
        case = folder / "case"
        case.mkdir(exist_ok=True)
        np.ascontiguousarray(logits, dtype=np.float32).tofile(case / "logits")
        subprocess.run([str(binary), str(case), str(rows), str(vocab), str(launches)], check=True, timeout=600)
        return np.fromfile(case / "tokens", np.int32), np.fromfile(case / "counters", np.int32)

    return run


def test_emulated_kernel_matches_the_reference(emulated):
    rng = np.random.default_rng(3)
    vocab = 2 * gs.PART + 300  # three parts, the last one partial
    logits = rng.standard_normal((7, vocab)).astype(np.float32)
    logits[1, 5] = logits[1, gs.PART + 7] = 50.0  # a tie across parts: the smaller index
    logits[2, -1] = 60.0  # the best in the partial part
    logits[3, 100] = np.nan
    logits[4, 2 * gs.PART] = np.inf
    logits[5] = -np.inf
    logits[6, :] = -np.inf
    logits[6, gs.PART + 1] = -1e30  # one finite value among -infinity
    tokens, counters = emulated(logits, launches=2)
    expected = gs.greedy_reference(logits)
    np.testing.assert_array_equal(tokens, expected)
    assert expected.tolist()[:3] == [int(np.argmax(logits[0])), 5, vocab - 1]
    assert expected.tolist()[3:] == [-1, -1, -1, gs.PART + 1]
    # The device sampler's own reference, at temperature 0, agrees.
    rows = len(logits)
    zeros, ones = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    np.testing.assert_array_equal(expected, sample_reference(logits, zeros, np.zeros(rows, np.int32), ones, zeros))
    assert (counters == 0).all()  # ready for the next launch


def test_one_part_rows(emulated):
    logits = np.random.default_rng(4).standard_normal((2, 100)).astype(np.float32)
    tokens, _ = emulated(logits)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=1))


def test_supports_and_parts():
    assert gs.parts(128256) == 63 and gs.supports(128256) and gs.supports(151936)
    assert not gs.supports(gs.MAX_PARTS * gs.PART + 1) and not gs.supports(0)


def test_the_launcher_refuses_what_it_does_not_serve():
    logits = np.zeros((2, 100), np.float32)
    with pytest.raises(KernelArgumentError, match="part_values"):
        gs.greedy_sample(logits, np.zeros((2, 2), np.float32), np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                         np.zeros(2, np.int32))
    with pytest.raises(KernelArgumentError, match="not served"):
        big = np.zeros((1, gs.MAX_PARTS * gs.PART + 1), np.float32)
        gs.greedy_sample(big, None, None, None, None)
