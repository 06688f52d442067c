"""The ``mtp`` drafter: a checkpoint's multi-token-prediction module proposes the drafts
(:ref:`families-mtp`; DeepSeek-V3 in the MLA family, Qwen3-Next in the GDN family).

The module's row at position ``i`` reads the main model's final state ``h_i`` and the token
``t_{i+1}`` and predicts ``t_{i+2}``; its decoder layer attends over a cache layer of its own
(the cache's last, added by the model's ``prepare_speculation``), where the rows before it wrote
theirs. So the drafter keeps, per sequence, how far that layer holds the true rows (``filled``)
and the main model's states it has not used yet:

* every forward leaves the final states of its rows (:attr:`~metrale.model.family.FamilyModel.step_outputs`),
  which :meth:`MtpDrafter.observe` copies per sequence (a verify's rows past the kept ones are
  dropped when the next call starts there);
* :meth:`MtpDrafter.catch_up` runs the module over every position from ``filled`` up to the last
  cached one (its next token known): after a prompt's last chunk (the drafter stage) and at each
  proposal;
* :meth:`MtpDrafter.propose` then takes the last position's prediction as the first draft and
  feeds each draft back with the module's own output state as ``h`` (one module, reused), writing
  the module's cache past ``filled``: the next catch-up overwrites those rows with the true ones.

Drafts are the module's greedy tokens: one token per position, which keeps speculation exact
(:mod:`metrale.speculative`). A sequence whose states went missing (rows decoded while it took no
drafts, a prefix-cache hit) restarts from the next rows it has; its drafts may suffer, never its
tokens.

A model serves the drafter when its ``prepare_speculation`` accepted the method (its
``mtp_drafting`` is then true), its forward leaves ``step_outputs["hidden"]`` (every row's final
state) and hands the rows to :meth:`MtpDrafter.observe` from ``after_run`` (and
:meth:`MtpDrafter.catch_up` from ``prime_drafter``) through its ``mtp_rows``, and its
``mtp_forward(batch, hidden)`` runs the module: ``(logits [rows, V], output states [rows, H])``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from metrale.batch import ForwardBatch, Segment
from metrale.errors import ConfigError, OutOfCacheBlocksError
from metrale.model.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.runner.graphs import as_decode_rows

METRALE_CONTRACT_VERSION = CONTRACT_VERSION

#: Final states a sequence keeps before the module catches up on them (their memory's bound).
MAX_KEPT_STATES = 256


@dataclass
class SequenceRows:
    """What the drafter keeps of one sequence: the module's cache holds true rows for positions
    ``[0, filled)`` (or from where the drafter first saw it); ``states`` the main model's final
    states of later positions as ``(first position, [rows, H])`` chunks; ``last`` the module's
    output at position ``filled - 1`` (its state and greedy token), the first draft."""

    filled: int
    states: list[tuple[int, Any]] = field(default_factory=list)
    last: tuple[int, Any, int] | None = None

    def forget_from(self, position: int) -> None:
        """Drop what a call starting at ``position`` recomputes (a rewound verify, a preempted
        sequence computed again)."""
        kept = []
        for start, rows in self.states:
            if start < position:
                kept.append((start, rows[: position - start]))
        self.states = kept
        self.filled = min(self.filled, position)
        if self.last is not None and self.last[0] >= position:
            self.last = None

    def state_rows(self, start: int, end: int, xp: Any) -> tuple[int, Any] | None:
        """``(first, rows)``: the kept states of the longest run of positions from the first kept
        one at or after ``start``, up to ``end``; None when none is kept."""
        chunks = sorted((s, rows) for s, rows in self.states if s + rows.shape[0] > start and s < end)
        if not chunks:
            return None
        first = max(start, chunks[0][0])
        parts, position = [], first
        for chunk_start, rows in chunks:
            if chunk_start > position:
                break
            parts.append(rows[position - chunk_start : end - chunk_start])
            position = chunk_start + rows.shape[0]
            if position >= end:
                break
        return first, parts[0] if len(parts) == 1 else xp.concatenate(parts)


class MtpDrafter:
    """Proposes drafts with ``model``'s MTP module (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: dict[int, SequenceRows] = {}

    # ------------------------------------------------------------------------------ states

    def observe(self, segments: Sequence[Segment], batch: ForwardBatch, hidden: Any) -> None:
        """Keep the final states ``hidden`` (rows of ``batch``, in order) of each segment's rows; a
        sequence that keeps more than :data:`MAX_KEPT_STATES` (a long prompt's chunks, decode
        steps that take no drafts) has the module caught up on them at once."""
        backend = self.model.backend
        overfull = []
        with backend.activate():  # (on the forward's stream: the states are its output)
            for index, segment in enumerate(segments):
                seq = segment.seq
                first, last = int(batch.row_starts[index]), int(batch.row_starts[index + 1])
                rows = self.rows.get(seq.seq_id)
                if rows is None:
                    rows = self.rows[seq.seq_id] = SequenceRows(filled=segment.start)
                    weakref.finalize(seq, self.rows.pop, seq.seq_id, None)
                rows.forget_from(segment.start)
                rows.states.append((segment.start, backend.xp.array(hidden[first:last], copy=True)))
                if sum(kept.shape[0] for _, kept in rows.states) > MAX_KEPT_STATES:
                    overfull.append(seq)
        if overfull:
            self.catch_up(overfull)

    def catch_up(self, seqs: Sequence[Any]) -> None:
        """Run the module over each sequence's kept positions from ``filled`` on, up to its last
        cached one whose next token is known (a prompt's last row waits for its sampled token);
        each sequence's last row becomes its ``last``."""
        segments, states = [], []
        xp = self.model.backend.xp
        for seq in seqs:
            rows = self.rows.get(seq.seq_id)
            end = min(seq.num_cached, len(seq.tokens) - 1)  # the positions whose next token is known
            if rows is None or rows.filled >= end:
                continue
            with self.model.backend.activate():
                found = rows.state_rows(rows.filled, end, xp)
            if found is None:
                continue
            first, hidden = found
            count = hidden.shape[0]
            segments.append(Segment(seq, list(seq.tokens[first + 1 : first + count + 1]), first, "all"))
            states.append(hidden)
        if not segments:
            return
        with self.model.backend.activate():
            hidden = xp.concatenate(states) if len(states) > 1 else states[0]
        logits, outputs = self.run(segments, hidden)
        tokens = self._greedy(logits)
        row = 0
        for segment in segments:
            rows = self.rows[segment.seq.seq_id]
            end = segment.start + len(segment.token_ids)
            row += len(segment.token_ids)
            rows.filled = end
            rows.states = [(max(s, end), r[max(0, end - s):]) for s, r in rows.states if s + r.shape[0] > end]
            rows.last = (end - 1, outputs[row - 1 : row], tokens[row - 1])

    # --------------------------------------------------------------------------- drafting

    def propose(self, seqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        self.catch_up([seq for seq, limit in zip(seqs, limits) if limit > 0])
        active = []  # (index in seqs, room for drafts, the row the next draft feeds in)
        for index, (seq, limit) in enumerate(zip(seqs, limits)):
            rows = self.rows.get(seq.seq_id)
            if limit <= 0 or rows is None or rows.last is None or rows.last[0] != seq.num_cached - 1:
                continue
            drafts[index].append(int(rows.last[2]))
            room = self._room(seq, limit)
            if room > 1:
                active.append((index, room, rows.last[1]))
        xp = self.model.backend.xp
        step = 1
        while active:
            # Draft j + 1 of each sequence: its draft j at position num_cached + j - 1, fed back
            # with the module's output state there.
            segments = [Segment(seqs[i], [drafts[i][-1]], seqs[i].num_cached + step - 1, "all") for i, _, _ in active]
            with self.model.backend.activate():
                states = xp.concatenate([state for _, _, state in active])
            logits, outputs = self.run(segments, states)
            tokens = self._greedy(logits)
            step += 1
            carried = []
            for row, (index, room, _) in enumerate(active):
                drafts[index].append(int(tokens[row]))
                if len(drafts[index]) < room:
                    carried.append((index, room, outputs[row : row + 1]))
            active = carried
        return drafts

    def _room(self, seq: Any, wanted: int) -> int:
        """How many of ``wanted`` drafts ``seq`` can take: draft ``j`` (from 1) runs the module at
        position ``num_cached + j - 2``, so its blocks are reserved here (fewer drafts where the
        cache has no room)."""
        cache = self.model.cache
        end = seq.num_cached + wanted - 1
        try:
            cache.reserve(seq, end)
        except OutOfCacheBlocksError:
            end = min(end, len(seq.block_table) * cache.block_size)
        return max(1, min(wanted, end - seq.num_cached + 1))

    def _greedy(self, logits: Any) -> list[int]:
        with self.model.backend.activate():
            host = logits.get() if hasattr(logits, "get") else np.asarray(logits)
        return np.argmax(host, axis=1).tolist()

    # ------------------------------------------------------------------------------ module

    def run(self, segments: list[Segment], hidden: Any) -> tuple[Any, Any]:
        """The module over ``segments`` (each row's token is ``t_{i+1}``, its position ``i``) with
        the states ``hidden`` ``[rows, H]`` (one per row, in order): ``(logits [rows, V], the
        module's output states [rows, H] float32)``. The rows run as decode rows of their own
        (:func:`~metrale.runner.graphs.as_decode_rows`), each attending over the module's cache
        up to its position."""
        model = self.model
        backend = model.backend
        # The other ranks of a tensor-parallel group run the module too (its collectives meet).
        ranks = getattr(getattr(model, "runner", None), "ranks", None)
        with backend.activate():
            built = ForwardBatch.build(segments, model.cache.block_size)
            batch = backend.prepare_batch(as_decode_rows(built))
            if getattr(hidden, "dtype", None) != np.float32:
                hidden = backend.ops.to_float32(hidden)
            if ranks is None:
                return model.mtp_forward(batch, hidden)
            ranks.drafter_forward(built, backend.to_numpy(hidden))
            try:
                result = model.mtp_forward(batch, hidden)
            except BaseException as error:
                ranks.abandon(error)
                raise
            ranks.finish(backend)
            return result


def mtp_drafter(config: Any, model: Any) -> MtpDrafter:
    """The ``mtp`` drafter factory for a model prepared for it (see the module docstring)."""
    if not getattr(model, "mtp_drafting", False):
        raise ConfigError(f"the mtp drafter needs a model with a multi-token-prediction module (DeepSeek-V3, "
                          f"Qwen3-Next), prepared for it; {type(model).__name__} is not")
    drafter = MtpDrafter(model)
    model.mtp_rows = drafter
    return drafter


@hookimpl
def metrale_drafters() -> dict[str, Any]:
    return {"mtp": mtp_drafter}
