"""The scheduler: which requests run in the next engine step, and how.

Each step it takes, in this order:

1. **decode rows** -- every running request whose prompt is done advances by one token. When
   the cache lacks blocks for them, the newest running request is preempted (its blocks are
   freed; it goes back to the front of the waiting queue and is recomputed later) until they
   fit. A request alone in the cache that still does not fit fails.
2. **prefill chunks** under the token budget (``max_num_batched_tokens`` minus the decode rows):
   first the running requests whose prompt is partly computed, then waiting requests in arrival
   order while fewer than ``max_num_seqs`` run. A chunk that does not finish its prompt ends on
   a KV-block boundary. With decode rows in the step at most one chunk joins them (a mixed
   step); without, several chunks form a batched prefill.

A family whose ``is_mla()`` is true gets its prompt in one chunk, alone in its step (no
chunked, batched or mixed prefill): such steps alternate with decode steps.

**Pooling requests** (:mod:`metrale.engine.pooling`) are admitted and chunked as any prompt,
under the same budget; their chunks go to the plan's ``pool`` list, which the engine runs in a
forward call of its own, so they do not count as the one chunk a mixed step takes (except for a
family that takes one prompt chunk per step, where a pooling chunk is that chunk). Pooling
requests skip the prefix-cache lookup.

A step in which nothing can run and nothing fails raises :class:`~metrale.errors.SchedulerStuckError`
(it would otherwise repeat forever).

With overlap scheduling the engine plans a step while the one before it still runs
(:meth:`Scheduler.schedule_ahead`): a request whose token is pending in that step decodes its
pending token, unless it is sure to finish when the token is read (``finishing``: it reaches its
``max_tokens`` or the model's context). A plan made ahead never preempts or fails a running
request: when the rows would not fit, or nothing would run, it gives way (None) and the engine
reads the step in flight back first.

Every queue change commits in one statement, after the request's cache is released: a request
that holds cache is always in a queue, whatever exception interrupts the scheduler.

Admitting a waiting request looks its prompt up in the prefix cache once; the blocks found are
kept by the request (and the lookup's result replayed) if its chunk has to wait. A request whose
tokens need more blocks than the whole cache has fails at admission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from metrale.cache.prefix import PrefixCache
from metrale.engine.generation import Request
from metrale.engine.pooling import reuses_prefix
from metrale.errors import AdapterError, SchedulerStuckError
from metrale.sequence import ForwardStep, PrefillSlice, Segment


@dataclass
class PrefillChunk:
    """``request``'s tokens ``[start, start + length)``; ``is_last`` finishes its prompt."""

    request: Request
    start: int
    length: int

    @property
    def is_last(self) -> bool:
        return self.start + self.length == len(self.request.seq.tokens)


@dataclass
class StepPlan:
    """What one engine step runs: decode rows and prefill chunks (rows first, then chunks), and
    the prompt chunks of pooling requests (``pool``, run by a ``final_states`` call of their own)."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    #: Chunks of pooling requests (:mod:`metrale.engine.pooling`): not part of :meth:`call`.
    pool: list[PrefillChunk] = field(default_factory=list)
    #: Requests that failed while being scheduled (each with ``error`` set).
    failed: list[Request] = field(default_factory=list)
    #: Requests preempted to make room (already back in the waiting queue).
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.pool

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(chunk.length for chunk in self.prefill) + sum(chunk.length for chunk in self.pool)

    def call(self) -> tuple[str, ForwardStep, dict[str, Any]]:
        """The one contract call that runs this plan's decode rows and prefill chunks (not its
        ``pool``; at least one row or chunk): the method, the step (every row as a
        :class:`~metrale.sequence.Segment`, decode rows first) and the method's arguments, which
        are derived from the same rows. A decode row whose token is pending passes token 0 (the
        model runner feeds the real one on the device)."""
        decode, prefill = self.decode, self.prefill
        seqs = [r.seq for r in decode]
        tokens = [0 if seq.pending_token is not None else seq.tokens[-1] for seq in seqs]
        segments = [Segment(seq, [token], seq.num_cached, "last") for token, seq in zip(tokens, seqs)]
        for chunk in prefill:
            seq = chunk.request.seq
            segments.append(Segment(seq, seq.tokens[chunk.start : chunk.start + chunk.length], chunk.start,
                                    "last" if chunk.is_last else "none"))
        if decode and not prefill:
            return ("decode_batch", ForwardStep("decode_batch", seqs, segments=segments),
                    {"tokens": tokens, "seqs": seqs, "stream": None})
        if decode:
            (chunk,) = prefill
            seq = chunk.request.seq
            step = ForwardStep("mixed_forward", [*seqs, seq], is_last_chunk=chunk.is_last, segments=segments)
            return "mixed_forward", step, {
                "decode_tokens": tokens, "decode_seqs": seqs, "prefill_tokens": list(seq.tokens), "prefill_seq": seq,
                "chunk_start": chunk.start, "chunk_len": chunk.length, "is_last": chunk.is_last, "stream": None}
        if len(prefill) == 1:
            (chunk,) = prefill
            seq = chunk.request.seq
            step = ForwardStep("prefill_chunk", [seq], is_last_chunk=chunk.is_last, segments=segments)
            return "prefill_chunk", step, {
                "tokens": list(seq.tokens), "seq": seq, "chunk_start": chunk.start, "chunk_len": chunk.length,
                "is_last_chunk": chunk.is_last, "stream": None}
        slices = [PrefillSlice(c.request.seq.tokens, c.request.seq, c.start, c.length, c.is_last) for c in prefill]
        step = ForwardStep("prefill_batch_chunk", [s.seq for s in slices], segments=segments)
        return "prefill_batch_chunk", step, {"slices": slices, "stream": None}


class Scheduler:
    """Waiting and running requests over one model cache (see the module docstring)."""

    def __init__(
        self,
        cache: Any,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        one_chunk_prefill: bool = False,
        prefix_cache: PrefixCache | None = None,
        on_release: Callable[[Request], None] | None = None,
        tail_split: Callable[[list[int]], int | None] | None = None,
        finishing: Callable[[Request], bool] | None = None,
        adapters: Any = None,
    ) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.one_chunk_prefill = one_chunk_prefill
        self.prefix_cache = prefix_cache
        self.on_release = on_release
        #: Where a prompt's chunks must break so a state snapshot lands near its tail (models
        #: with recurrent state and the prefix cache on).
        self.tail_split = tail_split
        #: Whether a running request finishes once its pending token is read, whatever the token.
        self.finishing = finishing or (lambda request: False)
        #: The LoRA adapter slots (:class:`~metrale.engine.lora_slots.LoraManager`), or None: a request of an
        #: adapter holds its slot from its admission to its release.
        self.adapters = adapters
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._last_was_prefill = False
        #: Preemptions over the scheduler's lifetime (for statistics).
        self.preemptions = 0

    # ------------------------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a finished or failed request out of the queues and release its cache."""
        running = [r for r in self.running if r is not request]
        waiting = [r for r in self.waiting if r is not request]
        # Commit: the request leaves the queues once its cache is released (a request holding
        # cache is always in a queue).
        self.running, self.waiting, _ = running, waiting, self.release(request)

    def release(self, request: Request) -> None:
        seq = request.seq
        if seq.block_table or seq.state_slot is not None:
            if self.on_release is not None:
                self.on_release(request)
            # Commit: the flags reset with the release.
            request.prefilled, request.published_blocks, _ = False, 0, self.cache.release(seq)
        else:
            request.prefilled, request.published_blocks = False, 0
        if seq.adapter_slot is not None:
            slot, seq.adapter_slot = seq.adapter_slot, None
            self.adapters.release(slot)

    def check(self) -> list[str]:
        """Violations of the scheduler's invariants: the queues are disjoint, hold no request
        twice, and at most ``max_num_seqs`` requests run."""
        problems = []
        running, waiting = {id(r) for r in self.running}, {id(r) for r in self.waiting}
        if len(running) != len(self.running) or len(waiting) != len(self.waiting):
            problems.append("a request is queued twice")
        if running & waiting:
            problems.append("a request is both running and waiting")
        if len(self.running) > self.max_num_seqs:
            problems.append(f"{len(self.running)} requests run, more than max_num_seqs={self.max_num_seqs}")
        if self.adapters is not None:
            held: dict[int, int] = {}
            for request in [*self.running, *self.waiting]:
                if request.seq.adapter_slot is not None:
                    held[request.seq.adapter_slot] = held.get(request.seq.adapter_slot, 0) + 1
            for slot in range(1, self.adapters.max_loras + 1):
                if self.adapters.holders(slot) != held.get(slot, 0):
                    problems.append(f"adapter slot {slot} has {self.adapters.holders(slot)} holds, "
                                    f"{held.get(slot, 0)} queued requests hold it")
        return problems

    def _blocks_for(self, request: Request, num_tokens: int) -> int:
        return self.cache.blocks_needed(request.seq, num_tokens) if self.cache.spec.uses_blocks else 0

    def _preempt_newest(self, plan: StepPlan, keep: Request | None = None) -> Request | None:
        """Preempt the newest running request (other than ``keep``); None if there is none."""
        for victim in sorted(self.running, key=lambda r: r.arrival, reverse=True):
            if victim is keep:
                continue
            running = [r for r in self.running if r is not victim]
            waiting = sorted([*self.waiting, victim], key=lambda r: r.arrival)
            preemptions = victim.num_preemptions + 1
            # Commit: back to the waiting queue (in arrival order) once its cache is released.
            self.running, self.waiting, victim.num_preemptions, _ = running, waiting, preemptions, self.release(victim)
            plan.preempted.append(victim)
            self.preemptions += 1
            return victim
        return None

    def _fail(self, plan: StepPlan, request: Request, message: str) -> None:
        request.error = message
        self.remove(request)
        plan.failed.append(request)

    # --------------------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for _ in range(len(self.running) + len(self.waiting) + 2):
            self._build(plan)
            if not plan.empty or not self.has_work:
                break
            # Nothing can run: free the prefix blocks waiting requests hold, then make room
            # for the oldest running request (or fail it when it is alone).
            if self._drop_waiting_holds():
                continue
            if not self.running:
                break
            oldest = min(self.running, key=lambda r: r.arrival)
            if self._preempt_newest(plan, keep=oldest) is None:
                self._fail(plan, oldest, self._too_long_message(oldest, len(oldest.seq.tokens)))
        if plan.empty and not plan.failed and self.has_work:
            raise SchedulerStuckError(self._stuck_message())
        self._last_was_prefill = bool(plan.prefill or plan.pool)
        return plan

    def schedule_ahead(self) -> StepPlan | None:
        """The next step's plan while a step is in flight, or None when it needs that step's
        results first (see the module docstring). Prompt chunks it admits and requests it fails
        at admission are as :meth:`schedule`'s."""
        plan = StepPlan()
        if not self._build(plan, ahead=True) or plan.empty:
            # Admissions made on the way stand: the next plan resumes their prompts.
            return None if not plan.failed else plan
        self._last_was_prefill = bool(plan.prefill or plan.pool)
        return plan

    def _stuck_message(self) -> str:
        slots = self.cache.state_slots
        slot_text = f", {slots.num_free} of {slots.num_slots} state slots free" if slots is not None else ""
        return (
            f"the scheduler can neither run nor admit a request: {len(self.running)} running, "
            f"{len(self.waiting)} waiting, {self.cache.num_free_blocks} of {self.cache.num_blocks} KV blocks "
            f"free{slot_text}"
        )

    def _build(self, plan: StepPlan, ahead: bool = False) -> bool:
        """Fill ``plan``; False when, planned ``ahead``, its decode rows would not fit (the plan
        is then left empty of rows)."""
        plan.decode, plan.prefill, plan.pool = [], [], []
        if not self._schedule_decode(plan, ahead):
            return False
        if self.one_chunk_prefill:
            rows = plan.decode
            if not rows or not self._last_was_prefill:
                # The rows keep their blocks reserved: they run if no prompt can.
                reserved = sum(self._blocks_for(r, r.seq.num_cached + 1) for r in rows)
                plan.decode = []
                self._schedule_prefill(plan, budget=None, max_chunks=1, reserved=reserved)
                if not plan.prefill and not plan.pool:
                    plan.decode = rows
        else:
            budget = self.max_num_batched_tokens - len(plan.decode)
            self._schedule_prefill(plan, budget=budget, max_chunks=1 if plan.decode else None)
        return True

    def _drop_waiting_holds(self) -> bool:
        """Release the prefix blocks held by waiting requests; whether there were any."""
        holders = [r for r in self.waiting if r.seq.block_table]
        for request in holders:
            self.release(request)
        return bool(holders)

    def _schedule_decode(self, plan: StepPlan, ahead: bool = False) -> bool:
        while True:
            rows = [r for r in self.running if r.prefilled and not self.finishing(r)]
            needed = sum(self._blocks_for(r, r.seq.num_cached + 1) for r in rows)
            if needed <= self.cache.num_free_blocks:
                plan.decode = sorted(rows, key=lambda r: r.arrival)
                return True
            if self._drop_waiting_holds():
                continue
            if ahead:
                return False
            if len(self.running) == 1:
                request = self.running[0]
                self._fail(plan, request, self._too_long_message(request, len(request.seq.tokens)))
                continue
            self._preempt_newest(plan)

    def _too_long_message(self, request: Request, num_tokens: int) -> str:
        needed = -(-num_tokens // self.block_size)
        return (
            f"request {request.request_id} needs {needed} KV blocks for {num_tokens} tokens, more than the "
            f"cache can give it ({self.cache.num_blocks} blocks in all; raise num_blocks or memory_bytes"
            f"{', or lower max_tokens' if request.pooling is None else ''})"
        )

    def _schedule_prefill(self, plan: StepPlan, budget: int | None, max_chunks: int | None,
                          reserved: int | None = None) -> None:
        if reserved is None:
            reserved = sum(self._blocks_for(r, r.seq.num_cached + 1) for r in plan.decode)
        # Partly prefilled running requests first, then waiting ones in arrival order.
        candidates = sorted((r for r in self.running if not r.prefilled), key=lambda r: r.arrival)
        for request in candidates + list(self.waiting):
            if max_chunks is not None and self._chunks_taken(plan, request) >= max_chunks:
                return
            if budget is not None and budget <= 0:
                return
            admitting = request in self.waiting
            if admitting:
                if len(self.running) >= self.max_num_seqs:
                    return
                total_blocks = -(-len(request.seq.tokens) // self.block_size)
                if self.cache.spec.uses_blocks and total_blocks > self.cache.num_blocks:
                    self._fail(plan, request, self._too_long_message(request, len(request.seq.tokens)))
                    continue
                slots = self.cache.state_slots
                if slots is not None and request.seq.state_slot is None and slots.num_free == 0:
                    return  # every recurrent-state slot is taken (the stuck handler frees holds)
                if request.lora is not None and request.seq.adapter_slot is None:
                    try:
                        adapter_slot = self.adapters.acquire(request.lora)
                    except AdapterError as error:  # (read again after remove_lora: its folder changed)
                        self._fail(plan, request, f"its LoRA adapter could not be loaded: {error}")
                        continue
                    if adapter_slot is None:
                        return  # every adapter slot is held by running requests of other adapters
                    request.seq.adapter_slot = adapter_slot
                if not request.seq.block_table and self.prefix_cache is not None and reuses_prefix(request):
                    first = request.cached_tokens is None
                    self._lookup(request, self.prefix_cache)
                    if self.cache.num_free_blocks < reserved:
                        # The hits revived evictable blocks this step's other rows count on.
                        self.release(request)
                        if first:
                            request.cached_tokens = None
                        return
            free = self.cache.num_free_blocks - reserved
            chunk = self._chunk(request, budget, free)
            if chunk is None:
                return  # in order: no later request overtakes this one
            if admitting:
                # Commit: from waiting to running in one statement.
                self.running[len(self.running):], _ = [request], self.waiting.remove(request)
            (plan.prefill if request.pooling is None else plan.pool).append(chunk)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            reserved += self._blocks_for(request, chunk.start + chunk.length)
            if budget is not None:
                budget -= chunk.length

    def _chunks_taken(self, plan: StepPlan, request: Request) -> int:
        """The chunks of ``plan`` that count against ``max_chunks`` for ``request``'s: pooling
        chunks run in a call of their own, so they and the prefill chunks do not limit one
        another -- except where every prompt chunk runs alone (``one_chunk_prefill``)."""
        if self.one_chunk_prefill:
            return len(plan.prefill) + len(plan.pool)
        return len(plan.prefill) if request.pooling is None else 0

    def _lookup(self, request: Request, prefix_cache: PrefixCache) -> None:
        seq = request.seq
        # The lookups record the blocks they take in the sequence's table as they take them.
        if prefix_cache.snapshots is not None:
            # Resume only where a state snapshot was taken; the slot gets that state.
            blocks, row = prefix_cache.lookup_with_state(
                seq.tokens, request.block_digests, seq.adapter_id, into=seq.block_table
            )
            if blocks:
                self.cache.state_slots.allocate(seq)
                self.cache.snapshots.restore(row, seq.state_slot)
        else:
            blocks = prefix_cache.lookup(seq.tokens, request.block_digests, seq.adapter_id, into=seq.block_table)
        seq.num_cached = len(blocks) * self.block_size
        if request.cached_tokens is None:
            request.cached_tokens = seq.num_cached

    def _chunk(self, request: Request, budget: int | None, free_blocks: int) -> PrefillChunk | None:
        """The largest chunk of ``request``'s remaining tokens within the budget and the free
        blocks (block-aligned unless it finishes the prompt), or None."""
        seq = request.seq
        start, total = seq.num_cached, len(seq.tokens)
        end = total if budget is None else min(total, start + budget)
        have = len(seq.block_table) if self.cache.spec.uses_blocks else 0
        if self.cache.spec.uses_blocks:
            end = min(end, (have + max(0, free_blocks)) * self.block_size)
        if self.tail_split is not None:
            split = self.tail_split(seq.tokens)
            if split is not None and start < split < end:
                end = split
        if end < total:
            if self.one_chunk_prefill:
                return None
            end = end // self.block_size * self.block_size
        if end <= start:
            return None
        return PrefillChunk(request, start, end - start)
