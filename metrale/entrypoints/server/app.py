"""The OpenAI-compatible HTTP server: :func:`build_app` makes a FastAPI app around an
:class:`~metrale.AsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(:mod:`metrale.entrypoints.server.responses`), ``POST /v1/embeddings``
(:mod:`metrale.entrypoints.server.embeddings`), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`metrale.entrypoints.server.anthropic`), ``GET /v1/models`` (and
``GET /v1/models/{model}``), vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
(:mod:`metrale.entrypoints.server.tokenization`), ``GET /health``, ``GET /metrics``, and, only when turned on,
vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (:mod:`metrale.entrypoints.server.lora`).
``docs/serving.rst`` lists every field, status and metric.

How a request runs. The handler reads the body (the :class:`~metrale.entrypoints.server.gate._Gate` middleware has already
checked the API key, the body's size and the time it took to arrive), checks it field by field (every bad value is a 400
naming the field), turns it into one :class:`~metrale.params.SamplingParams` per prompt and
submits one engine request per prompt (a request's ``n`` completions run as one engine request
with ``SamplingParams.n``, so a seed gives the same completions as :meth:`metrale.LLM.generate`).
A :class:`~metrale.entrypoints.server.jobs._Job` reads the engine requests' outputs (one task per request, each holding at
most one output not yet sent) and aborts every unfinished one when it is closed: when the response is complete, when the
client goes away (a disconnect watcher reads ``http.disconnect`` for streaming and
non-streaming requests alike) or when the handler fails. Outputs are cumulative; the handlers
send each choice's new text only.

The pieces: :mod:`metrale.entrypoints.server.state` (the shared state and limits), :mod:`metrale.entrypoints.server.gate`
(the key and size checks), :mod:`metrale.entrypoints.server.checks` (request checking),
:mod:`metrale.entrypoints.server.jobs` (engine requests and their outputs), :mod:`metrale.entrypoints.server.handlers`
(the two endpoints) and :mod:`metrale.entrypoints.server.protocol` (the wire format).

Nothing a client sends reaches the engine unchecked, and no exception leaves a handler: bad
input is a 400, an unexpected failure a 500 with a generic message (logged with its traceback,
never with the request's body or key).
"""

from __future__ import annotations

import asyncio
import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from metrale._version import __version__
from metrale.config import RUNTIME_LORA_VARIABLE, environment_allows_runtime_lora_updating
from metrale.entrypoints.async_llm import AsyncEngineAPI
from metrale.entrypoints.parsers import ReasoningParser, ToolParser
from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.anthropic import _count_tokens, _messages
from metrale.entrypoints.server.checks import _validation_error
from metrale.entrypoints.server.embeddings import _embeddings
from metrale.entrypoints.server.gate import _Gate
from metrale.entrypoints.server.handlers import _answer, _chat, _completions
from metrale.entrypoints.server.lora import _load_lora_adapter, _unload_lora_adapter
from metrale.entrypoints.server.metrics import CONTENT_TYPE
from metrale.entrypoints.server.responses import _responses
from metrale.entrypoints.server.state import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_N,
    _error_response,
    _json_response,
    _State,
    _unavailable,
    logger,
)
from metrale.entrypoints.server.tokenization import _detokenize, _tokenize, _tokenizer_info
from metrale.errors import ConfigError
from metrale.loading.lora import LoRARequest

# --------------------------------------------------------------------------------- the app


def _set_parsers(state: _State, enable_auto_tool_choice: bool, tool_call_parser: Any, reasoning_parser: Any) -> None:
    """Look the parsers up by name (ConfigError for an unknown one), or take the classes given,
    and keep them in ``state``."""
    from metrale.entrypoints.parsers import ReasoningParser, ToolParser, get_reasoning_parser, get_tool_parser

    if not isinstance(enable_auto_tool_choice, bool):
        raise ConfigError(f"enable_auto_tool_choice must be True or False, got {enable_auto_tool_choice!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ConfigError("enable_auto_tool_choice (--enable-auto-tool-choice) needs a tool_call_parser "
                          "(--tool-call-parser NAME) to read the model's calls with")
    manager: Any = None
    for name, value, base, lookup in (("tool_call_parser", tool_call_parser, ToolParser, get_tool_parser),
                                      ("reasoning_parser", reasoning_parser, ReasoningParser, get_reasoning_parser)):
        if value is None:
            parser = None
        elif isinstance(value, type) and issubclass(value, base):
            parser = value
        elif isinstance(value, str):
            if manager is None:
                from metrale.model.plugin_manager import get_plugin_manager

                manager = get_plugin_manager()
            parser = lookup(value, manager)
        else:
            raise ConfigError(f"{name} must be a parser's name or a {base.__name__} subclass, got {value!r}")
        setattr(state, "tool_parser" if name == "tool_call_parser" else "reasoning_parser", parser)
    state.enable_auto_tool_choice = enable_auto_tool_choice


def build_app(
    engine: AsyncEngineAPI,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    max_n: int = DEFAULT_MAX_N,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    owns_engine: bool = True,
    lora_modules: Sequence[LoRARequest] = (),
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | type[ToolParser] | None = None,
    reasoning_parser: str | type[ReasoningParser] | None = None,
    allow_runtime_lora_updating: bool | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (an :class:`~metrale.AsyncLLM` or an
    :class:`~metrale.entrypoints.engine_process.EngineProcess`) as the model ``model_name``.

    ``api_key`` (None: no key) is required on every ``/v1`` path; ``max_body_bytes`` bounds
    request bodies (413 above it) and ``body_timeout`` the seconds a body may take to arrive
    after its request's head (408, and the connection closed, when it is slower); ``max_n``
    bounds ``n``; ``max_logprobs`` bounds ``logprobs``, ``top_logprobs`` and
    ``prompt_logprobs``. When the app shuts down (its ASGI
    lifespan ends) it refuses new requests with 503, waits up to ``drain_timeout`` seconds for
    the running ones, aborts the rest and, with ``owns_engine``, shuts the engine down.
    ``lora_modules`` are the engine's LoRA adapters (a list of :class:`~metrale.loading.lora.LoRARequest`): a
    request whose ``model`` is an adapter's name runs with it; ``/v1/models`` lists them too.
    ``app.state.metrale`` holds the app's state (``begin_drain()`` starts refusing requests).
    ``tool_call_parser`` and ``reasoning_parser`` name the parsers (plugins'
    ``metrale_tool_parsers`` and ``metrale_reasoning_parsers``, :mod:`metrale.entrypoints.parsers`)
    chat replies are read with, or are the parser classes themselves; ``tool_choice="auto"``
    replies are parsed for calls only with ``enable_auto_tool_choice``, which needs a
    ``tool_call_parser``. An unknown parser name raises
    :class:`~metrale.errors.ConfigError` listing the available ones.
    ``allow_runtime_lora_updating`` serves vLLM's ``POST /v1/load_lora_adapter`` and
    ``POST /v1/unload_lora_adapter`` (:mod:`metrale.entrypoints.server.lora`), which add and remove
    adapters while the server runs (the engine must serve LoRA); None (the default) takes vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` variable (``1`` or ``true``: on). Off, their paths are a 404
    as any unknown path. On, any client with the API key can make the server read any folder it
    can reach: a warning is logged.
    """
    if not isinstance(engine, AsyncEngineAPI):
        raise TypeError(f"build_app() takes an AsyncLLM or an EngineProcess, got {engine!r}")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be None or a non-empty string")
    for name, value in (("max_body_bytes", max_body_bytes), ("max_n", max_n), ("max_logprobs", max_logprobs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_logprobs" else 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) or not drain_timeout >= 0:
        raise ValueError(f"drain_timeout must be a number >= 0, got {drain_timeout!r}")
    if (isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float))
            or not (body_timeout > 0 and math.isfinite(body_timeout))):
        raise ValueError(f"body_timeout must be a number of seconds > 0, got {body_timeout!r}")
    adapters = {lora.lora_name: lora for lora in lora_modules}
    if len(adapters) != len(lora_modules) or model_name in adapters:
        raise ValueError(f"lora_modules need names of their own, apart from the model's {model_name!r}")
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = environment_allows_runtime_lora_updating()
    elif not isinstance(allow_runtime_lora_updating, bool):
        raise ValueError(f"allow_runtime_lora_updating must be True, False or None, got {allow_runtime_lora_updating!r}")
    state = _State(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes, max_n=max_n,
                   max_logprobs=max_logprobs, drain_timeout=float(drain_timeout), owns_engine=owns_engine,
                   body_timeout=float(body_timeout))
    state.lora_modules = adapters
    state.allow_runtime_lora_updating = allow_runtime_lora_updating
    _set_parsers(state, enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    if allow_runtime_lora_updating:
        logger.warning("runtime LoRA updating is on (--allow-runtime-lora-updating or %s): any client %s can load "
                       "an adapter from any folder this server can read (POST /v1/load_lora_adapter); serve it to "
                       "trusted clients only", RUNTIME_LORA_VARIABLE,
                       "with the API key" if api_key is not None else "(no API key is set)")
        if not engine.serves_lora:
            logger.warning("runtime LoRA updating is on but the engine serves no LoRA: every load will be refused "
                           "(start with --enable-lora)")

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

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _answer(state, request, _responses)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _answer(state, request, _embeddings)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _answer(state, request, _messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await _answer(state, request, _count_tokens)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _answer(state, request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _answer(state, request, _detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await _answer(state, request, _tokenizer_info)

    if state.allow_runtime_lora_updating:  # (off: no route, so a 404 as for any unknown path, as vLLM does)
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await _answer(state, request, _load_lora_adapter)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await _answer(state, request, _unload_lora_adapter)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json_response(P.models_list(state.model_name, state.created, state.max_model_len, state.vocab_size,
                                            state.lora_modules))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != state.model_name and model not in state.lora_modules:
            return _error_response(P.APIError(404, f"the model {P.clip(model)} does not exist", param="model",
                                              code="model_not_found"))
        return _json_response(P.model_card(state.model_name, state.created, state.max_model_len, state.vocab_size,
                                           state.lora_modules.get(model)))

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
