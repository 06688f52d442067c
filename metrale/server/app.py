"""The OpenAI-compatible HTTP server: :func:`build_app` makes a FastAPI app around an
:class:`~metrale.AsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and
``GET /v1/models/{model}``), ``GET /health``, ``GET /metrics``. ``docs/serving.rst`` lists every
field, status and metric.

How a request runs. The handler reads the body (the :class:`_Gate` middleware has already
checked the API key and the body's size), checks it field by field (every bad value is a 400
naming the field), turns it into one :class:`~metrale.params.SamplingParams` per prompt and
submits one engine request per prompt (a request's ``n`` completions run as one engine request
with ``SamplingParams.n``, so a seed gives the same completions as :meth:`metrale.LLM.generate`).
A :class:`_Job` reads the engine requests' outputs (one task per request, each holding at
most one output not yet sent) and aborts every unfinished one when it is closed: when the response is complete, when the
client goes away (a disconnect watcher reads ``http.disconnect`` for streaming and
non-streaming requests alike) or when the handler fails. Outputs are cumulative; the handlers
send each choice's new text only.

Nothing a client sends reaches the engine unchecked, and no exception leaves a handler: bad
input is a 400, an unexpected failure a 500 with a generic message (logged with its traceback,
never with the request's body or key).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale._version import __version__
from metrale.async_llm import AsyncLLM
from metrale.errors import EngineBusyError, EngineClosedError, InvalidRequestError, MetraleError, QueueFullError
from metrale.params import MAX_LOGPROBS, MAX_N, RequestOutput, SamplingParams
from metrale.server import protocol as P
from metrale.server.metrics import CONTENT_TYPE, ServerMetrics
from metrale.structured import StructuredOutputParams

logger = logging.getLogger(__name__)

#: Request bodies larger than this are refused with 413 (the default of ``max_body_bytes``).
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: The most completions per prompt (``n``) by default.
DEFAULT_MAX_N = 16
#: The most alternatives per token (``logprobs``, ``top_logprobs``, ``prompt_logprobs``) by default.
DEFAULT_MAX_LOGPROBS = 20
#: Seconds a shutdown waits for running requests by default.
DEFAULT_DRAIN_TIMEOUT = 10.0
#: The most prompts one completions request may hold.
MAX_PROMPTS = 256
#: The most stop strings one request may give, and the longest one (characters).
MAX_STOP = 16
MAX_STOP_LENGTH = 256
#: JSON bodies nested deeper than this are refused (a deep body would exhaust the recursion of
#: the validators and the chat template).
MAX_JSON_DEPTH = 64
#: ``max_tokens`` of a completion that does not give it (OpenAI's default).
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: The roles a chat message may have.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: ``chat_template_kwargs`` keys that would collide with the template's own arguments.
RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "add_generation_prompt", "tools", "documents"})

#: Known paths, as the ``endpoint`` label of ``metrale_requests_total`` names them (others: ``other``).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

#: The sampling fields of a request that map one to one onto :class:`SamplingParams`.
_PLAIN_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "prompt_logprobs")

#: The constraint keys of ``structured_outputs`` (StructuredOutputParams' fields).
_STRUCTURED_KEYS = ("json", "json_object", "regex", "grammar", "choice")


def _endpoint(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


def _error_response(error: P.APIError) -> Response:
    return Response(P.dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers)


def _json_response(data: Any, status: int = 200) -> Response:
    return Response(P.dumps(data), status_code=status, media_type="application/json")


def _unavailable(message: str, code: str) -> P.APIError:
    return P.APIError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})


# ------------------------------------------------------------------------------------ state


class _State:
    """What the app's handlers and middleware share."""

    def __init__(self, engine: AsyncLLM, *, model_name: str, api_key: str | None, max_body_bytes: int, max_n: int,
                 max_logprobs: int, drain_timeout: float, owns_engine: bool) -> None:
        self.engine = engine
        self.llm = engine.llm
        self.model_name = model_name
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_n = max_n
        self.max_logprobs = max_logprobs
        self.drain_timeout = drain_timeout
        self.owns_engine = owns_engine
        self.created = P.now()
        # The model's properties, kept: the LLM is closed when the engine shuts down.
        self.vocab_size = int(self.llm.vocab_size)
        self.max_model_len = int(self.llm.max_model_len)
        self.eos_token_ids = tuple(self.llm.eos_token_ids)
        tokenizer = self.llm.tokenizer
        self.token_text = P.TokenText(
            (lambda token: tokenizer.decode([token], skip_special_tokens=False)) if tokenizer is not None else None)
        self.draining = False
        self.in_progress = 0
        self.jobs: set[_Job] = set()
        self.metrics = ServerMetrics(engine.stats, lambda: engine.num_active, lambda: self.in_progress)

    def engine_alive(self) -> bool:
        return self.engine.is_running

    def begin_drain(self) -> None:
        """Take no more requests (they get 503); those running go on."""
        self.draining = True


# ------------------------------------------------------------------------------- middleware


class _Gate:
    """Pure ASGI middleware in front of every HTTP request: counts it
    (``metrale_requests_total``), checks the API key on ``/v1`` paths, refuses new ``/v1``
    requests while the server drains, and reads the whole body with a size limit (the declared
    ``Content-Length`` first, then the bytes actually received, so a chunked upload cannot
    pass it) before the app sees it."""

    def __init__(self, app: ASGIApp, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        status: int | None = None

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        state.in_progress += 1
        try:
            await self._handle(scope, receive, counted)
        except BaseException:
            if status is None:
                status = 500
            raise
        finally:
            state.in_progress -= 1
            state.metrics.requests.labels(_endpoint(scope.get("path", "")), str(status if status is not None else 499)).inc()

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        path = scope.get("path", "")
        headers = _headers(scope)
        if path == "/v1" or path.startswith("/v1/"):
            if state.api_key is not None and not _authorized(headers, state.api_key):
                await _send_error(send, P.APIError(
                    401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'", type="authentication_error",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
            if state.draining:
                await _send_error(send, _unavailable("the server is shutting down; it takes no new requests",
                                                     "service_unavailable"))
                return
        declared = headers.get(b"content-length")
        too_big = False
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(send, P.APIError(400, "the Content-Length header is not a number"))
                return
            too_big = int(declared) > state.max_body_bytes
        body = bytearray()
        received = 0
        # A body over the limit is read (and dropped) up to a bound, so that the client can
        # finish sending and read the 413; a body declared past that bound is answered at once
        # (and the connection closed after the answer).
        discard_limit = 4 * state.max_body_bytes
        while not (too_big and declared is not None and int(declared) > discard_limit):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > state.max_body_bytes:
                too_big = True
            if not too_big:
                body += chunk
            if not message.get("more_body", False) or received > discard_limit:
                break
        if too_big:
            await _send_error(send, P.APIError(
                413, f"the request body is larger than this server accepts ({state.max_body_bytes} bytes)",
                code="request_too_large"))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    found: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", []):
        found.setdefault(bytes(name).lower(), bytes(value))
    return found


def _authorized(headers: dict[bytes, bytes], key: bytes) -> bool:
    """Whether the request carries the key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``),
    compared in constant time."""
    given = []
    authorization = headers.get(b"authorization")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() == b"bearer":
            given.append(token.strip())
    if b"x-api-key" in headers:
        given.append(headers[b"x-api-key"].strip())
    ok = False
    for token in given:
        ok |= hmac.compare_digest(token, key)
    return ok


async def _send_error(send: Send, error: P.APIError) -> None:
    body = P.dumps(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ------------------------------------------------------------------------------ the requests


class _Job:
    """The engine requests of one HTTP request: submitted together, read together, aborted
    together (:meth:`close`). Updates the request metrics as outputs arrive.

    One task per engine request takes its outputs, one at a time: it takes the next only once
    :meth:`next` has handed out the one before, so a slow client holds at most one output per
    request and leaves the engine's outputs to coalesce (they are cumulative)."""

    def __init__(self, state: _State, endpoint: str, prompts: list[tuple[str | None, list[int]]],
                 params: list[SamplingParams], base_id: str) -> None:
        self.state = state
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
        """Submit every prompt (all or none: a failure aborts those already submitted)."""
        state = self.state
        state.jobs.add(self)
        try:
            for index, ((text, ids), params) in enumerate(zip(self.prompts, self.params)):
                prompt: dict[str, Any] = {"prompt_token_ids": ids}
                if text is not None:
                    prompt["prompt"] = text
                request_id = f"{self.base_id}-{index}"
                active = state.engine.submit(prompt, params, request_id)
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
        n = self.params[0].n if self.params else 1
        for index in range(len(self.request_ids)):
            for j in range(n):
                if (index, j) not in self._finished:
                    self._finished.add((index, j))
                    self.state.metrics.finished.labels(self.endpoint, "abort").inc()
        self._wake.set()


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


# ------------------------------------------------------------------------- request checking


async def _parse(request: Request, model: type[P.SamplingRequest]) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise P.APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise P.APIError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as error:
        raise P.APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise P.APIError(400, f"the request body must be a JSON object, got a JSON {type(data).__name__}")
    if _too_deep(data, MAX_JSON_DEPTH):
        raise P.APIError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise _validation_error(error.errors()) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(data: Any, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _validation_error(errors: list[Any]) -> P.APIError:
    """A 400 for pydantic's first error, naming the field."""
    if not errors:
        return P.APIError(400, "the request is invalid")
    first = errors[0]
    param = P.error_param(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        text = f"{param} is required"
    else:
        text = f"{param}: {message} (got {P.clip(first.get('input'))})" if param else message
    return P.APIError(400, text, param=param)


def _check_model(state: _State, req: P.SamplingRequest) -> None:
    if req.model != state.model_name:
        raise P.APIError(404, f"the model {P.clip(req.model)} does not exist; this server serves {state.model_name!r}",
                         param="model", code="model_not_found")


def _check_n(state: _State, req: P.SamplingRequest) -> int:
    if not req.given("n"):
        return 1
    n = req.n
    assert n is not None
    limit = min(state.max_n, MAX_N)
    if not 1 <= n <= limit:
        raise P.APIError(400, f"n must be between 1 and {limit}, got {n}", param="n")
    return n


def _check_stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise P.APIError(400, f"stop must be a string or a list of strings, got {P.clip(value)}", param="stop")
    if len(stops) > MAX_STOP:
        raise P.APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP} are accepted", param="stop")
    for stop in stops:
        if not stop:
            raise P.APIError(400, "stop strings must not be empty", param="stop")
        if len(stop) > MAX_STOP_LENGTH:
            raise P.APIError(400, f"stop strings may hold at most {MAX_STOP_LENGTH} characters, got one of {len(stop)}",
                             param="stop")
    return stops


def _check_logprobs_count(state: _State, name: str, value: int | None) -> int:
    assert value is not None
    limit = min(state.max_logprobs, MAX_LOGPROBS)
    if not 0 <= value <= limit:
        raise P.APIError(400, f"{name} must be between 0 and {limit}, got {value}", param=name)
    return value


def _structured(req: P.SamplingRequest) -> tuple[StructuredOutputParams | None, str | None]:
    """The request's structured output (from ``structured_outputs``, ``guided_*`` or
    ``response_format``) and the field it came from."""
    found: list[tuple[dict[str, Any], str]] = []
    if req.given("structured_outputs"):
        spec = dict(req.structured_outputs or {})
        unknown = [key for key, value in spec.items() if key not in _STRUCTURED_KEYS and value is not None]
        if unknown:
            raise P.APIError(400, f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(_STRUCTURED_KEYS)})",
                             param=f"structured_outputs.{unknown[0]}")
        spec = {key: value for key, value in spec.items() if value is not None and not (key == "json_object" and value is False)}
        if spec:
            found.append((spec, "structured_outputs"))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if req.given(name):
            found.append(({key: getattr(req, name)}, name))
    if req.given("response_format"):
        fmt = req.response_format
        assert fmt is not None
        if fmt.type == "json_object":
            found.append(({"json_object": True}, "response_format"))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise P.APIError(400, "response_format of type 'json_schema' needs a 'json_schema' object",
                                 param="response_format.json_schema")
            schema = fmt.json_schema.schema_
            found.append(({"json": schema} if schema is not None else {"json_object": True}, "response_format"))
        elif fmt.type != "text":
            raise P.APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {P.clip(fmt.type)}",
                             param="response_format.type")
    if not found:
        return None, None
    if len(found) > 1:
        raise P.APIError(400, f"give one structured output, got {' and '.join(name for _, name in found)}", param=found[1][1])
    spec, name = found[0]
    try:
        return StructuredOutputParams(**spec), name
    except (InvalidRequestError, TypeError) as error:
        raise P.APIError(400, f"{name}: {error}", param=name) from None


def _sampling_options(state: _State, req: P.SamplingRequest, *, n: int, logprobs: int | None,
                      logprobs_param: str) -> dict[str, Any]:
    """The request's :class:`SamplingParams` options (all but ``max_tokens``), each checked
    alone so that a bad one is named; only the fields the request gives, so the checkpoint's
    sampling defaults fill the others."""
    options: dict[str, Any] = {name: getattr(req, name) for name in _PLAIN_FIELDS if req.given(name)}
    params = {name: name for name in options}
    if req.given("stop"):
        options["stop"] = _check_stop(req.stop)
    if req.given("logit_bias"):
        options["logit_bias"] = dict(req.logit_bias or {})
    if n != 1:
        options["n"] = n
    if logprobs is not None:
        options["logprobs"] = logprobs
        params["logprobs"] = logprobs_param
    if req.given("prompt_logprobs"):
        _check_logprobs_count(state, "prompt_logprobs", options["prompt_logprobs"])
    structured, source = _structured(req)
    if structured is not None:
        options["structured_output"] = structured
        params["structured_output"] = source or "response_format"
    for name, value in options.items():
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as error:
            raise P.APIError(400, str(error), param=params.get(name, name)) from None
    ids = [_token_id(t) for t in options.get("logit_bias", {})]
    bad = [t for t in ids if t is not None and not 0 <= t < state.vocab_size]
    if bad:
        raise P.APIError(400, f"logit_bias holds token id {bad[0]}, outside the vocabulary [0, {state.vocab_size})",
                         param="logit_bias")
    bad_stop = [t for t in options.get("stop_token_ids", ()) if not 0 <= t < state.vocab_size]
    if bad_stop:
        raise P.APIError(400, f"stop_token_ids holds token id {bad_stop[0]}, outside the vocabulary [0, {state.vocab_size})",
                         param="stop_token_ids")
    if structured is not None:
        if state.llm.tokenizer is None:
            raise P.APIError(400, "structured output needs a tokenizer; this model has none", param=source)
        try:  # compiled here to name the field; the engine finds it in the compiler's cache
            state.llm.grammar_compiler().compile(structured)
        except InvalidRequestError as error:
            raise P.APIError(400, f"{source}: {error}", param=source) from None
    return options


def _token_id(key: Any) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def _params_for_prompt(state: _State, options: dict[str, Any], prompt_len: int, max_tokens: int | None,
                       max_tokens_param: str, default_max_tokens: int | None, prompt_param: str) -> SamplingParams:
    """One prompt's :class:`SamplingParams`: ``max_tokens`` (given, or the default, capped by
    the context) checked against the model's context."""
    room = state.max_model_len - prompt_len
    if room < 1:
        raise P.APIError(400, f"the prompt has {prompt_len} tokens, which fills the model's context of "
                         f"{state.max_model_len} tokens: nothing can be generated", param=prompt_param)
    if max_tokens is not None:
        if max_tokens < 1:
            raise P.APIError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
        if prompt_len + max_tokens > state.max_model_len:
            raise P.APIError(400, f"{max_tokens_param} ({max_tokens}) plus the prompt's {prompt_len} tokens is more than the "
                             f"model's context of {state.max_model_len} tokens", param=max_tokens_param)
        value = max_tokens
    else:
        value = min(default_max_tokens or room, room)
    min_tokens = options.get("min_tokens", 0)
    if min_tokens > value:
        raise P.APIError(400, f"min_tokens ({min_tokens}) must be at most {max_tokens_param} ({value})", param="min_tokens")
    try:
        return SamplingParams(**options, max_tokens=value)
    except InvalidRequestError as error:
        raise P.APIError(400, str(error)) from None


def _completion_prompts(state: _State, value: Any) -> list[tuple[str | None, list[int]]]:
    """The prompts of a completions request: a string, a list of strings, a list of token ids
    or a list of lists of token ids."""
    shapes = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list):
        if not value:
            raise P.APIError(400, "prompt must not be an empty list", param="prompt")
        if all(_is_token(v) for v in value):
            items = [value]
        elif all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            items = value
        else:
            raise P.APIError(400, f"prompt must be {shapes}, got a list mixing {P.clip(value)}", param="prompt")
    else:
        raise P.APIError(400, f"prompt must be {shapes}, got {P.clip(value)}", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise P.APIError(400, f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} are accepted", param="prompt")
    prompts = []
    for index, item in enumerate(items):
        label = "prompt" if len(items) == 1 else f"prompt[{index}]"
        if isinstance(item, str):
            try:
                ids = state.llm.encode(item)
            except InvalidRequestError as error:
                raise P.APIError(400, f"{label}: {error}", param="prompt") from None
            text: str | None = item
        else:
            if not all(_is_token(t) for t in item):
                raise P.APIError(400, f"{label} must be a list of token ids (ints), got {P.clip(item)}", param="prompt")
            bad = [t for t in item if not 0 <= t < state.vocab_size]
            if bad:
                raise P.APIError(400, f"{label} holds token id {bad[0]}, outside the vocabulary [0, {state.vocab_size})",
                                 param="prompt")
            ids, text = list(item), None
        if not ids:
            raise P.APIError(400, f"{label} has no tokens", param="prompt")
        if len(ids) > state.max_model_len:
            raise P.APIError(400, f"{label} has {len(ids)} tokens, more than the model's context of {state.max_model_len}",
                             param="prompt")
        prompts.append((text, ids))
    return prompts


def _is_token(value: Any) -> bool:
    return type(value) is int


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise P.APIError(400, f"messages must be a list of messages, got {P.clip(messages)}", param="messages")
    if not messages:
        raise P.APIError(400, "messages must hold at least one message", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise P.APIError(400, f"{where} must be an object with 'role' and 'content', got {P.clip(message)}", param=where)
        if "role" not in message:
            raise P.APIError(400, f"{where}.role is required", param=f"{where}.role")
        role = message["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise P.APIError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {P.clip(role)}",
                             param=f"{where}.role")
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise P.APIError(400, f"{where}.content is required for a {role!r} message", param=f"{where}.content")
            continue
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise P.APIError(400, f"{where}.content must be a string or a list of text parts, got {P.clip(content)}",
                             param=f"{where}.content")
        for part_index, part in enumerate(content):
            label = f"{where}.content[{part_index}]"
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise P.APIError(400, f"{label} must be a text part {{'type': 'text', 'text': '...'}} (this server takes text "
                                 f"only), got {P.clip(part)}", param=label)
    return messages


def _chat_prompt(state: _State, req: P.ChatCompletionRequest) -> tuple[str, list[int]]:
    messages = _check_messages(req.messages)
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise P.APIError(400, f"chat_template_kwargs may not set {reserved[0]!r} (give it as its own field)",
                         param="chat_template_kwargs")
    if req.given("documents"):
        kwargs["documents"] = req.documents
    if req.given("tool_choice") and req.tool_choice not in ("none", "auto"):
        raise P.APIError(400, "tool_choice may only be 'none' or 'auto': this server does not force or parse tool calls",
                         param="tool_choice")
    if req.continue_final_message:
        raise P.APIError(400, "continue_final_message is not supported", param="continue_final_message")
    add_generation_prompt = req.add_generation_prompt if req.add_generation_prompt is not None else True
    try:
        text = state.llm.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=req.tools, **kwargs)
        ids = state.llm.encode(text, add_special_tokens=False)
    except InvalidRequestError as error:
        raise P.APIError(400, str(error), param="messages") from None
    if not ids:
        raise P.APIError(400, "the rendered conversation has no tokens", param="messages")
    if len(ids) > state.max_model_len:
        raise P.APIError(400, f"the conversation has {len(ids)} tokens, more than the model's context of {state.max_model_len}",
                         param="messages")
    return text, ids


# ------------------------------------------------------------------------------ the handlers


def _stream_flags(req: P.SamplingRequest) -> tuple[bool, bool]:
    stream = bool(req.stream)
    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)
    if req.given("stream_options") and not stream:
        raise P.APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return stream, include_usage


async def _completions(state: _State, request: Request) -> Response:
    req: P.CompletionRequest = await _parse(request, P.CompletionRequest)
    _check_model(state, req)
    if req.given("suffix"):
        raise P.APIError(400, "suffix is not supported", param="suffix")
    n = _check_n(state, req)
    if req.given("best_of") and req.best_of != n:
        raise P.APIError(400, "best_of is not supported (other than equal to n)", param="best_of")
    stream, include_usage = _stream_flags(req)
    k = _check_logprobs_count(state, "logprobs", req.logprobs) if req.given("logprobs") else None
    echo = bool(req.echo)
    prompts = _completion_prompts(state, req.prompt)
    options = _sampling_options(state, req, n=n, logprobs=k, logprobs_param="logprobs")
    asked_prompt_logprobs = options.get("prompt_logprobs")
    if echo and k is not None:
        options["prompt_logprobs"] = max(k, asked_prompt_logprobs or 0)
    default = state.llm.sampling_defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    params = [_params_for_prompt(state, options, len(ids), req.max_tokens, "max_tokens", default, "prompt")
              for _, ids in prompts]
    response_id, created = P.new_id("cmpl"), P.now()
    job = _Job(state, "/v1/completions", prompts, params, response_id)
    job.submit()
    try:
        echo_texts = [text if text is not None else _decode(state, ids) for text, ids in prompts] if echo else []
        context = _CompletionContext(state, req.model, response_id, created, n, k, echo, echo_texts, asked_prompt_logprobs,
                                     include_usage)
        job.watch(request)
        if stream:
            return _EventStream(_completion_events(job, context), job)
        try:
            outputs = await _collect(job)
        except _ClientGone:
            return Response(status_code=499)
        return _json_response(context.response(job, outputs))
    except BaseException:
        job.close()
        raise


def _decode(state: _State, ids: list[int]) -> str:
    try:
        return state.llm.decode(ids)
    except MetraleError:
        return ""


class _CompletionContext:
    """What the completions responses are built from."""

    def __init__(self, state: _State, model: str, response_id: str, created: int, n: int, k: int | None, echo: bool,
                 echo_texts: list[str], prompt_logprobs: int | None, include_usage: bool) -> None:
        self.state = state
        self.model = model
        self.id = response_id
        self.created = created
        self.n = n
        self.k = k
        self.echo = echo
        self.echo_texts = echo_texts
        self.prompt_logprobs = prompt_logprobs
        self.include_usage = include_usage

    def echo_logprobs(self, builder: P.CompletionLogprobs, output: RequestOutput) -> dict:
        ids = output.prompt_token_ids
        entries = list(output.prompt_logprobs or [None] * len(ids))
        return builder.piece(ids, entries, first_is_prompt_start=True)

    def prompt_logprobs_json(self, output: RequestOutput) -> list | None:
        if self.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        keep = self.prompt_logprobs
        trimmed: list = []
        for position, entry in enumerate(output.prompt_logprobs):
            if entry is None:
                trimmed.append(None)
                continue
            actual = output.prompt_token_ids[position]
            trimmed.append({t: lp for t, lp in entry.items() if t == actual or (lp.rank is not None and lp.rank <= keep)})
        return P.prompt_logprobs_json(trimmed, self.state.token_text)

    def response(self, job: _Job, outputs: dict[int, RequestOutput]) -> dict:
        state = self.state
        choices = []
        completion_tokens = 0
        prompt_tokens = sum(len(ids) for _, ids in job.prompts)
        for index in range(len(job.prompts)):
            output = outputs[index]
            for completion in output.outputs:
                failure = _failure(output, completion.finish_reason)
                if failure is not None:
                    raise failure
                completion_tokens += len(completion.token_ids)
                text = completion.text or ""
                logprobs = None
                if self.k is not None:
                    builder = P.CompletionLogprobs(self.k, state.token_text)
                    parts = [self.echo_logprobs(builder, output)] if self.echo else []
                    parts.append(builder.piece(completion.token_ids, list(completion.logprobs or [])))
                    logprobs = {key: [v for part in parts for v in part[key]] for key in parts[0]}
                if self.echo:
                    text = self.echo_texts[index] + text
                reason = P.stop_reason(completion, state.eos_token_ids, job.params[index].stop_token_ids)
                choices.append(P.completion_choice(index * self.n + completion.index, text, logprobs,
                                                   completion.finish_reason, reason, self.prompt_logprobs_json(output)))
        return P.completion_response(self.id, self.created, self.model, choices, P.usage(prompt_tokens, completion_tokens))


async def _completion_events(job: _Job, context: _CompletionContext) -> AsyncIterator[bytes]:
    state = context.state
    sent: dict[int, _Choice] = {}
    completion_tokens = 0
    try:
        while (item := await job.next()) is not None:
            index, output = item
            for completion in output.outputs:
                choice_index = index * context.n + completion.index
                choice = sent.setdefault(choice_index, _Choice())
                if choice.finished:
                    continue
                failure = _failure(output, completion.finish_reason)
                if failure is not None:
                    yield P.sse(failure.body())
                    yield P.SSE_DONE
                    return
                text = completion.text or ""
                delta = text[choice.text:] if len(text) > choice.text else ""
                choice.text = max(choice.text, len(text))
                new_ids = completion.token_ids[choice.tokens:]
                logprobs = None
                if context.k is not None:
                    if choice.logprobs is None:
                        choice.logprobs = P.CompletionLogprobs(context.k, state.token_text)
                    parts = []
                    if context.echo and not choice.started:
                        parts.append(context.echo_logprobs(choice.logprobs, output))
                    if new_ids:
                        entries = list(completion.logprobs or [])[choice.tokens:len(completion.token_ids)]
                        parts.append(choice.logprobs.piece(new_ids, entries))
                    if parts:
                        logprobs = {key: [v for part in parts for v in part[key]] for key in parts[0]}
                choice.tokens = len(completion.token_ids)
                first = not choice.started
                if first and context.echo:
                    delta = context.echo_texts[index] + delta
                prompt_logprobs = context.prompt_logprobs_json(output) if first else None
                finish = completion.finish_reason
                if not delta and logprobs is None and finish is None and prompt_logprobs is None:
                    continue  # (then no echo piece was made either: with logprobs it is never empty)
                choice.started = True
                if finish is not None:
                    choice.finished = True
                    completion_tokens += len(completion.token_ids)
                reason = P.stop_reason(completion, state.eos_token_ids, job.params[index].stop_token_ids) if finish else None
                choice_json = P.completion_choice(choice_index, delta, logprobs, finish, reason, prompt_logprobs)
                yield P.sse(P.completion_chunk(context.id, context.created, context.model, [choice_json],
                                               include_usage=context.include_usage))
        if job.closed and len(job.done) < len(job.request_ids):
            return  # the client went away
        if context.include_usage:
            used = P.usage(sum(len(ids) for _, ids in job.prompts), completion_tokens)
            yield P.sse(P.completion_chunk(context.id, context.created, context.model, [], used=used, include_usage=True))
        yield P.SSE_DONE
    except Exception:
        logger.exception("a completions stream failed")
        yield P.sse(P.error_body("the server failed while answering this request", "server_error", None, "internal_error"))
        yield P.SSE_DONE
    finally:
        job.close()


async def _chat(state: _State, request: Request) -> Response:
    req: P.ChatCompletionRequest = await _parse(request, P.ChatCompletionRequest)
    _check_model(state, req)
    n = _check_n(state, req)
    stream, include_usage = _stream_flags(req)
    k = None
    if req.logprobs:
        k = _check_logprobs_count(state, "top_logprobs", req.top_logprobs) if req.given("top_logprobs") else 0
    elif req.given("top_logprobs") and req.top_logprobs != 0:
        raise P.APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    text, ids = _chat_prompt(state, req)
    options = _sampling_options(state, req, n=n, logprobs=k, logprobs_param="top_logprobs")
    if req.given("max_completion_tokens"):
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    default = state.llm.sampling_defaults.get("max_tokens")
    params = [_params_for_prompt(state, options, len(ids), max_tokens, max_param, default, "messages")]
    response_id, created = P.new_id("chatcmpl"), P.now()
    job = _Job(state, "/v1/chat/completions", [(text, ids)], params, response_id)
    job.submit()
    try:
        context = _ChatContext(state, req.model, response_id, created, n, k, include_usage)
        job.watch(request)
        if stream:
            return _EventStream(_chat_events(job, context), job)
        try:
            outputs = await _collect(job)
        except _ClientGone:
            return Response(status_code=499)
        return _json_response(context.response(job, outputs[0]))
    except BaseException:
        job.close()
        raise


class _ChatContext:
    def __init__(self, state: _State, model: str, response_id: str, created: int, n: int, k: int | None,
                 include_usage: bool) -> None:
        self.state = state
        self.model = model
        self.id = response_id
        self.created = created
        self.n = n
        self.k = k
        self.include_usage = include_usage

    def response(self, job: _Job, output: RequestOutput) -> dict:
        state = self.state
        choices = []
        for completion in output.outputs:
            failure = _failure(output, completion.finish_reason)
            if failure is not None:
                raise failure
            logprobs = None
            if self.k is not None:
                logprobs = P.chat_logprobs(completion.token_ids, list(completion.logprobs or []), self.k, state.token_text)
            reason = P.stop_reason(completion, state.eos_token_ids, job.params[0].stop_token_ids)
            choices.append(P.chat_choice(completion.index, completion.text or "", logprobs, completion.finish_reason, reason))
        used = P.usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs))
        return P.chat_response(self.id, self.created, self.model, choices, used)


async def _chat_events(job: _Job, context: _ChatContext) -> AsyncIterator[bytes]:
    state = context.state
    sent: dict[int, _Choice] = {}
    completion_tokens = 0
    try:
        for index in range(context.n):
            sent[index] = _Choice()
            role = P.chat_delta_choice(index, {"role": "assistant", "content": ""}, None, None, None)
            yield P.sse(P.chat_chunk(context.id, context.created, context.model, [role], include_usage=context.include_usage))
        while (item := await job.next()) is not None:
            _, output = item
            for completion in output.outputs:
                choice = sent.setdefault(completion.index, _Choice())
                if choice.finished:
                    continue
                failure = _failure(output, completion.finish_reason)
                if failure is not None:
                    yield P.sse(failure.body())
                    yield P.SSE_DONE
                    return
                text = completion.text or ""
                delta = text[choice.text:] if len(text) > choice.text else ""
                choice.text = max(choice.text, len(text))
                new_ids = completion.token_ids[choice.tokens:]
                logprobs = None
                if context.k is not None and new_ids:
                    entries = list(completion.logprobs or [])[choice.tokens:len(completion.token_ids)]
                    logprobs = P.chat_logprobs(new_ids, entries, context.k, state.token_text)
                choice.tokens = len(completion.token_ids)
                finish = completion.finish_reason
                if not delta and logprobs is None and finish is None:
                    continue
                if finish is not None:
                    choice.finished = True
                    completion_tokens += len(completion.token_ids)
                reason = P.stop_reason(completion, state.eos_token_ids, job.params[0].stop_token_ids) if finish else None
                content = {"content": delta} if delta or finish is None else {}
                choice_json = P.chat_delta_choice(completion.index, content, logprobs, finish, reason)
                yield P.sse(P.chat_chunk(context.id, context.created, context.model, [choice_json],
                                         include_usage=context.include_usage))
        if job.closed and len(job.done) < len(job.request_ids):
            return  # the client went away
        if context.include_usage:
            used = P.usage(sum(len(ids) for _, ids in job.prompts), completion_tokens)
            yield P.sse(P.chat_chunk(context.id, context.created, context.model, [], used=used, include_usage=True))
        yield P.SSE_DONE
    except Exception:
        logger.exception("a chat completions stream failed")
        yield P.sse(P.error_body("the server failed while answering this request", "server_error", None, "internal_error"))
        yield P.SSE_DONE
    finally:
        job.close()


async def _answer(state: _State, request: Request, handler: Callable[[_State, Request], Awaitable[Response]]) -> Response:
    """Run a handler; every failure becomes an OpenAI-shaped error response."""
    try:
        return await handler(state, request)
    except P.APIError as error:
        return _error_response(error)
    except QueueFullError as error:
        return _error_response(_unavailable(str(error), "queue_full"))
    except EngineClosedError:
        return _error_response(_unavailable("the engine is shut down; it takes no more requests", "service_unavailable"))
    except EngineBusyError as error:
        return _error_response(_unavailable(str(error), "engine_busy"))
    except InvalidRequestError as error:
        return _error_response(P.APIError(400, str(error)))
    except Exception:
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error_response(P.APIError(500, "the server failed while answering this request (the failure is logged)",
                                          type="server_error", code="internal_error"))


# --------------------------------------------------------------------------------- the app


def build_app(
    engine: AsyncLLM,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_n: int = DEFAULT_MAX_N,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    owns_engine: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` as the model ``model_name``.

    ``api_key`` (None: no key) is required on every ``/v1`` path; ``max_body_bytes`` bounds
    request bodies (413 above it); ``max_n`` bounds ``n``; ``max_logprobs`` bounds
    ``logprobs``, ``top_logprobs`` and ``prompt_logprobs``. When the app shuts down (its ASGI
    lifespan ends) it refuses new requests with 503, waits up to ``drain_timeout`` seconds for
    the running ones, aborts the rest and, with ``owns_engine``, shuts the engine down.
    ``app.state.metrale`` holds the app's state (``begin_drain()`` starts refusing requests).
    """
    if not isinstance(engine, AsyncLLM):
        raise TypeError(f"build_app() takes an AsyncLLM, got {engine!r}")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be None or a non-empty string")
    for name, value in (("max_body_bytes", max_body_bytes), ("max_n", max_n), ("max_logprobs", max_logprobs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_logprobs" else 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) or not drain_timeout >= 0:
        raise ValueError(f"drain_timeout must be a number >= 0, got {drain_timeout!r}")
    state = _State(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes, max_n=max_n,
                   max_logprobs=max_logprobs, drain_timeout=float(drain_timeout), owns_engine=owns_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + state.drain_timeout
        while state.jobs and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for job in list(state.jobs):
            job.abort()
        settle = loop.time() + 1.0  # the aborted requests' handlers send their last event
        while state.jobs and loop.time() < settle:
            await asyncio.sleep(0.02)
        if state.owns_engine:
            await asyncio.to_thread(engine.shutdown, 0.0)

    app = FastAPI(title="Metrale", version=__version__, docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.metrale = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            message = f"no route {request.method} {P.clip(request.url.path, 200)}"
            api_error = P.APIError(404, message, code="not_found")
        elif error.status_code == 405:
            api_error = P.APIError(405, f"{request.method} is not allowed on {P.clip(request.url.path, 200)}",
                                   code="method_not_allowed", headers=dict(error.headers or {}))
        else:
            api_error = P.APIError(error.status_code, str(error.detail), headers=dict(error.headers or {}))
        return _error_response(api_error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        return _error_response(_validation_error(list(error.errors())))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return _error_response(P.APIError(500, "the server failed while answering this request (the failure is logged)",
                                          type="server_error", code="internal_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(state, request, _completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(state, request, _chat)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json_response(P.models_list(state.model_name, state.created, state.max_model_len, state.vocab_size))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != state.model_name:
            return _error_response(P.APIError(404, f"the model {P.clip(model)} does not exist", param="model",
                                              code="model_not_found"))
        return _json_response(P.model_card(state.model_name, state.created, state.max_model_len, state.vocab_size))

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return _error_response(_unavailable("the server is shutting down", "service_unavailable"))
        if not state.engine_alive():
            return _error_response(_unavailable("the engine is not running", "engine_down"))
        return _json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(_Gate, state=state)
    return app
