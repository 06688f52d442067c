"""Decode graphs by live-context bucket (``metrale.runner.graphs``): the buckets a model gets,
the bucket a step replays, the graphs recorded ahead of time (a runner whose recording is
stubbed, so no GPU is needed), and a step's metadata packed with the block table as wide as its
bucket needs."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.batch import ForwardBatch, Segment
from metrale.kernels.lora_tiles import ADAPTER_TILE_ROWS, adapter_tile_capacity
from metrale.runner.graphs import CudaGraphRunner, Rung, context_buckets, decode_buffer_length, pack_decode, table_width
from metrale.sequence import SequenceState


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


def stub_runner(max_model_len: int, recorded: list, model=None) -> CudaGraphRunner:
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    runner._model = lambda: model
    runner.disabled = None
    runner.buckets = context_buckets(max_model_len)
    runner.rungs = {}
    runner._rung = lambda size: runner.rungs.setdefault(size, Rung(size, None, None, None))
    runner._fill = lambda rung, batch, bucket: None

    def record(rung, bucket, lora=False):
        recorded.append((rung.size, bucket) + (("lora",) if lora else ()))
        rung.graphs[(bucket, lora)], rung.outputs[(bucket, lora)] = f"graph {rung.size}x{bucket}", "logits"
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
    assert set(runner.rungs[4].graphs) == {(512, False), (2048, False), (4096, False)}


def test_capture_records_the_adapters_graphs_of_a_model_that_serves_lora():
    class Model:
        lora_layout = "a layout"

    recorded: list = []
    stub_runner(2048, recorded, Model()).capture((1,))
    assert recorded == [(1, 512), (1, 512, "lora"), (1, 2048), (1, 2048, "lora")]


def test_capture_stops_once_graphs_are_turned_off():
    recorded: list = []
    runner = stub_runner(4096, recorded)
    original = runner._record_decode

    def failing(rung, bucket, lora=False):
        runner.disabled = "an op that cannot be captured"
        return original(rung, bucket, lora)

    runner._record_decode = failing
    runner.capture((1, 2))
    assert recorded == [(1, 512)]


def test_a_bucket_reads_the_blocks_its_tokens_fill():
    assert table_width(512, 16, 8192) == 32
    assert table_width(513, 16, 8192) == 33
    assert table_width(131072, 16, 2000) == 2000  # no more than the cache holds


def test_a_step_packs_its_table_as_wide_as_its_bucket():
    seqs = [SequenceState.from_prompt(list(range(n))) for n in (40, 7)]
    for seq, blocks in zip(seqs, ([5, 9, 2], [4])):
        seq.block_table = blocks
        seq.num_cached = len(seq.tokens) - 1
    batch = ForwardBatch.build([Segment(s, [s.tokens[-1]], s.num_cached, "last") for s in seqs], 16)
    size, width = 4, table_width(512, 16, 8192)
    host = np.full(decode_buffer_length(size, 8192), 7, np.int32)  # a rung's buffer: the widest table
    used = pack_decode(host, size, width, batch, feed=([1, 0], [0, 1]))
    tiles = adapter_tile_capacity(size) * (2 + ADAPTER_TILE_ROWS)  # the adapters' tiles, after the nine vectors
    assert used == decode_buffer_length(size, width) == 9 * size + tiles + size * width
    vectors = host[: 9 * size].reshape(9, size)
    assert vectors[0].tolist() == [39, 6, 0, 0]  # token ids, then padding rows' token 0
    assert vectors[1].tolist() == [39, 6, 0, 0]  # positions
    assert vectors[2].tolist() == [2 * 16 + 39 % 16, 4 * 16 + 6, 0, 0]  # cache slots
    assert vectors[3].tolist() == vectors[4].tolist() == [0, 1, 2, 3]  # each row its table row and logits row
    assert not vectors[6].any()  # adapter slots: the base model's
    assert vectors[7].tolist() == [1, 0, 0, 0] and vectors[8].tolist() == [0, 1, 0, 0]  # the feed's rows, indices
    assert not host[9 * size : 9 * size + tiles].any()  # no adapter rows: no tiles
    table = host[9 * size + tiles : used].reshape(size, width)
    assert table[0, :3].tolist() == [5, 9, 2] and table[1, :1].tolist() == [4]
    assert not table[0, 3:].any() and not table[1, 1:].any() and not table[2:].any()
    assert (host[used:] == 7).all()  # nothing past what the bucket reads is written
    padding = pack_decode(host, size, width, None)
    assert padding == used and not host[: 3 * size].any() and not host[6 * size : used].any()
