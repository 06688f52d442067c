"""The profiling tools' shared timing helper (tools/timing.py): warm-up, samples, statistics."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "timing.py"


@pytest.fixture(scope="module")
def timing():
    spec = importlib.util.spec_from_file_location("metrale_tools_timing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_statistics_of_the_samples(timing):
    result = timing.Timing((3e-6, 1e-6, 2e-6, 10e-6))
    assert result.median == pytest.approx(2.5e-6)
    assert result.min == pytest.approx(1e-6)
    assert result.mean == pytest.approx(4e-6)
    assert result.median_us == pytest.approx(2.5)
    assert result.min_us == pytest.approx(1.0)
    assert str(result) == "median 2.50 us, min 1.00 us (4 samples)"


def test_host_time_warms_up_then_times_each_sample_per_call(timing, monkeypatch):
    clock = itertools.count(0.0, 0.5)  # every reading of the clock advances it by 0.5 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    events = []

    result = timing.host_time(lambda: events.append("call"), repeats=3, warmup=2, calls=4,
                              synchronize=lambda: events.append("sync"))

    assert events == ["call"] * 2 + ["sync"] + (["call"] * 4 + ["sync"]) * 3
    # Each sample reads the clock twice (0.5 s apart) around its 4 calls.
    assert result.samples == (0.125, 0.125, 0.125)


def test_host_time_without_warmup_or_synchronize(timing):
    calls = []
    result = timing.host_time(lambda: calls.append(1), repeats=5, warmup=0)
    assert len(calls) == 5
    assert len(result.samples) == 5 and all(sample >= 0 for sample in result.samples)
    assert result.min <= result.median
