"""A request's engine requests and their outputs (:class:`_Job`): submitted together, read as they
come, aborted together when the client goes away or the response ends."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.state import _State, _unavailable
from metrale.params import RequestOutput

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ the requests


class _Job:
    """The engine requests of one HTTP request: submitted together, read together, aborted
    together (:meth:`close`). Updates the request metrics as outputs arrive. ``params`` holds one
    :class:`~metrale.params.SamplingParams` per prompt (a :class:`~metrale.params.PoolingParams`
    for :class:`_PoolingJob`).

    One task per engine request takes its outputs, one at a time: it takes the next only once
    :meth:`next` has handed out the one before, so a slow client holds at most one output per
    request and leaves the engine's outputs to coalesce (they are cumulative)."""

    def __init__(self, state: _State, endpoint: str, prompts: list[tuple[str | None, list[int]]],
                 params: list[Any], base_id: str, lora: Any = None) -> None:
        self.state = state
        self.lora = lora  # the LoRA adapter the requests run with, or None
        self.endpoint = endpoint
        self.prompts = prompts
        self.params = params
        self.base_id = base_id
        self.arrival = time.monotonic()
        self.request_ids: list[str] = []
        self.done: set[int] = set()
        self.tasks: list[asyncio.Task] = []
        self.closed = False
        self._pending: dict[int, RequestOutput | BaseException] = {}
        self._taken: list[asyncio.Event] = []
        self._wake = asyncio.Event()
        self._seen: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], float] = {}
        self._first: set[int] = set()
        self._finished: set[tuple[int, int]] = set()
        self._watcher: asyncio.Task | None = None
        self._single: Any = None

    def submit(self) -> None:
        """Submit every prompt (all or none: a failure aborts those already submitted). A LoRA
        adapter unloaded since the request was checked is a 404, as if it had not been served; one
        replaced in place (``load_inplace``) runs as it is now."""
        state = self.state
        if self.lora is not None:
            # (No await from here to the engine's submit: an unload reaches the engine after it.)
            current = state.lora_modules.get(self.lora.lora_name)
            if current is None:
                raise P.APIError(404, f"the model {P.clip(self.lora.lora_name)} does not exist (its LoRA adapter was "
                                 "unloaded)", param="model", code="model_not_found")
            self.lora = current
        state.jobs.add(self)
        try:
            for index, ((text, ids), params) in enumerate(zip(self.prompts, self.params)):
                prompt: dict[str, Any] = state.llm.tokenized_prompt(ids)
                if text is not None:
                    prompt["prompt"] = text
                request_id = f"{self.base_id}-{index}"
                active = self._start(prompt, params, request_id)
                self.request_ids.append(request_id)
                state.metrics.prompt_tokens.inc(len(ids))
                self._taken.append(asyncio.Event())
                if len(self.prompts) == 1:
                    self._single = active  # read directly in next(): no pump task
                else:
                    self.tasks.append(asyncio.ensure_future(self._pump(index, active)))
        except BaseException:
            self.close()
            raise

    def _start(self, prompt: Any, params: Any, request_id: str) -> Any:
        """Submit one prompt's engine request."""
        return self.state.engine.submit(prompt, params, request_id, self.lora)

    def _per_prompt(self) -> int:
        """The choices each prompt's engine request makes (``n``)."""
        return self.params[0].n if self.params else 1

    async def _pump(self, index: int, active: Any) -> None:
        taken = self._taken[index]
        try:
            while True:
                output = await active.next_output()
                self._pending[index] = output
                self._wake.set()
                if output.finished:
                    return
                await taken.wait()
                taken.clear()
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._pending[index] = error
            self._wake.set()

    def watch(self, request: Request) -> None:
        """Close the job when the client disconnects."""
        self._watcher = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    break
        except asyncio.CancelledError:
            raise
        except Exception:  # a receive channel that cannot be read: nothing to watch
            return
        if not self.closed:
            logger.debug("client of %s went away: its requests are aborted", self.base_id)
            self.close()

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any prompt (the oldest waiting), or None when every prompt
        finished or the job was closed."""
        if self._single is not None:
            if self.closed or self.done:
                return None
            output = await self._single.next_output()
            self._observe(0, output)
            return 0, output
        while True:
            if self.closed or len(self.done) == len(self.request_ids):
                return None
            if self._pending:
                index = next(iter(self._pending))
                output = self._pending.pop(index)
                self._taken[index].set()
                if isinstance(output, BaseException):
                    raise output
                self._observe(index, output)
                return index, output
            self._wake.clear()
            await self._wake.wait()

    def _observe(self, index: int, output: RequestOutput) -> None:
        metrics = self.state.metrics
        now = time.monotonic()
        for completion in output.outputs:
            key = (index, completion.index)
            new = len(completion.token_ids) - self._seen.get(key, 0)
            if new > 0:
                self._seen[key] = len(completion.token_ids)
                metrics.generation_tokens.inc(new)
                if index not in self._first:
                    self._first.add(index)
                    metrics.ttft.observe(now - self.arrival)
                last = self._last.get(key)
                if last is not None:
                    for _ in range(new):
                        metrics.itl.observe((now - last) / new)
                self._last[key] = now
            if completion.finish_reason is not None and key not in self._finished:
                self._finished.add(key)
                metrics.finished.labels(self.endpoint, completion.finish_reason).inc()
        if output.finished and index not in self.done:
            self.done.add(index)
            metrics.e2e.observe(now - self.arrival)

    def abort(self) -> None:
        """Abort the unfinished engine requests (their readers get ``abort`` outputs)."""
        for index, request_id in enumerate(self.request_ids):
            if index not in self.done:
                self.state.engine.abort(request_id)

    def close(self) -> None:
        """Abort whatever is unfinished and stop reading (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.state.jobs.discard(self)
        for task in self.tasks:
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        self.abort()
        n = self._per_prompt()
        for index in range(len(self.request_ids)):
            for j in range(n):
                if (index, j) not in self._finished:
                    self._finished.add((index, j))
                    self.state.metrics.finished.labels(self.endpoint, "abort").inc()
        self._wake.set()


class _PoolingJob(_Job):
    """The pooling requests of one ``/v1/embeddings`` request (``params``: one
    :class:`~metrale.params.PoolingParams` per prompt): a :class:`_Job` whose engine requests each
    make one output, the vector. Counts each as finished (``stop``, ``error`` or ``abort``) and
    its latency."""

    def _start(self, prompt: Any, params: Any, request_id: str) -> Any:
        return self.state.engine.submit_pooling(prompt, params, request_id)

    def _per_prompt(self) -> int:
        return 1

    def _observe(self, index: int, output: Any) -> None:
        if not output.finished or index in self.done:
            return
        self.done.add(index)
        reason = "error" if output.error is not None else "stop" if output.outputs.embedding else "abort"
        metrics = self.state.metrics
        if (index, 0) not in self._finished:
            self._finished.add((index, 0))
            metrics.finished.labels(self.endpoint, reason).inc()
        metrics.e2e.observe(time.monotonic() - self.arrival)


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _failure(output: RequestOutput, finish_reason: str | None) -> P.APIError | None:
    """The error to answer for a completion that ended with ``error`` or ``abort``."""
    if finish_reason == "error":
        return P.APIError(500, f"the request could not be completed: {output.error or 'the engine failed'}",
                          type="server_error", code="engine_error")
    if finish_reason == "abort":
        return _unavailable("the request was aborted: the server is shutting down", "service_unavailable")
    return None


async def _collect(job: _Job) -> dict[int, RequestOutput]:
    """The final output of every prompt of a non-streaming request (:class:`_ClientGone` when
    the job was closed first: its client went away)."""
    last: dict[int, RequestOutput] = {}
    try:
        while (item := await job.next()) is not None:
            index, output = item
            last[index] = output
        if len(job.done) < len(job.request_ids):
            raise _ClientGone()
        return last
    finally:
        job.close()


class _EventStream(StreamingResponse):
    """A server-sent-event response whose job is closed (its requests aborted) whatever ends
    the response: the last event, a disconnect, a cancelled task."""

    def __init__(self, content: AsyncIterator[bytes], job: _Job) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.close()


class _Choice:
    """What a stream has sent of one choice."""

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0
        self.started = False
        self.finished = False
        self.logprobs: P.CompletionLogprobs | None = None
        #: The text the choice starts with (a completion's echoed prompt), which its logprobs'
        #: ``text_offset`` counts in.
        self.prefix = ""
        #: The choice's reply as its tool calls and reasoning are read (a chat reply with parsers).
        self.reply: Any = None


