"""The LoRA adapter slots of the engine (:class:`LoraManager`): which adapter each device slot
holds, and which running sequences hold each slot."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale.errors import AdapterError
from metrale.layers.lora_stacks import LoraLayout
from metrale.loading.lora import (
    ADAPTER_CONFIG,
    LoraAdapter,
    LoRARequest,
    load_adapter,
    names_the_served_model,
    served_model_names,
)

if TYPE_CHECKING:
    from metrale.loading.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


class LoraManager:
    """The adapter slots of one model (``max_loras`` of them, each holding one adapter on the
    device) and the adapters read so far.

    :meth:`resolve` reads and checks a request's adapter (once per ``lora_int_id``);
    :meth:`acquire` gives a sequence the slot that holds its adapter, writing it into the least
    recently used free slot when no slot holds it; :meth:`release` returns it. A slot a running
    sequence holds is never overwritten: when every slot is held by other adapters,
    :meth:`acquire` answers None and the request waits.

    ``served_model`` is the checkpoint the adapters are served on: an adapter whose
    ``base_model_name_or_path`` names another model (:func:`names_the_served_model`) is served,
    with one warning per adapter folder (an adapter of a fine-tuned sibling may be meant for it).
    """

    def __init__(self, backend: Any, layout: LoraLayout, *, max_lora_rank: int, vocab_size: int,
                 served_model: "Checkpoint | None" = None, ranks: Any = None) -> None:
        self.backend = backend
        #: The model's other ranks (:class:`~metrale.backends.executor.RankExecutor`), None on one
        #: rank: each slot write is sent to them, and each writes its part of the adapter.
        self.ranks = ranks
        self.layout = layout
        self.max_loras = layout.num_slots - 1
        self.max_lora_rank = max_lora_rank
        self.num_layers = 1 + max((layer for layer, _ in layout.stacks), default=-1)
        self.vocab_size = vocab_size
        self.hidden_size = next((int(rows.rows.shape[2]) for rows in layout.token_rows.values()), 0)
        self._adapters: dict[int, LoraAdapter] = {}
        #: slot -> the lora_int_id it holds (absent: empty); holds per slot; use order (LRU first).
        self._held_by: dict[int, int] = {}
        self._holders = [0] * (self.max_loras + 1)
        self._order: list[int] = list(range(1, self.max_loras + 1))
        self._served = {(layer, name) for layer, stack in layout.stacks for name in stack.names}
        self.served_model = served_model
        self._served_model_names = served_model_names(served_model) if served_model is not None else None
        #: The adapter folders already warned about (their base model is another one).
        self._warned_folders: set[Path] = set()

    def resolve(self, request: LoRARequest) -> LoraAdapter:
        """The adapter of ``request``, read and checked (:class:`~metrale.errors.AdapterError`
        for one this model cannot serve, or a ``lora_int_id`` already used for another adapter)."""
        known = self._adapters.get(request.lora_int_id)
        if known is not None:
            if known.name != request.lora_name or Path(known.path) != Path(request.lora_path):
                raise AdapterError(f"lora_int_id {request.lora_int_id} already names adapter {known.name!r} at "
                                   f"{known.path}; give {request.lora_name!r} another id")
            return known
        adapter = load_adapter(request, self.layout.targets(), num_layers=self.num_layers,
                               vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                               max_lora_rank=self.max_lora_rank, refused=self.layout.refused, served=self._served)
        for layer, name in adapter.modules:
            if (layer, name) not in self._served:
                raise AdapterError(f"{request.lora_path}: LoRA on layer {layer}'s {name} is not served (that layer "
                                   "has no such projection)")
        for matrix, (ids, _) in adapter.token_rows.items():
            if matrix not in self.layout.token_rows:
                raise AdapterError(f"{request.lora_path}: replacing {matrix} rows is not served for this model")
            if len(ids) > int(self.layout.token_rows[matrix].tokens.shape[1]):
                raise AdapterError(f"{request.lora_path}: {len(ids)} {matrix} rows, more than the "
                                   f"{int(self.layout.token_rows[matrix].tokens.shape[1])} an adapter may replace")
        self._warn_of_another_base_model(adapter)
        self._adapters[request.lora_int_id] = adapter
        return adapter

    def _warn_of_another_base_model(self, adapter: LoraAdapter) -> None:
        """One warning per adapter folder whose ``base_model_name_or_path`` names another model
        than the served one (none when either is unknown)."""
        named = adapter.base_model_name_or_path
        if not named or self.served_model is None or self._served_model_names is None:
            return
        folder = Path(adapter.path).resolve()
        if folder in self._warned_folders or names_the_served_model(named, self._served_model_names):
            return
        self._warned_folders.add(folder)
        logger.warning("LoRA adapter %r (%s) was trained on %r (base_model_name_or_path in its %s), not on the "
                       "served model %s: it is served, but its outputs may not be what it was trained for",
                       adapter.name, adapter.path, named, ADAPTER_CONFIG, self.served_model.path)

    def slot_of(self, int_id: int) -> int | None:
        """The slot that holds adapter ``int_id`` now, or None."""
        return next((slot for slot, held in self._held_by.items() if held == int_id), None)

    def acquire(self, request: LoRARequest) -> int | None:
        """A hold on the slot of ``request``'s adapter (written there first if no slot holds it),
        or None when every slot is held by sequences of other adapters."""
        adapter = self.resolve(request)
        slot = self.slot_of(adapter.int_id)
        if slot is None:
            slot = next((s for s in self._order if self._holders[s] == 0), None)
            if slot is None:
                return None
            self._write(slot, adapter)
        self._holders[slot] += 1
        self._order.remove(slot)
        self._order.append(slot)
        return slot

    def release(self, slot: int) -> None:
        """Drop one hold on ``slot`` (its adapter stays there until the slot is needed)."""
        if self._holders[slot] <= 0:
            raise AdapterError(f"adapter slot {slot} released more often than acquired")
        self._holders[slot] -= 1

    def holders(self, slot: int) -> int:
        return self._holders[slot]

    def loaded(self) -> dict[int, str]:
        """``{slot: adapter name}`` of the slots that hold an adapter."""
        return {slot: self._adapters[int_id].name for slot, int_id in sorted(self._held_by.items())}

    def remove(self, int_id: int) -> bool:
        """Forget adapter ``int_id`` and free the slot that holds it; False when it is not known.
        :class:`~metrale.errors.AdapterError` while sequences hold its slot."""
        if int_id not in self._adapters:
            return False
        slot = self.slot_of(int_id)
        if slot is not None:
            if self._holders[slot]:
                raise AdapterError(f"adapter {self._adapters[int_id].name!r} is in use by {self._holders[slot]} "
                                   "running sequences")
            del self._held_by[slot]
            self._order.remove(slot)
            self._order.insert(0, slot)  # the first a new adapter takes
        del self._adapters[int_id]
        return True

    def requests(self) -> list[LoRARequest]:
        """A :class:`LoRARequest` of every adapter read, by ``lora_int_id``."""
        return [LoRARequest(a.name, a.int_id, a.path) for _, a in sorted(self._adapters.items())]

    def write_slot(self, slot: int, request: LoRARequest) -> None:
        """Write ``request``'s adapter into ``slot`` as another rank's manager did (a worker rank
        of a tensor-parallel group: its part of the adapter; no holds are counted here)."""
        self._write(slot, self.resolve(request))

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        if self.ranks is not None:
            # (Before this rank's copies: the next step the workers run reads the slot.)
            self.ranks.write_adapter(slot, LoRARequest(adapter.name, adapter.int_id, adapter.path))
        self._held_by.pop(slot, None)  # a torn write leaves the slot empty, never half another adapter's
        # On the engine's stream: the copies land before any forward queued after them reads the slot.
        with self.backend.activate():
            for layer, stack in self.layout.stacks:
                stack.write(self.backend, slot, [adapter.modules.get((layer, name)) for name in stack.names])
            for matrix, rows in self.layout.token_rows.items():
                rows.write(self.backend, slot, adapter.token_rows.get(matrix))
        self._held_by[slot] = adapter.int_id
