"""Flat (varlen) batches: every forward call becomes one :class:`ForwardBatch`.

A batch concatenates the new tokens of one or more sequences (segments). Per row it records the
absolute position, the segment, and the cache slot the row's KV goes to; it also lists the rows
whose logits the call returns. Layer code runs its matrix products over all rows at once and its
attention per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from metrale.errors import CacheError
from metrale.sequence import SequenceState


@dataclass
class Segment:
    """``len(token_ids)`` new tokens of ``seq`` at positions ``start, start+1, ...``.

    ``logits`` is ``"none"``, ``"last"`` (the segment's last row) or ``"all"`` (every row).
    """

    seq: SequenceState
    token_ids: Sequence[int]
    start: int
    logits: str = "last"

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class ForwardBatch:
    """Row-level metadata of one forward call (``N`` rows, ``S`` segments).

    ``token_ids``, ``positions``, ``seq_index``, ``slot_mapping``: ``[N]`` int64;
    ``block_tables``: ``[S, max_blocks]`` int64 (padded with the dummy block 0);
    ``row_starts``: ``[S + 1]``; ``logits_rows``: rows whose logits are returned, in order.
    ``max_context`` bounds every row's ``position + 1`` (it sizes the attention's key splits).
    """

    segments: list[Segment]
    token_ids: np.ndarray
    positions: np.ndarray
    seq_index: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    row_starts: np.ndarray
    logits_rows: np.ndarray
    max_context: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def build(cls, segments: list[Segment], block_size: int) -> "ForwardBatch":
        """Lay out ``segments`` (whose sequences already hold enough cache blocks)."""
        if not segments:
            raise CacheError("a forward batch needs at least one segment")
        token_ids, positions, seq_index, slots, logits_rows = [], [], [], [], []
        row_starts = [0]
        max_blocks = max(max(len(s.seq.block_table) for s in segments), 1)
        block_tables = np.zeros((len(segments), max_blocks), dtype=np.int64)
        for index, segment in enumerate(segments):
            count = len(segment.token_ids)
            if count == 0:
                raise CacheError(f"segment {index} of sequence {segment.seq.seq_id} has no tokens")
            table = np.asarray(segment.seq.block_table, dtype=np.int64)
            if segment.end > len(table) * block_size:
                raise CacheError(
                    f"sequence {segment.seq.seq_id} holds {len(table)} blocks, "
                    f"too few for position {segment.end - 1}"
                )
            block_tables[index, : len(table)] = table
            pos = np.arange(segment.start, segment.end, dtype=np.int64)
            base = row_starts[-1]
            token_ids.append(np.asarray(segment.token_ids, dtype=np.int64))
            positions.append(pos)
            seq_index.append(np.full(count, index, dtype=np.int64))
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            if segment.logits == "last":
                logits_rows.append(base + count - 1)
            elif segment.logits == "all":
                logits_rows.extend(range(base, base + count))
            row_starts.append(base + count)
        positions_all = np.concatenate(positions)
        return cls(
            segments=segments,
            token_ids=np.concatenate(token_ids),
            positions=positions_all,
            seq_index=np.concatenate(seq_index),
            slot_mapping=np.concatenate(slots),
            block_tables=block_tables,
            row_starts=np.asarray(row_starts, dtype=np.int64),
            logits_rows=np.asarray(logits_rows, dtype=np.int64),
            max_context=int(positions_all.max()) + 1,
        )
