"""The FP8-cache attention sweep's --parts edits name text the decode kernel's source has once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from metrale.kernels import attention_decode_mma

SWEEP = Path(__file__).resolve().parents[2] / "tools" / "sweeps" / "fp8_cache_attention.py"


def test_every_part_the_sweep_takes_out_is_in_the_kernel_once():
    spec = importlib.util.spec_from_file_location("fp8_cache_attention", SWEEP)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert len(sweep.PARTS) == 4
    for name, edits in sweep.PARTS:
        for text, _ in edits:
            assert attention_decode_mma.KERNEL.count(text) == 1, name
