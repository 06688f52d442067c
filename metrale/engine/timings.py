"""What the engine counts of its requests' times and its steps' sizes, for metrics.

:class:`BucketCounts` is a histogram as Prometheus keeps one (a count per upper bound, the sum
of the values); the engine keeps one of the tokens each step computes
(:data:`ITERATION_TOKEN_BUCKETS`), and the :class:`~metrale.engine.driver.EngineDriver` one per
phase of each finished request (:data:`REQUEST_PHASES`):

* ``queue``: from the engine receiving the request to its first scheduled step;
* ``prefill``: from that step to its first generated token;
* ``decode``: from its first generated token to its last;
* ``inference``: from its first scheduled step to its last token.

Times are ``time.monotonic()`` seconds: one clock for every process of a host, so an engine
process's times compare with each other wherever they are read.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

#: Upper bounds (seconds) of the request phase histograms.
REQUEST_TIME_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                           10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0)
#: Upper bounds of the tokens-per-step histogram (the decode batch sizes, then the prompt chunks).
ITERATION_TOKEN_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: The request phases timed, in the order the module docstring gives them.
REQUEST_PHASES: tuple[str, ...] = ("queue", "prefill", "decode", "inference")


@dataclass
class BucketCounts:
    """A histogram: ``counts[i]`` values at most ``bounds[i]`` and above the bound before it,
    ``counts[-1]`` those above every bound; ``total`` their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound, values at most it)]`` as Prometheus writes them, ``"+Inf"`` last."""
        running, rows = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            rows.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return rows

    def copy(self) -> "BucketCounts":
        return BucketCounts(self.bounds, list(self.counts), self.total)


def request_phases(arrival: float | None, scheduled: float | None, first_token: float | None,
                   last_token: float | None) -> dict[str, float]:
    """The phases (:data:`REQUEST_PHASES`) of a request with these times: each one whose two ends
    are known (a request aborted while waiting has no prefill, one that failed has no decode)."""
    spans = {"queue": (arrival, scheduled), "prefill": (scheduled, first_token), "decode": (first_token, last_token),
             "inference": (scheduled, last_token)}
    return {phase: max(end - start, 0.0) for phase, (start, end) in spans.items()
            if start is not None and end is not None}


def new_phase_histograms() -> dict[str, BucketCounts]:
    return {phase: BucketCounts(REQUEST_TIME_BUCKETS) for phase in REQUEST_PHASES}


def copied(histograms: dict[str, Any]) -> dict[str, BucketCounts]:
    return {name: histogram.copy() for name, histogram in histograms.items()}
