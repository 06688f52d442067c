"""Request checking: a request body turned into checked prompts and
:class:`~metrale.params.SamplingParams` (every bad value a 400 naming its field)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.replies import _template_messages
from metrale.entrypoints.server.state import (
    _PLAIN_FIELDS,
    _STRUCTURED_KEYS,
    CHAT_ROLES,
    MAX_JSON_DEPTH,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_LENGTH,
    RESERVED_TEMPLATE_KWARGS,
    _State,
)
from metrale.errors import InvalidRequestError
from metrale.params import MAX_LOGPROBS, MAX_N, SamplingParams
from metrale.structured import StructuredOutputParams

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


def _check_model(state: _State, req: P.SamplingRequest) -> Any:
    """The LoRA adapter the request's ``model`` names (a :class:`~metrale.loading.lora.LoRARequest`), or
    None for the base model; 404 for any other name."""
    if req.model in state.lora_modules:
        return state.lora_modules[req.model]
    if req.model != state.model_name:
        served = ", ".join(repr(name) for name in [state.model_name, *state.lora_modules])
        raise P.APIError(404, f"the model {P.clip(req.model)} does not exist; this server serves {served}",
                         param="model", code="model_not_found")
    return None


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
    if structured is not None and state.llm.tokenizer is None:
        raise P.APIError(400, "structured output needs a tokenizer; this model has none", param=source)
    return options


async def _check_structured_output(state: _State, req: P.SamplingRequest, options: dict[str, Any],
                                   source: str | None = None) -> None:
    """Check the request's structured output off the event loop (a slow or crashing compile
    costs only this request: :mod:`metrale.structured.sandbox`), naming the field on a 400
    (``source``, else the field it came from); the engine then finds it checked."""
    structured = options.get("structured_output")
    if structured is None:
        return
    source = source or _structured(req)[1] or "response_format"
    try:
        await state.engine.check_structured_output(structured)
    except InvalidRequestError as error:
        raise P.APIError(400, f"{source}: {error}", param=source) from None


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


def _completion_prompts(state: _State, value: Any, add_special_tokens: bool = True, *, param: str = "prompt",
                        max_prompts: int = MAX_PROMPTS, keep_last: int | None = None) -> list[tuple[str | None, list[int]]]:
    """The prompts of a completions request (or the ``input`` of an embeddings request, its
    field named by ``param``): a string, a list of strings, a list of token ids or a list of
    lists of token ids, at most ``max_prompts``; text is encoded with the tokenizer's special
    tokens (BOS) unless ``add_special_tokens`` is False. ``keep_last`` cuts each prompt to its
    last that many tokens (vLLM's ``truncate_prompt_tokens``) before its length is checked."""
    shapes = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list):
        if not value:
            raise P.APIError(400, f"{param} must not be an empty list", param=param)
        if all(_is_token(v) for v in value):
            items = [value]
        elif all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            items = value
        else:
            raise P.APIError(400, f"{param} must be {shapes}, got a list mixing {P.clip(value)}", param=param)
    else:
        raise P.APIError(400, f"{param} must be {shapes}, got {P.clip(value)}", param=param)
    if len(items) > max_prompts:
        raise P.APIError(400, f"{param} holds {len(items)} prompts; at most {max_prompts} are accepted", param=param)
    prompts = []
    for index, item in enumerate(items):
        label = param if len(items) == 1 else f"{param}[{index}]"
        if isinstance(item, str):
            try:
                ids = state.llm.encode(item, add_special_tokens=add_special_tokens)
            except InvalidRequestError as error:
                raise P.APIError(400, f"{label}: {error}", param=param) from None
            text: str | None = item
        else:
            if not all(_is_token(t) for t in item):
                raise P.APIError(400, f"{label} must be a list of token ids (ints), got {P.clip(item)}", param=param)
            bad = [t for t in item if not 0 <= t < state.vocab_size]
            if bad:
                raise P.APIError(400, f"{label} holds token id {bad[0]}, outside the vocabulary [0, {state.vocab_size})",
                                 param=param)
            ids, text = list(item), None
        if not ids:
            raise P.APIError(400, f"{label} has no tokens", param=param)
        if keep_last is not None and len(ids) > keep_last:
            ids, text = ids[-keep_last:], None  # (the text no longer matches the ids run)
        if len(ids) > state.max_model_len:
            raise P.APIError(400, f"{label} has {len(ids)} tokens, more than the model's context of {state.max_model_len}",
                             param=param)
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


def _chat_text(state: _State, req: P.ChatCompletionRequest | P.TokenizeRequest) -> str:
    """The conversation of ``req`` (its ``messages``, ``tools``, ``documents``,
    ``chat_template_kwargs`` and ``add_generation_prompt``, checked) rendered by the chat
    template."""
    messages = _check_messages(req.messages)
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise P.APIError(400, f"chat_template_kwargs may not set {reserved[0]!r} (give it as its own field)",
                         param="chat_template_kwargs")
    if req.given("documents"):
        kwargs["documents"] = req.documents
    messages = _template_messages(messages)
    if req.continue_final_message:
        raise P.APIError(400, "continue_final_message is not supported", param="continue_final_message")
    add_generation_prompt = req.add_generation_prompt if req.add_generation_prompt is not None else True
    try:
        return state.llm.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=req.tools, **kwargs)
    except InvalidRequestError as error:
        raise P.APIError(400, str(error), param="messages") from None


def _chat_prompt(state: _State, req: P.ChatCompletionRequest) -> tuple[str, list[int]]:
    text = _chat_text(state, req)
    try:
        ids = state.llm.encode(text, add_special_tokens=False)
    except InvalidRequestError as error:
        raise P.APIError(400, str(error), param="messages") from None
    if not ids:
        raise P.APIError(400, "the rendered conversation has no tokens", param="messages")
    if len(ids) > state.max_model_len:
        raise P.APIError(400, f"the conversation has {len(ids)} tokens, more than the model's context of {state.max_model_len}",
                         param="messages")
    return text, ids


