"""tools/soak.py, short, on the CPU: many clients, streams dropped, requests given up, bad
requests, crashing grammars, LoRA adapters, speculation and preemption, and the engine process
killed once: nothing stalls or leaks, the server lives and stops cleanly, and every finished
request equals its solo run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_short_soak_finds_nothing_wrong(tmp_path):
    code = soak.main(["--seconds", "15", "--concurrency", "8", "--seed", "3", "--output", str(tmp_path / "soak.json")])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["problems"] == [] and code == 0, result["problems"]
    # (At least one finished and replayed request per client, however loaded the machine is.)
    assert result["kill"]["engine_killed"] and result["finished_and_replayed"] >= 8
    assert {"drop_stream", "give_up", "bad_request", "crashing_grammar", "empty_schema"} <= set(result["by_action"])
