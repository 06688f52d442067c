"""The quantized decode experts (:mod:`metrale.kernels.quantized_moe_decode`) run on the host through
the CUDA emulation header against their NumPy reference: FP8 with per-token and per-group inputs
and 128-row blocks, INT4 with zero points, INT8 with INT8 inputs, MXFP4; one to eight tokens, a
token choosing the same expert twice, widths that leave warps idle."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import quantized_moe_decode as qm
from metrale.kernels.quantized import QuantizedWeight, float32_to_fp8_e4m3, pack_nibbles
from metrale.kernels.quantized_gemv import ACTIVATIONS, CODES

INSTANCES = [("fp8", "fp8_token"), ("fp8", "fp8_group"), ("int4", "weight_only"), ("int8", "int8_token"),
             ("mxfp4", "weight_only")]


def emulation_main() -> str:
    def dispatch(kernel: str, arguments: str) -> str:
        return "\n".join(
            f"        if (w.codes == {CODES[c]} && w.act == {ACTIVATIONS[a]}) emu::launch(grid, {{THREADS, 1, 1}}, "
            f"[&] {{ {kernel}<{CODES[c]}, {ACTIVATIONS[a]}>({arguments}); }});" for c, a in INSTANCES)

    weight = "w.input_scale, w.act_group, w.code_bytes, w.scales, w.zeros, w.block_rows, w.block_columns, w.scale_columns"
    return r"""
#include <string>

struct Weight {
    int codes, act, block_rows, block_columns, scale_columns, act_group, has_zeros;
    float input_scale;
    const unsigned char* code_bytes;
    const float* scales;
    const float* zeros;
};

// A weight's 8 arguments (codes, act, block_rows, block_columns, scale_columns, act_group, has_zeros,
// input_scale) and its files NAME_codes, NAME_scales, NAME_zeros.
Weight read_weight(const std::string& folder, const std::string& name, char** arguments, int rows, int columns) {
    Weight w;
    w.codes = std::atoi(arguments[0]); w.act = std::atoi(arguments[1]); w.block_rows = std::atoi(arguments[2]);
    w.block_columns = std::atoi(arguments[3]); w.scale_columns = std::atoi(arguments[4]);
    w.act_group = std::atoi(arguments[5]); w.has_zeros = std::atoi(arguments[6]); w.input_scale = std::atof(arguments[7]);
    const size_t bytes = (size_t)rows * (w.codes == 1 || w.codes == 3 ? columns / 2 : columns);
    w.code_bytes = read<unsigned char>(folder + "/" + name + "_codes", bytes);
    const size_t count = (size_t)((rows + w.block_rows - 1) / w.block_rows) * w.scale_columns;
    w.scales = read<float>(folder + "/" + name + "_scales", count);
    w.zeros = w.has_zeros ? read<float>(folder + "/" + name + "_zeros", count) : nullptr;
    return w;
}

int main(int argc, char** argv) {
    if (argc != 23) emu::fail("usage: folder tokens top_k H I E gate_up(8 arguments) down(8 arguments)");
    const std::string folder = argv[1];
    const int tokens = std::atoi(argv[2]), top_k = std::atoi(argv[3]), H = std::atoi(argv[4]), I = std::atoi(argv[5]);
    const int E = std::atoi(argv[6]);
    const float* x = read<float>(folder + "/x", (size_t)tokens * H);
    const int* experts = read<int>(folder + "/experts", (size_t)tokens * top_k);
    const float* weights = read<float>(folder + "/weights", (size_t)tokens * top_k);
    unsigned short* act_rows = allocate<unsigned short>((size_t)tokens * top_k * I);
    float* out = allocate<float>((size_t)tokens * H);
    {
        const Weight w = read_weight(folder, "gate_up", argv + 7, E * 2 * I, H);
        const dim3 grid = {(unsigned)((I + WARPS * 2 - 1) / (WARPS * 2)), (unsigned)(tokens * top_k), 1};
""" + dispatch("quantized_moe_gate_up", f"x, experts, {weight}, act_rows, top_k, H, I") + r"""
    }
    {
        const Weight w = read_weight(folder, "down", argv + 15, E * H, I);
        const dim3 grid = {(unsigned)((H + WARPS - 1) / WARPS), (unsigned)tokens, 1};
""" + dispatch("quantized_moe_down", f"act_rows, experts, weights, {weight}, out, top_k, H, I") + r"""
    }
    write(folder + "/out", out, (size_t)tokens * H);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized_moe_emulated")
    binary = build_emulated(folder / "quantized_moe.cpp", qm.source().replace(qm.INSTRUCTIONS, "") + emulation_main())

    def weight_arguments(name: str, weight: QuantizedWeight, case) -> list[str]:
        np.ascontiguousarray(weight.codes).tofile(case / f"{name}_codes")
        np.ascontiguousarray(weight.scales, np.float32).tofile(case / f"{name}_scales")
        if weight.zeros is not None:
            np.ascontiguousarray(weight.zeros, np.float32).tofile(case / f"{name}_zeros")
        scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
        return [str(v) for v in (CODES[weight.codes_format], ACTIVATIONS[weight.activations], weight.block[0],
                                 weight.block[1], weight.scales.shape[1], weight.activation_group,
                                 int(weight.zeros is not None), repr(scale))]

    def run(x, experts, weights, gate_up, down):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        np.ascontiguousarray(x, np.float32).tofile(case / "x")
        np.ascontiguousarray(experts, np.int32).tofile(case / "experts")
        np.ascontiguousarray(weights, np.float32).tofile(case / "weights")
        tokens, hidden = x.shape
        inter = down.shape[1]
        count = down.shape[0] // hidden
        arguments = [str(tokens), str(experts.shape[1]), str(hidden), str(inter), str(count)]
        arguments += weight_arguments("gate_up", gate_up, case) + weight_arguments("down", down, case)
        subprocess.run([str(binary), str(case), *arguments], check=True, timeout=600)
        return np.fromfile(case / "out", np.float32).reshape(tokens, hidden)

    return run


def stack(rng, codes: str, rows: int, inner: int, block: tuple[int, int], activations: str,
          asymmetric: bool = False) -> QuantizedWeight:
    scale_shape = (-(-rows // block[0]), -(-inner // block[1]))
    scales = rng.uniform(0.01, 0.05, size=scale_shape).astype(np.float32)
    zeros = None
    if codes == "fp8":
        stored = float32_to_fp8_e4m3(rng.normal(size=(rows, inner)).astype(np.float32) * 50)
    elif codes == "int8":
        stored = rng.integers(0, 256, size=(rows, inner), dtype=np.uint8)
    else:
        stored = pack_nibbles(rng.integers(0, 16, size=(rows, inner), dtype=np.uint8))
        if codes == "mxfp4":
            scales = np.exp2(rng.integers(-7, -3, size=scale_shape)).astype(np.float32)
        elif asymmetric:
            zeros = rng.integers(0, 16, size=scale_shape).astype(np.float32)
    return QuantizedWeight(codes, stored, scales, block, (rows, inner), zeros=zeros, activations=activations,
                           activation_group=32)


@pytest.mark.parametrize("codes, activations, tokens, top_k, hidden, inter, experts, block, asymmetric", [
    ("fp8", "fp8_token", 1, 2, 64, 48, 4, (1, 64), False),
    ("fp8", "fp8_group", 3, 2, 96, 64, 3, (32, 32), False),  # blocks of 32 rows and columns, groups of 32 inputs
    ("int4", "weight_only", 8, 3, 64, 40, 5, (1, 16), True),  # eight tokens, zero points
    ("int8", "int8_token", 2, 2, 32, 24, 2, (1, 32), False),
    ("mxfp4", "weight_only", 4, 2, 64, 32, 3, (1, 32), False),
])
def test_emulated_experts_match_the_reference(emulated, codes, activations, tokens, top_k, hidden, inter, experts,
                                              block, asymmetric):
    rng = np.random.default_rng(tokens * 100 + hidden)
    gate_up = stack(rng, codes, experts * 2 * inter, hidden, block, activations, asymmetric)
    down = stack(rng, codes, experts * hidden, inter, (block[0], min(block[1], inter)), activations, asymmetric)
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    chosen = rng.integers(0, experts, size=(tokens, top_k)).astype(np.int32)
    chosen[0, :] = chosen[0, 0]  # one token picks the same expert twice
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    got = emulated(x, chosen, weights, gate_up, down)
    expected = qm.quantized_decode_experts_reference(x, chosen, weights, gate_up, down)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_supports():
    rng = np.random.default_rng(0)
    gate_up = stack(rng, "fp8", 4 * 2 * 48, 64, (1, 64), "fp8_token")
    down = stack(rng, "fp8", 4 * 64, 48, (1, 48), "fp8_token")
    assert qm.supports(8, 2, gate_up, down) and not qm.supports(9, 2, gate_up, down)
    ordered = QuantizedWeight("fp8", down.codes, down.scales, down.block, down.shape, activations="fp8_token",
                              input_order=np.arange(48, dtype=np.int32))
    assert not qm.supports(1, 2, gate_up, ordered)
