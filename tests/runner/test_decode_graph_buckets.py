"""Decode graphs by live-context bucket (``metrale.runner.graphs``): the buckets a model gets,
the bucket a step replays, and the graphs recorded ahead of time (a runner whose recording is
stubbed, so no GPU is needed)."""

from __future__ import annotations

import pytest

from metrale.runner.graphs import CudaGraphRunner, Rung, context_buckets


@pytest.mark.parametrize("max_model_len, buckets", [
    (300, (300,)),
    (512, (512,)),
    (513, (512, 513)),
    (4096, (512, 2048, 4096)),
    (32768, (512, 2048, 8192, 32768)),
    (131072, (512, 2048, 8192, 32768, 131072)),
])
def test_buckets_grow_fourfold_up_to_max_model_len(max_model_len, buckets):
    assert context_buckets(max_model_len) == buckets


def stub_runner(max_model_len: int, recorded: list) -> CudaGraphRunner:
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    runner.disabled = None
    runner.buckets = context_buckets(max_model_len)
    runner.rungs = {}
    runner._rung = lambda size: runner.rungs.setdefault(size, Rung(size, None, None, None))
    runner._fill = lambda rung, batch: None

    def record(rung, bucket):
        recorded.append((rung.size, bucket))
        rung.graphs[bucket], rung.outputs[bucket] = f"graph {rung.size}x{bucket}", "logits"
        return "eager"

    runner._record_decode = record
    return runner


def test_a_step_replays_the_smallest_bucket_that_holds_its_longest_sequence():
    runner = stub_runner(32768, [])
    assert [runner.context_bucket(c) for c in (1, 512, 513, 2048, 2049, 30000, 32768)] == [
        512, 512, 2048, 2048, 8192, 32768, 32768]


def test_capture_records_every_bucket_of_every_rung_once():
    recorded: list = []
    runner = stub_runner(4096, recorded)
    runner.capture((1, 3))
    assert recorded == [(1, 512), (1, 2048), (1, 4096), (4, 512), (4, 2048), (4, 4096)]
    runner.capture((2, 4))  # rung 4 is recorded already
    assert recorded[6:] == [(2, 512), (2, 2048), (2, 4096)]
    assert set(runner.rungs[4].graphs) == {512, 2048, 4096}


def test_capture_stops_once_graphs_are_turned_off():
    recorded: list = []
    runner = stub_runner(4096, recorded)
    original = runner._record_decode

    def failing(rung, bucket):
        runner.disabled = "an op that cannot be captured"
        return original(rung, bucket)

    runner._record_decode = failing
    runner.capture((1, 2))
    assert recorded == [(1, 512)]
