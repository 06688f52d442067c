"""The sampling kernel (:mod:`metrale.kernels.sampling`) run on the host through the CUDA emulation
header against :func:`~metrale.kernels.sampling.sample_reference`: greedy rows and their ties,
rows without a distribution, draws whose uniform sits inside one token's interval (top-k, top-p,
min-p, thresholds among ties and values one ulp apart), the seeded draw's hash, and what the
launcher refuses. Built with 64 threads a block (two warps, so the warps' partial results are
combined) for the cases and with the launch's own count for one of them."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import sampling

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 4) emu::fail("usage: folder rows vocab");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), vocab = std::atoi(argv[3]);
    float* logits = read<float>(folder + "/logits", (size_t)rows * vocab);
    float* temperature = read<float>(folder + "/temperature", rows);
    int* top_k = read<int>(folder + "/top_k", rows);
    float* top_p = read<float>(folder + "/top_p", rows);
    float* log_min_p = read<float>(folder + "/log_min_p", rows);
    long long* seeds = read<long long>(folder + "/seeds", rows);
    long long* steps = read<long long>(folder + "/steps", rows);
    float* uniforms = read<float>(folder + "/uniforms", rows);
    int* tokens = allocate<int>(rows);
    emu::launch({(unsigned)rows, 1, 1}, {SAMPLE_THREADS, 1, 1}, [&] {
        sample_tokens(logits, vocab, temperature, top_k, top_p, log_min_p, seeds, steps, uniforms, tokens);
    });
    write(folder + "/tokens", tokens, rows);
    return 0;
}
"""


def build(folder, threads):
    constants = sampling.CONSTANTS.replace(f"SAMPLE_THREADS {sampling.SAMPLE_THREADS}", f"SAMPLE_THREADS {threads}")
    assert f"SAMPLE_THREADS {threads}\n" in constants
    binary = build_emulated(folder / f"sampling_{threads}.cpp", constants + sampling.KERNEL + EMULATION_MAIN)

    def run(logits, temperature, top_k, top_p, seeds, steps, uniforms, log_min_p=None):
        rows, vocab = logits.shape
        case = folder / f"case_{threads}"
        case.mkdir(exist_ok=True)
        if log_min_p is None:
            log_min_p = np.full(rows, -np.inf, np.float32)
        for name, array, dtype in (("logits", logits, np.float32), ("temperature", temperature, np.float32),
                                   ("top_k", top_k, np.int32), ("top_p", top_p, np.float32),
                                   ("log_min_p", log_min_p, np.float32), ("seeds", seeds, np.int64),
                                   ("steps", steps, np.int64), ("uniforms", uniforms, np.float32)):
            np.ascontiguousarray(array, dtype=dtype).tofile(case / name)
        subprocess.run([str(binary), str(case), str(rows), str(vocab)], check=True, timeout=600)
        return np.fromfile(case / "tokens", np.int32)

    return run


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build(tmp_path_factory.mktemp("sampling_emulated"), 64)


@pytest.fixture(scope="module")
def emulated_full_block(tmp_path_factory):
    return build(tmp_path_factory.mktemp("sampling_emulated_full"), sampling.SAMPLE_THREADS)


def parameters(cases):
    """(temperature, top_k, top_p) arrays of ``(temperature, top_k, top_p)`` rows."""
    return (np.array([c[0] for c in cases], np.float32), np.array([c[1] for c in cases], np.int32),
            np.array([c[2] for c in cases], np.float32))


def interval_middles(logits, temperature, top_k, top_p, rng, points, log_min_p=None):
    """Per row, a uniform at the middle of a randomly chosen token's interval, read off the
    reference on a grid of ``points`` uniforms."""
    grid = (np.arange(points, dtype=np.float32) + 0.5) / points
    uniforms = np.zeros(len(logits), np.float32)
    for row in range(len(logits)):
        one = slice(row, row + 1)
        lmp = None if log_min_p is None else log_min_p[one]
        picks = np.array([sampling.sample_reference(logits[one], temperature[one], top_k[one], top_p[one],
                                                    np.array([u], np.float32), lmp)[0] for u in grid])
        token = picks[rng.integers(len(picks))]
        inside = np.nonzero(picks == token)[0]  # the grid points of token's interval (contiguous)
        uniforms[row] = grid[(inside[0] + inside[-1]) // 2]
    return uniforms


@pytest.mark.parametrize("threads", ["64", "full block"])
def test_the_seeded_draw_uses_request_uniform(emulated, emulated_full_block, threads):
    run = emulated if threads == "64" else emulated_full_block
    logits = np.zeros((4, 7), np.float32) + np.arange(7, dtype=np.float32)  # distinct, comparable weights
    seeds = np.array([0, 1, 2**40 + 5, 123456789], np.int64)
    steps = np.array([0, 3, 17, 2**33], np.int64)
    ones = np.ones(4, np.float32)
    out = run(logits, ones, np.zeros(4, np.int32), ones, seeds, steps, np.full(4, -1, np.float32))
    uniforms = np.array([sampling.request_uniform(int(s), int(t)) for s, t in zip(seeds, steps)], np.float32)
    np.testing.assert_array_equal(out, sampling.sample_reference(logits, ones, np.zeros(4, np.int32), ones, uniforms))


def test_request_uniform_is_splitmix64_of_seed_and_step():
    # SplitMix64's published first output for state 0 is 0xE220A8397B1DCDAF: seed 0, step 0.
    assert sampling.request_uniform(0, 0) == (0xE220A8397B1DCDAF >> 40) / 2**24
    draws = [sampling.request_uniform(seed, step) for seed in range(20) for step in range(20)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)


def test_greedy_takes_the_first_of_equal_maxima(emulated):
    rng = np.random.default_rng(12)
    vocab = 150  # not a multiple of the loads a thread issues per round
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    for row, places in enumerate([[3, 77], [149], [0, 64, 128], [40, 41, 149], [17]]):
        logits[row, places] = 9.0  # ties: the smallest index wins, as np.argmax picks it
    zeros = np.zeros(5, np.float32)
    out = emulated(logits, zeros, np.zeros(5, np.int32), np.ones(5, np.float32), np.zeros(5, np.int64),
                   np.zeros(5, np.int64), np.full(5, -1.0, np.float32))
    assert out.tolist() == np.argmax(logits, axis=1).tolist() == [3, 149, 0, 40, 17]


def test_rows_without_a_distribution_get_minus_one(emulated):
    """NaN or +inf anywhere in a row, or every logit -inf: token -1 (greedy and sampled), and the
    other rows are unaffected."""
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(8, 37)).astype(np.float32)
    logits[1, 30] = np.nan
    logits[2, 0] = np.inf
    logits[3, :] = -np.inf
    logits[5, 36] = np.nan  # the last element: a clamped load in the kernel
    logits[6, :5] = -np.inf  # some -inf values are fine
    temperature = np.array([0.0, 0.0, 0.8, 0.0, 0.8, 0.8, 0.0, 0.8], np.float32)
    top_k = np.array([0, 0, 5, 0, 3, 0, 0, 0], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.9, 0.8, 1.0, 1.0, 0.7], np.float32)
    uniforms = rng.random(8).astype(np.float32)
    expected = sampling.sample_reference(logits, temperature, top_k, top_p, uniforms)
    assert expected.tolist()[1:4] == [-1, -1, -1] and expected[5] == -1
    assert (expected[[0, 4, 6, 7]] >= 0).all() and expected[6] >= 5
    zeros = np.zeros(8, np.int64)
    np.testing.assert_array_equal(emulated(logits, temperature, top_k, top_p, zeros, zeros, uniforms), expected)


def test_the_token_is_the_one_whose_interval_holds_u(emulated):
    rng = np.random.default_rng(8)
    vocab = 37
    cases = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 9, 0.8), (2.0, 1, 1.0)]
    logits = (2 * rng.standard_normal((len(cases), vocab))).astype(np.float32)
    temperature, top_k, top_p = parameters(cases)
    uniforms = interval_middles(logits, temperature, top_k, top_p, rng, 400)
    zeros = np.zeros(len(cases), np.int64)
    out = emulated(logits, temperature, top_k, top_p, zeros, zeros, uniforms)
    np.testing.assert_array_equal(out, sampling.sample_reference(logits, temperature, top_k, top_p, uniforms))
    assert out[0] == np.argmax(logits[0])
    assert logits[2, out[2]] / np.float32(0.7) >= np.sort(logits[2] / np.float32(0.7))[-5]
    assert logits[5, out[5]] == logits[5].max()  # top_k = 1


def test_thresholds_among_ties_match_the_reference(emulated):
    """Top-k and top-p thresholds from the radix search: logits on a coarse grid (many ties, at
    the thresholds too), negative and positive values, a vocabulary past the values a block
    reads per round; u at the middle of a kept token's interval, then just below 1 (the last
    kept token: the kept sets themselves)."""
    rng = np.random.default_rng(21)
    vocab = 603
    cases = [(1.0, 3, 1.0), (0.8, 17, 1.0), (1.0, 0, 0.3), (1.5, 0, 0.95), (1.0, 40, 0.5), (0.6, 2, 0.9),
             (1.0, 602, 0.99), (2.5, 0, 0.05)]
    logits = (np.round(rng.standard_normal((len(cases), vocab)) * 2) / 2 - 1.0).astype(np.float32)
    temperature, top_k, top_p = parameters(cases)
    # Rows at temperature 1 get a cluster of 40 values one ulp apart on top (top-k and top-p cut
    # inside it, so every bit of the threshold key matters), some of them repeated.
    cluster = np.float32(2.0) + np.arange(40, dtype=np.float32) * np.spacing(np.float32(2.0))
    cluster[::7] = cluster[1::7][: len(cluster[::7])]
    for row in np.nonzero(temperature == 1.0)[0]:
        logits[row, rng.permutation(vocab)[:40]] = cluster
    uniforms = interval_middles(logits, temperature, top_k, top_p, rng, 300)
    zeros = np.zeros(len(cases), np.int64)
    out = emulated(logits, temperature, top_k, top_p, zeros, zeros, uniforms)
    np.testing.assert_array_equal(out, sampling.sample_reference(logits, temperature, top_k, top_p, uniforms))
    last = np.full(len(cases), np.float32(1.0) - np.float32(2.0**-24), np.float32)
    out_last = emulated(logits, temperature, top_k, top_p, zeros, zeros, last)
    np.testing.assert_array_equal(out_last, sampling.sample_reference(logits, temperature, top_k, top_p, last))


def test_min_p_matches_the_reference(emulated):
    rng = np.random.default_rng(3)
    rows, vocab = 6, 97
    logits = (2 * rng.standard_normal((rows, vocab))).astype(np.float32)
    temperature = np.array([1.0, 0.7, 1.3, 1.0, 2.0, 1.0], np.float32)
    top_k = np.array([0, 0, 10, 0, 0, 3], np.int32)
    top_p = np.array([1.0, 0.9, 1.0, 1.0, 0.8, 1.0], np.float32)
    log_min_p = np.log(np.array([0.1, 0.05, 0.3, 1.0, 0.01, 0.5], np.float32)).astype(np.float32)
    zeros = np.zeros(rows, np.int64)
    for u in (0.0, 0.37, 0.999):
        uniforms = np.full(rows, u, np.float32)
        out = emulated(logits, temperature, top_k, top_p, zeros, zeros, uniforms, log_min_p)
        np.testing.assert_array_equal(out, sampling.sample_reference(logits, temperature, top_k, top_p, uniforms, log_min_p))
        assert out[3] == np.argmax(logits[3])  # min_p 1 keeps only the most likely
        scaled = logits[0] / temperature[0]
        assert scaled[out[0]] >= scaled.max() + np.log(np.float32(0.1)) - 1e-6


def test_the_launcher_refuses_host_arrays_and_wrong_dtypes():
    rows = 2
    arrays = [np.zeros((rows, 5), np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32),
              np.ones(rows, np.float32), np.zeros(rows, np.int64), np.zeros(rows, np.int64),
              np.full(rows, -1, np.float32), np.zeros(rows, np.int32)]
    with pytest.raises(KernelArgumentError, match="on the device"):
        sampling.sample(*arrays)
    wrong = list(arrays)
    wrong[2] = np.zeros(rows, np.int64)
    with pytest.raises(KernelArgumentError, match="top_k has dtype int64, expected int32"):
        sampling.sample(*wrong)
    with pytest.raises(KernelArgumentError, match="log_min_p"):
        sampling.sample(*arrays, log_min_p=np.zeros(rows + 1, np.float32))
