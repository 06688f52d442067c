"""tools/speculative_bench.py on the CPU, at a tiny size: every part runs and its numbers hold
together (an oracle's drafts are all kept, n-gram speculation changes no output)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import speculative_bench  # noqa: E402


def test_every_part_runs_on_a_tiny_model(tmp_path):
    output = tmp_path / "spec.json"
    report = speculative_bench.main([
        "--device", "cpu", "--checkpoint", "tiny-dense", "--k", "1,3", "--context", "24", "--steps", "2",
        "--max-tokens", "12", "--tiny", "tiny-dense", "--prompts", "2", "--output", str(output)])
    assert output.exists()
    costs = report["verify_seconds"]
    assert set(costs) == {"decode", "verify_k1", "verify_k3"} and all(v > 0 for v in costs.values())
    oracle = report["oracle"]
    assert oracle["k"] == 3 and oracle["tokens_agreeing"] == 12
    assert oracle["accepted"] == oracle["drafted"] > 0  # every token of the oracle is the target's
    ngram = report["ngram"]["tiny-dense"]
    assert ngram["same_tokens"] == ngram["prompts"] == 2
    assert ngram["accepted"] <= ngram["drafted"] and (ngram["verify_steps"] == 0 or ngram["tokens_per_verify"] >= 1)
