"""The asynchronous engine: :class:`AsyncLLM`, requests submitted at any time by any number of
callers, each receiving its outputs as they are made.

One background thread, the *engine thread*, owns the model, its cache and its
:class:`~metrale.engine.engine.Engine`, and steps continuously while there is work. Callers (on
an asyncio event loop) submit requests with :meth:`AsyncLLM.generate`; a request joins the
running batch at the engine's next step, and every step's new tokens reach the caller's async
iterator through its event loop. Leaving the iterator early -- ``break``, an exception, a
cancelled task, a disconnected HTTP client -- aborts the request at the next step: its KV blocks,
its state slot and its sampler state are freed.

Pooling requests (embeddings, :mod:`metrale.engine.pooling`) go the same way:
:meth:`AsyncLLM.embed` (or :meth:`AsyncLLM.encode`, vLLM's name, or :meth:`AsyncLLM.submit_pooling`)
queues one, it joins the engine's steps beside the generation requests, and its one output --
the vector -- reaches the caller when its prompt's last chunk has run.

Validation (the prompt, the sampling options, a structured output's schema) happens in the
caller, when :meth:`AsyncLLM.generate` is called, so a bad request raises there and never reaches
the engine. The waiting queue is bounded: with ``max_num_seqs`` requests able to run, at most
``max_num_seqs + max_waiting_requests`` are accepted at once; past that, ``generate`` raises
:class:`~metrale.errors.QueueFullError` at once.

Outputs are cumulative (each holds everything generated so far, as
:meth:`metrale.LLM.generate_stream`'s): when a caller reads more slowly than tokens arrive, it
gets the newest output and skips the ones in between, losing nothing. An output is made only once
the caller has taken the one before (and always for the last), so a slow reader costs the engine
thread nothing per token.

LoRA adapters can be added and removed while requests run (:meth:`AsyncEngineAPI.add_lora`,
:meth:`AsyncEngineAPI.remove_lora`): the engine thread reads and checks an added adapter between
two steps, and forgets a removed one once the last request using it has finished.

The :class:`~metrale.LLM` under an ``AsyncLLM`` is taken for the ``AsyncLLM``'s lifetime (its own
``generate`` raises :class:`~metrale.errors.EngineBusyError` meanwhile); both drive the same
:class:`~metrale.engine.engine.Engine` class.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from metrale.engine.driver import EngineDriver, EngineStats
from metrale.entrypoints.prompts import Prompt
from metrale.errors import AdapterError, ConfigError, EngineClosedError, InvalidRequestError, QueueFullError
from metrale.loading.lora import LoRARequest
from metrale.params import EmbeddingRequestOutput, PoolingParams, RequestOutput, SamplingParams
from metrale.validation import check_int

logger = logging.getLogger(__name__)

#: Waiting requests an :class:`AsyncLLM` accepts by default beyond the running ones.
DEFAULT_MAX_WAITING_REQUESTS = 1024


def new_request_id(request_id: str | None) -> str:
    """``request_id``, checked (a non-empty string), or a new one when None."""
    if request_id is None:
        return f"req-{uuid.uuid4().hex}"
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
    return request_id


def refuse_pooling_adapter(lora_request: Any) -> None:
    """Pooling requests run on the base model: an adapter is refused
    (:class:`~metrale.errors.InvalidRequestError`)."""
    if lora_request is not None:
        raise InvalidRequestError(f"pooling requests (embeddings) run on the base model; a LoRA adapter "
                                  f"({getattr(lora_request, 'lora_name', lora_request)!r}) is not served for them")


class _OutputStream:
    """One request's newest output, handed from the engine thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.latest: RequestOutput | EmbeddingRequestOutput | BaseException | None = None
        self.ready = asyncio.Event()
        #: An output was handed over and the caller has not taken it yet (read by the engine
        #: thread, which then only marks the request as having more).
        self.unread = False

    def push(self, item: RequestOutput | EmbeddingRequestOutput | BaseException) -> None:  # on the event loop
        self.latest = item
        self.ready.set()

    async def next(self) -> Any:
        await self.ready.wait()
        self.ready.clear()
        item, self.latest = self.latest, None
        self.unread = False
        # Hand the interpreter lock to the engine thread if it waits for it: the engine's steps
        # come first, and callers that fall behind get several tokens per output instead.
        time.sleep(0)
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


@dataclass
class SubmittedRequest:
    """A request :meth:`AsyncLLM.submit` (or :meth:`AsyncLLM.submit_pooling`) queued:
    :meth:`next_output` waits for its next output (the last has ``finished`` True; a pooling
    request's one output is an :class:`~metrale.params.EmbeddingRequestOutput`)."""

    group: Any
    stream: _OutputStream
    finished: bool = False
    submitted: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return self.group.request_id

    async def next_output(self) -> Any:
        """The newest output not taken yet (waits for one)."""
        return await self.stream.next()


class AsyncEngineAPI:
    """What :class:`AsyncLLM` and :class:`~metrale.entrypoints.engine_process.EngineProcess` share: the
    async iteration over a request's outputs, the awaiting of a pooling request's vector and the
    ``async with`` block. A subclass provides ``submit``, ``submit_pooling``, ``abort``,
    ``stats``, ``num_active``, ``is_running``, ``shutdown``, and the LoRA calls ``serves_lora``,
    ``list_loras``, ``add_lora`` and ``remove_lora``."""

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None, lora_request: Any = None) -> Any:
        raise NotImplementedError

    def submit_pooling(self, prompt: Prompt, pooling_params: PoolingParams | None = None,
                       request_id: str | None = None, lora_request: Any = None) -> Any:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    @property
    def num_active(self) -> int:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def shutdown(self, drain_timeout: float = 0.0, close_llm: bool = True) -> None:
        raise NotImplementedError

    def _prepare_structured_output(self, structured_output: Any) -> None:
        raise NotImplementedError

    @property
    def serves_lora(self) -> bool:
        """Whether the engine serves LoRA adapters (it was built with ``enable_lora=True``)."""
        raise NotImplementedError

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine serves now (added and not removed), by ``lora_int_id``."""
        raise NotImplementedError

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check the adapter of ``lora_request`` (a :class:`~metrale.loading.lora.LoRARequest`)
        in the engine, between two of its steps, so that requests may name it. Raises
        :class:`~metrale.errors.AdapterError` for an adapter the model cannot serve (no such
        folder, no ``adapter_config.json``, a rank above ``max_lora_rank``, a projection the model
        lacks, ...) or a ``lora_int_id`` that already names another adapter,
        :class:`~metrale.errors.ConfigError` when the engine serves no LoRA and
        :class:`~metrale.errors.EngineClosedError` when it is not running. Adding an adapter
        already served under the same id, name and folder does nothing."""
        raise NotImplementedError

    async def remove_lora(self, lora: str | int) -> None:
        """Remove the served adapter named ``lora`` (a ``lora_name``) or of ``lora_int_id``
        ``lora`` (an int). Requests already submitted with it run to their end with it; the
        engine forgets it (its memory and its device slot freed) once the last has finished.
        Raises :class:`~metrale.errors.AdapterError` when no served adapter has that name or
        id (or several have that name), :class:`~metrale.errors.EngineClosedError` when the
        engine is not running."""
        raise NotImplementedError

    async def check_structured_output(self, structured_output: Any) -> None:
        """Check a request's structured output (a
        :class:`~metrale.structured.StructuredOutputParams`) on a worker thread, so this event
        loop goes on serving meanwhile, however long the check takes (:mod:`metrale.structured.sandbox`);
        :meth:`submit` then finds it checked. Raises
        :class:`~metrale.errors.InvalidRequestError` for a constraint that is bad, over a limit
        or admits no output. :meth:`generate` calls it before submitting."""
        await asyncio.to_thread(self._prepare_structured_output, structured_output)

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and iterate over its outputs as they are made; the last has
        ``finished`` True. ``prompt`` is a text, a list of token ids or a prompt dict (as
        :meth:`metrale.LLM.generate` takes); ``request_id`` names it for :meth:`abort` (unique
        among the running requests; default: a new one); ``lora_request`` (a
        :class:`~metrale.loading.lora.LoRARequest`) runs it with that adapter (the engine serving LoRA).

        Raises :class:`~metrale.errors.InvalidRequestError` (and its subclasses) for a bad
        request, :class:`~metrale.errors.QueueFullError` when the waiting queue is full and
        :class:`~metrale.errors.EngineClosedError` after :meth:`shutdown` -- all before the
        first output. Leaving the iteration early aborts the request."""
        structured = getattr(sampling_params, "structured_output", None)
        if structured is not None:
            await self.check_structured_output(structured)
        active = self.submit(prompt, sampling_params, request_id, lora_request)
        done = False
        try:
            while True:
                output = await active.next_output()
                done = output.finished
                yield output
                if done:
                    return
        finally:
            if not done:
                self.abort(active.request_id)

    async def encode(
        self, prompt: Prompt, pooling_params: PoolingParams | None = None, request_id: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's name: submit one pooling request (an embedding) and iterate over its outputs --
        one, final (``finished`` True), once its prompt has run. Arguments and errors as
        :meth:`embed`'s; leaving the iteration early aborts the request."""
        active = self.submit_pooling(prompt, pooling_params, request_id, lora_request)
        done = False
        try:
            while not done:
                output = await active.next_output()
                done = output.finished
                yield output
        finally:
            if not done:
                self.abort(active.request_id)

    async def embed(
        self, prompt: Prompt, pooling_params: PoolingParams | None = None, request_id: str | None = None,
        lora_request: Any = None,
    ) -> EmbeddingRequestOutput:
        """Submit one pooling request and wait for its vector: the prompt's final normed states
        pooled as ``pooling_params`` says (:class:`~metrale.params.PoolingParams`; None or a field
        left None: the model's default, last-token and normalized unless its
        sentence-transformers configuration says otherwise), batched with the engine's other
        requests. ``prompt`` and ``request_id`` are as :meth:`generate` takes them.

        Returns the final :class:`~metrale.params.EmbeddingRequestOutput`; one that failed in the
        engine (its prompt needs more cache than there is) or was aborted has an empty
        embedding, and ``error`` when it failed. Raises
        :class:`~metrale.errors.InvalidRequestError` for a bad prompt or params, or an adapter in
        ``lora_request`` (pooling runs on the base model);
        :class:`~metrale.errors.ConfigError` when the model serves no embeddings (a family
        without :class:`~metrale.layers.loading.DecoderEnds`, tensor parallelism);
        :class:`~metrale.errors.QueueFullError` and :class:`~metrale.errors.EngineClosedError` as
        :meth:`generate` -- all before anything runs. Cancelling the wait aborts the request."""
        active = self.submit_pooling(prompt, pooling_params, request_id, lora_request)
        done = False
        try:
            while not done:
                output = await active.next_output()
                done = output.finished
            return output
        finally:
            if not done:
                self.abort(active.request_id)

    async def __aenter__(self) -> "AsyncEngineAPI":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await asyncio.to_thread(self.shutdown)


class AsyncLLM(AsyncEngineAPI):
    """A model served to concurrent callers (see the module docstring).

    ``model`` is an :class:`~metrale.LLM`, or what :class:`~metrale.LLM` takes (a checkpoint
    folder or an embedded model name, with the engine options as keywords). ``max_waiting_requests``
    bounds the requests queued beyond the ``max_num_seqs`` that can run. Use it as ``async with AsyncLLM(...) as
    engine:`` or call :meth:`shutdown`.
    """

    def __init__(self, model: Any, *, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS, **options: Any) -> None:
        from metrale.entrypoints.llm import LLM

        self.max_waiting_requests = check_int("max_waiting_requests", max_waiting_requests, minimum=0)
        if isinstance(model, LLM):
            if options:
                raise InvalidRequestError(f"engine options {sorted(options)} given with an already loaded LLM")
            self.llm = model
        elif isinstance(model, (str, Path)):
            self.llm = LLM(model, **options)
        else:
            raise InvalidRequestError(f"model must be an LLM, a checkpoint folder or an embedded model name, got {model!r}")
        self._hold = self.llm._take("AsyncLLM()")
        self._driver = EngineDriver(self.llm)
        self._condition = threading.Condition()
        self._inbox: deque[SubmittedRequest] = deque()
        self._aborts: deque[str] = deque()
        #: LoRA calls for the engine thread: ("add", LoRARequest) or ("remove", name or id), with
        #: the future their caller awaits.
        self._lora_calls: deque[tuple[str, Any, Future]] = deque()
        self._active: dict[str, SubmittedRequest] = {}
        #: Requests with news whose caller has not taken their previous output yet.
        self._behind: dict[str, SubmittedRequest] = {}
        self._accepting = True
        self._stopping = False
        self._thread = threading.Thread(target=self._engine_thread, name="metrale-engine", daemon=True)
        self._thread.start()
        self._hold.hand_to(self)

    # ------------------------------------------------------------------------------ callers

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None, lora_request: Any = None) -> SubmittedRequest:
        """Validate and queue a request (the first half of :meth:`generate`, which iterates
        over what this returns; the same errors); must be called on the event loop that will
        read it. The caller reads it with :meth:`SubmittedRequest.next_output` and must
        :meth:`abort` it if it stops reading before the last output."""
        loop = asyncio.get_running_loop()
        llm = self.llm
        request_id = new_request_id(request_id)
        self._check_open()
        text, ids = llm.prompt_ids(prompt, "the prompt")
        params = llm.request_params(sampling_params if sampling_params is not None else SamplingParams())
        lora = llm.lora_requests(lora_request, 1)[0]
        return self._queue(llm.new_group(text, ids, params, request_id=request_id, lora=lora), loop)

    def submit_pooling(self, prompt: Prompt, pooling_params: PoolingParams | None = None,
                       request_id: str | None = None, lora_request: Any = None) -> SubmittedRequest:
        """Validate and queue a pooling request (the first half of :meth:`embed`; the same
        errors); must be called on the event loop that will read it. Its one output comes
        through :meth:`SubmittedRequest.next_output`; the caller must :meth:`abort` it if it stops
        waiting before."""
        loop = asyncio.get_running_loop()
        llm = self.llm
        request_id = new_request_id(request_id)
        self._check_open()
        text, ids = llm.prompt_ids(prompt, "the prompt")
        params = llm.pooling_params(pooling_params)
        refuse_pooling_adapter(lora_request)
        return self._queue(llm.new_pooling_group(text, ids, params, request_id=request_id), loop)

    def _queue(self, group: Any, loop: asyncio.AbstractEventLoop) -> SubmittedRequest:
        """Queue a checked request group for the engine thread (within the queue's bound)."""
        request_id = group.request_id
        with self._condition:
            self._check_open()
            if request_id in self._active:
                raise InvalidRequestError(f"request_id {request_id!r} is already running")
            limit = self.llm.config.max_num_seqs + self.max_waiting_requests
            if len(self._active) >= limit:
                raise QueueFullError(
                    f"{len(self._active)} requests are running or waiting, as many as this engine accepts (max_num_seqs="
                    f"{self.llm.config.max_num_seqs} + max_waiting_requests={self.max_waiting_requests}); retry later")
            active = SubmittedRequest(group, _OutputStream(loop))
            self._active[request_id] = active
            self._inbox.append(active)
            self._condition.notify()
        return active

    def _prepare_structured_output(self, structured_output: Any) -> None:
        self.llm.grammar_compiler().compile(structured_output)

    def abort(self, request_id: str) -> None:
        """Abort a running or waiting request (from any thread): it is dropped at the engine's
        next step and its cache freed; its iterator gets a last output with ``finish_reason ==
        "abort"``. Unknown or finished ids are ignored."""
        with self._condition:
            if request_id in self._active:
                self._aborts.append(request_id)
                self._condition.notify()

    @property
    def serves_lora(self) -> bool:
        """Whether the engine serves LoRA adapters (``enable_lora=True``)."""
        return self.llm.lora is not None

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine holds (added, or read for a request) and was not asked to
        remove, by ``lora_int_id``."""
        return self._driver.served_loras()

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """See :meth:`AsyncEngineAPI.add_lora`; the adapter is read on the engine thread."""
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"add_lora() takes a LoRARequest, got {lora_request!r}")
        if not self.serves_lora:
            raise ConfigError("adding a LoRA adapter needs an engine that serves LoRA: LLM(..., enable_lora=True)")
        await self._lora_call("add", lora_request)

    async def remove_lora(self, lora: str | int) -> None:
        """See :meth:`AsyncEngineAPI.remove_lora`."""
        if isinstance(lora, bool) or not isinstance(lora, (str, int)):
            raise AdapterError(f"remove_lora() takes an adapter's lora_name or lora_int_id, got {lora!r}")
        await self._lora_call("remove", lora)

    async def _lora_call(self, kind: str, argument: Any) -> Any:
        """Hand a LoRA call to the engine thread and wait for its answer."""
        future: Future = Future()
        with self._condition:
            self._check_open()
            self._lora_calls.append((kind, argument, future))
            self._condition.notify()
        return await asyncio.wrap_future(future)

    def _run_lora_calls(self, calls: list[tuple[str, Any, Future]]) -> None:  # on the engine thread
        driver = self._driver
        for kind, argument, future in calls:
            if not future.set_running_or_notify_cancel():  # its caller stopped waiting before it ran
                continue
            try:
                if kind == "add":
                    driver.add_lora(argument)
                else:
                    driver.remove_lora(argument)
            except Exception as error:
                future.set_exception(error)
            else:
                future.set_result(None)

    def stats(self) -> EngineStats:
        """The engine's load now (any thread)."""
        return self._driver.stats(accepted=len(self._active))

    @property
    def holds_engine(self) -> bool:
        """Whether this engine still holds its :class:`~metrale.LLM` (until :meth:`shutdown`
        has stopped its thread)."""
        return self._accepting or self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken (False once :meth:`shutdown` began)."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        """Whether the engine thread runs and new requests are taken (not once a rank of a model
        split over several failed)."""
        return self._accepting and self._thread.is_alive() and self._driver.broken is None

    @property
    def num_active(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self._active)

    def _check_open(self) -> None:
        if not self._accepting:
            raise EngineClosedError("the AsyncLLM is shut down; it takes no more requests")
        if not self._thread.is_alive():
            raise EngineClosedError("the engine thread has stopped")

    # ----------------------------------------------------------------------------- lifetime

    def shutdown(self, drain_timeout: float = 0.0, close_llm: bool = True) -> None:
        """Stop taking requests; let the running ones finish for up to ``drain_timeout``
        seconds, then abort the rest, stop the engine thread and (``close_llm``) close the
        :class:`~metrale.LLM`, freeing its memory. Blocks until done; calling it again does
        nothing."""
        with self._condition:
            if self._stopping:
                return
            self._accepting = False
        deadline = time.monotonic() + max(float(drain_timeout), 0.0)
        while self._active and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        with self._condition:
            for request_id in list(self._active):
                self._aborts.append(request_id)
            self._stopping = True
            self._condition.notify()
        self._thread.join()
        self.llm._release(self._hold)
        if close_llm:
            self.llm.close()

    # ------------------------------------------------------------------------ engine thread

    def _engine_thread(self) -> None:
        driver = self._driver
        with self.llm.backend.activate():
            while True:
                with self._condition:
                    while not (self._inbox or self._aborts or self._lora_calls or self._stopping or driver.has_work()):
                        self._condition.wait()
                    new, self._inbox = list(self._inbox), deque()
                    aborts, self._aborts = list(self._aborts), deque()
                    lora_calls, self._lora_calls = list(self._lora_calls), deque()
                    stopping = self._stopping
                try:
                    try:
                        for active in new:
                            if not active.finished and not driver.admit(active.group):
                                self._deliver(active)
                        for request_id in aborts:
                            group = driver.abort(request_id)
                            aborted = self._active.get(request_id)
                            if group is not None and aborted is not None and aborted.group is group:
                                self._deliver(aborted)
                    finally:
                        # (After the new requests: a removal waits for those submitted before it.
                        # Always: every call taken is answered.)
                        self._run_lora_calls(lora_calls)
                    if stopping and not driver.has_work():
                        driver.retire()
                        return
                    if driver.has_work():
                        self._step()
                    driver.retire()
                except Exception as error:  # never let the thread die with callers waiting on it
                    driver.fail_everything(error, [a.group for a in self._active.values()])
                    for active in list(self._active.values()):
                        self._deliver(active)

    def _step(self) -> None:
        touched: dict[str, SubmittedRequest] = self._behind
        self._behind = {}
        for group in self._driver.step():
            active = self._active.get(group.request_id)
            if active is not None and active.group is group:
                touched[group.request_id] = active
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_OutputStream, RequestOutput]]] = {}
        for request_id, active in touched.items():
            if active.stream.unread and not active.group.finished:
                self._behind[request_id] = active
            else:
                self._deliver(active, batches)
        for loop, items in batches.items():
            self._hand_over(loop, items)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, items: list[tuple[_OutputStream, RequestOutput]]) -> None:
        """Push ``items`` on ``loop`` with one wake-up."""
        try:
            loop.call_soon_threadsafe(_push_all, items)
        except RuntimeError:  # the callers' event loop is closed: nobody reads these requests
            for stream, output in items:
                active = self._active.get(output.request_id)
                if active is not None and not output.finished:
                    self.llm.engine.abort(active.group.completions)
                    with self._condition:
                        self._active.pop(output.request_id, None)

    def _deliver(self, active: SubmittedRequest, batches: dict | None = None) -> None:
        """Make ``active``'s output and hand it over (into ``batches`` when given, else at once)."""
        group = active.group
        active.stream.unread = True
        output = group.output()
        if output.finished:
            active.finished = True
            self._behind.pop(group.request_id, None)
            with self._condition:
                self._active.pop(group.request_id, None)
        item = (active.stream, output)
        if batches is None:
            self._hand_over(active.stream.loop, [item])
        else:
            batches.setdefault(active.stream.loop, []).append(item)


def _push_all(items: list[tuple[_OutputStream, RequestOutput]]) -> None:  # on the callers' event loop
    for stream, output in items:
        stream.push(output)
