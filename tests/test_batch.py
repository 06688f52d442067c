"""ForwardBatch.build lays out mixed segments row by row."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.batch import ForwardBatch, Segment
from metrale.errors import CacheError
from metrale.sequence import SequenceState


def sequence(table, num_cached):
    seq = SequenceState.from_prompt(list(range(100)))
    seq.block_table = list(table)
    seq.num_cached = num_cached
    return seq


def test_rows_slots_tables_and_logits_rows_of_mixed_segments():
    block_size = 4
    a = sequence([7, 3], 2)  # prefill chunk of 3 tokens at positions 2..4 (crosses a block)
    b = sequence([5], 0)  # decode-like single token at position 0
    c = sequence([9, 1, 8], 9)  # 2 tokens at positions 9, 10, all logits
    segments = [Segment(a, [11, 12, 13], 2, "none"), Segment(b, [21], 0, "last"), Segment(c, [31, 32], 9, "all")]
    batch = ForwardBatch.build(segments, block_size)
    expected_rows = [(11, 2, 0), (12, 3, 0), (13, 4, 0), (21, 0, 1), (31, 9, 2), (32, 10, 2)]
    tables = [[7, 3], [5], [9, 1, 8]]
    assert batch.token_ids.tolist() == [t for t, _, _ in expected_rows]
    assert batch.positions.tolist() == [p for _, p, _ in expected_rows]
    assert batch.seq_index.tolist() == [s for _, _, s in expected_rows]
    assert batch.slot_mapping.tolist() == [tables[s][p // block_size] * block_size + p % block_size for _, p, s in expected_rows]
    assert batch.block_tables.tolist() == [[7, 3, 0], [5, 0, 0], [9, 1, 8]]
    assert batch.row_starts.tolist() == [0, 3, 4, 6]
    assert batch.logits_rows.tolist() == [3, 4, 5]
    assert batch.max_context == 11
    assert batch.token_ids.dtype == np.int64 and batch.slot_mapping.dtype == np.int64


def test_a_batch_knows_when_every_row_gives_logits_in_order():
    a, b = sequence([7, 3], 2), sequence([5], 0)
    cases = [
        ([Segment(a, [11], 2, "last"), Segment(b, [21], 0, "last")], True),  # a decode step
        ([Segment(a, [11, 12, 13], 2, "all")], True),  # a verify
        ([Segment(a, [11, 12], 2, "all"), Segment(b, [21, 22], 0, "all")], True),
        ([Segment(a, [11, 12, 13], 2, "last")], False),  # a prompt's last row only
        ([Segment(a, [11, 12], 2, "all"), Segment(b, [21, 22], 0, "none")], False),
    ]
    for segments, expected in cases:
        batch = ForwardBatch.build(segments, 4)
        assert batch.every_row_logits is expected
        if expected:
            assert batch.logits_rows.tolist() == list(range(batch.num_rows))


def test_bad_segments_are_refused():
    with pytest.raises(CacheError, match="at least one segment"):
        ForwardBatch.build([], 4)
    with pytest.raises(CacheError, match="has no tokens"):
        ForwardBatch.build([Segment(sequence([1], 0), [], 0)], 4)
    with pytest.raises(CacheError, match="too few for position 4"):
        ForwardBatch.build([Segment(sequence([1], 0), [1, 2, 3, 4, 5], 0)], 4)


def test_decode_batches_take_a_shortcut_with_the_same_layout():
    rng = np.random.default_rng(3)
    block_size = 4
    for _ in range(20):
        count = int(rng.integers(1, 9))
        segments = []
        for _ in range(count):
            blocks = int(rng.integers(1, 6))
            position = int(rng.integers(0, blocks * block_size))
            table = rng.choice(np.arange(1, 50), blocks, replace=False).tolist()
            segments.append(Segment(sequence(table, position), [int(rng.integers(0, 1000))], position, "last"))
        fast = ForwardBatch.build(segments, block_size)
        general = ForwardBatch._build_rows(segments, block_size)
        for name in ("token_ids", "positions", "seq_index", "slot_mapping", "block_tables", "row_starts", "logits_rows"):
            assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
            assert getattr(fast, name).dtype == getattr(general, name).dtype, name
        assert fast.max_context == general.max_context
    with pytest.raises(CacheError, match="too few for position 4"):
        ForwardBatch.build([Segment(sequence([1], 4), [7], 4)], 4)


def test_batches_name_each_segments_state_slot():
    """Decode and prompt layouts alike; a sequence without a slot gets the dummy slot 0."""
    a = SequenceState.from_prompt([1, 2, 3], block_table=[4], state_slot=2)
    b = SequenceState.from_prompt([5, 6], block_table=[7])
    decode = ForwardBatch.build([Segment(a, [9], 0), Segment(b, [8], 0)], block_size=4)
    prompts = ForwardBatch.build([Segment(a, [1, 2, 3], 0, "none"), Segment(b, [5, 6], 0)], block_size=4)
    assert decode.state_slots.tolist() == prompts.state_slots.tolist() == [2, 0]


def test_block_array_follows_a_growing_or_replaced_table():
    seq = SequenceState.from_prompt([1, 2, 3], block_table=[4, 9])
    assert seq.block_array().tolist() == [4, 9]
    assert seq.block_array() is seq.block_array()  # unchanged table: the same array
    seq.block_table.append(2)
    seq.block_table.extend([7, 5])
    assert seq.block_array().tolist() == [4, 9, 2, 7, 5]
    seq.block_table = [3, 1]  # released and reallocated: a new list
    assert seq.block_array().tolist() == [3, 1]
    seq.block_table = []
    assert seq.block_array().tolist() == [] and seq.block_array().dtype == np.int64
