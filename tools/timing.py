"""Timing shared by the profiling tools and the sweeps: warm-up calls, then repeated samples, median and minimum.

Three clocks:

* :func:`host_time` -- the host clock (``time.perf_counter``): what a call costs the Python
  thread, GPU work included only where the timed function waits for it;
* :func:`cuda_event_time` -- CUDA events recorded on a stream around each sample: the GPU time of
  the work the function queues there;
* :func:`graph_time` -- the function captured ``calls_per_graph`` times back to back into one
  CUDA graph, the graph replayed and timed with events: a call's GPU time without its launch
  overhead.

Each returns a :class:`Timing` of seconds per call. The GPU clocks need CuPy; :func:`graph_time`
also a :class:`metrale.backends.cuda.CudaBackend` (for its stream and graph memory pool).
The tools import this module as ``timing``: run as ``python3 tools/GROUP/NAME.py``, a tool has
only ``tools/GROUP/`` on its import path, so it puts ``tools/`` there itself first.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Timing:
    """Seconds per call of each sample of one measurement."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def median_us(self) -> float:
        return self.median * 1e6

    @property
    def min_us(self) -> float:
        return self.min * 1e6

    def __str__(self) -> str:
        return f"median {self.median_us:.2f} us, min {self.min_us:.2f} us ({len(self.samples)} samples)"


def host_time(
    function: Callable[[], Any], *, repeats: int = 10, warmup: int = 3, calls: int = 1,
    synchronize: Callable[[], Any] | None = None,
) -> Timing:
    """Host-clock seconds per call of ``function()``.

    ``warmup`` untimed calls, then ``repeats`` samples of ``calls`` back-to-back calls each.
    ``synchronize`` (a stream's or backend's) runs after the warm-up and after each sample,
    outside the clock, so every sample starts with the device idle; a function whose GPU work
    should count waits for it itself.
    """
    for _ in range(warmup):
        function()
    if synchronize is not None:
        synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        samples.append((time.perf_counter() - started) / calls)
        if synchronize is not None:
            synchronize()
    return Timing(tuple(samples))


def cuda_event_time(function: Callable[[], Any], stream: Any, *, repeats: int = 10, warmup: int = 3) -> Timing:
    """GPU seconds of ``function()``'s work on ``stream`` (a CuPy stream): ``warmup`` untimed
    calls, then ``repeats`` samples, each one call between two CUDA events."""
    import cupy

    for _ in range(warmup):
        function()
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        function()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)  # milliseconds -> seconds
    return Timing(tuple(samples))


def graph_time(
    backend: Any, call: Callable[[], Any], *, calls_per_graph: int = 20, repeats: int = 10, warmup: int = 3,
) -> Timing:
    """GPU seconds per call of ``call()``, from a CUDA graph of ``calls_per_graph`` back-to-back
    calls on ``backend``'s stream (one eager call first, to compile and allocate), replayed
    ``warmup`` times untimed and then ``repeats`` times between CUDA events."""
    import cupy

    stream = backend.stream
    with cupy.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        call()
        stream.synchronize()
        stream.begin_capture(getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2))
        for _ in range(calls_per_graph):
            call()
        graph = stream.end_capture()
    replays = cuda_event_time(lambda: graph.launch(stream=stream), stream, repeats=repeats, warmup=warmup)
    return Timing(tuple(seconds / calls_per_graph for seconds in replays.samples))
