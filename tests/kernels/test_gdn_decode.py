"""The fused Gated DeltaNet decode kernels (:mod:`metrale.kernels.gdn_decode`) run on the host
through the CUDA emulation header against the unfused ops' references one after another
(:func:`~metrale.kernels.gdn_decode.decode_reference`): the output, the moved-on conv histories
and recurrent states, several rows in shuffled slots, one and two value heads per key head."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import gdn_decode
from metrale.loading.checkpoint import bf16_to_float32

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 11) emu::fail("usage: folder rows slots Hk Hv dk dv kernel eps rule_threads");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), slots = std::atoi(argv[3]), Hk = std::atoi(argv[4]), Hv = std::atoi(argv[5]);
    const int dk = std::atoi(argv[6]), dv = std::atoi(argv[7]), K = std::atoi(argv[8]);
    const float eps = std::atof(argv[9]);
    const int G = Hv / Hk, C = 2 * Hk * dk + Hv * dv, W = 2 * dk + 2 * G * dv;
    float* qkvz = read<float>(folder + "/qkvz", (size_t)rows * Hk * W);
    float* ba = read<float>(folder + "/ba", (size_t)rows * 2 * Hv);
    float* weight = read<float>(folder + "/weight", (size_t)C * K);
    float* conv_state = read<float>(folder + "/conv_state", (size_t)slots * C * (K - 1));
    float* a_log = read<float>(folder + "/a_log", Hv);
    float* dt_bias = read<float>(folder + "/dt_bias", Hv);
    float* state = read<float>(folder + "/state", (size_t)slots * Hv * dk * dv);
    int* slot_of = read<int>(folder + "/slots", rows);
    float* norm = read<float>(folder + "/norm", dv);
    float* mixed = allocate<float>((size_t)rows * C);
    unsigned short* out = allocate<unsigned short>((size_t)rows * Hv * dv);
    const unsigned conv_threads = 64, threads = std::atoi(argv[10]);
    emu::launch({(unsigned)rows, (C + conv_threads - 1) / conv_threads, 1}, {conv_threads, 1, 1},
                [&] { gdn_decode_conv(qkvz, weight, conv_state, slot_of, mixed, Hk, Hv, dk, dv, K); });
    emu::launch({(unsigned)rows, (unsigned)Hv, 1}, {threads, 1, 1}, [&] {
        gdn_decode_rule(mixed, qkvz, ba, a_log, dt_bias, state, slot_of, norm, eps, 1e-6f, out, Hk, Hv, dk, dv);
    });
    write(folder + "/out", out, (size_t)rows * Hv * dv);
    write(folder + "/conv_state", conv_state, (size_t)slots * C * (K - 1));
    write(folder + "/state", state, (size_t)slots * Hv * dk * dv);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gdn_decode_emulated")
    binary = build_emulated(folder / "gdn_decode.cpp", gdn_decode.HELPERS + gdn_decode.KERNELS + EMULATION_MAIN)

    def run(arrays, geometry, eps):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        rows, slots = arrays["qkvz"].shape[0], arrays["state"].shape[0]
        key_heads, value_heads, key_dim, value_dim = geometry
        subprocess.run([str(binary), str(case), str(rows), str(slots), str(key_heads), str(value_heads), str(key_dim),
                        str(value_dim), str(arrays["weight"].shape[1]), repr(eps),
                        str(gdn_decode.rule_threads(key_dim, value_dim))], check=True, timeout=600)
        channels = 2 * key_heads * key_dim + value_heads * value_dim
        out = bf16_to_float32(np.fromfile(case / "out", np.uint16)).reshape(rows, value_heads, value_dim)
        conv_state = np.fromfile(case / "conv_state", np.float32).reshape(slots, channels, -1)
        state = np.fromfile(case / "state", np.float32).reshape(slots, value_heads, key_dim, value_dim)
        return out, conv_state, state

    return run


@pytest.mark.parametrize("rows, key_heads, value_heads, key_dim, value_dim, kernel", [
    (1, 1, 1, 32, 32, 4),
    (3, 2, 4, 32, 48, 4),  # two value heads per key head; d_v > d_k
    (2, 2, 2, 64, 32, 3),  # d_k > d_v; another conv width
    (1, 1, 2, 128, 128, 4),  # Qwen3-Next's heads: 8 row groups of 16 rows
    (1, 1, 1, 1024, 1000, 2),  # one row group: rows past the cached ones; d_v not a multiple of 32
])
def test_emulated_kernels_match_the_unfused_references(emulated, rows, key_heads, value_heads, key_dim, value_dim,
                                                       kernel):
    from metrale.kernels.gated_delta import L2_NORM_EPS

    assert L2_NORM_EPS == 1e-6  # the emulation's main passes it as a literal
    rng = np.random.default_rng(rows + key_dim + value_dim)
    group = value_heads // key_heads
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    slots = rows + 2
    arrays = dict(
        qkvz=rng.standard_normal((rows, key_heads * (2 * key_dim + 2 * group * value_dim))).astype(np.float32),
        ba=rng.standard_normal((rows, 2 * value_heads)).astype(np.float32),
        weight=(0.5 * rng.standard_normal((channels, kernel))).astype(np.float32),
        conv_state=rng.standard_normal((slots, channels, kernel - 1)).astype(np.float32),
        a_log=rng.standard_normal(value_heads).astype(np.float32),
        dt_bias=rng.standard_normal(value_heads).astype(np.float32),
        state=(0.3 * rng.standard_normal((slots, value_heads, key_dim, value_dim))).astype(np.float32),
        slots=rng.permutation(slots)[:rows].astype(np.int32),
        norm=(1.0 + 0.3 * rng.standard_normal(value_dim)).astype(np.float32),
    )
    geometry = (key_heads, value_heads, key_dim, value_dim)
    out, conv_state, state = emulated(arrays, geometry, 1e-6)
    expected_conv, expected_state = arrays["conv_state"].copy(), arrays["state"].copy()
    expected = gdn_decode.decode_reference(arrays["qkvz"], arrays["ba"], arrays["weight"], expected_conv,
                                           arrays["a_log"], arrays["dt_bias"], expected_state, arrays["slots"],
                                           arrays["norm"], 1e-6, *geometry)
    np.testing.assert_allclose(conv_state, expected_conv, rtol=0, atol=0)  # moved, not computed
    np.testing.assert_allclose(state, expected_state, rtol=1e-5, atol=1e-5)
    # bf16 output: one rounding step.
    assert np.abs(out - expected).max() <= 1e-2 * np.abs(expected).max()


def test_supports_and_threads():
    assert gdn_decode.supports(16, 32, 128, 128) and not gdn_decode.supports(16, 24, 128, 128)
    # Row groups of d_v threads (rounded to a warp), each thread CACHED_ROWS rows where they fit.
    assert gdn_decode.rule_row_groups(128, 128) == 8 and gdn_decode.rule_threads(128, 128) == 1024
    assert gdn_decode.rule_row_groups(32, 48) == 2 and gdn_decode.rule_threads(32, 48) == 128
    assert gdn_decode.rule_row_groups(1024, 1000) == 1 and gdn_decode.rule_threads(1024, 1000) == 1024
    assert gdn_decode.rule_shared_bytes(128, 128) == (2 * 128 + 32 + 1024) * 4
