"""GPT-OSS's expert kernels (:mod:`metrale.kernels.moe_clamped`) against their reference under
numba's CUDA simulator, on bf16 and MXFP4 stacks, with and without biases; the references
themselves against a plain transcription of the formula."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.kernels import moe_clamped
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import QuantizedWeight, dequantize

SIMULATED = __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED
TOKENS, HIDDEN, INTER, COUNT, TOP_K = 3, 64, 32, 5, 2


def rel_error(actual, expected):
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def mxfp4_stack(rng, rows, inner):
    """A random MXFP4 weight ``[rows, inner]`` (scales per row and block of 32 columns)."""
    codes = rng.integers(0, 256, size=(rows, inner // 2), dtype=np.uint8)
    scales = np.exp2(rng.integers(-4, 0, size=(rows, inner // 32))).astype(np.float32)
    return QuantizedWeight("mxfp4", codes, scales, (1, 32), (rows, inner))


def bf16_stack(rng, rows, inner):
    return float32_to_bf16((0.3 * rng.standard_normal((rows, inner))).astype(np.float32))


def as_float(weight):
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else bf16_to_float32(weight)


def test_the_reference_is_the_formula():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    gate_up = rng.standard_normal((COUNT * 2 * INTER, HIDDEN)).astype(np.float32) * 0.3
    down = rng.standard_normal((COUNT * HIDDEN, INTER)).astype(np.float32) * 0.3
    gate_up_bias = rng.standard_normal(COUNT * 2 * INTER).astype(np.float32)
    down_bias = rng.standard_normal(COUNT * HIDDEN).astype(np.float32)
    experts = np.array([[4, 0], [2, 4], [1, 3]], np.int32)
    weights = rng.random((TOKENS, TOP_K)).astype(np.float32)
    alpha, limit = 1.702, 0.8
    expected = np.zeros((TOKENS, HIDDEN))
    for n in range(TOKENS):
        for s in range(TOP_K):
            e = experts[n, s]
            rows = slice(2 * INTER * e, 2 * INTER * (e + 1))
            projected = gate_up[rows].astype(np.float64) @ x[n] + gate_up_bias[rows]
            gate, up = np.minimum(projected[:INTER], limit), np.clip(projected[INTER:], -limit, limit)
            act = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            rows = slice(HIDDEN * e, HIDDEN * (e + 1))
            expected[n] += weights[n, s] * (down[rows].astype(np.float64) @ act + down_bias[rows])
    got = moe_clamped.clamped_experts_reference(x, experts, weights, gate_up, down, alpha, limit, gate_up_bias,
                                                down_bias)
    assert rel_error(got, expected) <= 1e-5
    chosen, chosen_weights = moe_clamped.topk_softmax_reference(np.array([[0.5, 2.0, 2.0, -1.0]], np.float32), 3)
    assert chosen.tolist() == [[1, 2, 0]]  # a tie goes to the smaller expert
    top = np.array([2.0, 2.0, 0.5])
    np.testing.assert_allclose(chosen_weights[0], np.exp(top) / np.exp(top).sum(), rtol=1e-6)


@pytest.mark.skipif(not SIMULATED, reason="the simulator runs these; a GPU runs the op checks (-m gpu)")
@pytest.mark.parametrize("gate_up_format, down_format, biased", [
    ("bf16", "bf16", True), ("bf16", "bf16", False), ("mxfp4", "mxfp4", True), ("mxfp4", "mxfp4", False),
])
def test_the_kernels_match_the_reference(gate_up_format, down_format, biased):
    rng = np.random.default_rng(7)
    stacks = {"bf16": bf16_stack, "mxfp4": mxfp4_stack}
    gate_up = stacks[gate_up_format](rng, COUNT * 2 * INTER, HIDDEN)
    down = stacks[down_format](rng, COUNT * HIDDEN, INTER)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    gate_up_bias = rng.standard_normal(COUNT * 2 * INTER).astype(np.float32) if biased else None
    down_bias = rng.standard_normal(COUNT * HIDDEN).astype(np.float32) if biased else None
    experts = np.array([[4, 0], [2, 4], [1, 3]], np.int32)
    weights = rng.random((TOKENS, TOP_K)).astype(np.float32)
    x_in = x if gate_up_format == "mxfp4" else float32_to_bf16(x)
    expected = moe_clamped.clamped_experts_reference(x if gate_up_format == "mxfp4" else bf16_to_float32(x_in),
                                                     experts, weights, as_float(gate_up), as_float(down), 1.702, 0.9,
                                                     gate_up_bias, down_bias)
    act = np.zeros((TOKENS * TOP_K, INTER), np.float32)
    out = np.zeros((TOKENS, HIDDEN), np.float32)
    launcher = moe_clamped.clamped_experts_mxfp4 if gate_up_format == "mxfp4" else moe_clamped.clamped_experts_bf16
    launcher(x_in, experts, weights, gate_up, down, 1.702, 0.9, gate_up_bias, down_bias, act, out)
    assert rel_error(out, expected) <= 1e-5


@pytest.mark.skipif(not SIMULATED, reason="the simulator runs these; a GPU runs the op checks (-m gpu)")
def test_each_launcher_refuses_the_other_s_stacks():
    from metrale.errors import KernelArgumentError

    rng = np.random.default_rng(8)
    bf16 = bf16_stack(rng, COUNT * 2 * INTER, HIDDEN), bf16_stack(rng, COUNT * HIDDEN, INTER)
    mxfp4 = mxfp4_stack(rng, COUNT * 2 * INTER, HIDDEN), mxfp4_stack(rng, COUNT * HIDDEN, INTER)
    experts = np.zeros((TOKENS, TOP_K), np.int32)
    weights = np.ones((TOKENS, TOP_K), np.float32)
    act = np.zeros((TOKENS * TOP_K, INTER), np.float32)
    out = np.zeros((TOKENS, HIDDEN), np.float32)
    x = np.zeros((TOKENS, HIDDEN), np.float32)
    with pytest.raises(KernelArgumentError, match="bf16 kernels take bf16 stacks"):
        moe_clamped.clamped_experts_bf16(float32_to_bf16(x), experts, weights, mxfp4[0], bf16[1], 1.7, 0.9, None, None,
                                         act, out)
    with pytest.raises(KernelArgumentError, match="two plain MXFP4 stacks"):
        moe_clamped.clamped_experts_mxfp4(x, experts, weights, mxfp4[0], bf16[1], 1.7, 0.9, None, None, act, out)
