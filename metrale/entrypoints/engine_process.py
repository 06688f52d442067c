"""An asynchronous engine in its own process: :class:`EngineProcess`.

:class:`~metrale.AsyncLLM` runs the engine on a thread of the caller's process, so every line of
Python its callers run -- an HTTP server's request parsing, JSON encoding, streamed chunks --
competes with the engine's host work for the interpreter lock. An ``EngineProcess`` takes the
same calls (:meth:`~EngineProcess.generate`, :meth:`~EngineProcess.submit`,
:meth:`~EngineProcess.abort`, :meth:`~EngineProcess.stats`, :meth:`~EngineProcess.shutdown`)
but loads the model in a child process whose only thread steps the engine; the callers' process
never loads a weight. The engine process is a fresh interpreter on a socket pair
(:func:`metrale.child_process.start_child`: the caller's ``__main__`` is not imported again, as it
would be by a ``multiprocessing`` start); it stops when the callers' process goes away.

What crosses between them:

* to the engine: each checked request (its prompt's token ids and its
  :class:`~metrale.SamplingParams`, or for a pooling request its resolved
  :class:`~metrale.PoolingParams`), aborts, LoRA adapters to add or remove, and the shutdown;
* from the engine, once per step: what each changed request gained -- its new token ids, the
  text they added, their log probabilities, how it finished; a pooling request's vector (float32)
  once it finished -- and the engine's :class:`~metrale.engine.driver.EngineStats`. The callers'
  side adds these up, so the outputs it hands out are the cumulative
  :class:`~metrale.RequestOutput`\\ s (and the :class:`~metrale.EmbeddingRequestOutput`\\ s) an
  ``AsyncLLM`` hands out.
  And the answer to each LoRA call (done, or the error it raised there).

Requests are checked on the callers' side (:class:`~metrale.entrypoints.frontend.PromptFrontend`: the
tokenizer, the chat template, the sampling defaults, the structured-output compiler), so a bad
request raises in :meth:`~EngineProcess.submit` and never reaches the engine (a structured
output is checked there in a sandbox process, :mod:`metrale.structured.sandbox`, and compiled by
the engine process beside its steps). If the engine process dies, every unfinished request ends
with ``finish_reason == "error"``; the ``EngineProcess`` then starts it again, up to
``max_restarts`` times, or stops taking requests. A restarted engine process reads again every
adapter served when the last one stopped (those added at run time included); one that can no
longer be read is dropped, with a logged error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from metrale.child_process import start_child
from metrale.engine.driver import EngineDriver, EngineStats
from metrale.engine.generation import RequestGroup, visible_text
from metrale.engine.pooling import PoolingGroup
from metrale.entrypoints.async_llm import (
    DEFAULT_MAX_WAITING_REQUESTS,
    AsyncEngineAPI,
    new_request_id,
    refuse_pooling_adapter,
)
from metrale.entrypoints.frontend import PromptFrontend
from metrale.entrypoints.prompts import Prompt
from metrale.errors import (
    AdapterError,
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    MetraleError,
    QueueFullError,
    RankError,
)
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.lora import LoRARequest
from metrale.params import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    LogprobsDict,
    PoolingParams,
    RequestOutput,
    SamplingParams,
)
from metrale.validation import check_int

logger = logging.getLogger(__name__)

#: Seconds the idle engine process waits for a message before it looks at its compiles again.
COMPILE_POLL_S = 0.005

#: Seconds :meth:`EngineProcess.shutdown` waits for the engine process beyond the drain time
#: before it is killed.
SHUTDOWN_GRACE_S = 60.0

# What one completion gained in a step: (index, new token ids, characters of the text sent
# before that stay, text added after them, new log-probability dicts or None, cumulative log
# probability or None, finish reason, stop reason).
_CompletionDelta = tuple[int, list[int], int, "str | None", "list[LogprobsDict] | None", "float | None",
                         "str | None", "str | int | None"]
# What one request gained: (request id, finished, error, cached tokens, preemptions, prompt log
# probabilities (in its first record only), its completions' deltas -- for a pooling request, its
# vector once it finished well: float32 [hidden_size], else an empty list).
_Record = tuple[str, bool, "str | None", int, int, Any, "list[_CompletionDelta] | np.ndarray"]
# The answer to one LoRA call: (call id, the error it raised or None).
_Reply = tuple[int, "BaseException | None"]


def _sendable(error: BaseException) -> BaseException:
    """``error``, or a :class:`~metrale.errors.MetraleError` saying what it was when it does not
    pickle (it crosses to the callers' side)."""
    try:
        pickle.dumps(error)
    except Exception:
        return MetraleError(f"{type(error).__name__}: {error}")
    return error


# ------------------------------------------------------------------------ the engine process


class _Sent:
    """What the callers' side has been sent of one completion."""

    __slots__ = ("tokens", "text", "logprobs", "cumulative")

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""
        self.logprobs = 0
        self.cumulative = 0.0


class _EngineLoop:
    """The engine process's loop: takes messages between steps, steps, and sends each step's
    records in one message."""

    def __init__(self, llm: Any, conn: Connection) -> None:
        self.llm = llm
        self.conn = conn
        self.driver = EngineDriver(llm)
        self.sent: dict[str, list[_Sent]] = {}
        self.records: list[_Record] = []
        self.stop_at: float | None = None
        self.connected = True
        #: Requests whose structured output compiles on :attr:`compiler_thread` (the engine's
        #: steps go on meanwhile), in arrival order: (future, their "add" message).
        self.compiling: list[tuple[Future | None, tuple]] = []
        self.compiler_thread = ThreadPoolExecutor(1, thread_name_prefix="metrale-grammar")

    def run(self) -> None:
        driver = self.driver
        with self.llm.backend.activate():
            while self.connected:
                if self.stop_at is not None:
                    if not (driver.has_work() or self.compiling):
                        break
                    if time.monotonic() >= self.stop_at:
                        self._abort_all()
                self._receive(block=not driver.has_work() and self.stop_at is None and not self.compiling)
                self._admit_compiled()
                try:
                    if driver.has_work():
                        for group in driver.step():
                            self._record(group)
                except Exception as error:  # never leave the callers waiting
                    for group in driver.fail_everything(error):
                        self._record(group)
                if driver.broken is not None:
                    for group in driver.fail_everything(RankError(driver.broken)):
                        self._record(group)
                    self._flush()
                    break
                self._retire()
                self._flush()
            self._abort_all()
            self._flush()
            self.compiler_thread.shutdown(wait=False, cancel_futures=True)
            if self.connected:
                self._send(("closed", [], driver.stats()))

    def _receive(self, block: bool) -> None:
        try:
            if block:
                self.conn.poll(None)
            elif self.compiling and not self.driver.has_work():
                self.conn.poll(COMPILE_POLL_S)  # (idle but for compiles: look at them again soon)
            while self.conn.poll(0):
                self._handle(self.conn.recv())
        except (EOFError, OSError):  # the callers' process is gone: nobody reads these requests
            self.connected = False

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "pool":
            self._add_pooling(message)
        elif kind == "add":
            structured = message[4].structured_output
            if self.compiling or (structured is not None and not self.llm.grammar_compiler().is_compiled(structured)):
                # Compiled beside the engine's steps; admitted in arrival order once compiled.
                future = self.compiler_thread.submit(self._compile, structured) if structured is not None else None
                self.compiling.append((future, message))
                return
            self._add(message)
        elif kind == "abort":
            if self._drop_compiling(message[1]):
                return
            group = self.driver.abort(message[1])
            if group is not None:
                self._record(group)
        elif kind == "add_lora":
            self._lora_call(message[1], self.driver.add_lora, message[2])
        elif kind == "remove_lora":
            # Requests still compiling were accepted before the removal: they keep the adapter.
            busy = [m[5].lora_int_id for _, m in self.compiling if m[5] is not None]
            self._lora_call(message[1], self.driver.remove_lora, message[2], busy)
        elif kind == "shutdown":
            self.stop_at = time.monotonic() + max(float(message[1]), 0.0)

    def _lora_call(self, call_id: int, method: Any, *args: Any) -> None:
        """Run a LoRA call and send its answer at once (before the next step's records)."""
        try:
            method(*args)
        except Exception as error:
            self._flush()
            self._send(("reply", (call_id, _sendable(error)), self.driver.stats()))
            return
        self._flush()
        self._send(("reply", (call_id, None), self.driver.stats()))

    def _retire(self) -> None:
        """Forget the removed adapters no request uses any more (nor a request still compiling)."""
        if self.driver.retiring:
            self.driver.retire([m[5].lora_int_id for _, m in self.compiling if m[5] is not None])

    def _compile(self, structured: Any) -> None:
        self.llm.grammar_compiler().compile(structured)

    def _admit_compiled(self) -> None:
        """Admit the requests whose structured output is compiled now, in arrival order."""
        while self.compiling:
            future, message = self.compiling[0]
            if future is not None and not future.done():
                return
            self.compiling.pop(0)
            self._add(message, future.exception() if future is not None else None)

    def _drop_compiling(self, request_id: str) -> bool:
        """Abort a request still waiting for its compile; False when there is none."""
        for index, (_, message) in enumerate(self.compiling):
            if message[1] == request_id:
                del self.compiling[index]
                self.records.append((request_id, True, None, 0, 0, None, []))
                return True
        return False

    def _add(self, message: tuple, compile_error: BaseException | None = None) -> None:
        """Start the request of an "add" message (its structured output compiled, if any)."""
        _, request_id, text, ids, params, lora = message
        try:
            if compile_error is not None:
                raise compile_error
            group = self.llm.new_group(text, ids, params, request_id=request_id, lora=self.llm.lora_requests(lora, 1)[0])
        except Exception as error:  # checked by the callers' side already; fails this request only
            self.records.append((request_id, True, f"the request could not be started: {error}", 0, 0, None, []))
            return
        self._admit(group)

    def _add_pooling(self, message: tuple) -> None:
        """Start the pooling request of a "pool" message."""
        _, request_id, text, ids, params = message
        try:
            group = self.llm.new_pooling_group(text, ids, params, request_id=request_id)
        except Exception as error:  # checked by the callers' side already; fails this request only
            self.records.append((request_id, True, f"the request could not be started: {error}", 0, 0, None, []))
            return
        self._admit(group)

    def _admit(self, group: Any) -> None:
        try:
            admitted = self.driver.admit(group)
        except Exception as error:
            for failed in self.driver.fail_everything(error, [group]):
                self._record(failed)
            return
        if not admitted:
            self._record(group)

    def _abort_all(self) -> None:
        for _, message in list(self.compiling):
            self._drop_compiling(message[1])
        for request_id in list(self.driver.groups):
            group = self.driver.abort(request_id)
            if group is not None:
                self._record(group)

    def _record(self, group: RequestGroup | PoolingGroup) -> None:
        if isinstance(group, PoolingGroup):
            request = group.request
            vector = request.embedding if request.embedding is not None and group.finished else []
            self.records.append((group.request_id, group.finished, group.error or request.error, 0,
                                 request.num_preemptions, None, vector))
            return
        first_time = group.request_id not in self.sent
        sent = self.sent.setdefault(group.request_id, [_Sent() for _ in group.completions])
        done = group.finished
        deltas: list[_CompletionDelta] = []
        for request, already in zip(group.completions, sent):
            finished = done or request.finish_reason is not None
            generated = request.generated
            total = len(generated)
            text = visible_text(request, finished)
            if text is None:
                keep, added = 0, None
            elif text.startswith(already.text):
                keep, added = len(already.text), text[len(already.text):]
            else:
                keep, added = 0, text
            new_logprobs = cumulative = None
            if request.params.logprobs is not None:
                dicts = request.logprob_dicts()
                new_logprobs = dicts[already.logprobs:]
                for entry in request.token_logprobs[already.tokens: total]:
                    already.cumulative += entry.logprob
                cumulative = float(already.cumulative)
                already.logprobs = len(dicts)
            deltas.append((request.index, list(generated[already.tokens:]), keep, added, new_logprobs, cumulative,
                           (request.finish_reason or "length") if finished else None, request.stop_reason))
            already.tokens = total
            if text is not None:
                already.text = text
        first = group.completions[0]
        errors = [c.error for c in group.completions if c.error is not None]
        self.records.append((
            group.request_id, done, group.error or (errors[0] if errors else None), first.cached_tokens or 0,
            sum(c.num_preemptions for c in group.completions), group.prompt_logprobs if first_time else None, deltas,
        ))
        if done:
            del self.sent[group.request_id]

    def _flush(self) -> None:
        if self.records:
            records, self.records = self.records, []
            self._send(("outputs", records, self.driver.stats()))

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, EOFError):
            self.connected = False


def engine_summary(llm: Any) -> dict[str, Any]:
    """What a loaded :class:`~metrale.LLM` runs with, as plain values (the engine process sends
    them to the callers' side): the device, the model, the KV cache and the scheduling options.
    ``metrale serve`` logs it at start-up (:func:`metrale.entrypoints.server.main.summary_lines`)."""
    config = llm.config
    cache = llm.cache
    lora = llm.lora
    speculative = config.speculative_config
    graphs_off = _cuda_graphs_off_reason(llm)
    return {
        "backend": llm.backend.name,
        "device": _device_name(llm.backend),
        "model": str(llm.checkpoint.path),
        "family": llm.family.name,
        "dtype": _weight_dtype(llm.backend),
        "max_model_len": int(llm.max_model_len),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "kv_cache_blocks": int(cache.num_blocks),
        "block_size": int(cache.block_size),
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "state_slots": cache.state_slots.num_slots if cache.state_slots is not None else None,
        "prefix_caching": llm.engine.prefix_cache is not None,
        "cuda_graphs": graphs_off is None,
        "cuda_graphs_off_reason": graphs_off,
        "overlap_scheduling": bool(llm.engine.overlap),
        "lora": None if lora is None else {
            "adapters": [request.lora_name for request in llm.list_loras()],
            "max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank,
        },
        "speculative": None if speculative is None else {
            "method": speculative.method, "num_speculative_tokens": speculative.num_speculative_tokens,
        },
        "tensor_parallel_size": config.tensor_parallel_size,
        "expert_parallel": config.expert_parallel,
        "batch_invariant": config.batch_invariant,
    }


def _device_name(backend: Any) -> str:
    """``cpu``, or ``cuda:N (GPU name)``."""
    device = getattr(backend, "device", None)
    if backend.name != "cuda" or device is None:
        return backend.name
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
        return f"cuda:{device.id} ({name.decode() if isinstance(name, bytes) else name})"
    except Exception:  # the name is a courtesy: never fail the start for it
        return f"cuda:{device.id}"


def _weight_dtype(backend: Any) -> str:
    # The GPU backend keeps weights and cache as bf16 bits in uint16 arrays.
    dtype = np.dtype(backend.cache_dtype)
    return "bfloat16" if dtype == np.uint16 else dtype.name


def _cuda_graphs_off_reason(llm: Any) -> str | None:
    """Why decode steps are not replayed from CUDA graphs, or None when they are."""
    if llm.backend.name != "cuda":
        return "not on a GPU"
    if not llm.config.cuda_graphs:
        return "--no-cuda-graphs"
    graphs = getattr(getattr(llm.model, "runner", None), "graphs", None)
    if graphs is None:
        return f"{type(llm.model).__name__} cannot be captured"
    return graphs.disabled


def _engine_process_main(fd: int) -> None:
    """The engine process, on the socket ``fd``: take the model and its options, load it, say
    it is ready (or why it failed), run the loop. The adapters sent are read before it is ready:
    a bad one fails the start (``strict``, the first start) or is dropped and reported in the
    "ready" payload (a restart: the adapters served when the last engine process stopped)."""
    # The callers' side decides when to stop (a signal to the whole process group, as Ctrl-C
    # or a service manager sends, reaches both; the server then drains its requests first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        model, options, chat_template, capture_graphs, lora_modules, strict = conn.recv()
    except (EOFError, OSError):
        return
    from metrale.entrypoints.llm import LLM

    try:
        llm = LLM(model, chat_template=chat_template, **options)
        # Every structured output reaching this process was checked by the callers' side, in its
        # sandbox (EngineProcess.submit): compiled here directly.
        llm.isolate_grammars = False
        dropped: list[tuple[int, str]] = []
        for lora in lora_modules:
            try:
                llm.add_lora(lora)
            except Exception as error:
                if strict:
                    raise
                dropped.append((lora.lora_int_id, str(error)))
        if capture_graphs:
            llm.capture_graphs()
    except BaseException as error:
        try:
            conn.send(("failed", error))
        except Exception:  # an error that does not pickle
            conn.send(("failed", MetraleError(f"{type(error).__name__}: {error}")))
        return
    try:
        conn.send(("ready", {
            "path": str(llm.checkpoint.path), "tokenizer_path": str(llm.tokenizer_path),
            "vocab_size": llm.vocab_size, "max_model_len": llm.max_model_len,
            "eos_token_ids": list(llm.eos_token_ids), "max_num_seqs": llm.config.max_num_seqs,
            "device": llm.backend.name, "summary": engine_summary(llm), "dropped_loras": dropped,
            "pooling_unavailable": llm.pooling_unavailable, "embedding_size": llm.embedding_size,
        }))
        _EngineLoop(llm, conn).run()
    finally:
        llm.close()
        conn.close()


# --------------------------------------------------------------------------- the callers' side


class _CompletionState:
    __slots__ = ("index", "token_ids", "text", "logprobs", "cumulative", "finish_reason", "stop_reason")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text: str | None = None
        self.logprobs: list[LogprobsDict] | None = None
        self.cumulative: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class RemoteRequest:
    """A request :meth:`EngineProcess.submit` sent to the engine: :meth:`next_output` waits for
    its next output (the last has ``finished`` True), as
    :class:`~metrale.entrypoints.async_llm.SubmittedRequest`'s does."""

    def __init__(self, request_id: str, text: str | None, ids: list[int], n: int,
                 loop: asyncio.AbstractEventLoop, lora_request: Any = None) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.loop = loop
        self.prompt = text
        self.prompt_token_ids = ids
        self.completions = [_CompletionState(i) for i in range(n)]
        self.finished = False
        self.error: str | None = None
        self.cached_tokens = 0
        self.num_preemptions = 0
        self.prompt_logprobs: Any = None
        self.submitted = time.monotonic()
        self._ready = asyncio.Event()

    def apply(self, record: _Record) -> None:  # on the request's event loop
        _, finished, error, cached, preemptions, prompt_logprobs, deltas = record
        if self.finished:
            return
        for index, new_ids, keep, added, new_logprobs, cumulative, finish_reason, stop_reason in deltas:
            state = self.completions[index]
            state.token_ids.extend(new_ids)
            if added is not None:
                state.text = (state.text or "")[:keep] + added
            if new_logprobs is not None:
                state.logprobs = (state.logprobs or []) + new_logprobs
            state.cumulative = cumulative
            state.finish_reason, state.stop_reason = finish_reason, stop_reason
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        self.cached_tokens, self.num_preemptions = cached, preemptions
        if error is not None:
            self.error = error
        if finished:
            self.finished = True
            for state in self.completions:
                if state.finish_reason is None:
                    state.finish_reason = "error" if self.error is not None else "abort"
        self._ready.set()

    async def next_output(self) -> RequestOutput:
        """The newest output not taken yet (waits for one)."""
        await self._ready.wait()
        self._ready.clear()
        return self.output()

    def output(self) -> RequestOutput:
        """The request's output so far."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[CompletionOutput(index=s.index, text=s.text, token_ids=list(s.token_ids),
                                      cumulative_logprob=s.cumulative,
                                      logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                      finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                     for s in self.completions],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            cached_tokens=self.cached_tokens,
            error=self.error,
            num_preemptions=self.num_preemptions,
            lora_request=self.lora_request,
        )


def _settle(future: Future, error: BaseException | None) -> None:
    """Give ``future`` its answer, unless its caller stopped waiting for it."""
    if not future.set_running_or_notify_cancel():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class RemotePoolingRequest:
    """A pooling request :meth:`EngineProcess.submit_pooling` sent to the engine:
    :meth:`next_output` waits for its one output, as
    :class:`~metrale.entrypoints.async_llm.SubmittedRequest`'s does."""

    def __init__(self, request_id: str, text: str | None, ids: list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.prompt = text
        self.prompt_token_ids = ids
        self.embedding: list[float] = []
        self.finished = False
        self.error: str | None = None
        self.num_preemptions = 0
        self.submitted = time.monotonic()
        self._ready = asyncio.Event()

    def apply(self, record: _Record) -> None:  # on the request's event loop
        _, finished, error, _, preemptions, _, vector = record
        if self.finished:
            return
        if isinstance(vector, np.ndarray):
            self.embedding = vector.tolist()
        self.num_preemptions = preemptions
        if error is not None:
            self.error = error
        self.finished = self.finished or finished
        self._ready.set()

    async def next_output(self) -> EmbeddingRequestOutput:
        """The request's output once it is final (waits for it)."""
        await self._ready.wait()
        self._ready.clear()
        return self.output()

    def output(self) -> EmbeddingRequestOutput:
        """The request's output so far (an empty embedding until it finished well)."""
        return EmbeddingRequestOutput(request_id=self.request_id, prompt=self.prompt,
                                      prompt_token_ids=self.prompt_token_ids,
                                      outputs=EmbeddingOutput(list(self.embedding)), finished=self.finished,
                                      error=self.error)


def _apply_all(items: list[tuple[RemoteRequest, _Record]]) -> None:  # on the callers' event loop
    for request, record in items:
        request.apply(record)


class EngineProcess(AsyncEngineAPI):
    """A model served to concurrent callers from an engine process (see the module docstring).

    ``model`` is a checkpoint folder or an embedded model name and ``options`` the engine
    options of :class:`~metrale.LLM` (``device``, ``max_num_seqs``, ...), ``chat_template`` as
    there; ``max_waiting_requests`` bounds the requests queued beyond the ``max_num_seqs`` that
    can run; ``capture_graphs`` records the CUDA graphs before the first request;
    ``lora_modules`` (a list of :class:`~metrale.loading.lora.LoRARequest`, with ``enable_lora=True``) are
    the adapters requests may name, each read and checked before the engine is ready;
    :meth:`add_lora` and :meth:`remove_lora` change them while it runs.
    ``max_restarts`` is how many times an engine process that stops unexpectedly (killed, or
    crashed) is started again: its unfinished requests fail, new ones get
    :class:`~metrale.errors.EngineClosedError` while the model loads again (:attr:`is_running` is
    False), then it serves as before; past that number, or when the new one fails to load, the
    ``EngineProcess`` stops taking requests. The constructor returns once the model is loaded,
    and raises what :class:`~metrale.LLM` would
    for bad options or a bad checkpoint; options that cannot be sent to another process (a
    ``plugin_manager``: the engine process loads the installed plugins itself) raise
    :class:`~metrale.errors.ConfigError` before any process starts. :attr:`llm` is the callers' side's
    :class:`~metrale.entrypoints.frontend.PromptFrontend`. Use it as ``async with EngineProcess(...) as
    engine:`` or call :meth:`shutdown`.
    """

    def __init__(self, model: str | Path, *, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 chat_template: str | Path | None = None, capture_graphs: bool = True,
                 lora_modules: Sequence[LoRARequest] = (), max_restarts: int = 0, **options: Any) -> None:
        self.max_waiting_requests = check_int("max_waiting_requests", max_waiting_requests, minimum=0)
        self.lora_modules = tuple(lora_modules)
        if not all(isinstance(lora, LoRARequest) for lora in self.lora_modules):
            raise ConfigError(f"lora_modules must be LoRARequests, got {lora_modules!r}")
        if not isinstance(model, (str, Path)) or not str(model):
            raise InvalidRequestError(f"model must be a checkpoint folder or an embedded model name, got {model!r}")
        for name, value in options.items():  # they cross to the engine process: plain values only
            try:
                pickle.dumps(value)
            except Exception:
                raise ConfigError(f"option {name}={value!r} cannot be sent to the engine process (plain values only; "
                                  "a plugin_manager, say, does not cross: the engine process loads the installed "
                                  "plugins itself)") from None
        template = str(chat_template) if isinstance(chat_template, Path) else chat_template
        self._start_options = (str(model), options, template, bool(capture_graphs))
        #: The adapters requests may name, by ``lora_int_id``: ``lora_modules``, then those
        #: :meth:`add_lora` added and :meth:`remove_lora` did not remove.
        self._adapters: dict[int, LoRARequest] = {lora.lora_int_id: lora for lora in self.lora_modules}
        #: LoRA calls sent and not answered yet: call id -> (future, kind, argument).
        self._calls: dict[int, tuple[Future, str, Any]] = {}
        self._next_call = 0
        self.max_restarts = check_int("max_restarts", max_restarts, minimum=0)
        #: Times the engine process was started again after it stopped unexpectedly.
        self.restarts = 0
        self._stopping = False
        self._conn, payload = self._start_engine_process()
        self.device: str = payload["device"]
        self.max_num_seqs: int = payload["max_num_seqs"]
        #: What the engine runs with (:func:`engine_summary`), as the engine process reported it.
        self.summary: dict[str, Any] = payload["summary"]
        #: The callers' side of the model: tokenizer, chat template, sampling defaults.
        self.llm = PromptFrontend(Checkpoint(Path(payload["path"])), vocab_size=payload["vocab_size"],
                                  max_model_len=payload["max_model_len"], chat_template=chat_template,
                                  tokenizer_path=payload["tokenizer_path"])
        self.llm.eos_token_ids = list(payload["eos_token_ids"])
        self.llm.pooling_unavailable = payload["pooling_unavailable"]
        self.llm.embedding_size = payload["embedding_size"]
        self._lock = threading.Lock()
        self._active: dict[str, RemoteRequest | RemotePoolingRequest] = {}
        self._stats = EngineStats()
        self._accepting = True
        self._alive = True
        self._restarting = False
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._read, name="metrale-engine-reader", daemon=True)
        self._reader.start()

    def _start_engine_process(self, restart: bool = False) -> tuple[Connection, dict[str, Any]]:
        """Start an engine process and wait until its model is loaded: its connection and its
        "ready" payload. Raises what loading raised there, or
        :class:`~metrale.errors.EngineClosedError` when it exited first. The first start reads
        ``lora_modules`` (a bad one fails it); a ``restart`` the adapters served now (a bad one is
        dropped: the payload's ``dropped_loras``)."""
        if restart:
            with self._lock:
                adapters = tuple(self._adapters.values())
        else:
            adapters = self.lora_modules
        process, conn = start_child("metrale.entrypoints.engine_process", "_engine_process_main")
        self._process: subprocess.Popen = process  # (seen by shutdown while the model loads)
        try:
            conn.send((*self._start_options, adapters, not restart))
            kind, payload = conn.recv()
        except (EOFError, OSError):
            code = process.wait(10)
            conn.close()
            raise EngineClosedError(f"the engine process exited (exit code {code}) before the model was loaded") from None
        except BaseException:
            process.kill()
            conn.close()
            raise
        if kind != "ready":
            process.wait(30)
            conn.close()
            raise payload
        return conn, payload

    # ------------------------------------------------------------------------------ callers

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None, lora_request: Any = None) -> RemoteRequest:
        """Check and send a request to the engine (the first half of :meth:`generate`; the
        same errors); must be called on the event loop that will read it. The caller reads it
        with :meth:`RemoteRequest.next_output` and must :meth:`abort` it if it stops reading
        before the last output."""
        loop = asyncio.get_running_loop()
        request_id = new_request_id(request_id)
        self._check_open()
        text, ids = self.llm.prompt_ids(prompt, "the prompt")
        params = self.llm.request_params(sampling_params if sampling_params is not None else SamplingParams())
        if params.structured_output is not None:  # a bad schema or grammar is refused here; the engine compiles it
            self.llm.grammar_compiler().check(params.structured_output)
        if lora_request is not None and (not isinstance(lora_request, LoRARequest)
                                         or self._adapters.get(lora_request.lora_int_id) != lora_request):
            raise InvalidRequestError(f"{lora_request!r} is not one of this engine's adapters (lora_modules, or "
                                      "one add_lora added): "
                                      f"{', '.join(sorted(r.lora_name for r in self._adapters.values())) or 'none'}")
        request = RemoteRequest(request_id, text, ids, params.n, loop, lora_request)
        return self._queue(request, ("add", request_id, text, ids, params, lora_request))

    def submit_pooling(self, prompt: Prompt, pooling_params: PoolingParams | None = None,
                       request_id: str | None = None, lora_request: Any = None) -> RemotePoolingRequest:
        """Check and send a pooling request to the engine (the first half of :meth:`embed`; the
        same errors); must be called on the event loop that will read it. Its one output comes
        through :meth:`RemotePoolingRequest.next_output`; the caller must :meth:`abort` it if it
        stops waiting before."""
        loop = asyncio.get_running_loop()
        request_id = new_request_id(request_id)
        self._check_open()
        text, ids = self.llm.prompt_ids(prompt, "the prompt")
        params = self.llm.pooling_params(pooling_params)
        refuse_pooling_adapter(lora_request)
        return self._queue(RemotePoolingRequest(request_id, text, ids, loop), ("pool", request_id, text, ids, params))

    def _queue(self, request: Any, message: tuple) -> Any:
        """Send ``message``, ``request``'s, to the engine within the queue's bound."""
        request_id = request.request_id
        with self._lock:
            self._check_open()
            if request_id in self._active:
                raise InvalidRequestError(f"request_id {request_id!r} is already running")
            limit = self.max_num_seqs + self.max_waiting_requests
            if len(self._active) >= limit:
                raise QueueFullError(
                    f"{len(self._active)} requests are running or waiting, as many as this engine accepts (max_num_seqs="
                    f"{self.max_num_seqs} + max_waiting_requests={self.max_waiting_requests}); retry later")
            self._active[request_id] = request
            self._send(message)
        return request

    def _prepare_structured_output(self, structured_output: Any) -> None:
        self.llm.grammar_compiler().check(structured_output)

    def abort(self, request_id: str) -> None:
        """Abort a running or waiting request (from any thread): it is dropped at the engine's
        next step and its cache freed; its reader gets a last output with ``finish_reason ==
        "abort"``. Unknown or finished ids are ignored."""
        with self._lock:
            if request_id in self._active and self._alive:
                self._send(("abort", request_id))

    @property
    def serves_lora(self) -> bool:
        """Whether the engine serves LoRA adapters (``enable_lora=True``)."""
        return self.summary.get("lora") is not None

    def list_loras(self) -> list[LoRARequest]:
        """The adapters requests may name: ``lora_modules``, then those :meth:`add_lora` added and
        :meth:`remove_lora` did not remove, by ``lora_int_id``."""
        return [lora for _, lora in sorted(self._adapters.items())]

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """See :meth:`AsyncEngineAPI.add_lora`: the engine process reads and checks the adapter
        between two steps; requests may name it once this returns. A restarted engine process
        reads it again."""
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"add_lora() takes a LoRARequest, got {lora_request!r}")
        if not self.serves_lora:
            raise ConfigError("adding a LoRA adapter needs an engine that serves LoRA: enable_lora=True")
        with self._lock:
            known = self._adapters.get(lora_request.lora_int_id)
            if known == lora_request:
                return
            if known is not None:
                raise AdapterError(f"lora_int_id {known.lora_int_id} already names adapter {known.lora_name!r} at "
                                   f"{known.lora_path}; give {lora_request.lora_name!r} another id")
            future = self._call("add_lora", lora_request)
        await asyncio.wrap_future(future)

    async def remove_lora(self, lora: str | int) -> None:
        """See :meth:`AsyncEngineAPI.remove_lora`: requests can no longer name the adapter once
        this is called; the engine process forgets it once the requests sent before have
        finished. While a stopped engine process is started again the adapter is only left out
        of the new one."""
        if isinstance(lora, bool) or not isinstance(lora, (str, int)):
            raise AdapterError(f"remove_lora() takes an adapter's lora_name or lora_int_id, got {lora!r}")
        with self._lock:
            if not self._accepting:
                raise EngineClosedError("the engine is shut down")
            found = [r for r in self._adapters.values()
                     if (r.lora_int_id == lora if isinstance(lora, int) else r.lora_name == lora)]
            if not found:
                raise AdapterError(f"no LoRA adapter {lora!r} is loaded (loaded: "
                                   f"{', '.join(repr(r.lora_name) for r in self._adapters.values()) or 'none'})")
            if len(found) > 1:
                raise AdapterError(f"{len(found)} loaded adapters are named {lora!r} (lora_int_id "
                                   f"{', '.join(str(r.lora_int_id) for r in found)}); remove one by its lora_int_id")
            del self._adapters[found[0].lora_int_id]
            if self._restarting or not self._alive:
                return  # (the engine process that starts next leaves it out)
            future = self._call("remove_lora", found[0].lora_int_id)
        try:
            await asyncio.wrap_future(future)
        except EngineClosedError:  # stopped meanwhile: a restarted one leaves it out
            pass
        except AdapterError:  # (read for no request yet, or already forgotten there: nothing to free)
            pass

    def _call(self, kind: str, argument: Any) -> Future:  # under self._lock
        """Send a LoRA call to the engine process; its future gets the answer."""
        self._check_open()
        self._next_call += 1
        future: Future = Future()
        self._calls[self._next_call] = (future, kind, argument)
        try:
            self._send((kind, self._next_call, argument))
        except BaseException:
            del self._calls[self._next_call]
            raise
        return future

    def _take_reply(self, reply: _Reply) -> None:  # on the reader thread
        call_id, error = reply
        with self._lock:
            call = self._calls.pop(call_id, None)
            if call is None:
                return
            future, kind, argument = call
            if error is None and kind == "add_lora":
                self._adapters[argument.lora_int_id] = argument
        _settle(future, error)

    def _fail_calls(self, reason: str) -> None:  # on the reader thread
        """Fail every LoRA call not answered: the engine process that took it is gone."""
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for future, _, _ in calls:
            _settle(future, EngineClosedError(reason))

    def stats(self) -> EngineStats:
        """The engine's load as of its last step (any thread)."""
        stats = self._stats
        return dataclasses.replace(stats, waiting=max(len(self._active) - stats.running, 0))

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken (False once :meth:`shutdown` began)."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        """Whether the engine process runs and new requests are taken."""
        return self._accepting and self._alive and self._process.poll() is None

    @property
    def num_active(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self._active)

    def _check_open(self) -> None:
        if not self._accepting:
            raise EngineClosedError("the engine is shut down; it takes no more requests")
        if self._restarting:
            raise EngineClosedError("the engine process stopped and is being started again; retry shortly")
        if not self._alive or self._process.poll() is not None:
            raise EngineClosedError(f"the engine process has stopped (exit code {self._process.returncode})")

    def _send(self, message: tuple) -> None:  # under self._lock
        try:
            self._conn.send(message)
        except (OSError, EOFError, ValueError):
            self._alive = False
            raise EngineClosedError("the engine process has stopped") from None

    # ----------------------------------------------------------------------------- lifetime

    def shutdown(self, drain_timeout: float = 0.0, close_llm: bool = True) -> None:
        """Stop taking requests; let the running ones finish for up to ``drain_timeout``
        seconds, then abort the rest and stop the engine process (which frees the model's
        memory; ``close_llm`` is accepted for :class:`~metrale.AsyncLLM`'s signature). Blocks
        until done; calling it again does nothing."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._accepting = False
            drain = max(float(drain_timeout), 0.0)
            if self._alive:
                try:
                    self._send(("shutdown", drain))
                except EngineClosedError:
                    pass
            elif self._restarting:
                self._process.kill()  # a model loading again serves nobody now
        self._done.wait(drain + SHUTDOWN_GRACE_S)
        try:
            self._process.wait(SHUTDOWN_GRACE_S if self._done.is_set() else 1.0)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not stop in time: it is killed")
            self._process.kill()
            self._process.wait(10)
        self._reader.join(10)
        self._conn.close()

    # ------------------------------------------------------------------------------- reader

    def _read(self) -> None:
        """Take the engine's messages (a thread of its own), applying each step's records on
        their requests' event loops; start the engine process again when it stops unexpectedly
        (``max_restarts``)."""
        while True:
            closed = self._read_connection(self._conn)
            with self._lock:
                self._alive = False
                orphans = list(self._active)
            self._fail_calls("the engine process stopped before it answered")
            code = self._exit_code()
            if orphans:
                reason = "the engine process stopped" + (f" (exit code {code})" if code is not None else "")
                logger.error("%s with %d requests unfinished; they fail", reason, len(orphans))
                self._dispatch([(request_id, True, reason, 0, 0, None, []) for request_id in orphans])
            if closed or self._stopping or self.restarts >= self.max_restarts or not self._restart(code):
                break
        self._done.set()

    def _read_connection(self, conn: Connection) -> bool:
        """Apply ``conn``'s messages until it ends; True when the engine process said it closed."""
        while True:
            try:
                kind, records, stats = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return False
            self._stats = stats
            if kind == "reply":
                self._take_reply(records)
                continue
            self._dispatch(records)
            if kind == "closed":
                return True

    def _exit_code(self) -> int | None:
        try:
            return self._process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def _restart(self, code: int | None) -> bool:
        """Start the engine process again after it stopped with ``code``; False when it could
        not be (the ``EngineProcess`` then stays down)."""
        self.restarts += 1
        logger.warning("the engine process stopped unexpectedly (exit code %s); starting it again (restart %d of %d)",
                       code, self.restarts, self.max_restarts)
        self._restarting = True
        try:
            self._conn.close()
            conn, payload = self._start_engine_process(restart=True)
        except BaseException as error:
            logger.error("the engine process could not be started again: %r", error)
            return False
        finally:
            self._restarting = False
        with self._lock:
            for int_id, why in payload["dropped_loras"]:
                lora = self._adapters.pop(int_id, None)
                logger.error("LoRA adapter %r could not be read again by the restarted engine process; requests can "
                             "no longer name it: %s", lora.lora_name if lora else int_id, why)
            self._conn = conn
            self._stats = EngineStats()
            self._alive = not self._stopping
        if self._stopping:  # shut down while it loaded
            return False
        logger.warning("the engine process runs again")
        return True

    def _dispatch(self, records: list[_Record]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, _Record]]] = {}
        with self._lock:
            for record in records:
                request = self._active.get(record[0])
                if request is None:
                    continue
                if record[1]:
                    del self._active[record[0]]
                batches.setdefault(request.loop, []).append((request, record))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_apply_all, items)
            except RuntimeError:  # the callers' event loop is closed: nobody reads these requests
                for request, record in items:
                    if not record[1]:
                        self.abort(request.request_id)
