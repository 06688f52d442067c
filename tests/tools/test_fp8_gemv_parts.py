"""The FP8 GEMV parts sweep's edits each find their text once in the kernel's source and change it;
its projections are the 8B shape's, served by the GEMV at one row."""

from __future__ import annotations

import numpy as np
import pytest
from tool_module import load_tool


def test_every_part_edits_the_current_kernel_source():
    from metrale.kernels import fp8_gemv

    sweep = load_tool("sweeps/fp8_gemv_parts.py", "fp8_gemv_parts")
    for name, edits in sweep.PARTS:
        edited = sweep.edited_source(fp8_gemv.KERNELS, edits, name)
        assert edited != fp8_gemv.KERNELS
        for _, replacement in edits:
            assert replacement in edited
    with pytest.raises(SystemExit, match="no longer has"):
        sweep.edited_source("no kernel here", sweep.PARTS[0][1], sweep.PARTS[0][0])


def test_the_projections_are_served_at_one_row():
    from metrale.kernels import fp8_gemv
    from metrale.kernels.quantized import quantize_fp8_per_channel

    sweep = load_tool("sweeps/fp8_gemv_parts.py", "fp8_gemv_parts")
    for _, inner, columns, norm, gated in sweep.PROJECTIONS:
        weight = quantize_fp8_per_channel(np.zeros((16, inner), np.float32), "fp8_token")
        assert fp8_gemv.serves(1, weight) and (not norm or fp8_gemv.serves_norm(1, weight))
        assert columns % 16 == 0 and (not gated or columns % 2 == 0)
