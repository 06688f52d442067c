"""Driving one :class:`~metrale.LLM`'s engine for requests that arrive and leave at any time:
:class:`EngineDriver`, the loop body that :class:`~metrale.AsyncLLM`'s engine thread and an
:class:`~metrale.entrypoints.engine_process.EngineProcess`'s engine process share, and :class:`EngineStats`.

The driver admits request groups, aborts them and steps the engine, and keeps going through
failures: a failed step fails only the requests it touched (or, when the engine's bookkeeping
had to be rebuilt, every running request), and an unexpected error fails every request and
leaves the engine idle and consistent. It never hands an output to anyone: each call returns
the groups whose output changed, and the caller delivers them.

It also adds and removes LoRA adapters while requests run (:meth:`EngineDriver.add_lora`,
:meth:`EngineDriver.remove_lora`): an adapter removed while admitted requests use it is forgotten
only once the last of them has finished (:meth:`EngineDriver.retire`), so no running request ever
loses its adapter or has its slot rewritten under it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Sequence

from metrale.engine.generation import RequestGroup
from metrale.engine.timings import BucketCounts, copied, new_phase_histograms, request_phases
from metrale.errors import AdapterError

if TYPE_CHECKING:
    from metrale.entrypoints.llm import LLM

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of the engine's load, for metrics and ``/health``.

    ``running`` / ``waiting`` count requests (a request with ``n`` completions counts once)
    running on the engine and queued for it; ``kv_blocks_used`` / ``kv_blocks_total`` the paged
    cache (blocks kept only by the prefix cache count as free: they are evicted on demand);
    ``state_slots_used`` / ``state_slots_total`` recurrent-state slots (0 / 0 for models without);
    ``prefix_queried_blocks`` / ``prefix_hit_blocks`` the prefix cache's lookups so far;
    ``preemptions`` the preemptions so far; ``steps`` the engine steps so far;
    ``spec_verify_steps`` / ``spec_draft_tokens`` / ``spec_accepted_tokens`` the speculative
    verifies so far and the draft tokens they verified and kept; ``lora_slots_used`` /
    ``lora_slots_total`` the LoRA adapter slots running requests hold, and in all (0 / 0 without
    LoRA), ``lora_adapters_loaded`` the slots that hold an adapter. ``request_phases`` holds a
    histogram per phase of the finished requests (``queue``, ``prefill``, ``decode``,
    ``inference``: :mod:`metrale.engine.timings`), ``iteration_tokens`` one of the tokens each
    step computed (None before the engine's first snapshot).
    """

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    prefix_queried_blocks: int = 0
    prefix_hit_blocks: int = 0
    preemptions: int = 0
    steps: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    lora_slots_used: int = 0
    lora_slots_total: int = 0
    lora_adapters_loaded: int = 0
    request_phases: dict[str, BucketCounts] = field(default_factory=dict)
    iteration_tokens: BucketCounts | None = None

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks in use (0 to 1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class EngineDriver:
    """Admits, aborts and steps the request groups of ``llm``'s engine (see the module
    docstring). ``groups`` maps the admitted, unfinished groups' request ids to them."""

    def __init__(self, llm: "LLM") -> None:
        self.llm = llm
        self.groups: dict[str, RequestGroup] = {}
        self.steps = 0
        #: The finished requests' phases (:mod:`metrale.engine.timings`).
        self.request_phases = new_phase_histograms()
        #: The ``lora_int_id`` of each adapter :meth:`remove_lora` was asked to remove that admitted
        #: requests still use: forgotten by :meth:`retire` once none does.
        self.retiring: set[int] = set()

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return self.llm.engine.has_unfinished()

    @property
    def broken(self) -> str | None:
        """Why the engine cannot step any more (a rank of a model split over several failed,
        :mod:`metrale.backends.executor`), or None. The loops then fail what is left and stop, so the
        engine reports itself not running."""
        ranks = getattr(self.llm, "ranks", None)
        return None if ranks is None else ranks.broken

    def admit(self, group: RequestGroup) -> bool:
        """Add ``group``'s completions to the engine (after its prompt's log probabilities,
        when asked for). False when it failed at once: its output is then final."""
        try:
            self.llm.prompt_logprobs(group)
        except Exception as error:  # (device memory, say): this request fails, the engine goes on
            group.error = f"the prompt's log probabilities could not be computed: {error}"
            for request in group.completions:
                request.finish_reason, request.error = "error", group.error
            return False
        for request in group.completions:
            self.llm.engine.add_request(request)
        self.groups[group.request_id] = group
        return True

    def abort(self, request_id: str) -> RequestGroup | None:
        """Drop an admitted group from the engine, its cache freed; returns it (its output is
        final, ``finish_reason == "abort"``), or None when ``request_id`` is not running."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.llm.engine.abort(group.completions)
        for request in group.completions:
            if request.finish_reason is None:  # never scheduled
                request.finish_reason = "abort"
        self._record_phases(group)
        return group

    def step(self) -> list[RequestGroup]:
        """One engine step; the groups it changed (finished ones are no longer in ``groups``)."""
        engine = self.llm.engine
        try:
            changed = engine.step()
        except Exception as error:  # a failed forward fails its own requests; the others go on
            logger.error("an engine step failed: %r", error)
            problems = engine.check()
            if problems:
                logger.error("the engine is rebuilt: %s", "; ".join(problems))
                requests = [r for g in self.groups.values() for r in g.completions]
                engine.recover(requests)
                for request in requests:
                    if request.finish_reason is None:
                        request.finish_reason, request.error = "error", f"the engine failed: {error!r}"
            changed = [r for g in self.groups.values() for r in g.completions if r.finish_reason is not None]
        self.steps += 1
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for request in changed:
            if len(request.seq.tokens) > request.seq.prompt_len:  # (no copy of the tokens)
                if request.first_token_time is None:
                    request.first_token_time = now
                request.last_token_time = now
            group = self.groups.get(request.request_id)
            if group is not None and any(r is request for r in group.completions):
                touched[request.request_id] = group
        for request_id, group in touched.items():
            if group.finished:
                del self.groups[request_id]
                self._record_phases(group)
        return list(touched.values())

    def _record_phases(self, group: RequestGroup) -> None:
        """Count a finished group's phases: from its first completion's arrival and first step
        to the first token of any completion and the last token of all."""
        def first(times: list[float | None]) -> float | None:
            known = [t for t in times if t is not None]
            return min(known) if known else None

        completions = group.completions
        last = [r.last_token_time for r in completions if r.last_token_time is not None]
        phases = request_phases(first([r.arrival_time for r in completions]),
                                first([r.first_scheduled_time for r in completions]),
                                first([r.first_token_time for r in completions]), max(last) if last else None)
        for phase, seconds in phases.items():
            self.request_phases[phase].observe(seconds)

    def add_lora(self, lora: Any) -> None:
        """Read and check adapter ``lora`` (a :class:`~metrale.loading.lora.LoRARequest`) now, so that a
        bad one is refused here rather than at its first request: :class:`~metrale.errors.AdapterError`
        for one the model cannot serve (or whose ``lora_int_id`` names another adapter),
        :class:`~metrale.errors.ConfigError` when the engine serves no LoRA."""
        self.llm.add_lora(lora)
        self.retiring.discard(lora.lora_int_id)

    def served_loras(self) -> list[Any]:
        """The adapters the engine holds and was not asked to remove, by ``lora_int_id``."""
        return [lora for lora in self.llm.list_loras() if lora.lora_int_id not in self.retiring]

    def find_lora(self, lora: str | int) -> Any:
        """The served adapter (:meth:`served_loras`) of ``lora_int_id`` ``lora`` (an int) or named
        ``lora`` (a string); :class:`~metrale.errors.AdapterError` when there is none, or several of
        that name."""
        served = self.served_loras()
        if isinstance(lora, bool) or not isinstance(lora, (int, str)):
            raise AdapterError(f"an adapter is named by its lora_name (a string) or its lora_int_id, got {lora!r}")
        found = [r for r in served if (r.lora_int_id == lora if isinstance(lora, int) else r.lora_name == lora)]
        if not found:
            raise AdapterError(f"no LoRA adapter {lora!r} is loaded (loaded: "
                               f"{', '.join(repr(r.lora_name) for r in served) or 'none'})")
        if len(found) > 1:
            raise AdapterError(f"{len(found)} loaded adapters are named {lora!r} (lora_int_id "
                               f"{', '.join(str(r.lora_int_id) for r in found)}); remove one by its lora_int_id")
        return found[0]

    def remove_lora(self, lora: str | int, busy: Collection[int] = ()) -> Any:
        """Remove the served adapter ``lora`` (:meth:`find_lora`; :class:`~metrale.errors.AdapterError`
        when there is none): forgotten now when no admitted request uses it (nor one of ``busy``,
        the ids of requests accepted but not admitted yet), else by :meth:`retire` once the last
        has finished, its requests running to the end with it. Returns its
        :class:`~metrale.loading.lora.LoRARequest`."""
        found = self.find_lora(lora)
        self.retiring.add(found.lora_int_id)
        self.retire(busy)
        return found

    def retire(self, busy: Collection[int] = ()) -> None:
        """Forget the adapters :meth:`remove_lora` was asked to remove that no admitted request
        uses any more (nor one of ``busy``); the others wait for a later call."""
        if not self.retiring:
            return
        used = set(busy)
        for group in self.groups.values():
            for request in group.completions:
                if request.lora is not None:
                    used.add(request.lora.lora_int_id)
        for int_id in sorted(self.retiring - used):
            try:
                self.llm.remove_lora(int_id)
            except AdapterError:  # a finished request's slot not released yet: a later call
                continue
            self.retiring.discard(int_id)

    def fail_everything(self, error: BaseException, also: Sequence[RequestGroup] = ()) -> list[RequestGroup]:
        """After an unexpected error outside a step: every admitted group (and those of
        ``also``, not admitted yet) fails with ``error``, and the engine is made idle and
        consistent. Returns the failed groups."""
        logger.error("the engine loop failed: %r; every request is failed", error)
        groups = list(self.groups.values()) + [g for g in also if g.request_id not in self.groups]
        self.groups = {}
        self.llm.engine.recover([r for g in groups for r in g.completions])
        for group in groups:
            for request in group.completions:
                if request.finish_reason is None:
                    request.finish_reason, request.error = "error", f"the engine failed: {error!r}"
        return groups

    def stats(self, accepted: int | None = None) -> EngineStats:
        """The engine's load now; ``accepted`` counts the unfinished requests taken so far,
        admitted or not (default: the admitted ones), those not running are waiting."""
        engine = self.llm.engine
        cache = self.llm.cache
        running_ids = {r.request_id for r in list(engine.scheduler.running)}
        slots = cache.state_slots
        prefix = engine.prefix_cache
        return EngineStats(
            running=len(running_ids),
            waiting=max((len(self.groups) if accepted is None else accepted) - len(running_ids), 0),
            kv_blocks_used=cache.num_blocks - cache.num_free_blocks if cache.spec.uses_blocks else 0,
            kv_blocks_total=cache.num_blocks if cache.spec.uses_blocks else 0,
            state_slots_used=(slots.num_slots - slots.num_free) if slots is not None else 0,
            state_slots_total=slots.num_slots if slots is not None else 0,
            prefix_queried_blocks=prefix.queried_blocks if prefix is not None else 0,
            prefix_hit_blocks=prefix.hit_blocks if prefix is not None else 0,
            preemptions=engine.scheduler.preemptions,
            steps=self.steps,
            spec_verify_steps=engine.calls.get("verify", 0),
            spec_draft_tokens=engine.draft_tokens,
            spec_accepted_tokens=engine.accepted_tokens,
            request_phases=copied(self.request_phases),
            iteration_tokens=engine.iteration_tokens.copy(),
            **_lora_stats(self.llm.lora),
        )


def _lora_stats(lora: Any) -> dict[str, int]:
    """The LoRA fields of :class:`EngineStats` for ``lora`` (a :class:`~metrale.engine.lora_slots.LoraManager`
    or None)."""
    if lora is None:
        return {}
    slots = range(1, lora.max_loras + 1)
    return {"lora_slots_used": sum(1 for slot in slots if lora.holders(slot)), "lora_slots_total": lora.max_loras,
            "lora_adapters_loaded": len(lora.loaded())}
