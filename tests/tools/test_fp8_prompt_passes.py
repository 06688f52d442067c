"""The prompt passes' sweep times a weight the fused pass serves, at the 8B shape's width."""

from __future__ import annotations

import numpy as np
from tool_module import load_tool


def test_the_sweeps_weight_takes_per_token_fp8_rows_of_the_8b_width():
    sweep = load_tool("sweeps/fp8_prompt_passes.py", "fp8_prompt_passes")
    weight = sweep.down_input_weight(sweep.INTERMEDIATE, np.random.default_rng(0))
    assert weight.shape == (16, 14336) and weight.activations == "fp8_token" and weight.codes_format == "fp8"
    gate_up = np.zeros((4, 2 * sweep.INTERMEDIATE), np.uint16)
    from metrale.kernels import quantized_gemv

    assert quantized_gemv.serves_silu_fp8_rows(gate_up, weight)
    assert not quantized_gemv.serves_silu_fp8_rows(gate_up[:, :-8], weight)


def test_the_sweeps_norm_rows_are_of_a_width_the_fused_norm_serves():
    sweep = load_tool("sweeps/fp8_prompt_passes.py", "fp8_prompt_passes")
    weight = sweep.down_input_weight(sweep.HIDDEN, np.random.default_rng(0))
    from metrale.kernels import quantized_gemv

    gains = np.ones(sweep.HIDDEN, np.uint16)
    assert quantized_gemv.serves_rmsnorm_fp8_rows(np.zeros((4, sweep.HIDDEN), np.float32), gains, weight)
    assert not quantized_gemv.serves_rmsnorm_fp8_rows(np.zeros((4, sweep.HIDDEN), np.uint16), gains, weight)
