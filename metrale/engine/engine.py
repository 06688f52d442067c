"""The engine step loop: continuous batching over the forward contract.

Requests enter a waiting queue (:meth:`Engine.add_request`). Each :meth:`Engine.step` asks the
:class:`~metrale.engine.scheduler.Scheduler` for a plan and makes exactly one forward call
through the :class:`~metrale.model.forward.ModelForward` facade:

* decode rows only: ``decode_batch``;
* one prefill chunk: ``prefill_chunk``; several: ``prefill_batch_chunk``;
* decode rows and one prefill chunk: ``mixed_forward``;
* decode rows only, with speculative decoding on (``speculation``) and drafts proposed:
  ``verify``, then the ``verdict`` (:meth:`Engine._speculate`).

The prompt chunks of pooling requests (:mod:`metrale.engine.pooling`: embeddings) that a plan
holds run after that call, in one call of their own, ``final_states``; their states are read
back and pooled at once, and a request whose last chunk ran finishes with its vector in the same
step (such a step is read back before :meth:`Engine.step` returns, even with overlap
scheduling). A step without pooling chunks does nothing more than before.

After a chunk that does not finish its prompt, ``normalize_ssm_states`` checks the sequence's
recurrent state. Every row that returned logits samples one token (:mod:`metrale.runner.sampling`; seeded per
request and per generated-token index, so a request's tokens do not depend on its batch
companions), the stop rules run, and finished requests give their cache back. With the prefix
cache on, every full block a step computed is published, so later prompts with the same prefix
reuse it; for a model with recurrent state, the state after each unfinished prompt chunk is kept
as a snapshot on the block the chunk completed, the only places a later prompt resumes from.

A forward call that raises fails every request of that step (their cache is released; nothing
is retried, so no prefix reference or KV write is applied twice) and the error propagates; the
engine stays usable for the other requests. A row whose logits are not finite finishes its
request with ``finish_reason == "error"``; the other rows go on. Whatever exception escapes a
step, :meth:`Engine.recover` leaves the engine idle and consistent.

**Overlap scheduling** (``overlap=True``): a step is planned and queued on the device while the
step before it still runs, and only then is that earlier step's sampled tokens read back and its
requests' stop rules applied. The new step's decode rows take their input tokens from the earlier
step's sampled tokens on the device (:attr:`~metrale.sequence.SequenceState.pending_token`, fed by
the model runner), so the host's scheduling, batch layout and bookkeeping hide behind the GPU's
work. A request sure to finish when its pending token is read (length) is left out of the step
planned ahead; one that stops on a token or a stop string runs one row more, whose token is
dropped. Each request's tokens are those of the step-by-step engine. When a plan made ahead would
have to preempt, or nothing would run, the step in flight is read back first and the plan made as
usual. Each :meth:`Engine.step` call then queues one step and returns the requests changed by the
one before it.

**Every change is handed out.** Whatever reads a step back -- :meth:`Engine.step`, or
:meth:`Engine.abort` when the step in flight holds a request it drops -- goes through one place
(:meth:`Engine._read_back`), which puts every request that step changed or finished in the
engine's outbox; the next :meth:`Engine.step` returns and empties it, and
:meth:`Engine.has_unfinished` is true while it holds anything. So the final output of a request
that finished in a step an abort read back still reaches its caller.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from metrale.cache.prefix import PrefixCache
from metrale.engine.generation import Request, StopChecker, finishing
from metrale.engine.pooling import apply_states, pooling_segments
from metrale.engine.scheduler import Scheduler, StepPlan
from metrale.engine.timings import ITERATION_TOKEN_BUCKETS, BucketCounts
from metrale.errors import CacheError, ConfigError, PluginError
from metrale.runner.sampling import RowExtras, new_sampler
from metrale.sequence import SequenceState

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """One step queued on the device whose sampled tokens are not read back yet."""

    method: str
    #: Every request of the step (decode rows, then the prompt chunks' requests).
    members: list[Request]
    #: The requests that sample a token, in the order of the sampled rows.
    rows: list[Request] = field(default_factory=list)
    #: The step's :class:`~metrale.runner.sampling.SampledTokens` (None when no row samples).
    sampled: Any = None
    #: Each member's cached length once this step has run (its KV computed up to there).
    ends: list[int] = field(default_factory=list)


class Engine:
    """Continuous batching over one model and its cache (see the module docstring)."""

    def __init__(
        self,
        forward: Any,
        cache: Any,
        backend: Any,
        stopper: StopChecker,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        overlap: bool = False,
        speculation: tuple[Any, Any] | None = None,
        adapters: Any = None,
        runner: Any = None,
    ) -> None:
        if max_num_batched_tokens < cache.block_size:
            raise ConfigError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least the KV block size "
                f"({cache.block_size}): a chunk that does not finish its prompt ends on a block boundary"
            )
        self.forward = forward
        self.cache = cache
        self.backend = backend
        #: The model runner the dispatch hands the step's segments to (:class:`~metrale.runner.ModelRunner`,
        #: built with the cache by the composition root), None for a model that runs without one.
        self.runner = runner
        self.sampler = new_sampler(backend, max_num_seqs)
        self.stopper = stopper
        # Recurrent state is not in the blocks: such models resume a shared prefix only from a
        # state snapshot, so they use the prefix cache only when snapshots are kept.
        self.snapshots = cache.snapshots if cache.state_slots is not None else None
        usable = cache.spec.uses_blocks and (self.snapshots is None or self.snapshots.count > 0)
        self.prefix_cache = (
            PrefixCache(cache.allocator, cache.block_size, self.snapshots) if enable_prefix_caching and usable else None
        )
        stateful_cache = self.prefix_cache is not None and self.snapshots is not None
        self.scheduler = Scheduler(
            cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            one_chunk_prefill=forward.is_mla(),
            prefix_cache=self.prefix_cache,
            # Not a bound method of the engine: the scheduler must not refer back to it.
            on_release=functools.partial(publish_blocks, self.prefix_cache) if self.prefix_cache is not None else None,
            tail_split=forward.prefill_tail_split if stateful_cache else None,
            finishing=functools.partial(finishing, max_model_len=stopper.max_model_len),
            adapters=adapters,
        )
        #: Whether steps are planned and queued while the one before them runs (module docstring).
        self.overlap = overlap
        #: ``(SpeculativeConfig, drafter)`` when decode steps speculate, else None. Drafts need
        #: the tokens before them on the host: speculation and overlap exclude each other.
        if speculation is not None and overlap:
            raise ConfigError("speculative decoding runs without overlap scheduling")
        self.speculation = speculation
        #: The step queued on the device whose tokens are not read back yet (overlap only).
        self.in_flight: LaunchedStep | None = None
        self._arrivals = itertools.count()
        #: Requests changed or finished by steps read back and not handed out yet (module docstring).
        self._outbox: list[Request] = []
        #: Forward calls made, by contract method, and the wall seconds of the :meth:`step` calls
        #: that launched them (forward, sampling, and reading back the step before it with overlap
        #: scheduling, or this one without), for tests and statistics.
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        #: Draft tokens verified and kept so far (speculative decoding).
        self.draft_tokens = 0
        self.accepted_tokens = 0
        #: Sequences a verify ran with drafts, counted once per verify step each: the mean
        #: accepted length is ``(accepted_tokens + drafted_sequences) / drafted_sequences``.
        self.drafted_sequences = 0
        #: Steps queued while the step before them was still in flight (overlap scheduling).
        self.overlapped_steps = 0
        #: What :meth:`recover` found inconsistent and rebuilt (for tests and diagnostics).
        self.repairs: list[str] = []
        #: The tokens each launched step computed (decode rows, prompt chunks, verify rows).
        self.iteration_tokens = BucketCounts(ITERATION_TOKEN_BUCKETS)

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        request.arrival = next(self._arrivals)
        if request.arrival_time is None:
            request.arrival_time = time.monotonic()
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        """Whether a :meth:`step` would do anything: requests queued, a step in flight, or
        changed requests not handed out yet."""
        return self.scheduler.has_work or self.in_flight is not None or bool(self._outbox)

    def abort(self, requests: Sequence[Request]) -> list[Request]:
        """Drop ``requests`` (those still queued; finished ones are left alone): their cache is
        released and they finish with ``finish_reason == "abort"``. A step in flight that holds
        one of them is read back first; what it changed for the other requests is handed out by
        the next :meth:`step`. Returns the requests dropped."""
        queued = {id(r) for r in self.scheduler.running} | {id(r) for r in self.scheduler.waiting}
        targets = [r for r in requests if id(r) in queued and r.finish_reason is None]
        if not targets:
            return []
        step = self.in_flight
        target_ids = {id(t) for t in targets}
        if step is not None and any(id(r) in target_ids for r in step.members):
            self._read_back()
        dropped = []
        for request in targets:
            if request.finish_reason is None:
                request.seq.pending_token = None
                self._remove(request)
                request.finish_reason = "abort"
                dropped.append(request)
        return dropped

    def _remove(self, request: Request) -> None:
        """Take ``request`` out of the queues, releasing its cache and its sampler state."""
        self.sampler.release(request.seq.seq_id)
        self.scheduler.remove(request)

    def _drop_in_flight(self) -> None:
        """Forget the step in flight without reading its tokens: its rows' pending tokens are
        dropped (the device finishes the step; nothing reads its results)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            for request in step.rows:
                pending = request.seq.pending_token
                if pending is not None and pending[0] is step.sampled:
                    request.seq.pending_token = None

    def check(self) -> list[str]:
        """Violations of the bookkeeping invariants (cache, prefix cache, scheduler); empty when
        the engine is consistent."""
        problems = self.cache.check() + self.scheduler.check()
        if self.prefix_cache is not None:
            problems += self.prefix_cache.check()
        return problems

    def recover(self, requests: Sequence[Request] = (), seqs: Sequence[SequenceState] = ()) -> list[str]:
        """Make the engine idle and consistent after an exception escaped a step or a forward
        call -- a ``KeyboardInterrupt`` included, wherever it landed.

        Drops ``requests`` and every queued request, releasing their cache (and that of
        ``seqs``). An idle engine holds no block and no state slot, and only the prefix cache
        keeps blocks and snapshots; if the bookkeeping disagrees, it is rebuilt from that: the
        prefix cache keeps its consistent entries, every other block and slot becomes free.
        Returns what had to be repaired (also appended to :attr:`repairs`); with every mutation
        committed in one statement this stays empty."""
        self._drop_in_flight()
        self._outbox = []
        pending = [*self.scheduler.running, *self.scheduler.waiting, *requests]
        problems: list[str] = []
        for request in {id(r): r for r in pending}.values():
            self.sampler.release(request.seq.seq_id)
            try:
                self.scheduler.remove(request)
            except CacheError as error:
                problems.append(f"releasing request {request.request_id}: {error}")
        for seq in seqs:
            try:
                self.cache.release(seq)
            except CacheError as error:
                problems.append(f"releasing sequence {seq.seq_id}: {error}")
        problems += self.check()
        blocks, slots = self.cache.holdings()
        if blocks or slots:
            problems.append(f"{blocks} blocks and {slots} state slots still held with no request running")
        if problems:
            self._rebuild([request.seq for request in pending] + list(seqs))
        self.repairs.extend(problems)
        return problems

    def _rebuild(self, seqs: list[SequenceState]) -> None:
        prefix = self.prefix_cache
        if prefix is not None:
            prefix.repair()
        self.scheduler.running, self.scheduler.waiting = [], []
        for seq in seqs:
            seq.block_table, seq.state_slot, seq.num_cached, seq.pending_token = [], None, 0, None
        self.cache.allocator.reset(prefix.registered_blocks() if prefix is not None else set())
        if self.cache.state_slots is not None:
            self.cache.state_slots.reset()
            self.cache.snapshots.reset(prefix.snapshot_rows() if prefix is not None else [])

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token or finished since the last call
        (in it, or in a step read back by :meth:`abort` before it). With overlap scheduling,
        queue one step and return the requests the step before it changed."""
        started = time.perf_counter()
        in_flight = self.in_flight
        if in_flight is None and not self.scheduler.has_work:
            return self._hand_out()
        # A structured output's next mask needs its token read first: no step planned ahead.
        ahead = in_flight is not None and not any(r.grammar is not None for r in in_flight.rows)
        plan = self.scheduler.schedule_ahead() if ahead else None
        if in_flight is not None and plan is None:
            # Planned ahead, the step would preempt or be empty: read the step in flight first.
            self._read_back()
            in_flight = None
        if plan is None:
            plan = self.scheduler.schedule()
        for request in plan.failed:
            request.finish_reason = "error"
        self._outbox += plan.failed
        launched = None
        if self.speculation is not None and plan.decode and not plan.prefill and in_flight is None:
            try:
                speculated = self._speculate(plan.decode)
            except BaseException as error:
                self._fail_members(plan, error)
                raise
            if speculated is not None:
                self._outbox += speculated
                self.seconds["verify"] = self.seconds.get("verify", 0.0) + time.perf_counter() - started
                if plan.pool:
                    self._pool(plan.pool)
                return self._hand_out()
        if plan.decode or plan.prefill:
            try:
                method, call, arguments = plan.call()
                # The step's one forward call, straight from here: its segments go through the
                # stages and the dispatch hook to the model runner unchanged.
                result = self.forward.run(method, call, **arguments)
                launched = self._launched(plan, method, result)
            except BaseException as error:
                # The step before the failed one is read back before the error propagates.
                self._read_back()
                self._fail_members(plan, error)
                raise
        if in_flight is not None:
            self.overlapped_steps += launched is not None
            self._read_back()
        if launched is not None:
            self.in_flight = launched
            if not (self.overlap and launched.sampled is not None):
                self._read_back()
        timed = launched.method if launched is not None else in_flight.method if in_flight is not None else None
        if timed is not None:
            self.seconds[timed] = self.seconds.get(timed, 0.0) + time.perf_counter() - started
        if launched is not None or plan.pool:
            self.iteration_tokens.observe(plan.num_tokens)
        if plan.pool:
            self._pool(plan.pool)
        return self._hand_out()

    def _pool(self, chunks: list[Any]) -> None:
        """Run a plan's pooling chunks (:mod:`metrale.engine.pooling`) in one ``final_states``
        call and pool their states; the requests whose last chunk ran finish and give their cache
        back. A call that raises fails these requests only (their cache released) and the error
        propagates."""
        started = time.perf_counter()
        segments = pooling_segments(chunks)
        try:
            states = self.forward.final_states(segments)
            finished = apply_states(chunks, segments, states, self.backend)
            for chunk in chunks:
                if not chunk.is_last:
                    self.forward.normalize_ssm_states(chunk.request.seq)
                    self._snapshot(chunk.request)
                self._publish(chunk.request)
            for request in finished:
                self._remove(request)
        except BaseException as error:
            self._fail_requests([chunk.request for chunk in chunks], error)
            raise
        self._outbox += finished
        self.calls["final_states"] = self.calls.get("final_states", 0) + 1
        self.seconds["final_states"] = self.seconds.get("final_states", 0.0) + time.perf_counter() - started

    def _read_back(self) -> None:
        """Read the step in flight back (if any) and apply it; every request it changed or
        finished goes to the outbox. The one place a launched step is read back."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._outbox += self._finish(step)

    def _hand_out(self) -> list[Request]:
        """Empty the outbox: each changed request once, in the order first changed."""
        changed, self._outbox = self._outbox, []
        return list({id(r): r for r in changed}.values())

    def _launched(self, plan: StepPlan, method: str, result: Any) -> LaunchedStep:
        """After the step's forward call (``method``, which returned ``result``): queue its
        sampling; a decode row whose token is pending gets it on the device."""
        members = [*plan.decode, *(chunk.request for chunk in plan.prefill)]
        sampled = sampled_rows(plan, method, result)
        for chunk in plan.prefill:
            if not chunk.is_last:
                self.forward.normalize_ssm_states(chunk.request.seq)
                self._snapshot(chunk.request)
        self.calls[method] = self.calls.get(method, 0) + 1
        step = LaunchedStep(method, members, [r for requests, _ in sampled for r in requests],
                            ends=[r.seq.num_cached for r in members])
        if step.rows:
            rows = step.rows
            # A row's draw is fixed by its seed and the index of the token it draws.
            steps = [len(r.generated) + (r.seq.pending_token is not None) for r in rows]
            extras = [self._row_extras(r) for r in rows]
            step.sampled = self.sampler.sample_async(
                [logits for _, logits in sampled], [r.params for r in rows], [r.seed for r in rows], steps,
                extras if any(e is not None for e in extras) else None)
            for index, request in enumerate(rows):
                request.seq.pending_token = (step.sampled, index)
                request.prefilled = True
        return step

    def _speculate(self, requests: list[Request]) -> list[Request] | None:
        """A decode step with drafts: propose them, run ``verify``, sample every row as plain
        decoding would (the request's seed, the index of the token drawn), keep each request's
        drafts up to the first that differs from its row's sample plus that sample (or the one
        after the last draft), tell the model with the ``verdict``, apply the tokens in order
        through the stop rules. None when no request gets a draft (the plain step runs)."""
        from metrale.speculative import accepted_count

        config, drafter = self.speculation  # type: ignore[misc]
        limits = [self._draft_limit(r, config.num_speculative_tokens) for r in requests]
        if not any(limits):
            return None
        seqs = [r.seq for r in requests]
        try:
            drafts = self._checked_drafts(drafter.propose(seqs, limits), limits)
        except Exception:  # a drafter's failure costs the step its drafts, never its requests
            logger.warning("the %s drafter failed; decoding this step without drafts", config.method, exc_info=True)
            return None
        drafts = self._fit_drafts(seqs, drafts)
        if not any(drafts):
            return None
        logits = self.forward.verify([[seq.tokens[-1], *d] for seq, d in zip(seqs, drafts)], seqs)
        params, seeds, steps, extras = [], [], [], []
        for request, draft in zip(requests, drafts):
            extra = self._row_extras(request) if not draft else None  # (_draft_limit: none with drafts)
            for j in range(len(draft) + 1):
                params.append(request.params)
                seeds.append(request.seed)
                steps.append(len(request.generated) + j)
                extras.append(extra)
        sampled = self.sampler.sample_async([logits], params, seeds, steps,
                                            extras if any(e is not None for e in extras) else None)
        tokens, entries = sampled.tokens(), sampled.logprobs()
        rows = [len(d) + 1 for d in drafts]
        starts = np.concatenate([[0], np.cumsum(rows)]).astype(int)
        accepted = [accepted_count(d, tokens[start : start + len(d) + 1]) for d, start in zip(drafts, starts)]
        self.forward.verdict(seqs, rows, accepted)
        self.calls["verify"] = self.calls.get("verify", 0) + 1
        self.iteration_tokens.observe(sum(rows))
        self.draft_tokens += sum(len(d) for d in drafts)
        self.accepted_tokens += sum(accepted)
        self.drafted_sequences += sum(1 for d in drafts if d)
        changed: list[Request] = []
        for request, draft, kept, start in zip(requests, drafts, accepted, starts):
            request.num_draft_tokens += len(draft)
            request.num_accepted_tokens += kept
            for row in range(start, start + kept + 1):
                if not self._apply_token(request, tokens[row], entries[row]):
                    break
            changed.append(request)
            seq = request.seq
            if request.finish_reason is not None:
                # Rows kept past a stop computed positions whose tokens the request dropped.
                seq.num_cached = min(seq.num_cached, len(seq.tokens) - 1)
            self._publish(request)
            if request.finish_reason is not None:
                self._remove(request)
        return changed

    def _checked_drafts(self, proposed: Any, limits: list[int]) -> list[list[int]]:
        """The drafter's proposals cut to ``limits``; :class:`~metrale.errors.PluginError` unless
        they are one list per sequence of token ids within the vocabulary."""
        vocab = int(self.forward.model.vocab_size)
        if not isinstance(proposed, (list, tuple)) or len(proposed) != len(limits):
            raise PluginError(f"a drafter returned {proposed!r:.80} for {len(limits)} sequences (one list each)")
        drafts = []
        for tokens, limit in zip(proposed, limits):
            cut = list(tokens)[:limit]
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab for t in cut):
                raise PluginError(f"a drafter proposed {cut!r:.80}: not token ids below the vocabulary size {vocab}")
            drafts.append([int(t) for t in cut])
        return drafts

    def _draft_limit(self, request: Request, count: int) -> int:
        """How many drafts ``request`` may take this step: none while its token is pending or
        when its row needs more than its params (penalties, ``min_tokens``, a structured output:
        each later row would need the drafts before it applied), else up to ``count`` within its
        ``max_tokens`` and the model's context."""
        seq, params = request.seq, request.params
        if seq.pending_token is not None or request.grammar is not None or params.penalized:
            return 0
        if params.min_tokens and request.banned_tokens(self.stopper.eos_token_ids, False):
            return 0
        left = request.params.max_tokens - len(request.generated) - 1
        room = self.stopper.max_model_len - len(seq.tokens) - 1
        return max(0, min(count, left, room))

    def _fit_drafts(self, seqs: list[SequenceState], drafts: list[list[int]]) -> list[list[int]]:
        """``drafts`` shortened (the longest first) until the verify's rows fit the step's token
        budget (``max_num_batched_tokens``) and the free blocks."""
        cache = self.cache
        budget = self.scheduler.max_num_batched_tokens

        def fits() -> bool:
            if sum(len(d) + 1 for d in drafts) > budget:
                return False
            if not cache.spec.uses_blocks:
                return True
            needed = sum(cache.blocks_needed(seq, seq.num_cached + 1 + len(d)) for seq, d in zip(seqs, drafts))
            return needed <= cache.num_free_blocks

        while not fits() and any(drafts):
            longest = max(range(len(drafts)), key=lambda i: len(drafts[i]))
            drafts[longest] = drafts[longest][:-1]
        return drafts

    def _apply_token(self, request: Request, token: int, entry: Any) -> bool:
        """Append one sampled token to ``request`` and run the stop rules; False when the
        request is finished (by this token, or by logits with nothing to sample from)."""
        if token < 0:
            request.error = (
                f"the logits of request {request.request_id} are not finite (NaN or infinity) at generated "
                f"token {len(request.generated)}: there is nothing to sample from"
            )
            request.finish_reason = "error"
            return False
        request.seq.tokens.append(int(token))
        if entry is not None:
            request.token_logprobs.append(entry)
        if request.grammar is not None and not request.grammar.accept(int(token)):
            request.error = f"token {int(token)} does not match the structured output of request {request.request_id}"
            request.finish_reason = "error"
            return False
        self.stopper.update(request, int(token))
        return request.finish_reason is None

    def _row_extras(self, request: Request) -> RowExtras | None:
        """What the sampler needs for ``request``'s row besides its params (None: nothing)."""
        params = request.params
        pending = request.seq.pending_token is not None
        banned = request.banned_tokens(self.stopper.eos_token_ids, pending) if params.min_tokens else ()
        mask = None
        if request.grammar is not None:
            mask = np.zeros(-(-int(self.forward.model.vocab_size) // 32), dtype=np.int32)
            request.grammar.fill_bitmask(mask)
        if not (banned or mask is not None or params.penalized):
            return None
        seq = request.seq
        return RowExtras(key=seq.seq_id, tokens=seq.tokens, prompt_len=seq.prompt_len, mask=mask, banned=banned)

    def _fail_members(self, plan: StepPlan, error: BaseException) -> None:
        """A step that raised fails every request of its call (their cache released; nothing
        retried). They reach the caller with the error, not through the outbox."""
        self._fail_requests([*plan.decode, *(chunk.request for chunk in plan.prefill)], error)

    def _fail_requests(self, members: list[Request], error: BaseException) -> None:
        for request in members:
            self._remove(request)
            request.seq.pending_token = None
            request.error = f"the forward step failed: {error!r}"
            request.finish_reason = "error"
        failed = {id(r) for r in members}
        self._outbox = [r for r in self._outbox if id(r) not in failed]

    def _finish(self, step: LaunchedStep) -> list[Request]:
        """Read a launched step's tokens back and apply them: append each, run the stop rules,
        publish the blocks computed, remove the finished requests. A request that finished
        before (its row ran once more, planned ahead) keeps nothing of this step."""
        changed: list[Request] = []
        tokens = step.sampled.tokens() if step.sampled is not None else []
        logprobs = step.sampled.logprobs() if step.sampled is not None else []
        for request, token, entry in zip(step.rows, tokens, logprobs):
            seq = request.seq
            pending = seq.pending_token
            if pending is not None and pending[0] is step.sampled:
                seq.pending_token = None
            if request.finish_reason is not None:
                continue
            self._apply_token(request, token, entry)
            changed.append(request)
        for request, end in zip(step.members, step.ends):
            seq = request.seq
            if request.finish_reason is not None:
                # Finished while a row planned ahead runs: that row's token is dropped, and the
                # blocks it writes are not published (its step is not read back).
                seq.pending_token = None
                seq.num_cached = min(seq.num_cached, end)
            # Only what steps read back have computed is published: a block the step in flight
            # completes waits for that step's logits to prove finite.
            self._publish(request, upto=end)
            if request.finish_reason is not None:
                self._remove(request)
        return changed

    def _snapshot(self, request: Request) -> None:
        """After a chunk that ends on a block boundary: keep the sequence's recurrent state there,
        on the block it completes, for later prefix hits."""
        if self.prefix_cache is None or self.snapshots is None or request.seq.state_slot is None:
            return
        seq = request.seq
        if seq.num_cached % self.cache.block_size or not seq.num_cached:
            return
        self._publish(request)
        row = self.snapshots.take(seq.state_slot)
        if row is not None:
            self.prefix_cache.attach_snapshot(request.block_digests[seq.num_cached // self.cache.block_size - 1], row)

    def _publish(self, request: Request, upto: int | None = None) -> None:
        """Register the request's newly computed full blocks in the prefix cache (those before
        position ``upto`` when given)."""
        if self.prefix_cache is not None:
            publish_blocks(self.prefix_cache, request, upto)


def sampled_rows(plan: StepPlan, method: str, result: Any) -> list[tuple[list[Request], Any]]:
    """The requests of ``plan`` that sample a token and their logits rows, from the result of
    its contract call ``method`` (each method's own result shape)."""
    decode, prefill = plan.decode, plan.prefill
    if method == "decode_batch":
        return [(decode, result)]
    if method == "mixed_forward":
        (chunk,) = prefill
        return [(decode, result.decode_logits)] + ([([chunk.request], result.prefill_logits)] if chunk.is_last else [])
    if method == "prefill_chunk":
        (chunk,) = prefill
        return [([chunk.request], result)] if chunk.is_last else []
    return [([c.request], logits) for c, logits in zip(prefill, result) if c.is_last]


def publish_blocks(prefix_cache: PrefixCache, request: Request, upto: int | None = None) -> None:
    """Register ``request``'s computed full blocks not published yet in ``prefix_cache`` (at most
    its first ``upto`` positions) -- unless the request failed (its cache may hold what made its
    logits non-finite)."""
    if request.error is not None:
        return
    seq = request.seq
    computed = seq.num_cached if upto is None else min(upto, seq.num_cached)
    full = min(computed // prefix_cache.block_size, len(seq.block_table))
    if full > request.published_blocks:
        prefix_cache.publish(seq.tokens, seq.block_table, computed, request.block_digests,
                             seq.adapter_id, first=request.published_blocks)
        request.published_blocks = full
