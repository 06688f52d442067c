"""The routed-expert form of the FP8 decode GEMV (:func:`metrale.kernels.fp8_gemv.fp8_decode_experts`)
run on the host through the CUDA emulation header against its NumPy reference and against the
general quantized experts' reference: block-wise FP8 (DeepSeek-V3's) and per-channel FP8 with
per-token inputs, one and several tokens, tokens sharing an expert, grids of one and several
splits; what it serves and what its launcher refuses before any launch."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import fp8_gemv as fg
from metrale.kernels import quantized_gemv as qg
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import QuantizedWeight, float32_to_fp8_e4m3
from metrale.kernels.quantized_moe_decode import quantized_decode_experts_reference

ACTIVATIONS = ("fp8_group", "fp8_token")


def emulation_main() -> str:
    # The gated product from float32 or bf16 rows (x, x16), the down product from the bf16 act.
    dispatch = "\n".join(
        f"    if (act_kind == {fg.ACTIVATIONS[a]} && split == {s} && gated == {int(g)} && bf16 == {int(b)}) {{ "
        f"emu::launch({{(unsigned)blocks, (unsigned)pairs, 1}}, {{THREADS, 1, 1}}, [&] {{ "
        f"{fg.kernel_name(a, s, 1, True, fg.UNROLL, b or not g, g, False, True)}"
        f"({('x16' if b else 'x') if g else 'act'}, 1.0f, nullptr, nullptr, codes, scales, block_rows, nullptr, "
        f"{'reinterpret_cast<float*>(act)' if g else 'partial'}, 1, K, columns, nullptr, nullptr, 0.0f, 0.0f, nullptr, "
        f"experts, {'top_k' if g else '1'}); }}); found = true; }}"
        for a in ACTIVATIONS for s in qg.SPLITS for g in (True, False) for b in ((False, True) if g else (False,)))
    return r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 14) emu::fail("usage: folder act tokens top_k H I E gate_split gate_blocks down_split down_blocks block_rows "
                              "bf16_rows");
    const std::string folder = argv[1];
    const int act_kind = std::atoi(argv[2]), tokens = std::atoi(argv[3]), top_k = std::atoi(argv[4]);
    const int H = std::atoi(argv[5]), I = std::atoi(argv[6]), E = std::atoi(argv[7]);
    const int splits[2] = {std::atoi(argv[8]), std::atoi(argv[10])}, grid[2] = {std::atoi(argv[9]), std::atoi(argv[11])};
    const int block_rows_of[2] = {std::atoi(argv[12]), std::atoi(argv[12])};
    const int pairs = tokens * top_k;
    const int bf16_rows = std::atoi(argv[13]);   // the gated product reads x as bf16 bits (x16)
    const float* x = read<float>(folder + "/x", (size_t)tokens * H);
    const unsigned short* x16 = bf16_rows ? read<unsigned short>(folder + "/x_bf16", (size_t)tokens * H) : nullptr;
    const int* experts = read<int>(folder + "/experts", pairs);
    const float* weights = read<float>(folder + "/weights", pairs);
    unsigned short* act = allocate<unsigned short>((size_t)pairs * I);
    float* partial = allocate<float>((size_t)pairs * H);
    float* out = allocate<float>((size_t)tokens * H);
    for (int gated = 1; gated >= 0; --gated) {
        const std::string name = gated ? "gate_up" : "down";
        const int rows = gated ? E * 2 * I : E * H, K = gated ? H : I, columns = gated ? I : H;
        const int scale_rows = std::atoi(argv[12]) >= rows ? 1 : rows / std::atoi(argv[12]);
        const int scale_columns = act_kind == ACT_FP8_GROUP ? (K + 127) / 128 : 1;
        const unsigned char* codes = read<unsigned char>(folder + "/" + name + "_codes", (size_t)rows * K);
        const float* scales = read<float>(folder + "/" + name + "_scales", (size_t)scale_rows * scale_columns);
        const int split = splits[gated ? 0 : 1], blocks = grid[gated ? 0 : 1], block_rows = block_rows_of[0];
        const int bf16 = gated ? bf16_rows : 0;
        bool found = false;
""" + dispatch + r"""
        if (!found) emu::fail("no such instance");
    }
    emu::launch({(unsigned)((H + THREADS - 1) / THREADS), (unsigned)tokens, 1}, {THREADS, 1, 1}, [&] {
        expert_slot_sum(partial, weights, out, top_k, H);
    });
    write(folder + "/act", act, (size_t)pairs * I);
    write(folder + "/out", out, (size_t)tokens * H);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8_experts_emulated")
    source = qg.CONSTANTS + qg.HELPERS + qg.DEVICE_FUNCTIONS + qg.KERNELS + fg.KERNELS + emulation_main()
    binary = build_emulated(folder / "fp8_experts.cpp", source)

    def run(x, experts, weights, gate_up: QuantizedWeight, down: QuantizedWeight, multiprocessors: int,
            bf16_rows: bool = False):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        tokens, top_k = experts.shape
        hidden, inter = x.shape[1], down.shape[1]
        np.ascontiguousarray(x, np.float32).tofile(case / "x")
        if bf16_rows:  # x as bf16 bits (the caller's x holds bf16 values)
            float32_to_bf16(np.ascontiguousarray(x, np.float32)).tofile(case / "x_bf16")
        np.ascontiguousarray(experts, np.int32).tofile(case / "experts")
        np.ascontiguousarray(weights, np.float32).tofile(case / "weights")
        for name, weight in (("gate_up", gate_up), ("down", down)):
            np.ascontiguousarray(weight.codes).tofile(case / f"{name}_codes")
            np.ascontiguousarray(weight.scales, np.float32).tofile(case / f"{name}_scales")
        share = max(1, multiprocessors // (tokens * top_k))
        gate_split, gate_blocks = qg.plan(2 * inter, share)
        down_split, down_blocks = qg.plan(hidden, share)
        arguments = [fg.ACTIVATIONS[gate_up.activations], tokens, top_k, hidden, inter, down.shape[0] // hidden,
                     gate_split, gate_blocks, down_split, down_blocks, gate_up.block[0], int(bf16_rows)]
        subprocess.run([str(binary), str(case), *map(str, arguments)], check=True, timeout=600)
        act = bf16_to_float32(np.fromfile(case / "act", np.uint16).reshape(tokens * top_k, inter))
        return np.fromfile(case / "out", np.float32).reshape(tokens, hidden), act

    return run


def stacked_weight(rng, experts: int, rows: int, inner: int, activations: str) -> QuantizedWeight:
    """``experts`` experts' FP8 weights of ``rows x inner`` stacked: block-wise (128 x 128 scale
    blocks, inputs per group of 128) or a scale per row (inputs per token)."""
    out = experts * rows
    stored = float32_to_fp8_e4m3(rng.normal(size=(out, inner)).astype(np.float32) * 100)
    if activations == "fp8_group":
        scales = rng.uniform(0.0005, 0.002, size=(out // 128, -(-inner // 128))).astype(np.float32)
        return QuantizedWeight("fp8", stored, scales, (128, 128), (out, inner), activations="fp8_group",
                               activation_group=128)
    scales = rng.uniform(0.0005, 0.002, size=(out, 1)).astype(np.float32)
    return QuantizedWeight("fp8", stored, scales, (1, inner), (out, inner), activations="fp8_token")


CASES = [
    # activations, tokens, top_k, hidden, inter, experts, multiprocessors
    ("fp8_group", 1, 6, 256, 128, 8, 132),  # one token's six experts, one block a pair
    ("fp8_group", 3, 2, 384, 256, 4, 4),  # tokens sharing experts, several splits
    ("fp8_token", 1, 3, 192, 64, 5, 132),
    ("fp8_token", 2, 4, 128, 80, 6, 8),  # I not a multiple of 64: a short last piece
]


@pytest.mark.parametrize("activations, tokens, top_k, hidden, inter, experts, multiprocessors", CASES)
def test_emulated_experts_match_the_reference(emulated, activations, tokens, top_k, hidden, inter, experts,
                                              multiprocessors):
    rng = np.random.default_rng(tokens * 100 + hidden + inter)
    gate_up = stacked_weight(rng, experts, 2 * inter, hidden, activations)
    down = stacked_weight(rng, experts, hidden, inter, activations)
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    assert fg.serves_experts(tokens, top_k, gate_up, down)
    got, act = emulated(x, chosen, weights, gate_up, down, multiprocessors)
    want = fg.fp8_decode_experts_reference(x, chosen, weights, gate_up, down)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-3 * scale
    # The gated products, pair by pair: the reference's bf16 values, to within a bf16 step.
    for t in range(tokens):
        for s in range(top_k):
            one = fg._expert_rows(gate_up, int(chosen[t, s]), 2 * inter)
            np.testing.assert_allclose(act[t * top_k + s], fg.fp8_gemv_reference(x[t : t + 1], one, swiglu=True)[0],
                                       rtol=1e-2, atol=1e-2 * np.abs(act).max())
    # The general quantized experts' reference, whose weights are rounded to bf16: its gated values
    # differ by bf16 steps, which move some of the down inputs' FP8 codes (a step is 2^-3 of a
    # value) when they are quantized again, so the two agree to a few parts in a hundred.
    general = quantized_decode_experts_reference(x, chosen, weights, gate_up, down)
    assert np.abs(got - general).max() <= 5e-2 * np.abs(general).max()


@pytest.mark.parametrize("activations, tokens, top_k, hidden, inter, experts, multiprocessors", CASES[:2] + CASES[3:])
def test_emulated_experts_read_bf16_rows_as_their_float32_values(emulated, activations, tokens, top_k, hidden, inter,
                                                                 experts, multiprocessors):
    """The gated product from bf16 rows (a norm's output as it comes) gives the float32 rows' bits."""
    rng = np.random.default_rng(tokens * 10 + inter)
    gate_up = stacked_weight(rng, experts, 2 * inter, hidden, activations)
    down = stacked_weight(rng, experts, hidden, inter, activations)
    x = bf16_to_float32(float32_to_bf16(rng.normal(size=(tokens, hidden)).astype(np.float32)))
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    from_floats, act_floats = emulated(x, chosen, weights, gate_up, down, multiprocessors)
    from_bits, act_bits = emulated(x, chosen, weights, gate_up, down, multiprocessors, bf16_rows=True)
    assert np.array_equal(act_bits, act_floats)
    assert np.array_equal(from_bits, from_floats)


def test_what_the_expert_form_serves():
    rng = np.random.default_rng(0)
    gate_up = stacked_weight(rng, 4, 256, 256, "fp8_group")
    down = stacked_weight(rng, 4, 256, 128, "fp8_group")
    assert fg.serves_experts(1, 6, gate_up, down)
    assert fg.serves_experts(fg.MAX_EXPERT_TOKENS, 2, gate_up, down)
    assert not fg.serves_experts(fg.MAX_EXPERT_TOKENS + 1, 2, gate_up, down)
    assert not fg.serves_experts(1, 2, down, gate_up)  # not a gate_up / down pair of stacks
    odd = stacked_weight(rng, 4, 192, 256, "fp8_token")  # I = 96
    odd_down = stacked_weight(rng, 4, 256, 96, "fp8_token")
    assert fg.serves_experts(1, 2, odd, odd_down)
    # Block scales of 128 rows straddling two experts (I = 96: 192 rows an expert) are refused.
    straddling = stacked_weight(rng, 4, 192, 256, "fp8_token")
    blocks = QuantizedWeight("fp8", straddling.codes, np.ones((6, 2), np.float32), (128, 128), straddling.shape,
                             activations="fp8_group", activation_group=128)
    assert not fg.serves_experts(1, 2, blocks, stacked_weight(rng, 4, 256, 96, "fp8_token"))


def test_the_launcher_refuses_before_any_launch():
    rng = np.random.default_rng(1)
    gate_up = stacked_weight(rng, 4, 256, 256, "fp8_group")
    down = stacked_weight(rng, 4, 256, 128, "fp8_group")
    tokens, top_k = fg.MAX_EXPERT_TOKENS + 1, 2
    with pytest.raises(KernelArgumentError, match="not served"):
        fg.fp8_decode_experts(np.zeros((tokens, 256), np.float32), np.zeros((tokens, top_k), np.int32),
                              np.zeros((tokens, top_k), np.float32), gate_up, down,
                              np.zeros((tokens * top_k, 128), np.uint16), np.zeros((tokens * top_k, 256), np.float32),
                              np.zeros((tokens, 256), np.float32), None)
    with pytest.raises(KernelArgumentError, match="weights"):
        fg.fp8_decode_experts(np.zeros((1, 256), np.float32), np.zeros((1, top_k), np.int32),
                              np.zeros((1, top_k + 1), np.float32), gate_up, down, np.zeros((top_k, 128), np.uint16),
                              np.zeros((top_k, 256), np.float32), np.zeros((1, 256), np.float32), None)
