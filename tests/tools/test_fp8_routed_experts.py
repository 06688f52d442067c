"""The routed-experts sweep's stacks are block FP8 (128 x 128 scale blocks, inputs quantized in
groups of 128) that the routed form serves up to its token limit and no further."""

from __future__ import annotations

import numpy as np
from tool_module import load_tool


def test_the_sweeps_stacks_are_served_and_dequantize_as_block_fp8():
    from metrale.kernels import fp8_gemv
    from metrale.kernels.quantized import dequantize

    sweep = load_tool("sweeps/fp8_routed_experts.py", "fp8_routed_experts")
    rng = np.random.default_rng(0)
    experts, hidden, width = 2, 256, 128
    gate_up = sweep.block_fp8_stack(experts * 2 * width, hidden, rng)
    down = sweep.block_fp8_stack(experts * hidden, width, rng)
    assert gate_up.block == (128, 128) and gate_up.activations == "fp8_group"
    assert fp8_gemv.serves_experts(fp8_gemv.MAX_EXPERT_TOKENS, 2, gate_up, down)
    assert not fp8_gemv.serves_experts(fp8_gemv.MAX_EXPERT_TOKENS + 1, 2, gate_up, down)
    matrix = dequantize(gate_up)
    block = matrix[:128, :128] / gate_up.scales[0, 0]
    assert np.abs(block).max() > 1.0  # codes of values times 100, not the scaled values
    assert np.isfinite(matrix).all() and matrix.shape == (experts * 2 * width, hidden)
