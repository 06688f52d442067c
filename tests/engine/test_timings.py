"""The engine's histograms (:mod:`metrale.engine.timings`) bucket as Prometheus does, and the
request phases follow from a request's times."""

from __future__ import annotations

import random

import pytest

from metrale.engine.timings import ITERATION_TOKEN_BUCKETS, REQUEST_TIME_BUCKETS, BucketCounts, request_phases


@pytest.mark.parametrize("bounds", [REQUEST_TIME_BUCKETS, ITERATION_TOKEN_BUCKETS])
def test_bucket_counts_equal_prometheus_client_s_histogram(bounds):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    reference = prometheus_client.Histogram("values", "", buckets=bounds, registry=registry)
    ours = BucketCounts(bounds)
    rng = random.Random(0)
    values = [rng.choice(bounds) for _ in range(50)] + [rng.uniform(0, 2 * bounds[-1]) for _ in range(200)] + [0.0]
    for value in values:
        ours.observe(value)
        reference.observe(value)
    (family,) = list(registry.collect())
    expected = [(sample.labels["le"], int(sample.value)) for sample in family.samples if sample.name == "values_bucket"]
    assert [(float(le), count) for le, count in ours.cumulative()] == [(float(le), count) for le, count in expected]
    assert ours.count == len(values)
    assert ours.total == pytest.approx(registry.get_sample_value("values_sum"))


def test_request_phases_leave_out_what_did_not_happen():
    assert request_phases(1.0, 1.5, 2.0, 4.0) == {"queue": 0.5, "prefill": 0.5, "decode": 2.0, "inference": 2.5}
    assert request_phases(1.0, None, None, None) == {}  # aborted while waiting
    assert request_phases(1.0, 1.25, None, None) == {"queue": 0.25}  # failed in its prompt step


def test_a_copy_is_independent():
    counts = BucketCounts((1.0, 2.0))
    counts.observe(1.5)
    copy = counts.copy()
    counts.observe(0.5)
    assert copy.counts == [0, 1, 0] and counts.counts == [1, 1, 0]
