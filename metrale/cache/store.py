"""Cache storage allocated from a :class:`~metrale.cache.spec.CacheSpec`.

Layouts (``nb`` = usable blocks + 1 dummy, ``bs`` = block size, ``ns`` = state slots + 1 dummy):

* paged K/V layer:      ``k``, ``v``: ``[nb, bs, num_kv_heads, head_dim]``
* paged latent layer:   ``latent``: ``[nb, bs, width]``
* recurrent-state layer: ``conv``: ``[ns, *conv_shape]``, ``state``: ``[ns, *state_shape]`` (both fp32)

The paged arrays hold the backend's ``cache_dtype`` (float32 on the CPU, bf16 bits on the GPU),
or with ``kv_cache_dtype="fp8"`` FP8 E4M3 codes and one float32 scale per token slot and head
(:class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray`): the ops that write and read the cache
quantize and dequantize it.

Buffers are allocated once and never move (captured CUDA graphs read them by address).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from metrale.cache.blocks import DUMMY_BLOCK, BlockAllocator
from metrale.cache.spec import CacheSpec, PagedKVSpec, PagedLatentSpec, RecurrentStateSpec
from metrale.config import check_kv_cache_dtype
from metrale.errors import CacheError, ConfigError
from metrale.kernels.kv_cache_fp8 import FP8_E4M3_NAMES, Fp8CacheArray, cache_rows
from metrale.sequence import SequenceState

#: Bytes of one scale of an FP8 cache (float32).
FP8_SCALE_BYTES = 4


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    """Whether ``kv_cache_dtype`` asks for an FP8 E4M3 cache."""
    return kv_cache_dtype in FP8_E4M3_NAMES


def cache_itemsizes(backend: Any, kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """``(bytes per cached value, bytes per scale)`` of a paged cache of ``kv_cache_dtype`` on
    ``backend``: its ``cache_dtype`` and no scales, or one byte per FP8 code and a float32 scale per
    token slot and head."""
    check_kv_cache_dtype(kv_cache_dtype)
    if not is_fp8_kv_cache(kv_cache_dtype):
        return np.dtype(backend.cache_dtype).itemsize, 0
    return 1, FP8_SCALE_BYTES


@dataclass
class PagedKVLayer:
    """One attention layer's paged keys and values (float arrays, or :class:`Fp8CacheArray`)."""

    spec: PagedKVSpec
    k: Any
    v: Any


@dataclass
class PagedLatentLayer:
    """One MLA layer's paged latents (a float array, or an :class:`Fp8CacheArray`)."""

    spec: PagedLatentSpec
    latent: Any

    def rows(self, slots: Any) -> Any:
        """The latent rows at the flat cache slots ``slots [K]`` -> ``[K, width]`` (float32 from an FP8 cache)."""
        return cache_rows(self.latent, slots)


@dataclass
class RecurrentStateLayer:
    spec: RecurrentStateSpec
    conv: Any
    state: Any


def write_state_rows(layers: list[Any], activate: Callable[[], Any], write: tuple, mirror: list | None = None) -> None:
    """One write to every recurrent layer's conv and state rows, on the backend's stream
    (``activate``): ``("zero", row)`` or ``("copy", source, target)``; recorded in ``mirror``
    too when there is one."""
    if write[0] not in ("zero", "copy"):
        raise CacheError(f"unknown state-row write {write!r}")
    with activate():
        for layer in layers:
            if write[0] == "zero":
                layer.conv[write[1]] = 0
                layer.state[write[1]] = 0
            else:
                layer.conv[write[2]] = layer.conv[write[1]]
                layer.state[write[2]] = layer.state[write[1]]
    if mirror is not None:
        mirror.append(write)


class StateSlotPool:
    """Owner-tracked recurrent-state slots ``1..num_slots`` (0 is the dummy slot).

    A slot is zeroed (every state layer) when it is allocated, owned by exactly one sequence,
    and released exactly once. Like the block allocator, each mutation commits in one statement:
    an interrupt finds a slot either owned (and recorded on its sequence) or free. The zeroing
    runs under ``activate()`` (the backend's stream): after the steps queued before it, which
    may still write the slot's last owner's state.
    """

    def __init__(self, num_slots: int, layers: list[RecurrentStateLayer],
                 activate: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.num_slots = num_slots
        self._layers = layers
        self._activate = activate
        self._owner: dict[int, int] = {}
        self._free = list(range(num_slots, 0, -1))
        #: Where each write to the state rows is also recorded (None: nowhere), for ranks that
        #: hold other parts of the same states (:meth:`ModelCache.apply_state_writes`).
        self.mirror: list | None = None

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
        slot = self._free[-1]
        write_state_rows(self._layers, self._activate, ("zero", slot), self.mirror)
        # Commit.
        self._free[-1:], self._owner[slot], seq.state_slot = [], seq.seq_id, slot
        return slot

    def release(self, seq: SequenceState) -> None:
        slot = seq.state_slot
        if slot is None:
            raise CacheError(f"sequence {seq.seq_id} owns no state slot")
        if self._owner.get(slot) != seq.seq_id:
            raise CacheError(f"state slot {slot} is not owned by sequence {seq.seq_id}")
        # Commit.
        self._free[len(self._free):], seq.state_slot, _ = [slot], None, self._owner.pop(slot)

    def check(self) -> list[str]:
        """Violations of the pool's invariants: every slot is exactly one of owned or free."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("the free list holds a slot twice")
        for slot in range(1, self.num_slots + 1):
            if (slot in free) == (slot in self._owner):
                problems.append(f"slot {slot}: free {slot in free}, owner {self._owner.get(slot)}")
        if 0 in free or 0 in self._owner:
            problems.append("the dummy slot is handed out")
        return problems

    def reset(self) -> None:
        """Free every slot. For an engine with no live sequence, after an interrupted step."""
        self._owner, self._free = {}, list(range(self.num_slots, 0, -1))


class StateSnapshots:
    """Copies of recurrent states taken at block-aligned depths, for prefix-cache hits on models
    with recurrent layers. They live in rows ``num_slots + 1 ..`` of the state layers' arrays,
    after the slots; :meth:`take` copies a slot's conv and recurrent states into a free row (the
    oldest snapshot is dropped when none is free, telling ``on_drop`` first), :meth:`restore`
    copies a row back into a slot; both copies run under ``activate()``, the backend's stream."""

    def __init__(self, first_row: int, count: int, layers: list[RecurrentStateLayer],
                 activate: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.count = count
        self.first_row = first_row
        self._layers = layers
        self._activate = activate
        self._free = list(range(first_row + count - 1, first_row - 1, -1))
        self._taken: list[int] = []  # oldest first
        self._on_drop: Any = None
        #: As :attr:`StateSlotPool.mirror`.
        self.mirror: list | None = None

    @property
    def on_drop(self) -> Any:
        """Called with a row before its snapshot is dropped to make room (held weakly when it
        is a bound method, so its owner forms no reference cycle with the snapshots)."""
        return self._on_drop() if isinstance(self._on_drop, weakref.WeakMethod) else self._on_drop

    @on_drop.setter
    def on_drop(self, callback: Any) -> None:
        self._on_drop = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else callback

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def take(self, slot: int) -> int | None:
        """Snapshot ``slot`` into a row (None when no snapshots are kept)."""
        if not self.count:
            return None
        if not self._free:
            oldest = self._taken[0]
            callback = self.on_drop
            if callback is not None:
                callback(oldest)
            # Commit.
            self._taken[:1], self._free[len(self._free):] = [], [oldest]
        row = self._free[-1]
        write_state_rows(self._layers, self._activate, ("copy", slot, row), self.mirror)
        # Commit.
        self._free[-1:], self._taken[len(self._taken):] = [], [row]
        return row

    def release_rows(self, rows: list[int]) -> None:
        """:meth:`release` each of ``rows`` at once (rows not taken are ignored)."""
        rows = [row for row in dict.fromkeys(rows) if row in self._taken]
        taken = [row for row in self._taken if row not in rows]
        # Commit.
        self._taken, self._free[len(self._free):] = taken, rows

    def restore(self, row: int, slot: int) -> None:
        write_state_rows(self._layers, self._activate, ("copy", row, slot), self.mirror)

    def release(self, row: int) -> None:
        if row in self._taken:
            index = self._taken.index(row)
            # Commit.
            self._taken[index : index + 1], self._free[len(self._free):] = [], [row]

    def check(self) -> list[str]:
        """Violations of the invariants: every row is exactly one of taken or free."""
        rows = set(range(self.first_row, self.first_row + self.count))
        taken, free = set(self._taken), set(self._free)
        problems = []
        if len(taken) != len(self._taken) or len(free) != len(self._free):
            problems.append("a snapshot row is listed twice")
        if taken & free or taken | free != rows:
            problems.append(f"snapshot rows: taken {sorted(taken)}, free {sorted(free)}, expected {sorted(rows)}")
        return problems

    def reset(self, kept: list[int]) -> None:
        """Keep the snapshots in rows ``kept`` (oldest first), free every other row."""
        kept = [row for row in kept if self.first_row <= row < self.first_row + self.count]
        free = [row for row in range(self.first_row + self.count - 1, self.first_row - 1, -1) if row not in kept]
        self._taken, self._free = kept, free


def plan_num_blocks(
    spec: CacheSpec, block_size: int, memory_bytes: int, itemsize: int, max_num_seqs: int, max_model_len: int,
    scale_itemsize: int = 0,
) -> int:
    """Usable blocks: as many as ``memory_bytes`` holds (the dummy block included), capped at what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens can use (each rounds up to whole blocks).
    Never fewer than one. A block's bytes: :meth:`~metrale.cache.spec.CacheSpec.bytes_per_token`
    (values of ``itemsize`` bytes, scales of ``scale_itemsize``) times ``block_size``."""
    bytes_per_block = max(1, spec.bytes_per_token(itemsize, scale_itemsize) * block_size)
    fit = memory_bytes // bytes_per_block - 1
    needed = max_num_seqs * math.ceil(max_model_len / block_size)
    return int(max(1, min(fit, needed)))


@dataclass(frozen=True)
class CachePlan:
    """How big a model's cache is: usable blocks, state slots and snapshots, and its bytes."""

    num_blocks: int
    num_state_slots: int
    num_state_snapshots: int
    num_bytes: int


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def plan_cache(
    spec: CacheSpec,
    *,
    block_size: int,
    itemsize: int,
    num_blocks: int | None,
    memory_bytes: int,
    available_bytes: int | None,
    num_state_slots: int,
    num_state_snapshots: int,
    max_num_seqs: int,
    max_model_len: int,
    scale_itemsize: int = 0,
) -> CachePlan:
    """The cache's size, checked before anything is allocated.

    ``num_blocks`` None derives the block count from ``memory_bytes`` (minus the recurrent-state
    rows: the slots, the dummy slot and the snapshots) with :func:`plan_num_blocks`. Raises
    :class:`~metrale.errors.ConfigError` when the whole cache would need more than
    ``available_bytes`` (the memory the backend can still give; None: unknown). ``itemsize`` and
    ``scale_itemsize`` are the bytes of a cached value and of a scale (:func:`cache_itemsizes`).
    """
    state_bytes = (num_state_slots + 1 + num_state_snapshots) * spec.state_bytes_per_slot()
    if num_blocks is None:
        num_blocks = plan_num_blocks(
            spec, block_size, max(1, memory_bytes - state_bytes), itemsize, max_num_seqs, max_model_len, scale_itemsize
        )
    block_bytes = (num_blocks + 1) * spec.bytes_per_token(itemsize, scale_itemsize) * block_size
    total = block_bytes + state_bytes
    if available_bytes is not None and total > available_bytes:
        raise ConfigError(
            f"the cache needs {_gib(total)} ({num_blocks} blocks of {block_size} tokens: {_gib(block_bytes)}; "
            f"{num_state_slots} state slots and {num_state_snapshots} snapshots: {_gib(state_bytes)}), more than "
            f"the {_gib(available_bytes)} of memory available; lower num_blocks, memory_bytes, max_num_seqs, "
            "num_state_slots or num_state_snapshots"
        )
    return CachePlan(num_blocks, num_state_slots, num_state_snapshots, total)


class ModelCache:
    """The whole cache of a model: storage per layer plus the block and slot bookkeeping.

    ``kv_cache_dtype`` (:data:`~metrale.config.KV_CACHE_DTYPES`) says how the paged layers are stored: ``"auto"``
    in the backend's ``cache_dtype``, ``"fp8"`` / ``"fp8_e4m3"`` as
    :class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray` (quantized with the spec's static scales
    where it has them, per token slot and head otherwise)."""

    def __init__(
        self,
        spec: CacheSpec,
        backend: Any,
        *,
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        num_state_snapshots: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        spec.validate()
        cache_itemsizes(backend, kv_cache_dtype)
        self.spec = spec
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.layers: list[Any] = []
        state_layers: list[RecurrentStateLayer] = []
        self.kv_cache_dtype = kv_cache_dtype
        fp8 = is_fp8_kv_cache(kv_cache_dtype)

        def paged(shape: tuple[int, ...], static_scale: float | None) -> Any:
            if fp8:
                # Codes 0 and scales 1 (an empty cache), in the backend's arrays.
                scales = backend.zeros(shape[:-1], np.float32)
                scales += 1.0
                return Fp8CacheArray(backend.zeros(shape, np.uint8), scales, static_scale)
            return backend.zeros(shape, backend.cache_dtype)

        for layer in spec.layers:
            if isinstance(layer, PagedKVSpec):
                v_dim = layer.v_head_dim or layer.head_dim
                k = paged((num_blocks + 1, block_size, layer.num_kv_heads, layer.head_dim), layer.k_scale)
                v = paged((num_blocks + 1, block_size, layer.num_kv_heads, v_dim), layer.v_scale)
                self.layers.append(PagedKVLayer(layer, k, v))
            elif isinstance(layer, PagedLatentSpec):
                latent = paged((num_blocks + 1, block_size, layer.width), layer.scale)
                self.layers.append(PagedLatentLayer(layer, latent))
            else:
                rows = num_state_slots + 1 + num_state_snapshots
                conv = backend.zeros((rows, *layer.conv_shape), np.float32)
                state = backend.zeros((rows, *layer.state_shape), np.float32)
                state_layer = RecurrentStateLayer(layer, conv, state)
                self.layers.append(state_layer)
                state_layers.append(state_layer)
        self.state_slots = StateSlotPool(num_state_slots, state_layers, backend.activate) if state_layers else None
        self.snapshots = (
            StateSnapshots(num_state_slots + 1, num_state_snapshots, state_layers, backend.activate)
            if state_layers else None
        )
        self._state_layers = state_layers

    # ----------------------------------------------------------------------------- ranks

    def mirror_state_writes(self, log: list | None) -> None:
        """Record every later write to the recurrent state rows (a slot zeroed for a new
        sequence, a snapshot taken or restored) in ``log`` (None: stop), for
        :meth:`apply_state_writes` on the caches of the model's other ranks."""
        for keeper in (self.state_slots, self.snapshots):
            if keeper is not None:
                keeper.mirror = log

    def apply_state_writes(self, writes: list) -> None:
        """Make the writes another rank's cache recorded (:meth:`mirror_state_writes`) here."""
        for write in writes:
            write_state_rows(self._state_layers, self.backend.activate, tuple(write))

    # ----------------------------------------------------------------------------- blocks

    def blocks_needed(self, seq: SequenceState, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold positions ``[0, num_tokens)``."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def reserve(self, seq: SequenceState, num_tokens: int) -> None:
        """Make ``seq``'s block table cover positions ``[0, num_tokens)`` (all or nothing);
        give it a state slot if the model has recurrent layers and it has none."""
        missing = self.blocks_needed(seq, num_tokens) if self.spec.uses_blocks else 0
        slot_pool = self.state_slots if seq.state_slot is None else None  # the pool to take a slot from
        if slot_pool is not None and slot_pool.num_free == 0:
            raise CacheError(f"all {slot_pool.num_slots} recurrent-state slots are in use")
        if missing:
            self.allocator.allocate(missing, into=seq.block_table)
        if slot_pool is not None:
            slot_pool.allocate(seq)

    def release(self, seq: SequenceState) -> None:
        """Return every block and the state slot of ``seq``; resets it to an empty cache."""
        if seq.block_table:
            # Commit (the table empties in the statement that frees its blocks).
            seq.block_table, seq.num_cached, _ = [], 0, self.allocator.free(seq.block_table)
        if self.state_slots is not None and seq.state_slot is not None:
            self.state_slots.release(seq)
        seq.num_cached = 0

    def check(self) -> list[str]:
        """Violations of the invariants of the allocator, the slot pool and the snapshots."""
        problems = list(self.allocator.check())
        if self.state_slots is not None:
            problems += self.state_slots.check()
        if self.snapshots is not None:
            problems += self.snapshots.check()
        return problems

    def holdings(self) -> tuple[int, int]:
        """(blocks in use, state slots in use)."""
        slots = self.state_slots.num_slots - self.state_slots.num_free if self.state_slots is not None else 0
        return self.allocator.num_in_use, slots

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
