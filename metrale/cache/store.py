"""Cache storage allocated from a :class:`~metrale.cache.spec.CacheSpec`.

Layouts (``nb`` = usable blocks + 1 dummy, ``bs`` = block size, ``ns`` = state slots + 1 dummy):

* paged K/V layer:      ``k``, ``v``: ``[nb, bs, num_kv_heads, head_dim]``
* paged latent layer:   ``latent``: ``[nb, bs, width]``
* recurrent-state layer: ``conv``: ``[ns, *conv_shape]``, ``state``: ``[ns, *state_shape]`` (both fp32)

Buffers are allocated once and never move (captured CUDA graphs read them by address).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.cache.blocks import DUMMY_BLOCK, BlockAllocator
from metrale.cache.spec import CacheSpec, PagedKVSpec, PagedLatentSpec, RecurrentStateSpec
from metrale.errors import CacheError
from metrale.sequence import SequenceState

#: Slot id reserved for padding rows of a batch.
DUMMY_STATE_SLOT = 0


@dataclass
class PagedKVLayer:
    spec: PagedKVSpec
    k: Any
    v: Any


@dataclass
class PagedLatentLayer:
    spec: PagedLatentSpec
    latent: Any


@dataclass
class RecurrentStateLayer:
    spec: RecurrentStateSpec
    conv: Any
    state: Any


class StateSlotPool:
    """Owner-tracked recurrent-state slots ``1..num_slots`` (0 is the dummy slot).

    A slot is zeroed (every state layer) when it is allocated, owned by exactly one sequence,
    and released exactly once.
    """

    def __init__(self, num_slots: int, layers: list[RecurrentStateLayer]) -> None:
        self.num_slots = num_slots
        self._layers = layers
        self._owner: dict[int, int] = {}
        self._free = list(range(num_slots, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owner(self, slot: int) -> int | None:
        return self._owner.get(slot)

    def allocate(self, seq: SequenceState) -> int:
        if seq.state_slot is not None:
            raise CacheError(f"sequence {seq.seq_id} already owns state slot {seq.state_slot}")
        if not self._free:
            raise CacheError(f"all {self.num_slots} recurrent-state slots are in use")
        slot = self._free.pop()
        for layer in self._layers:
            layer.conv[slot] = 0
            layer.state[slot] = 0
        self._owner[slot] = seq.seq_id
        seq.state_slot = slot
        return slot

    def release(self, seq: SequenceState) -> None:
        slot = seq.state_slot
        if slot is None:
            raise CacheError(f"sequence {seq.seq_id} owns no state slot")
        if self._owner.get(slot) != seq.seq_id:
            raise CacheError(f"state slot {slot} is not owned by sequence {seq.seq_id}")
        del self._owner[slot]
        self._free.append(slot)
        seq.state_slot = None


class StateSnapshots:
    """Copies of recurrent states taken at block-aligned depths, for prefix-cache hits on models
    with recurrent layers. They live in rows ``num_slots + 1 ..`` of the state layers' arrays,
    after the slots; :meth:`take` copies a slot's conv and recurrent states into a free row (the
    oldest snapshot is dropped when none is free, telling ``on_drop``), :meth:`restore` copies a
    row back into a slot."""

    def __init__(self, first_row: int, count: int, layers: list[RecurrentStateLayer]) -> None:
        self.count = count
        self._layers = layers
        self._free = list(range(first_row + count - 1, first_row - 1, -1))
        self._taken: list[int] = []  # oldest first
        #: Called with a row when its snapshot is dropped to make room.
        self.on_drop: Any = None

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def take(self, slot: int) -> int | None:
        """Snapshot ``slot`` into a row (None when no snapshots are kept)."""
        if not self.count:
            return None
        if not self._free:
            oldest = self._taken.pop(0)
            if self.on_drop is not None:
                self.on_drop(oldest)
            self._free.append(oldest)
        row = self._free.pop()
        for layer in self._layers:
            layer.conv[row] = layer.conv[slot]
            layer.state[row] = layer.state[slot]
        self._taken.append(row)
        return row

    def restore(self, row: int, slot: int) -> None:
        for layer in self._layers:
            layer.conv[slot] = layer.conv[row]
            layer.state[slot] = layer.state[row]

    def release(self, row: int) -> None:
        if row in self._taken:
            self._taken.remove(row)
            self._free.append(row)


def plan_num_blocks(
    spec: CacheSpec, block_size: int, memory_bytes: int, itemsize: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Usable blocks: as many as ``memory_bytes`` holds (the dummy block included), capped at what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens can use (each rounds up to whole blocks).
    Never fewer than one."""
    bytes_per_block = max(1, spec.values_per_token() * block_size * itemsize)
    fit = memory_bytes // bytes_per_block - 1
    needed = max_num_seqs * math.ceil(max_model_len / block_size)
    return int(max(1, min(fit, needed)))


class ModelCache:
    """The whole cache of a model: storage per layer plus the block and slot bookkeeping."""

    def __init__(
        self,
        spec: CacheSpec,
        backend: Any,
        *,
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        num_state_snapshots: int = 0,
    ) -> None:
        spec.validate()
        self.spec = spec
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.layers: list[Any] = []
        state_layers: list[RecurrentStateLayer] = []
        dtype = backend.cache_dtype
        for layer in spec.layers:
            if isinstance(layer, PagedKVSpec):
                v_dim = layer.v_head_dim or layer.head_dim
                k = backend.zeros((num_blocks + 1, block_size, layer.num_kv_heads, layer.head_dim), dtype)
                v = backend.zeros((num_blocks + 1, block_size, layer.num_kv_heads, v_dim), dtype)
                self.layers.append(PagedKVLayer(layer, k, v))
            elif isinstance(layer, PagedLatentSpec):
                latent = backend.zeros((num_blocks + 1, block_size, layer.width), dtype)
                self.layers.append(PagedLatentLayer(layer, latent))
            else:
                rows = num_state_slots + 1 + num_state_snapshots
                conv = backend.zeros((rows, *layer.conv_shape), np.float32)
                state = backend.zeros((rows, *layer.state_shape), np.float32)
                state_layer = RecurrentStateLayer(layer, conv, state)
                self.layers.append(state_layer)
                state_layers.append(state_layer)
        self.state_slots = StateSlotPool(num_state_slots, state_layers) if state_layers else None
        self.snapshots = (
            StateSnapshots(num_state_slots + 1, num_state_snapshots, state_layers) if state_layers else None
        )

    # ----------------------------------------------------------------------------- blocks

    def blocks_needed(self, seq: SequenceState, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold positions ``[0, num_tokens)``."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def reserve(self, seq: SequenceState, num_tokens: int) -> None:
        """Make ``seq``'s block table cover positions ``[0, num_tokens)`` (all or nothing);
        give it a state slot if the model has recurrent layers and it has none."""
        missing = self.blocks_needed(seq, num_tokens) if self.spec.uses_blocks else 0
        needs_slot = self.state_slots is not None and seq.state_slot is None
        if needs_slot and self.state_slots.num_free == 0:
            raise CacheError(f"all {self.state_slots.num_slots} recurrent-state slots are in use")
        if missing:
            seq.block_table.extend(self.allocator.allocate(missing))
        if needs_slot:
            self.state_slots.allocate(seq)

    def release(self, seq: SequenceState) -> None:
        """Return every block and the state slot of ``seq``; resets it to an empty cache."""
        if seq.block_table:
            blocks, seq.block_table = seq.block_table, []
            self.allocator.free(blocks)
        if self.state_slots is not None and seq.state_slot is not None:
            self.state_slots.release(seq)
        seq.seq_len = 0

    def slot_mapping(self, seq: SequenceState, start: int, end: int) -> np.ndarray:
        """Flat cache slots (``block * block_size + offset``) of positions ``[start, end)``."""
        positions = np.arange(start, end, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        if end > len(table) * self.block_size:
            raise CacheError(
                f"sequence {seq.seq_id} has {len(table)} blocks, too few for position {end - 1}"
            )
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def dummy_block(self) -> int:
        return DUMMY_BLOCK
