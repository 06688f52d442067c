"""Flat (varlen) batches: every forward call becomes one :class:`ForwardBatch`.

A batch concatenates the new tokens of one or more sequences (segments). Per row it records the
absolute position, the segment, and the cache slot the row's KV goes to; it also lists the rows
whose logits the call returns. Layer code runs its matrix products over all rows at once and its
attention per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from metrale.errors import CacheError
from metrale.kernels.lora_tiles import adapter_tiles
from metrale.sequence import MIXED_ADAPTERS, Segment

__all__ = ["ForwardBatch", "adapter_route"]  # (Segment, of metrale.sequence, is importable from here too)


@dataclass
class ForwardBatch:
    """Row-level metadata of one forward call (``N`` rows, ``S`` segments).

    ``token_ids``, ``positions``, ``seq_index``, ``slot_mapping``: ``[N]`` int64;
    ``block_tables``: ``[S, max_blocks]`` int64 (padded with the dummy block 0);
    ``row_starts``: ``[S + 1]``; ``logits_rows``: rows whose logits are returned, in order.
    ``max_context`` bounds every row's ``position + 1`` (it sizes the attention's key splits).
    ``state_slots``: ``[S]`` int64, each segment's recurrent-state slot (0, the dummy slot, for
    sequences without one and for padding). ``every_row_logits``: ``logits_rows`` is known to be
    ``0 .. N - 1`` (a decode step, a verify of one sequence): the rows need no gathering.
    ``adapter_slots``: ``[N]`` int64, each row's LoRA adapter slot (0: the base model), None when
    every row runs the base model; ``adapter_route``: the step's route
    (:func:`metrale.batch.adapter_route`: None, one slot, or
    :data:`~metrale.sequence.MIXED_ADAPTERS`); ``adapter_tiles``: the rows grouped by slot
    (:func:`metrale.kernels.lora_tiles.adapter_tiles`), with ``adapter_slots``, for the op ``lora_expand``.
    ``final_states``: the rows of ``logits_rows`` return their final normed states (float32
    ``[rows, hidden_size]``, :meth:`~metrale.layers.loading.DecoderEnds.logits`) instead of their
    logits: a step of pooling requests' chunks, run eagerly (never from a CUDA graph).
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
    state_slots: np.ndarray | None = None
    extras: dict = field(default_factory=dict)
    every_row_logits: bool = False
    adapter_slots: np.ndarray | None = None
    adapter_route: int | str | None = None
    adapter_tiles: np.ndarray | None = None
    final_states: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def build(cls, segments: list[Segment], block_size: int) -> "ForwardBatch":
        """Lay out ``segments`` (whose sequences already hold enough cache blocks)."""
        if not segments:
            raise CacheError("a forward batch needs at least one segment")
        if all(len(s.token_ids) == 1 and s.logits == "last" for s in segments):
            batch = cls._build_decode(segments, block_size)
        else:
            batch = cls._build_rows(segments, block_size)
        if any(s.seq.adapter_slot for s in segments):
            per_segment = np.fromiter((s.seq.adapter_slot or 0 for s in segments), dtype=np.int64, count=len(segments))
            batch.adapter_slots = per_segment[batch.seq_index]
            batch.adapter_route = adapter_route(batch.adapter_slots)
            batch.adapter_tiles = adapter_tiles(batch.adapter_slots)
        return batch

    @classmethod
    def _build_rows(cls, segments: list[Segment], block_size: int) -> "ForwardBatch":
        """:meth:`build` for any segments."""
        count = len(segments)
        lengths = np.fromiter((len(s.token_ids) for s in segments), dtype=np.int64, count=count)
        if not lengths.all():
            index = int(np.argmin(lengths))
            raise CacheError(f"segment {index} of sequence {segments[index].seq.seq_id} has no tokens")
        tables = [s.seq.block_table for s in segments]
        max_blocks = max(max(len(table) for table in tables), 1)
        block_tables = np.zeros((count, max_blocks), dtype=np.int64)
        for index, (segment, table) in enumerate(zip(segments, tables)):
            if segment.end > len(table) * block_size:
                raise CacheError(
                    f"sequence {segment.seq.seq_id} holds {len(table)} blocks, "
                    f"too few for position {segment.end - 1}"
                )
            block_tables[index, : len(table)] = table
        rows = int(lengths.sum())
        row_starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=row_starts[1:])
        starts = np.fromiter((s.start for s in segments), dtype=np.int64, count=count)
        seq_index = np.repeat(np.arange(count, dtype=np.int64), lengths)
        positions = np.arange(rows, dtype=np.int64) + np.repeat(starts - row_starts[:-1], lengths)
        token_ids = np.fromiter((token for s in segments for token in s.token_ids), dtype=np.int64, count=rows)
        slot_mapping = block_tables[seq_index, positions // block_size] * block_size + positions % block_size
        logits_rows: list[int] = []
        for index, segment in enumerate(segments):
            if segment.logits == "last":
                logits_rows.append(int(row_starts[index + 1]) - 1)
            elif segment.logits == "all":
                logits_rows.extend(range(int(row_starts[index]), int(row_starts[index + 1])))
        return cls(
            segments=segments,
            token_ids=token_ids,
            positions=positions,
            seq_index=seq_index,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            row_starts=row_starts,
            logits_rows=np.asarray(logits_rows, dtype=np.int64),
            max_context=int(positions.max()) + 1,
            state_slots=_state_slots(segments),
            every_row_logits=len(logits_rows) == rows and all(s.logits == "all" for s in segments),
        )

    @classmethod
    def _build_decode(cls, segments: list[Segment], block_size: int) -> "ForwardBatch":
        """:meth:`build` for one new token per segment with its logits (a decode step): the same
        batch, from each sequence's cached block array (:meth:`SequenceState.block_array`) and
        whole-batch NumPy calls (per-row ones cost more than they save here)."""
        count = len(segments)
        tables = [s.seq.block_array() for s in segments]
        positions = np.fromiter((s.start for s in segments), dtype=np.int64, count=count)
        lengths = np.fromiter(map(len, tables), dtype=np.int64, count=count)
        short = positions >= lengths * block_size
        if short.any():
            index = int(np.argmax(short))
            raise CacheError(f"sequence {segments[index].seq.seq_id} holds {int(lengths[index])} blocks, too few for "
                             f"position {int(positions[index])}")
        width = max(int(lengths.max()), 1)
        block_tables = np.zeros((count, width), dtype=np.int64)
        block_tables[np.arange(width) < lengths[:, None]] = np.concatenate(tables)
        rows = np.arange(count, dtype=np.int64)
        return cls(
            segments=segments,
            token_ids=np.fromiter((s.token_ids[0] for s in segments), dtype=np.int64, count=count),
            positions=positions,
            seq_index=rows,
            slot_mapping=block_tables[rows, positions // block_size] * block_size + positions % block_size,
            block_tables=block_tables,
            row_starts=np.arange(count + 1, dtype=np.int64),
            logits_rows=rows.copy(),
            max_context=int(positions.max()) + 1,
            state_slots=_state_slots(segments),
            every_row_logits=True,
        )


def _state_slots(segments: list[Segment]) -> np.ndarray:
    return np.array([s.seq.state_slot or 0 for s in segments], dtype=np.int64)


def adapter_route(slots: np.ndarray) -> int | str | None:
    """The adapter route of a step whose rows have adapter ``slots`` (0: the base model): None
    when every row runs the base model, the slot when every row runs one adapter, else
    :data:`~metrale.sequence.MIXED_ADAPTERS`."""
    if slots.size == 0 or not slots.any():
        return None
    first = int(slots[0])
    return first if (slots == first).all() else MIXED_ADAPTERS
