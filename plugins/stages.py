"""Built-in stage plugins: flush, stamp, drafter, and the graph-capture error hook.

* flush: folds what a model left pending (``flush_pending``, :class:`~metrale.family.FamilyModel`:
  the Gated DeltaNet family's recurrent state as of a verify's last kept row) into its state
  before the forward reads it;
* stamp: records the adapter route of the step (one adapter slot for the whole batch, None for
  the base model, or ``MIXED_ADAPTERS``);
* drafter: the eager drafter prefill, ``prime_drafter`` (:class:`~metrale.family.FamilyModel`:
  the MLA family's MTP drafter catches up on the prompt's rows; nothing for other models);
* end_graph_capture: asks the model's backend to end an open capture (a no-op on the CPU).
"""

from __future__ import annotations

from typing import Any

from metrale.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.sequence import MIXED_ADAPTERS, ForwardStep

METRALE_CONTRACT_VERSION = CONTRACT_VERSION


@hookimpl
def metrale_flush(model: Any, step: ForwardStep) -> None:
    flush = getattr(model, "flush_pending", None)
    if flush is not None:
        flush()


@hookimpl
def metrale_stamp(model: Any, step: ForwardStep) -> None:
    slots = {seq.adapter_slot for seq in step.seqs}
    if step.method == "mixed_forward" or len(slots) > 1:
        step.stamps["adapter_route"] = MIXED_ADAPTERS
    else:
        step.stamps["adapter_route"] = next(iter(slots), None)


@hookimpl
def metrale_drafter(model: Any, step: ForwardStep, result: Any) -> None:
    prime = getattr(model, "prime_drafter", None)
    if prime is not None:
        prime(list(step.seqs))


@hookimpl
def metrale_end_graph_capture(model: Any, step: ForwardStep, error: BaseException) -> None:
    backend = getattr(model, "backend", None)
    if backend is not None:
        backend.end_graph_capture(step.stream)
