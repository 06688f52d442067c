"""tools/sweeps/lora_ops_bench.py on the CPU (the NumPy references timed by the host clock): every piece
of every projection is timed and reported."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "sweeps"))

import lora_ops_bench  # noqa: E402


def test_the_pieces_are_timed_on_the_cpu(tmp_path):
    report = lora_ops_bench.main(["--shape", "tiny", "--rows", "5", "--slots", "2", "--rank", "4", "--device", "cpu",
                                  "--output", str(tmp_path / "ops.json")])
    assert json.loads((tmp_path / "ops.json").read_text()) == report
    assert set(report["microseconds"]) == {"base", "extended product", "lora_expand",
                                           "extended product + lora_expand", "lora_linear"}
    for values in report["microseconds"].values():
        assert set(values) == {"qkv", "o", "gate_up", "down"} and all(us > 0 for us in values.values())
