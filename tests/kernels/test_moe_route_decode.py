"""The decode router kernel (:mod:`metrale.kernels.moe_route_decode`) run on the host through the
CUDA emulation header against :func:`~metrale.kernels.moe_route_decode.route_decode_reference`:
every routing method (softmax greedy and group-limited, sigmoid with bias and group limits), one
to eight tokens, several blocks of experts (the last block to finish chooses), a counter that is
zero again after each launch, and what the launcher refuses."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import moe_route_decode as mrd
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 12) emu::fail("usage: folder rows H E method n_group topk_group top_k renormalise scaling launches");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), H = std::atoi(argv[3]), E = std::atoi(argv[4]), method = std::atoi(argv[5]);
    const int n_group = std::atoi(argv[6]), topk_group = std::atoi(argv[7]), top_k = std::atoi(argv[8]);
    const int renormalise = std::atoi(argv[9]), launches = std::atoi(argv[11]);
    const float scaling = std::atof(argv[10]);
    unsigned short* x = read<unsigned short>(folder + "/x", (size_t)rows * H);
    float* gate = read<float>(folder + "/gate", (size_t)E * H);
    float* bias = method == 2 ? read<float>(folder + "/bias", E) : nullptr;
    float* logits = allocate<float>((size_t)rows * E);
    int* counter = allocate<int>(1);
    counter[0] = 0;
    int* experts = allocate<int>((size_t)rows * top_k);
    float* weights = allocate<float>((size_t)rows * top_k);
    for (int launch = 0; launch < launches; ++launch) {
        emu::launch({(unsigned)E, 1, 1}, {THREADS, 1, 1}, [&] {
            moe_route_decode(x, gate, bias, logits, counter, experts, weights, rows, H, E, method, n_group, topk_group,
                             top_k, renormalise, scaling);
        });
    }
    write(folder + "/experts", experts, (size_t)rows * top_k);
    write(folder + "/weights", weights, (size_t)rows * top_k);
    write(folder + "/counter", counter, 1);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_route_decode_emulated")
    binary = build_emulated(folder / "moe_route_decode.cpp", mrd.CONSTANTS + mrd.HELPERS + mrd.KERNEL
                            + EMULATION_MAIN)

    def run(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling, launches=1):
        rows, hidden = x.shape
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in dict(x=x, gate=gate, bias=bias).items():
            if array is not None:
                np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binary), str(case), str(rows), str(hidden), str(gate.shape[0]),
                        str(mrd.ROUTE_METHODS[method]), str(n_group), str(topk_group), str(top_k),
                        str(int(renormalise)), repr(scaling), str(launches)], check=True, timeout=600)
        experts = np.fromfile(case / "experts", np.int32).reshape(rows, top_k)
        weights = np.fromfile(case / "weights", np.float32).reshape(rows, top_k)
        return experts, weights, int(np.fromfile(case / "counter", np.int32)[0])

    return run


@pytest.mark.parametrize("rows, hidden, experts, method, n_group, topk_group, top_k, renormalise, scaling", [
    (1, 64, 64, "greedy", 1, 1, 6, False, 1.0),  # DeepSeek-V2-Lite's routing
    (3, 96, 40, "greedy", 1, 1, 10, True, 1.0),  # renormalised (Qwen3-Next's); five blocks, the last one partial
    (8, 32, 64, "group_limited_greedy", 8, 3, 6, False, 16.0),  # DeepSeek-V2's group limits
    (2, 64, 256, "noaux_tc", 8, 4, 8, True, 2.5),  # DeepSeek-V3's: sigmoid, bias, top-2 sums of groups
    (5, 48, 16, "noaux_tc", 16, 16, 4, False, 1.0),  # one expert a group, no group limit
])
def test_emulated_kernel_matches_the_reference(emulated, rows, hidden, experts, method, n_group, topk_group, top_k,
                                               renormalise, scaling):
    rng = np.random.default_rng(rows * 1000 + experts)
    x = float32_to_bf16(rng.standard_normal((rows, hidden)).astype(np.float32))
    gate = (0.2 * rng.standard_normal((experts, hidden))).astype(np.float32)
    bias = (0.05 * rng.standard_normal(experts)).astype(np.float32) if method == "noaux_tc" else None
    got_experts, got_weights, counter = emulated(x, gate, bias, method, n_group, topk_group, top_k, renormalise,
                                                 scaling, launches=2)
    expected_experts, expected_weights = mrd.route_decode_reference(
        bf16_to_float32(x), gate, bias, method, n_group, topk_group, top_k, renormalise, scaling)
    np.testing.assert_array_equal(got_experts, expected_experts)
    np.testing.assert_allclose(got_weights, expected_weights, rtol=1e-5, atol=1e-7)
    assert counter == 0  # ready for the next launch


def test_supports():
    assert mrd.supports(8, 2048, 256, 8, 8) and mrd.supports(1, 2048, 128, 1, 10)
    assert not mrd.supports(9, 2048, 64, 1, 6)  # more tokens than warps
    assert not mrd.supports(1, 2046, 64, 1, 6)  # hidden size not a multiple of 4
    assert not mrd.supports(1, 2048, 512, 8, 8)  # more experts than a warp's share of shared memory
    assert not mrd.supports(1, 2048, 64, 5, 6)  # unequal groups
    assert not mrd.supports(1, 2048, 64, 1, 17)


@pytest.mark.parametrize("change, why", [
    (dict(method="top_p"), "unknown routing method"),
    (dict(rows=9), "not served"),
    (dict(method="noaux_tc"), "needs the correction bias"),
    (dict(top_k=7), "out_experts"),  # the outputs are sized for top-6
])
def test_the_launcher_refuses_what_it_does_not_serve(change, why):
    rows = change.get("rows", 2)
    x = np.zeros((rows, 64), np.uint16)
    gate = np.zeros((64, 64), np.float32)
    out_experts, out_weights = np.zeros((rows, 6), np.int32), np.zeros((rows, 6), np.float32)
    with pytest.raises(KernelArgumentError, match=why):
        mrd.route_decode(x, gate, None, change.get("method", "greedy"), 1, 1, change.get("top_k", 6), False, 1.0,
                         np.zeros((rows, 64), np.float32), np.zeros(1, np.int32), out_experts, out_weights)
