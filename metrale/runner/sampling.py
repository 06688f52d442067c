"""Token sampling: one token per logits row, on the host or on the device.

Both backends sample the same way (:mod:`metrale.kernels.sampling`): a request's ``seed`` and
the index of the token being drawn (``step``) fix the uniform draw, so a seed gives the same
tokens on the CPU and on the GPU wherever the two backends' logits agree. A row whose logits hold
NaN or +infinity, or only -infinity, gets token -1.

Before a row is sampled its logits are processed (:mod:`metrale.kernels.logits_process`), on the
device on a GPU: a structured output's token bitmask (:mod:`metrale.kernels.token_mask`), the
request's ``logit_bias`` and the tokens ``min_tokens`` forbids, then the presence, frequency and
repetition penalties, counted on the device from the tokens sampled (:class:`PenaltySlots`), so
no step waits for the host. ``logprobs`` are taken from the logits before processing.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from metrale.params import MAX_LOGPROBS, SamplingParams

# metrale.kernels.sampling holds the kernel beside the reference (it imports numba), so it is
# imported on first use: ``import metrale`` stays free of numba.


def request_seed(seed: int | None, engine_seed: int, request_index: int) -> int:
    """The seed of one request: its own, or one derived from the engine seed and its index."""
    from metrale.kernels.sampling import _splitmix64

    if seed is not None:
        return int(seed)
    return _splitmix64((int(engine_seed) << 32) ^ int(request_index)) >> 1


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded ``seed`` (``n > 1``): the first keeps
    the request's seed, so ``n == 1`` and the first of ``n`` draw the same tokens."""
    from metrale.kernels.sampling import _splitmix64

    return seed if index == 0 else _splitmix64(int(seed) ^ (int(index) * 0x9E3779B97F4A7C15 & ((1 << 64) - 1))) >> 1


def parameter_arrays(params: Sequence[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(temperature, top_k, top_p)`` arrays of the rows: a temperature below
    :data:`~metrale.params.MIN_TEMPERATURE` is stored as 0 (greedy), top_k -1 as 0 (off) and a
    top_k above the vocabulary as the vocabulary size (all tokens)."""
    temperature = np.array([0.0 if p.greedy else p.temperature for p in params], dtype=np.float32)
    top_k = np.array([min(max(p.top_k, 0), vocab_size) for p in params], dtype=np.int32)
    top_p = np.array([p.top_p for p in params], dtype=np.float32)
    return temperature, top_k, top_p


def log_min_p_array(params: Sequence[SamplingParams]) -> np.ndarray:
    """``log(min_p)`` of the rows in float32 (-inf for min_p 0: keep all)."""
    return np.array([np.log(np.float32(p.min_p)) if p.min_p > 0 else -np.inf for p in params], dtype=np.float32)


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> list[int]:
    """One token per row of ``logits [R, vocab]`` (already processed)."""
    from metrale.kernels.sampling import request_uniform, sample_reference

    logits = np.asarray(logits, dtype=np.float32).reshape(len(params), -1)
    temperature, top_k, top_p = parameter_arrays(params, logits.shape[1])
    uniforms = np.array([request_uniform(s, t) for s, t in zip(seeds, steps)], dtype=np.float32)
    return sample_reference(logits, temperature, top_k, top_p, uniforms, log_min_p_array(params)).tolist()


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, step: int) -> int:
    """The token drawn from ``logits [vocab]`` by a request with ``seed`` at ``step``."""
    return sample_rows(np.asarray(logits).reshape(1, -1), [params], [seed], [step])[0]


@dataclass
class RowExtras:
    """What a row's logits processing needs besides its :class:`SamplingParams`.

    ``key`` names the request (completion) whose penalty counts the row uses, ``tokens`` its
    prompt and generated tokens known on the host (to rebuild its counts when it gets a slot),
    ``prompt_len`` how many of them are the prompt; ``mask`` the structured output's token bitmask
    for this token (int32 words, or None); ``banned`` tokens it may not draw now (``min_tokens``).
    """

    key: int
    tokens: Sequence[int] = ()
    prompt_len: int = 0
    mask: np.ndarray | None = None
    banned: Sequence[int] = ()


@dataclass
class TokenLogprobs:
    """Log probabilities of one sampled token: ``token``'s own (``logprob``, ``rank``) and the
    ``k`` most likely tokens (``top_ids``, ``top_logprobs``, most likely first)."""

    token: int
    logprob: float
    rank: int
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


class PenaltySlots:
    """Rows of the token-count table ``counts [capacity, vocab]`` int32, one per request that uses
    penalties (:mod:`metrale.kernels.logits_process`). A request gets a row the first time it is
    sampled with penalties (its counts rebuilt from its tokens on the host) and gives it back when
    it finishes (:meth:`release`); when every row is taken, the least recently sampled request
    not in the step loses its row, and rebuilds it when it is sampled again."""

    def __init__(self, xp: Any, capacity: int, vocab: int, allocate: Any = None) -> None:
        self.xp = xp
        self.capacity = capacity
        self.vocab = vocab
        self.counts = allocate((capacity, vocab)) if allocate is not None else xp.zeros((capacity, vocab), dtype=np.int32)
        self._owner: dict[int, int] = {}  # key -> slot
        self._free = list(range(capacity - 1, -1, -1))
        self._use = 0
        self._last_use: dict[int, int] = {}

    def slots(self, extras: Sequence[RowExtras | None], params: Sequence[SamplingParams]) -> np.ndarray:
        """The slot of every row (-1 for rows without penalties), giving rows to the requests
        that need one and rebuilding their counts."""
        from metrale.kernels.logits_process import PROMPT_FLAG

        slots = np.full(len(params), -1, dtype=np.int32)
        batch_keys = {extra.key for extra, p in zip(extras, params) if extra is not None and p.penalized}
        for row, (extra, p) in enumerate(zip(extras, params)):
            if extra is None or not p.penalized:
                continue
            self._use += 1
            self._last_use[extra.key] = self._use
            slot = self._owner.get(extra.key)
            if slot is None:
                slot = self._take(batch_keys)
                self._owner[extra.key] = slot
                tokens = np.asarray(extra.tokens, dtype=np.int64)
                prompt = np.unique(tokens[: extra.prompt_len])
                generated, counts = np.unique(tokens[extra.prompt_len :], return_counts=True)
                row_counts = np.zeros(self.vocab, dtype=np.int32)
                row_counts[prompt[prompt < self.vocab]] |= PROMPT_FLAG
                inside = generated < self.vocab
                row_counts[generated[inside]] += counts[inside].astype(np.int32)
                self.counts[slot] = self.xp.asarray(row_counts)
            slots[row] = slot
        return slots

    def _take(self, batch_keys: set[int]) -> int:
        if self._free:
            return self._free.pop()
        victims = [key for key in self._owner if key not in batch_keys]
        victim = min(victims, key=lambda key: self._last_use.get(key, 0))
        self._last_use.pop(victim, None)
        return self._owner.pop(victim)

    def release(self, key: int) -> None:
        """Give back the slot of ``key`` (nothing when it holds none)."""
        slot = self._owner.pop(key, None)
        self._last_use.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def used(self) -> int:
        return len(self._owner)


@dataclass
class LogitsPlan:
    """The host's description of one step's logits processing (module docstring)."""

    bias_rows: np.ndarray
    bias_tokens: np.ndarray
    bias_values: np.ndarray
    penalized: bool
    repetition: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    mask_rows: np.ndarray
    masks: np.ndarray | None
    logprob_ks: np.ndarray
    log_min_p: np.ndarray

    @property
    def wants_logprobs(self) -> bool:
        return bool((self.logprob_ks >= 0).any())

    @property
    def processes(self) -> bool:
        """Whether any row's logits change before sampling."""
        return bool(len(self.bias_rows)) or self.penalized or self.masks is not None


#: The plan of a step whose rows process nothing, by row count (read only).
_PLAIN_PLANS: dict[int, LogitsPlan] = {}


def _plain_plan(rows: int) -> LogitsPlan:
    plan = _PLAIN_PLANS.get(rows)
    if plan is None:
        none_i, none_f = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
        ones = np.ones(rows, dtype=np.float32)
        zeros = np.zeros(rows, dtype=np.float32)
        plan = _PLAIN_PLANS[rows] = LogitsPlan(
            bias_rows=none_i, bias_tokens=none_i, bias_values=none_f, penalized=False, repetition=ones,
            frequency=zeros, presence=zeros, mask_rows=np.full(rows, -1, dtype=np.int32), masks=None,
            logprob_ks=np.full(rows, -1, dtype=np.int32), log_min_p=np.full(rows, -np.inf, dtype=np.float32))
        for array in (ones, zeros, plan.mask_rows, plan.logprob_ks, plan.log_min_p):
            array.flags.writeable = False
    return plan


def plan_logits(params: Sequence[SamplingParams], extras: Sequence[RowExtras | None] | None, vocab: int) -> LogitsPlan:
    """The processing of one step's rows (a shared plan, made once, when no row asks for any:
    the common decode step pays one pass over its params)."""
    rows = len(params)
    if extras is None and not any(p.logit_bias or p.logprobs is not None or p.min_p > 0 or p.penalized for p in params):
        return _plain_plan(rows)
    extras = extras if extras is not None else [None] * rows
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    mask_rows = np.full(rows, -1, dtype=np.int32)
    masks: list[np.ndarray] = []
    for row, (p, extra) in enumerate(zip(params, extras)):
        entries = {t: b for t, b in p.logit_bias.items() if t < vocab}
        if extra is not None:
            for token in extra.banned:
                if 0 <= token < vocab:
                    entries[int(token)] = -math.inf
            if extra.mask is not None:
                mask_rows[row] = len(masks)
                masks.append(extra.mask)
        for token, value in entries.items():
            bias_rows.append(row)
            bias_tokens.append(token)
            bias_values.append(value)
    penalized = any(p.penalized for p in params)
    return LogitsPlan(
        bias_rows=np.asarray(bias_rows, dtype=np.int32),
        bias_tokens=np.asarray(bias_tokens, dtype=np.int32),
        bias_values=np.asarray(bias_values, dtype=np.float32),
        penalized=penalized,
        repetition=np.array([p.repetition_penalty for p in params], dtype=np.float32),
        frequency=np.array([p.frequency_penalty for p in params], dtype=np.float32),
        presence=np.array([p.presence_penalty for p in params], dtype=np.float32),
        mask_rows=mask_rows,
        masks=np.stack(masks).astype(np.int32, copy=False) if masks else None,
        logprob_ks=np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int32),
        log_min_p=log_min_p_array(params),
    )


def unpack_logprobs(ks: np.ndarray, ids: np.ndarray, values: np.ndarray, ranks: np.ndarray) -> list[TokenLogprobs | None]:
    """The per-row results of the logprobs kernel (or its reference)."""
    out: list[TokenLogprobs | None] = []
    for row, k in enumerate(ks.tolist()):
        if k < 0 or ids[row, 0] < 0:
            out.append(None)
            continue
        out.append(TokenLogprobs(int(ids[row, 0]), float(values[row, 0]), int(ranks[row]),
                                 ids[row, 1 : k + 1].tolist(), values[row, 1 : k + 1].tolist()))
    return out


class SampledTokens:
    """The tokens one step sampled, one per logits row: :attr:`device` holds them where the
    backend computes (int32 ``[R]``, what a later step's inputs can be fed from before they are
    read back, :meth:`metrale.runner.ModelRunner.run`), :meth:`tokens` on the host, waiting for
    them the first time it is called (-1 for a row with nothing to sample from);
    :meth:`logprobs` the rows' :class:`TokenLogprobs` (None for rows that did not ask)."""

    def __init__(self, device: Any, read: Any = None, tokens: list[int] | None = None,
                 logprobs: list[TokenLogprobs | None] | None = None) -> None:
        self.device = device
        self._read = read
        self._tokens = tokens
        self._logprobs = logprobs

    def tokens(self) -> list[int]:
        if self._tokens is None:
            tokens, self._logprobs = self._read()
            self._tokens, self._read = tokens, None
            return tokens
        return self._tokens

    def logprobs(self) -> list[TokenLogprobs | None]:
        tokens = self.tokens()
        return self._logprobs if self._logprobs is not None else [None] * len(tokens)


class TokenSampler:
    """Samples one token per row of a step's logits (see the module docstring)."""

    def __init__(self, backend: Any, max_num_seqs: int = 16) -> None:
        self.backend = backend
        #: Rows of penalty counts: one per running request that uses penalties (made on first use).
        self.penalty_capacity = max(int(max_num_seqs), 1)
        self.penalties: PenaltySlots | None = None

    def sample(self, logits: Any, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
               extras: Sequence[RowExtras | None] | None = None) -> list[int]:
        """One token per row of ``logits [R, vocab]`` (-1 for a row with nothing to sample from)."""
        return self.sample_async([logits], params, seeds, steps, extras).tokens()

    def release(self, key: int) -> None:
        """A request (completion) finished: its penalty counts are dropped."""
        if self.penalties is not None:
            self.penalties.release(key)

    def _penalty_slots(self, plan: LogitsPlan, params: Sequence[SamplingParams], extras: Any, vocab: int) -> np.ndarray:
        if not plan.penalized:
            return np.full(len(params), -1, dtype=np.int32)
        if self.penalties is None or self.penalties.vocab != vocab:
            self.penalties = self._new_penalties(vocab)
        return self.penalties.slots(extras if extras is not None else [None] * len(params), params)

    def _new_penalties(self, vocab: int) -> PenaltySlots:
        return PenaltySlots(np, self.penalty_capacity, vocab)

    def sample_async(self, logits: Sequence[Any], params: Sequence[SamplingParams], seeds: Sequence[int],
                     steps: Sequence[int], extras: Sequence[RowExtras | None] | None = None) -> SampledTokens:
        """One token per row of the row blocks ``logits`` (each ``[r, vocab]``, taken in order),
        queued on the backend without waiting for it (on the CPU it is computed at once).
        ``extras`` (one per row, or None) carries what processing needs besides the params."""
        from metrale.kernels import logits_process as lp
        from metrale.kernels.sampling import request_uniform, sample_reference

        parts = [np.asarray(self.backend.to_numpy(part), dtype=np.float32) for part in logits]
        if not parts:
            return SampledTokens(np.zeros(0, np.int32), tokens=[])
        raw = np.concatenate([p.reshape(len(p), -1) for p in parts])
        vocab = raw.shape[1]
        plan = plan_logits(params, extras, vocab)
        values = raw.copy() if plan.processes else raw
        if plan.masks is not None:
            from metrale.kernels.token_mask import apply_token_bitmask_reference

            apply_token_bitmask_reference(values, plan.masks, plan.mask_rows)
        lp.apply_logit_bias_reference(values, plan.bias_rows, plan.bias_tokens, plan.bias_values)
        slots = self._penalty_slots(plan, params, extras, vocab)
        if plan.penalized:
            assert self.penalties is not None
            lp.apply_penalties_reference(values, slots, self.penalties.counts, plan.repetition, plan.frequency, plan.presence)
        temperature, top_k, top_p = parameter_arrays(params, vocab)
        uniforms = np.array([request_uniform(s, t) for s, t in zip(seeds, steps)], dtype=np.float32)
        tokens = sample_reference(values, temperature, top_k, top_p, uniforms, plan.log_min_p)
        if plan.penalized:
            assert self.penalties is not None
            lp.count_tokens_reference(self.penalties.counts, slots, tokens)
        logprobs = None
        if plan.wants_logprobs:
            logprobs = unpack_logprobs(plan.logprob_ks, *lp.top_logprobs_reference(raw, tokens, plan.logprob_ks, MAX_LOGPROBS))
        return SampledTokens(tokens.astype(np.int32), tokens=tokens.tolist(), logprobs=logprobs)

    def prompt_logprobs(self, logits: Any, targets: Sequence[int], k: int) -> list[TokenLogprobs | None]:
        """Log probabilities of ``targets[i]`` under row ``i`` of ``logits [R, vocab]`` and the
        ``k`` most likely tokens of each row (a prompt's teacher-forced logits)."""
        from metrale.kernels import logits_process as lp

        raw = np.asarray(self.backend.to_numpy(logits), dtype=np.float32).reshape(len(targets), -1)
        ks = np.full(len(targets), k, dtype=np.int32)
        return unpack_logprobs(ks, *lp.top_logprobs_reference(raw, np.asarray(targets, np.int32), ks, max(k, 0)))

    def close(self) -> None:
        """Drop device buffers (none on the host)."""
        self.penalties = None


def new_sampler(backend: Any, max_num_seqs: int = 16) -> TokenSampler:
    """The sampler of ``backend``: the sampling kernel on the GPU, the reference on the CPU."""
    if backend.name == "cuda":
        return CudaSampler(backend, max_num_seqs)
    return TokenSampler(backend, max_num_seqs)


class CudaSampler(TokenSampler):
    """The sampling kernel on the backend's stream, replayed from a graph per batch shape, with
    the logits processing and logprobs kernels launched around it for the rows that ask. A step
    whose rows are all greedy takes the arg-max kernel instead (:mod:`metrale.kernels.greedy_sample`:
    the same tokens, every row spread over many blocks), without the sampling parameters' upload.

    Two sets of buffers per shape, used in turn: the tokens of one call stay on the device (and
    are read back) while the next call samples, as overlap scheduling needs. Before a set is
    used again, the call that used it last is read back."""

    def __init__(self, backend: Any, max_num_seqs: int = 16) -> None:
        super().__init__(backend, max_num_seqs)
        from metrale.kernels import greedy_sample
        from metrale.kernels.sampling import sample

        self._sample = sample
        self._greedy = greedy_sample
        self._buffers: dict[tuple[int, int, int], Any] = {}
        self._turn = 0

    def close(self) -> None:
        self._buffers.clear()
        self.penalties = None

    def _new_penalties(self, vocab: int) -> PenaltySlots:
        with self.backend.stream:
            return PenaltySlots(self.backend.xp, self.penalty_capacity, vocab)

    def _penalty_slots(self, plan: LogitsPlan, params: Sequence[SamplingParams], extras: Any, vocab: int) -> np.ndarray:
        with self.backend.stream:  # a rebuilt row's counts are written in stream order
            return super()._penalty_slots(plan, params, extras, vocab)

    def _upload(self, array: np.ndarray) -> Any:
        with self.backend.stream:
            return self.backend.xp.asarray(array)

    def sample_async(self, logits: Sequence[Any], params: Sequence[SamplingParams], seeds: Sequence[int],
                     steps: Sequence[int], extras: Sequence[RowExtras | None] | None = None) -> SampledTokens:
        from metrale.kernels import logits_process as lp

        backend = self.backend
        cp, stream = backend.xp, backend.stream
        rows = len(params)
        with stream:
            parts = []
            for part in logits:
                part = part.reshape(len(part), -1)
                if part.dtype != np.float32 or not part.flags.c_contiguous:
                    part = cp.ascontiguousarray(part, dtype=np.float32)
                parts.append(part)
        if sum(len(part) for part in parts) != rows:
            from metrale.errors import KernelArgumentError

            raise KernelArgumentError(f"sampling: {sum(len(p) for p in parts)} logits rows for {rows} requests")
        vocab = parts[0].shape[1]
        plan = plan_logits(params, extras, vocab)
        self._turn ^= 1
        buffers = self._buffers_for(rows, vocab, self._turn)
        if buffers.last is not None:
            buffers.last.tokens()  # its tokens are read before the buffers are written again
        temperature, top_k, top_p = parameter_arrays(params, vocab)
        greedy = buffers.greedy is not None and not temperature.any()
        host = buffers.host
        host.seeds[:] = np.asarray(seeds, dtype=np.uint64).view(np.int64)
        host.steps[:] = steps
        host.temperature[:] = temperature
        host.top_k[:] = top_k
        host.top_p[:] = top_p
        host.uniforms[:] = -1.0  # draw from (seed, step)
        host.log_min_p[:] = plan.log_min_p
        slots = self._penalty_slots(plan, params, extras, vocab)
        with stream:
            # One upload of every row's parameters, the logits into the sampler's own buffer,
            # the kernel (replayed from a graph after its first run: a numba launch costs far
            # more host time), one download of the tokens.
            if not greedy:
                buffers.device.data.copy_from_host_async(host.packed.ctypes.data_as(ctypes.c_void_p), host.packed.nbytes,
                                                         stream)
            offset = 0
            for part in parts:
                buffers.logits[offset:].data.copy_from_device_async(part.data, part.nbytes, stream)
                offset += len(part)
            raw = buffers.logits
            if plan.wants_logprobs and plan.processes:
                raw = cp.copy(buffers.logits)
            if plan.masks is not None:
                from metrale.kernels.token_mask import apply_token_bitmask

                apply_token_bitmask(buffers.logits, self._upload(plan.masks), self._upload(plan.mask_rows), stream)
            if len(plan.bias_rows):
                lp.apply_logit_bias(buffers.logits, self._upload(plan.bias_rows), self._upload(plan.bias_tokens),
                                    self._upload(plan.bias_values), stream)
            device_slots = None
            if plan.penalized:
                assert self.penalties is not None
                device_slots = self._upload(slots)
                lp.apply_penalties(buffers.logits, device_slots, self.penalties.counts, self._upload(plan.repetition),
                                   self._upload(plan.frequency), self._upload(plan.presence), stream)
            run, kind = (self._run_greedy, "greedy_graph") if greedy else (self._run, "graph")
            graph = getattr(buffers, kind)
            if graph:
                graph.launch(stream=stream)
            else:
                run(buffers)
                if backend.cuda_graphs and graph is None:
                    setattr(buffers, kind, self._record(buffers, run))
            tokens = buffers.views.tokens
            if device_slots is not None:
                assert self.penalties is not None
                lp.count_tokens(self.penalties.counts, device_slots, tokens, stream)
            tokens.data.copy_to_host_async(host.tokens.ctypes.data_as(ctypes.c_void_p), host.tokens.nbytes, stream)
            ks = None
            if plan.wants_logprobs:
                ks = plan.logprob_ks
                out = self._logprob_buffers(buffers)
                lp.top_logprobs(raw, tokens, self._upload(ks), out.ids, out.values, out.ranks, stream)
                for device, pinned in ((out.ids, out.host_ids), (out.values, out.host_values), (out.ranks, out.host_ranks)):
                    device.data.copy_to_host_async(pinned.ctypes.data_as(ctypes.c_void_p), pinned.nbytes, stream)
            buffers.done.record(stream)

        def read() -> tuple[list[int], list[TokenLogprobs | None] | None]:
            buffers.done.synchronize()
            logprobs = None
            if ks is not None:
                out = buffers.logprobs
                logprobs = unpack_logprobs(ks, out.host_ids, out.host_values, out.host_ranks)
            return host.tokens.tolist(), logprobs

        sampled = buffers.last = SampledTokens(tokens, read)
        return sampled

    def prompt_logprobs(self, logits: Any, targets: Sequence[int], k: int) -> list[TokenLogprobs | None]:
        from metrale.kernels import logits_process as lp

        cp, stream = self.backend.xp, self.backend.stream
        rows = len(targets)
        with stream:
            values = cp.ascontiguousarray(logits.reshape(rows, -1), dtype=np.float32)
            ks = np.full(rows, k, dtype=np.int32)
            ids = cp.empty((rows, k + 1), dtype=np.int32)
            out_values = cp.empty((rows, k + 1), dtype=np.float32)
            ranks = cp.empty(rows, dtype=np.int32)
            lp.top_logprobs(values, cp.asarray(np.asarray(targets, np.int32)), cp.asarray(ks), ids, out_values, ranks, stream)
            host = (cp.asnumpy(ids, stream=stream), cp.asnumpy(out_values, stream=stream), cp.asnumpy(ranks, stream=stream))
        stream.synchronize()
        return unpack_logprobs(ks, *host)

    def _logprob_buffers(self, buffers: Any) -> Any:
        if buffers.logprobs is None:
            import cupyx

            rows, cp = buffers.rows, self.backend.xp
            width = MAX_LOGPROBS + 1
            with self.backend.stream:
                buffers.logprobs = SimpleNamespace(
                    ids=cp.empty((rows, width), dtype=np.int32), values=cp.empty((rows, width), dtype=np.float32),
                    ranks=cp.empty(rows, dtype=np.int32),
                    host_ids=cupyx.empty_pinned((rows, width), dtype=np.int32),
                    host_values=cupyx.empty_pinned((rows, width), dtype=np.float32),
                    host_ranks=cupyx.empty_pinned((rows,), dtype=np.int32),
                )
        return buffers.logprobs

    def _run(self, buffers: Any) -> None:
        device = buffers.views
        self._sample(
            buffers.logits, device.temperature, device.top_k, device.top_p, device.seeds, device.steps,
            device.uniforms, device.tokens, self.backend.stream, log_min_p=device.log_min_p,
        )

    def _run_greedy(self, buffers: Any) -> None:
        greedy = buffers.greedy
        self._greedy.greedy_sample(buffers.logits, greedy.part_values, greedy.part_indices, greedy.counters,
                                   buffers.views.tokens, self.backend.stream)

    def _record(self, buffers: Any, run: Any) -> Any:
        """A graph of ``run(buffers)`` (a sampler kernel), or False when recording fails (that
        kernel then stays eager for this shape; the capture is ended and discarded)."""
        stream = self.backend.stream
        stream.begin_capture(getattr(self.backend.xp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            run(buffers)
            return stream.end_capture()
        except Exception:
            if stream.is_capturing():
                stream.end_capture()
            return False

    def _buffers_for(self, rows: int, vocab: int, turn: int) -> Any:
        """Pinned host and device buffers of ``rows`` rows of sampling parameters, logits and
        tokens, with the sampler's graph; kept per shape and turn."""
        buffers = self._buffers.get((rows, vocab, turn))
        if buffers is not None:
            return buffers
        import cupyx

        backend = self.backend
        # Packed per row: seed and step (int64), temperature, top_k, top_p, uniform, log_min_p (32-bit).
        packed = cupyx.empty_pinned((rows * ROW_BYTES,), dtype=np.uint8)
        tokens = cupyx.empty_pinned((rows,), dtype=np.int32)
        # From the default pool, as everything that outlives a step: the graph pool hands the
        # memory a finished capture freed to later allocations while that graph still writes it
        # (the tokens are read by the next step's feed; the greedy kernel's counters must keep
        # their zeros from one launch to the next).
        with backend.stream, backend.xp.cuda.using_allocator(backend.xp.get_default_memory_pool().malloc):
            device = backend.xp.empty(rows * ROW_BYTES, dtype=np.uint8)
            out = backend.xp.empty(rows, dtype=np.int32)
            logits = backend.xp.empty((rows, vocab), dtype=np.float32)
            greedy = None  # the arg-max kernel's scratch, where it serves the vocabulary
            if self._greedy.supports(vocab):
                parts = self._greedy.parts(vocab)
                greedy = SimpleNamespace(part_values=backend.xp.empty((rows, parts), dtype=np.float32),
                                         part_indices=backend.xp.empty((rows, parts), dtype=np.int32),
                                         counters=backend.xp.zeros(rows, dtype=np.int32))

        def fields(array: Any) -> dict[str, Any]:
            return {
                "seeds": array[: 8 * rows].view(np.int64),
                "steps": array[8 * rows : 16 * rows].view(np.int64),
                "temperature": array[16 * rows : 20 * rows].view(np.float32),
                "top_k": array[20 * rows : 24 * rows].view(np.int32),
                "top_p": array[24 * rows : 28 * rows].view(np.float32),
                "uniforms": array[28 * rows : 32 * rows].view(np.float32),
                "log_min_p": array[32 * rows : 36 * rows].view(np.float32),
            }

        buffers = self._buffers[(rows, vocab, turn)] = SimpleNamespace(
            rows=rows,
            host=SimpleNamespace(packed=packed, tokens=tokens, **fields(packed)),
            device=device,
            logits=logits,
            views=SimpleNamespace(tokens=out, **fields(device)),
            graph=None,
            greedy=greedy,
            greedy_graph=None,
            done=backend.xp.cuda.Event(disable_timing=True),
            last=None,
            logprobs=None,
        )
        return buffers


#: Bytes of one row's packed sampling parameters.
ROW_BYTES = 36
