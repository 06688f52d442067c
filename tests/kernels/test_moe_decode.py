"""The decode MoE kernels (:mod:`metrale.kernels.moe_decode`) run on the host through the CUDA
emulation header against :func:`~metrale.kernels.moe_decode.decode_experts_reference` (and, within
the bf16 rounding of the activation, :func:`metrale.kernels.moe.experts_reference`): one to eight
tokens, an expert chosen by several tokens, expert widths not multiples of a warp's columns."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import moe_decode
from metrale.kernels.moe import experts_reference
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 7) emu::fail("usage: folder tokens top_k H I experts");
    const std::string folder = argv[1];
    const int tokens = std::atoi(argv[2]), top_k = std::atoi(argv[3]), H = std::atoi(argv[4]), I = std::atoi(argv[5]);
    const int E = std::atoi(argv[6]), pairs = tokens * top_k;
    unsigned short* x = read<unsigned short>(folder + "/x", (size_t)tokens * H);
    int* experts = read<int>(folder + "/experts", pairs);
    float* weights = read<float>(folder + "/weights", pairs);
    const uint4* gate_up = reinterpret_cast<const uint4*>(read<unsigned short>(folder + "/gate_up", (size_t)E * 2 * I * H));
    const uint4* down = reinterpret_cast<const uint4*>(read<unsigned short>(folder + "/down", (size_t)E * H * I));
    unsigned short* act = allocate<unsigned short>((size_t)pairs * I);
    float* out = allocate<float>((size_t)tokens * H);
    const unsigned columns = WARPS * COLUMNS;
    emu::launch({(I + columns - 1) / columns, (unsigned)pairs, 1}, {THREADS, 1, 1},
                [&] { moe_decode_gate_up(x, gate_up, experts, act, top_k, H, I); });
    emu::launch({(H + WARPS - 1) / WARPS, (unsigned)tokens, 1}, {THREADS, 1, 1},
                [&] { moe_decode_down(act, down, experts, weights, out, top_k, H, I); });
    write(folder + "/act", act, (size_t)pairs * I);
    write(folder + "/out", out, (size_t)tokens * H);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_decode_emulated")
    source = moe_decode.CONSTANTS + moe_decode.HELPERS + moe_decode.KERNELS + EMULATION_MAIN
    binary = build_emulated(folder / "moe_decode.cpp", source)

    def run(x, experts, weights, gate_up, down):
        tokens, hidden = x.shape
        top_k, inter = experts.shape[1], down.shape[1]
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in dict(x=x, experts=experts, weights=weights, gate_up=gate_up, down=down).items():
            np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binary), str(case), str(tokens), str(top_k), str(hidden), str(inter),
                        str(down.shape[0] // hidden)], check=True, timeout=600)
        return np.fromfile(case / "out", np.float32).reshape(tokens, hidden)

    return run


@pytest.mark.parametrize("tokens, top_k, hidden, inter, num_experts", [
    (1, 3, 64, 40, 5),  # I = 40: the second block's warps past I return before the products
    (4, 2, 96, 24, 3),  # four tokens over three experts: experts shared between tokens
    (8, 4, 72, 56, 9),
    (2, 6, 40, 360, 8),  # 45 words a slot, 270 in all: a lane's second batch starts mid-slot (the GPU test: real widths)
])
def test_emulated_kernels_match_the_reference(emulated, tokens, top_k, hidden, inter, num_experts):
    rng = np.random.default_rng(tokens * 100 + hidden)

    def bf16(shape, scale):
        return float32_to_bf16((scale * rng.standard_normal(shape)).astype(np.float32))

    x = bf16((tokens, hidden), 1.0)
    gate_up = bf16((num_experts * 2 * inter, hidden), 0.2)
    down = bf16((num_experts * hidden, inter), 0.2)
    experts = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    out = emulated(x, experts, weights, gate_up, down)
    floats = [bf16_to_float32(a) for a in (x, gate_up, down)]
    expected = moe_decode.decode_experts_reference(floats[0], experts, weights, floats[1], floats[2])
    scale = np.abs(expected).max()
    assert np.abs(out - expected).max() <= 1e-4 * scale
    unrounded = experts_reference(floats[0], experts, weights, floats[1], floats[2])
    assert np.abs(out - unrounded).max() <= 2e-2 * scale


def test_supports():
    assert moe_decode.supports(1, 6, 2048, 1408) and moe_decode.supports(8, 10, 2048, 512)
    assert not moe_decode.supports(9, 6, 2048, 1408) and not moe_decode.supports(1, 6, 2048, 1404)
