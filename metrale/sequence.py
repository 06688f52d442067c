"""The per-sequence state and the argument / result types of the forward contract."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

_sequence_ids = itertools.count()


@dataclass(eq=False)
class SequenceState:
    """Everything the engine keeps for one sequence between forward calls.

    ``tokens`` holds the prompt followed by every generated token. ``num_cached`` counts the
    tokens whose KV (or recurrent state) is already in the cache; a forward call that consumes
    ``n`` new tokens advances it by ``n``. ``seq_len`` is the same count under the forward
    contract's name. ``block_table[i]`` is the cache block that holds positions
    ``[i * block_size, (i + 1) * block_size)``.
    """

    tokens: list[int]
    prompt_len: int
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    #: LoRA adapter slot on the device (:class:`~metrale.engine.lora_slots.LoraManager`), None when the base
    #: model serves this sequence.
    adapter_slot: int | None = None
    #: The adapter's ``lora_int_id`` (None: the base model): what the prefix cache keys blocks
    #: by, since a slot holds different adapters over time.
    adapter_id: int | None = None
    #: Recurrent-state slot (GDN conv + delta-rule state), None for families without one.
    state_slot: int | None = None
    #: Tokens a speculative drafter proposed that are not yet verified.
    draft_tokens: list[int] = field(default_factory=list)
    #: Generation counter that claims the shared hidden-capture slot on the first chunk.
    capture_generation: int | None = None
    #: Rows accepted by a verify but not yet folded into the recurrent state (the flush stage
    #: folds them).
    pending_flush: Any = None
    #: The token at position ``num_cached`` when it was sampled on the device by a step still in
    #: flight and is not in ``tokens`` yet (overlap scheduling): ``(sampled, row)``, row ``row``
    #: of that step's :class:`~metrale.runner.sampling.SampledTokens`. A decode call then gets a
    #: placeholder token for this sequence, and the model runner feeds the real one on the device
    #: (op ``feed_tokens``). None otherwise.
    pending_token: tuple[Any, int] | None = None
    #: (the block-table list, its blocks as an int64 array): :meth:`block_array`'s cache.
    _block_array: tuple[list[int], np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def from_prompt(cls, prompt: list[int], **kwargs: Any) -> "SequenceState":
        return cls(tokens=list(prompt), prompt_len=len(prompt), **kwargs)

    @property
    def seq_len(self) -> int:
        """The forward contract's name of :attr:`num_cached` (tokens already in the cache)."""
        return self.num_cached

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        self.num_cached = value

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def block_array(self) -> np.ndarray:
        """:attr:`block_table` as an int64 array (do not modify it).

        Made again only when the table changed: a table only grows at its end or is replaced by
        another list, so the cached array stays right while it is the same list object (held
        here, so its identity cannot be reused) of the same length; a grown table appends only
        its new blocks."""
        table, cached = self.block_table, self._block_array
        if cached is not None and cached[0] is table:
            known = cached[1]
            if len(known) == len(table):
                return known
            if len(known) < len(table):
                array = np.concatenate((known, np.asarray(table[len(known):], dtype=np.int64)))
                self._block_array = (table, array)
                return array
        array = np.asarray(table, dtype=np.int64)
        self._block_array = (table, array)
        return array


@dataclass
class PrefillSlice:
    """One sequence's chunk in a batched prefill: ``tokens[chunk_start:chunk_start+chunk_len]``
    of the full prompt ``tokens`` runs; ``is_last_chunk`` asks for logits."""

    tokens: list[int]
    seq: SequenceState
    chunk_start: int
    chunk_len: int
    is_last_chunk: bool


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
class MixedForwardResult:
    """Result of ``mixed_forward``: ``decode_logits`` is ``[n_decode, vocab]`` (row i for
    ``decode_seqs[i]``); ``prefill_logits`` is ``[1, vocab]`` when the chunk was the last, else
    None. Their rows never overlap."""

    decode_logits: Any
    prefill_logits: Any | None


#: Adapter route stamped when the rows of one step use different adapters (or some the base
#: model): the per-row path, whose kernels read each row's slot (token overlays included).
MIXED_ADAPTERS = "mixed-adapters"

#: The forward methods after which the drafter may run (when their chunk is the last).
PREFILL_LIKE_METHODS = frozenset({"prefill", "prefill_chunk", "prefill_twophase", "mixed_forward"})


@dataclass
class ForwardStep:
    """What the stage hooks see of one forward call.

    ``method`` is the contract method's name, ``seqs`` every sequence the call touches (decode
    rows first, then prefill), ``is_last_chunk`` whether a prefill-like call finishes its prompt,
    ``stream`` the engine stream (None on the CPU). Stamp plugins record routing in ``stamps``.
    ``segments`` are the call's rows as the engine planned them (each sequence's new tokens and
    the logits it wants, :class:`Segment`), passed on to the dispatch hooks that take them; None
    for a call made through a contract method directly (the family derives its own).
    """

    method: str
    seqs: list[SequenceState]
    stream: Any = None
    is_last_chunk: bool = False
    stamps: dict[str, Any] = field(default_factory=dict)
    segments: list[Segment] | None = None

    @property
    def runs_drafter(self) -> bool:
        """True when a successful call of this step must be followed by the drafter stage."""
        return self.method in PREFILL_LIKE_METHODS and self.is_last_chunk
