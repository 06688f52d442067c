"""ForwardBatch.build lays out mixed segments row by row."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.batch import ForwardBatch, Segment
from metrale.errors import CacheError
from metrale.sequence import SequenceState


def sequence(table, seq_len):
    seq = SequenceState.from_prompt(list(range(100)))
    seq.block_table = list(table)
    seq.seq_len = seq_len
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


def test_bad_segments_are_refused():
    with pytest.raises(CacheError, match="at least one segment"):
        ForwardBatch.build([], 4)
    with pytest.raises(CacheError, match="has no tokens"):
        ForwardBatch.build([Segment(sequence([1], 0), [], 0)], 4)
    with pytest.raises(CacheError, match="too few for position 4"):
        ForwardBatch.build([Segment(sequence([1], 0), [1, 2, 3, 4, 5], 0)], 4)
