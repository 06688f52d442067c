"""Built-in stage plugins: flush, stamp, drafter, and the graph-capture error hook.

* flush: folds what a model left pending (``flush_pending``, :class:`~metrale.model.family.FamilyModel`:
  the Gated DeltaNet family's recurrent state as of a verify's last kept row) into its state
  before the forward reads it;
* stamp: records the adapter route of the step (:func:`~metrale.batch.adapter_route`: one adapter
  slot for the whole batch, None for the base model, or ``MIXED_ADAPTERS``) and has the model
  check it (``check_adapters``, :class:`~metrale.model.family.FamilyModel`) before anything runs;
* drafter: the eager drafter prefill, ``prime_drafter`` (:class:`~metrale.model.family.FamilyModel`:
  the MLA family's MTP drafter catches up on the prompt's rows; nothing for other models);
* end_graph_capture: asks the model's backend to end an open capture (a no-op on the CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.batch import adapter_route
from metrale.model.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.sequence import ForwardStep

METRALE_CONTRACT_VERSION = CONTRACT_VERSION


@hookimpl
def metrale_flush(model: Any, step: ForwardStep) -> None:
    flush = getattr(model, "flush_pending", None)
    if flush is not None:
        flush()


@hookimpl
def metrale_stamp(model: Any, step: ForwardStep) -> None:
    if not any(seq.adapter_slot for seq in step.seqs):
        step.stamps["adapter_route"] = None  # the base model's step: no array work
    else:
        slots = np.fromiter((seq.adapter_slot or 0 for seq in step.seqs), dtype=np.int64, count=len(step.seqs))
        step.stamps["adapter_route"] = adapter_route(slots)
    check = getattr(model, "check_adapters", None)
    if check is not None:
        check(step)


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
