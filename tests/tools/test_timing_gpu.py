"""The profiling tools' GPU clocks (tools/timing.py) on a real device (``-m gpu``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "timing.py"


@pytest.fixture(scope="module")
def timing():
    spec = importlib.util.spec_from_file_location("metrale_tools_timing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_event_and_graph_times_of_a_copy_are_plausible(timing):
    import cupy

    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    source = cupy.ones(1 << 26, dtype=cupy.float32)  # 256 MiB: far above launch overhead
    target = cupy.empty_like(source)

    def copy():
        target.__setitem__(slice(None), source)

    with backend.activate():
        events = timing.cuda_event_time(copy, backend.stream, repeats=5, warmup=2)
    graphed = timing.graph_time(backend, copy, calls_per_graph=4, repeats=5, warmup=1)
    for result in (events, graphed):
        assert len(result.samples) == 5
        assert 0 < result.min <= result.median < 1.0
    # The copy reads and writes 512 MiB: at most a few TB/s, so well over 50 microseconds.
    assert graphed.median > 5e-5
    assert graphed.median == pytest.approx(events.median, rel=0.5)
    backend.close()
