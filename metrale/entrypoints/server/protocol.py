"""The OpenAI-compatible wire format: request models (pydantic v2) and response builders.

The request models check the *types* of the fields (strictly: ``"5"`` is not an int, ``1`` is
not a bool); the ranges are checked where the values become
:class:`~metrale.params.SamplingParams` (:mod:`metrale.entrypoints.server.app`), so the server and the Python
API refuse the same values. Fields the models do not name are accepted and ignored (OpenAI
clients send fields such as ``store`` or ``metadata`` that mean nothing to a local server).

Every builder returns plain JSON data (dicts, lists, strings, numbers); :func:`dumps` writes it.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from metrale.params import CompletionOutput, Logprob, LogprobsDict

#: The log probability written for -inf (and NaN): JSON has no infinity (vLLM's choice too).
MIN_LOGPROB = -9999.0


# ------------------------------------------------------------------------------------ errors


class APIError(Exception):
    """An error answered with an OpenAI-shaped body: ``{"error": {"message", "type", "param",
    "code"}}`` and ``status``; ``headers`` are added to the response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def dumps(data: Any) -> bytes:
    """Compact UTF-8 JSON. A string holding a lone surrogate (which a JSON escape such as
    ``"\\ud800"`` in a request can produce) is written as that escape, never a crash."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8", "backslashreplace")


def clip(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for error messages that quote the request."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


# ---------------------------------------------------------------------------------- requests


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    def given(self, name: str) -> bool:
        """Whether the request set ``name`` to something other than null."""
        return name in self.model_fields_set and getattr(self, name) is not None


class StreamOptions(_Model):
    include_usage: bool | None = None


class JSONSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: str
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(_Model):
    """The fields completions and chat completions share (OpenAI's and vLLM's extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Any = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Any = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingRequest):
    prompt: Any
    logprobs: int | None = None
    echo: bool | None = None
    suffix: Any = None
    best_of: int | None = None
    # vLLM's extension: whether text prompts get the tokenizer's special tokens (BOS); default true
    add_special_tokens: bool | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Any
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class TokenizeRequest(_Model):
    """vLLM's ``POST /tokenize`` body: a ``prompt`` (text) or ``messages`` (a conversation, rendered
    by the chat template first), with the chat fields of chat completions."""

    model: str | None = None
    prompt: Any = None
    messages: Any = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Model):
    """vLLM's ``POST /detokenize`` body: the ``tokens`` to turn back into text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Model):
    """vLLM's ``POST /v1/load_lora_adapter`` body: the adapter's name (the ``model`` requests
    give) and its folder on the server's machine; ``load_inplace`` replaces an adapter of that
    name already served."""

    lora_name: str
    lora_path: str
    load_inplace: bool | None = None


class UnloadLoRAAdapterRequest(_Model):
    """vLLM's ``POST /v1/unload_lora_adapter`` body: the adapter's name, and optionally its id
    (which must then be the one it is served with)."""

    lora_name: str
    lora_int_id: int | None = None


class EmbeddingRequest(_Model):
    """OpenAI's ``POST /v1/embeddings`` body, with vLLM's extensions (``truncate_prompt_tokens``,
    ``add_special_tokens``, ``normalize``, ``embed_dtype``, ``endianness``) and the pooling choice
    (``pooling_type``, vLLM's name of its pooler's setting)."""

    model: str
    input: Any
    encoding_format: str | None = None
    dimensions: int | None = None
    user: Any = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    embed_dtype: str | None = None
    endianness: str | None = None


def error_param(loc: Iterable[Any]) -> str | None:
    """A pydantic error location as OpenAI's ``param``: ``("messages", 0, "role")`` ->
    ``"messages[0].role"``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or None


# --------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def embedding_data(index: int, vector: Sequence[float], encoding_format: str) -> dict[str, Any]:
    """One entry of an embeddings response's ``data``: the vector as JSON numbers
    (``"float"``), or as the base64 of its little-endian float32 bytes (``"base64"``, what
    OpenAI's client decodes)."""
    import base64

    import numpy as np

    if encoding_format == "base64":
        embedding: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    else:
        embedding = [float(value) for value in vector]
    return {"object": "embedding", "index": index, "embedding": embedding}


def embedding_response(response_id: str, created: int, model: str, data: list[dict], prompt_tokens: int) -> dict[str, Any]:
    """An embeddings response: OpenAI's ``{"object": "list", "data", "model", "usage"}``, with
    vLLM's ``id`` and ``created``."""
    return {"id": response_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens``: the prompt tokens the
    prefix cache supplied (vLLM's ``num_cached_tokens``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(cached_tokens)}}


def _logprob_value(value: float) -> float:
    value = float(value)
    if math.isnan(value) or value == -math.inf:
        return MIN_LOGPROB
    return max(min(value, 0.0), MIN_LOGPROB)


def _ranked(entry: LogprobsDict, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely alternatives of one position, best first."""
    ranked = [(token, lp) for token, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


class TokenText:
    """The text of single tokens, as logprobs name them (``decoded_token``, else the tokenizer's
    decoding with special tokens, else ``"token_id:N"``); ``visible`` decodes tokens as a
    completion's text holds them (special tokens left out)."""

    def __init__(self, decode: Callable[[int], str] | None,
                 decode_visible: Callable[[Sequence[int]], str] | None = None) -> None:
        self._decode = decode
        self._decode_visible = decode_visible

    def __call__(self, token: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self._decode is not None:
            try:
                return self._decode(token)
            except Exception:  # a token the tokenizer cannot decode alone
                pass
        return f"token_id:{token}"

    def visible(self, token_ids: Sequence[int]) -> str | None:
        """What ``token_ids`` add to a completion's text (special tokens decode to nothing), or
        None when that is not known (no tokenizer, or one that cannot decode them)."""
        if self._decode_visible is None:
            return None
        try:
            return self._decode_visible(token_ids)
        except Exception:  # ids the tokenizer cannot decode
            return None


#: How far past a token's expected place its text is looked for in a choice's text: the decoder
#: may drop a token's leading space when it decodes it alone (SentencePiece).
_OFFSET_SEARCH = 16


def _at(text: str, cursor: int, piece: str) -> bool:
    """Whether ``text`` holds ``piece`` at ``cursor``, or the start of it up to its end (a
    stream's text so far)."""
    ahead = text[cursor:cursor + len(piece)]
    return piece.startswith(ahead) and (ahead == piece or cursor + len(ahead) >= len(text))


class CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` object of one completion choice (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``), built a piece at a time so that a
    stream can send each chunk's part (``text_offset`` continues across chunks).

    ``text_offset`` indexes into the choice's ``text``: ``text[text_offset[i]:]`` starts with
    ``tokens[i]`` for every token whose string the text holds there. A special token, which the
    text leaves out (such as a BOS), gets the offset where the text goes on; the tokens of a
    character split across tokens (each one's string holding a replacement character) all get
    the offset where their text together starts. ``offset`` is where the next token goes."""

    def __init__(self, k: int, token_text: TokenText, offset: int = 0) -> None:
        self.k = k
        self.token_text = token_text
        self.offset = offset
        self._partial: list[int] = []  # the tokens of a character still incomplete

    def continue_at(self, offset: int) -> None:
        """Place the next tokens from ``offset`` on: their text starts there (a completion's
        generated text after its echoed prompt)."""
        self.offset = offset
        self._partial.clear()

    def piece(self, token_ids: Sequence[int], entries: Sequence[LogprobsDict | None],
              first_is_prompt_start: bool = False, text: str | None = None) -> dict:
        """The logprobs of ``token_ids`` (one entry each), placed in ``text``, the choice's text
        so far (None: each token is counted by its string's length)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for position, (token, entry) in enumerate(zip(token_ids, entries)):
            chosen = entry.get(token) if entry is not None else None
            shown = self.token_text(token, chosen)
            tokens.append(shown)
            if entry is None or chosen is None or (first_is_prompt_start and position == 0):
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token_logprobs.append(_logprob_value(chosen.logprob))
                top = {self.token_text(t, lp): _logprob_value(lp.logprob) for t, lp in _ranked(entry, self.k)}
                top.setdefault(shown, _logprob_value(chosen.logprob))
                top_logprobs.append(top)
            text_offset.append(self._place(token, shown, text))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}

    def _place(self, token: int, shown: str, text: str | None) -> int:
        """The offset of ``token`` (whose string is ``shown``) in ``text``; moves :attr:`offset`
        past it. A stream's text may not hold the last tokens yet (it holds back what may become
        a stop string): a token past its end is taken to be there."""
        cursor = self.offset
        if text is None:
            self.offset += len(shown)
            return cursor
        if shown and cursor < len(text) and _at(text, cursor, shown):
            self._partial.clear()
            self.offset = cursor + len(shown)
            return cursor
        visible = self.token_text.visible([token])
        if visible == "":
            return cursor  # a special token: the text leaves it out
        if visible is None:
            visible = shown
        if self._partial or "\ufffd" in visible:
            # Part of a character split across tokens: placed once the tokens decode to it whole.
            whole = self.token_text.visible([*self._partial, token]) if self._partial else visible
            if whole is not None and "\ufffd" not in whole and _at(text, cursor, whole):
                self._partial.clear()
                self.offset = cursor + len(whole)
                return cursor
            if whole is not None and "\ufffd" in whole and len(self._partial) < 8:
                self._partial.append(token)
                return cursor
            self._partial.clear()
        if cursor >= len(text):
            self.offset += len(visible)
            return cursor
        found = text.find(shown, cursor, cursor + len(shown) + _OFFSET_SEARCH) if shown else -1
        if found >= 0:
            self.offset = found + len(shown)
            return found
        return cursor


def _chat_entry(text: str, value: float) -> dict[str, Any]:
    return {"token": text, "logprob": _logprob_value(value), "bytes": list(text.encode("utf-8", "backslashreplace"))}


def chat_logprobs(token_ids: list[int], entries: list[LogprobsDict], k: int, token_text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object of some generated tokens: ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs": [...]}]}`` with the ``k`` most likely alternatives."""
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry.get(token)
        text = token_text(token, chosen)
        item = _chat_entry(text, chosen.logprob if chosen is not None else -math.inf)
        item["top_logprobs"] = [_chat_entry(token_text(t, lp), lp.logprob) for t, lp in _ranked(entry, k)]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(entries: list[LogprobsDict | None] | None, token_text: TokenText) -> list | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then ``{token id (a string):
    {"logprob", "rank", "decoded_token"}}`` per token."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({str(token): {"logprob": _logprob_value(lp.logprob), "rank": lp.rank, "decoded_token": token_text(token, lp)}
                    for token, lp in entry.items()})
    return out


def stop_reason(completion: CompletionOutput, eos_token_ids: Iterable[int], stop_token_ids: Iterable[int]) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the completion; None
    for an end-of-sequence token or any other reason."""
    reason = completion.stop_reason
    if isinstance(reason, int) and reason in set(eos_token_ids) and reason not in set(stop_token_ids):
        return None
    return reason


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      reason: str | int | None, prompt_logprobs: list | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def chat_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                reason: str | int | None, message: dict[str, Any] | None = None) -> dict[str, Any]:
    """A chat choice: ``message`` (the assistant's, with its ``tool_calls`` and
    ``reasoning_content``), or by default a message whose content is ``text``."""
    if message is None:
        message = {"role": "assistant", "content": text, "tool_calls": []}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": reason}


def completion_response(response_id: str, created: int, model: str, choices: list[dict], used: dict) -> dict[str, Any]:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": used}


def chat_response(response_id: str, created: int, model: str, choices: list[dict], used: dict) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": used}


def completion_chunk(response_id: str, created: int, model: str, choices: list[dict], *,
                     used: dict | None = None, include_usage: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices}
    if include_usage:
        chunk["usage"] = used
    return chunk


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict], *,
               used: dict | None = None, include_usage: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": choices}
    if include_usage:
        chunk["usage"] = used
    return chunk


def chat_delta_choice(index: int, delta: dict[str, Any], logprobs: dict | None, finish_reason: str | None,
                      reason: str | int | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": reason}


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(data) + b"\n\n"


#: The event that ends every stream.
SSE_DONE = b"data: [DONE]\n\n"


def models_list(model: str, created: int, max_model_len: int, vocab_size: int,
                adapters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base model, then each LoRA adapter (``adapters``: name -> LoRARequest)."""
    cards = [model_card(model, created, max_model_len, vocab_size)]
    cards += [model_card(model, created, max_model_len, vocab_size, lora) for lora in (adapters or {}).values()]
    return {"object": "list", "data": cards}


def model_card(model: str, created: int, max_model_len: int, vocab_size: int, lora: Any = None) -> dict[str, Any]:
    """The card of the base model ``model``, or of its adapter ``lora`` (whose ``parent`` it is)."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "metrale", "max_model_len": max_model_len,
            "vocab_size": vocab_size}
    if lora is not None:
        card.update(id=lora.lora_name, root=str(lora.lora_path), parent=model)
    return card
