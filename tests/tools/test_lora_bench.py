"""tools/sweeps/lora_bench.py on the CPU with the embedded tiny-dense model: the adapters it writes load
as PEFT adapters, and it times the three kinds of decode step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "sweeps"))

import lora_bench  # noqa: E402


def test_the_bench_runs_on_tiny_dense(tmp_path):
    report = lora_bench.main(["--checkpoint", "tiny-dense", "--device", "cpu", "--batch", "3", "--adapters", "2",
                              "--rank", "4", "--context", "8", "--steps", "2", "--workdir", str(tmp_path),
                              "--output", str(tmp_path / "lora.json")])
    assert json.loads((tmp_path / "lora.json").read_text()) == report
    assert set(report["step_seconds"]) == {"base", "one_adapter", "mixed"}
    assert all(seconds > 0 for seconds in report["step_seconds"].values())
    assert len(report["rounds"]) == 3 and all(set(r) == {"base", "one_adapter", "mixed"} for r in report["rounds"])
    assert report["step_seconds"]["mixed"] == sorted(r["mixed"] for r in report["rounds"])[1]
    config = json.loads((tmp_path / "lora-tiny-dense-0" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
