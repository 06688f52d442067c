"""The server's shared state (:class:`_State`: the engine, the model's limits, the metrics), its
limits and the helpers that make responses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.responses import Response

from metrale.entrypoints.async_llm import AsyncEngineAPI
from metrale.entrypoints.frontend import PromptFrontend
from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

#: Request bodies larger than this are refused with 413 (the default of ``max_body_bytes``).
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: The most completions per prompt (``n``) by default.
DEFAULT_MAX_N = 16
#: The most alternatives per token (``logprobs``, ``top_logprobs``, ``prompt_logprobs``) by default.
DEFAULT_MAX_LOGPROBS = 20
#: Seconds a shutdown waits for running requests by default.
DEFAULT_DRAIN_TIMEOUT = 10.0
#: Seconds a request's body may take to arrive (after its head) by default; slower ones get 408.
DEFAULT_BODY_TIMEOUT = 30.0
#: The most prompts one completions request may hold.
MAX_PROMPTS = 256
#: The most inputs one embeddings request may hold (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048
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
#: The longest ``lora_name`` (characters) and ``lora_path`` (bytes, as the file system takes it)
#: ``POST /v1/load_lora_adapter`` accepts.
MAX_LORA_NAME = 256
MAX_LORA_PATH = 4096
#: ``chat_template_kwargs`` keys that would collide with the template's own arguments.
RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "add_generation_prompt", "tools", "documents"})

#: Known paths, as the ``endpoint`` label of ``metrale_requests_total`` names them (others: ``other``).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
             "/tokenizer_info", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/load_lora_adapter",
             "/v1/unload_lora_adapter", "/v1/embeddings")
#: The tokenizer's paths (vLLM's, outside ``/v1``): they take the API key as ``/v1`` paths do.
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")

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

    def __init__(self, engine: AsyncEngineAPI, *, model_name: str, api_key: str | None, max_body_bytes: int, max_n: int,
                 max_logprobs: int, drain_timeout: float, owns_engine: bool,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.engine: Any = engine
        self.llm: PromptFrontend = engine.llm  # type: ignore[attr-defined]
        self.model_name = model_name
        #: The LoRA adapters requests may name, by name (:func:`~metrale.entrypoints.server.app.build_app`'s
        #: ``lora_modules``, then those ``POST /v1/load_lora_adapter`` loads and ``/v1/unload_lora_adapter``
        #: does not unload).
        self.lora_modules: dict[str, Any] = {}
        #: Whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served.
        self.allow_runtime_lora_updating = False
        #: The ``lora_int_id`` the next loaded adapter gets (above every id given out or served).
        self.next_lora_id = 1
        #: Held while an adapter is loaded or unloaded: one at a time, so two loads of one name
        #: cannot both pass the check that it is free.
        self.lora_lock = asyncio.Lock()
        #: The tool-call parser class of ``tool_choice="auto"`` (``--tool-call-parser``), or None.
        self.tool_parser: Any = None
        #: Whether ``tool_choice="auto"`` replies are parsed for calls (``--enable-auto-tool-choice``).
        self.enable_auto_tool_choice = False
        #: The reasoning parser class (``--reasoning-parser``), or None.
        self.reasoning_parser: Any = None
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
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
            (lambda token: tokenizer.decode([token], skip_special_tokens=False)) if tokenizer is not None else None,
            (lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)) if tokenizer is not None else None)
        #: ``GET /tokenizer_info``'s answer, made on its first request.
        self.tokenizer_info: dict[str, Any] | None = None
        self.draining = False
        self.in_progress = 0
        #: The open jobs (:class:`~metrale.entrypoints.server.jobs._Job`: each adds itself and leaves when closed).
        self.jobs: set[Any] = set()
        cache_config = cache_config_labels(engine)
        self.metrics = ServerMetrics(self.engine.stats, lambda: self.engine.num_active, lambda: self.in_progress,
                                     model_name=model_name, cache_config=lambda: cache_config)

    def engine_alive(self) -> bool:
        return self.engine.is_running

    def begin_drain(self) -> None:
        """Take no more requests (they get 503); those running go on."""
        self.draining = True




def engine_summary_of(engine: Any) -> dict[str, Any]:
    """An :class:`~metrale.entrypoints.engine_process.EngineProcess`'s summary, as its engine process sent
    it, or the one of an :class:`~metrale.AsyncLLM`'s LLM."""
    summary = getattr(engine, "summary", None)
    if summary is not None:
        return summary
    from metrale.entrypoints.engine_process import engine_summary

    return engine_summary(engine.llm)


def cache_config_labels(engine: Any) -> dict[str, str] | None:
    """The labels of ``metrale_cache_config_info`` (vLLM's label names where vLLM has the setting),
    read from the engine's summary once; None for an engine that gives none."""
    try:
        summary = engine_summary_of(engine)
        return {"block_size": str(summary["block_size"]), "num_gpu_blocks": str(summary["kv_cache_blocks"]),
                "cache_dtype": str(summary["kv_cache_dtype"]), "enable_prefix_caching": str(summary["prefix_caching"]),
                "num_state_slots": str(summary["state_slots"] or 0)}
    except Exception as error:  # (a stand-in engine of a test, say): the labels are a courtesy
        logger.debug("no cache settings for the metrics: %r", error)
        return None
