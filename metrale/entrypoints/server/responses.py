"""OpenAI's Responses API, ``POST /v1/responses``, served statelessly on top of chat completions.

A request is read in the Responses shape -- ``input`` (a string, or a list of items: messages,
``function_call`` and ``function_call_output`` items, ``reasoning`` items), ``instructions``, the
flat function ``tools``, ``tool_choice``, ``text.format``, ``max_output_tokens``, ``reasoning``
-- checked field by field (a 400 naming the Responses field), and turned into the chat request it
means: ``instructions`` becomes a system message first, ``input_text`` and ``output_text`` parts
become text parts, a ``function_call`` item becomes a call on an assistant message (consecutive
ones share that message) and a ``function_call_output`` item a ``tool`` message, a ``reasoning``
item becomes the ``reasoning_content`` of the assistant message after it, ``text.format`` becomes
``response_format`` and ``reasoning.effort`` the chat template's ``reasoning_effort``. From there
the chat completions path runs unchanged (:mod:`metrale.entrypoints.server.checks` and
:mod:`metrale.entrypoints.server.replies`): the same template rendering, limits, sampling
parameters, forced tool calls under llguidance, tool-call and reasoning parsers, metrics and
abort on disconnect; so a request's output text is the text chat completions gives for the same
conversation.

The reply is read with :class:`~metrale.entrypoints.server.replies._Reply` into output items
(:class:`_OutputItems`): a ``reasoning`` item for the thinking, a ``message`` item for the
text, a ``function_call`` item per call. A streamed response sends the same items as OpenAI's
events (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
..., ``response.completed``), each with its ``sequence_number``; a non-streamed one runs the same
builder once over the whole reply, so both give the same items.

The server keeps no responses: ``store`` is accepted and ignored (responses say ``"store":
false``), and ``previous_response_id``, ``conversation``, ``item_reference`` items and
``background`` are refused with a 400 -- a client sends the earlier turns' items in ``input``.
``docs/serving.rst`` ("OpenAI Responses API") lists every field.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, cast

from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.checks import (
    _chat_prompt,
    _check_model,
    _check_structured_output,
    _params_for_prompt,
    _parse,
    _sampling_options,
    _structured,
    _validation_error,
)
from metrale.entrypoints.server.jobs import _ClientGone, _collect, _EventStream, _failure, _Job
from metrale.entrypoints.server.replies import MAX_FUNCTION_NAME, MAX_TOOLS, _constrain, _Reply, _reply_format, _ReplyFormat
from metrale.entrypoints.server.state import _json_response, _State
from metrale.errors import MetraleError
from metrale.params import RequestOutput

logger = logging.getLogger(__name__)

#: The path, as the metrics' ``endpoint`` label names it.
ENDPOINT = "/v1/responses"
#: The roles a message item may have.
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
#: The ``reasoning.effort`` values accepted (passed to the chat template as ``reasoning_effort``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
#: The ``reasoning.summary`` values accepted (no summary is written: ``summary`` is always empty).
REASONING_SUMMARIES = ("auto", "concise", "detailed")
#: Fields a request passes on to the chat request as they are: sampling options and vLLM's
#: extensions, checked there exactly as for chat completions.
PASSED_FIELDS = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "top_k",
                 "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "structured_outputs")
#: Content parts this server takes, and those it refuses as not text.
_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
#: Chat request fields as the Responses request names them, for errors raised by the chat checks.
_CHAT_FIELDS = {"messages": "input", "response_format": "text.format"}


# --------------------------------------------------------------------------------- the request


class ResponsesRequest(P._Model):
    """The fields of a Responses request the server reads (others are accepted and ignored).

    Types are checked strictly here; values, shapes and refusals by :func:`_chat_request`."""

    model: str
    input: Any = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extensions and the chat sampling fields the Responses API lacks
    seed: int | None = None
    stop: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def given(self, name: str) -> bool:
        """Whether the request set ``name`` to something other than null."""
        return name in self.model_fields_set and getattr(self, name) is not None


def _refuse_unserved(req: ResponsesRequest) -> None:
    """400 for what a stateless text-only server cannot do."""
    stateless = "this server keeps no responses; send the earlier turns' output items in input instead"
    if req.given("previous_response_id"):
        raise P.APIError(400, f"previous_response_id is not supported: {stateless}", param="previous_response_id")
    if req.given("conversation"):
        raise P.APIError(400, f"conversation is not supported: {stateless}", param="conversation")
    if req.background:
        raise P.APIError(400, "background is not supported: a response is generated while its request waits",
                         param="background")
    if req.given("prompt"):
        raise P.APIError(400, "prompt (a stored prompt template) is not supported; send the text in instructions and input",
                         param="prompt")
    if req.given("truncation") and req.truncation != "disabled":
        if req.truncation == "auto":
            raise P.APIError(400, "truncation 'auto' is not supported: an input longer than the context is refused",
                             param="truncation")
        raise P.APIError(400, f"truncation must be 'disabled' or 'auto', got {P.clip(req.truncation)}", param="truncation")
    if req.given("top_logprobs") and req.top_logprobs != 0:
        raise P.APIError(400, "top_logprobs is not supported by /v1/responses (chat completions serve logprobs)",
                         param="top_logprobs")
    if req.given("max_tool_calls") and (req.max_tool_calls or 0) < 1:
        raise P.APIError(400, f"max_tool_calls must be at least 1, got {req.max_tool_calls}", param="max_tool_calls")


def _text_of_parts(parts: Any, where: str, allowed: tuple[str, ...]) -> list[dict[str, Any]]:
    """Content parts as chat text parts: each of a type in ``allowed`` with a string ``text``."""
    if not isinstance(parts, list):
        raise P.APIError(400, f"{where} must be a string or a list of content parts, got {P.clip(parts)}", param=where)
    out = []
    for index, part in enumerate(parts):
        label = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise P.APIError(400, f"{label} is an {kind} part; this server takes text only ({' or '.join(allowed)} parts)",
                             param=label)
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise P.APIError(400, f"{label} must be a text part {{'type': {allowed[0]!r}, 'text': '...'}}, got {P.clip(part)}",
                             param=label)
        out.append({"type": "text", "text": part["text"]})
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise P.APIError(400, f"{where}.{key} must be a non-empty string, got {P.clip(value)}", param=f"{where}.{key}")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The text of a ``reasoning`` input item: its ``content`` texts, else its ``summary`` texts."""
    texts: dict[str, list[str]] = {}
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise P.APIError(400, f"{where}.{key} must be a list of {kind} parts, got {P.clip(parts)}", param=f"{where}.{key}")
        for index, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
                raise P.APIError(400, f"{where}.{key}[{index}] must be {{'type': {kind!r}, 'text': '...'}}, got {P.clip(part)}",
                                 param=f"{where}.{key}[{index}]")
            texts.setdefault(key, []).append(part["text"])
    return "".join(texts.get("content") or texts.get("summary") or [])


def _conversation(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input`` (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if req.given("instructions"):
        messages.append({"role": "system", "content": req.instructions})
    value = req.input
    if value is None:
        raise P.APIError(400, "input is required: a string or a list of input items", param="input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    if not isinstance(value, list):
        raise P.APIError(400, f"input must be a string or a list of input items, got {P.clip(value)}", param="input")
    if not value:
        raise P.APIError(400, "input must hold at least one item", param="input")
    calls: set[str] = set()
    reasoning: str | None = None  # a reasoning item's text, for the assistant message after it
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise P.APIError(400, f"{where} must be an input item object, got {P.clip(item)}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                raise P.APIError(400, f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {P.clip(role)}",
                                 param=f"{where}.role")
            content = item.get("content")
            if content is None:
                raise P.APIError(400, f"{where}.content is required", param=f"{where}.content")
            if not isinstance(content, str):
                content = _text_of_parts(content, f"{where}.content", _TEXT_PARTS)
            message: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
            reasoning = None  # (reasoning belongs to the assistant turn right after it, or to none)
            messages.append(message)
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise P.APIError(400, f"{where}.arguments must be the call's arguments as JSON text, got {P.clip(arguments)}",
                                 param=f"{where}.arguments")
            if arguments.strip():
                try:
                    json.loads(arguments)
                except ValueError:
                    raise P.APIError(400, f"{where}.arguments is not JSON: {P.clip(arguments)}",
                                     param=f"{where}.arguments") from None
            calls.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise P.APIError(400, f"{where}.call_id {P.clip(call_id)} answers no function_call item before it",
                                 param=f"{where}.call_id")
            output = item.get("output")
            if not isinstance(output, str):
                output = "".join(part["text"] for part in _text_of_parts(output, f"{where}.output", ("input_text",)))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            reasoning = None
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
        elif kind == "item_reference":
            raise P.APIError(400, f"{where} is an item_reference: this server keeps no items; send the item itself",
                             param=f"{where}.type")
        else:
            raise P.APIError(400, f"{where}.type must be 'message', 'function_call', 'function_call_output' or "
                             f"'reasoning' (the items this server serves), got {P.clip(kind)}", param=f"{where}.type")
    return messages


def _function_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``tools``, checked (function tools only), in chat's nested shape."""
    if not req.given("tools"):
        return []
    tools = list(req.tools or [])
    if len(tools) > MAX_TOOLS:
        raise P.APIError(400, f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", param="tools")
    names: set[str] = set()
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if tool.get("type") != "function":
            raise P.APIError(400, f"{where}.type must be 'function' (this server serves function tools only), got "
                             f"{P.clip(tool.get('type'))}", param=f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_FUNCTION_NAME:
            raise P.APIError(400, f"{where}.name must be a non-empty string of at most {MAX_FUNCTION_NAME} characters, "
                             f"got {P.clip(name)}", param=f"{where}.name")
        if name in names:
            raise P.APIError(400, f"{where}.name {name!r} names a function given before; names must differ",
                             param=f"{where}.name")
        names.add(name)
        function: dict[str, Any] = {"name": name}
        for key, kind, what in (("parameters", dict, "a JSON schema object"), ("description", str, "a string"),
                                ("strict", bool, "true or false")):
            value = tool.get(key)
            if value is not None and not isinstance(value, kind):
                raise P.APIError(400, f"{where}.{key} must be {what}, got {P.clip(value)}", param=f"{where}.{key}")
            if value is not None and key != "strict":  # forced calls always follow the schema
                function[key] = value
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(req: ResponsesRequest) -> Any:
    """The request's ``tool_choice`` in chat's shape, or None when it gives none."""
    if not req.given("tool_choice"):
        return None
    value = req.tool_choice
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise P.APIError(400, f"tool_choice of type 'function' needs a 'name', got {P.clip(value)}", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise P.APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} (this "
                     f"server serves function tools only), got {P.clip(value)}", param="tool_choice")


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``, or None for plain text."""
    if not req.given("text"):
        return None
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise P.APIError(400, f"text.format must be an object with a 'type', got {P.clip(fmt)}", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise P.APIError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {P.clip(kind)}",
                         param="text.format.type")
    name, schema, strict = fmt.get("name"), fmt.get("schema"), fmt.get("strict")
    if not isinstance(name, str) or not name:
        raise P.APIError(400, f"text.format.name must be a non-empty string, got {P.clip(name)}", param="text.format.name")
    if not isinstance(schema, dict):
        raise P.APIError(400, f"text.format.schema must be a JSON schema object, got {P.clip(schema)}",
                         param="text.format.schema")
    if strict is not None and not isinstance(strict, bool):
        raise P.APIError(400, f"text.format.strict must be true or false, got {P.clip(strict)}", param="text.format.strict")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _reasoning_options(req: ResponsesRequest) -> dict[str, Any]:
    """The request's ``reasoning``, checked: ``{"effort", "summary"}`` (None when not given)."""
    options = dict(req.reasoning or {})
    checked: dict[str, Any] = {"effort": None, "summary": None}
    for key, allowed in (("effort", REASONING_EFFORTS), ("summary", REASONING_SUMMARIES)):
        value = options.get(key)
        if value is not None and value not in allowed:
            raise P.APIError(400, f"reasoning.{key} must be one of {', '.join(allowed)}, got {P.clip(value)}",
                             param=f"reasoning.{key}")
        checked[key] = value
    return checked


def _chat_request(req: ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat completions request that ``req`` means (see the module docstring)."""
    _refuse_unserved(req)
    body: dict[str, Any] = {"model": req.model, "messages": _conversation(req)}
    tools = _function_tools(req)
    if tools:
        body["tools"] = tools
    choice = _tool_choice(req)
    if choice is not None:
        body["tool_choice"] = choice
    if req.given("parallel_tool_calls"):
        body["parallel_tool_calls"] = req.parallel_tool_calls
    response_format = _response_format(req)
    if response_format is not None:
        body["response_format"] = response_format
    kwargs = dict(req.chat_template_kwargs or {})
    effort = _reasoning_options(req)["effort"]
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    if kwargs or req.given("chat_template_kwargs"):
        body["chat_template_kwargs"] = kwargs
    for name in PASSED_FIELDS:
        if req.given(name):
            body[name] = getattr(req, name)
    try:
        return P.ChatCompletionRequest.model_validate(body)
    except ValidationError as error:  # (not expected: the fields above were checked already)
        raise _validation_error(list(error.errors())) from None


def _renamed(error: P.APIError) -> P.APIError:
    """An error of the chat checks with the fields named as the Responses request names them."""
    param = error.param
    for chat_name, name in _CHAT_FIELDS.items():
        if param is not None and (param == chat_name or param.startswith((chat_name + ".", chat_name + "["))):
            param = name if chat_name == "messages" else name + param[len(chat_name):]
            break
    message = error.message.replace("response_format", "text.format")
    return P.APIError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)


# ------------------------------------------------------------------------------ the handler


async def _responses(state: _State, request: Request) -> Response:
    """``POST /v1/responses``: the response to one request, streamed or not."""
    req: ResponsesRequest = await _parse(request, cast(Any, ResponsesRequest))
    try:
        return await _respond(state, request, req)
    except P.APIError as error:
        raise _renamed(error) from None


async def _respond(state: _State, request: Request, req: ResponsesRequest) -> Response:
    chat = _chat_request(req)
    lora = _check_model(state, chat)
    reply_format = _reply_format(state, chat)
    if req.max_tool_calls is not None:
        reply_format.call_limit = min(reply_format.call_limit or req.max_tool_calls, req.max_tool_calls)
    text, ids = _chat_prompt(state, chat)
    options = _sampling_options(state, chat, n=1, logprobs=None, logprobs_param="top_logprobs")
    source = _constrain(reply_format, options, chat, _structured(chat)[1])
    await _check_structured_output(state, chat, options, source)
    default = state.llm.sampling_defaults.get("max_tokens")
    params = [_params_for_prompt(state, options, len(ids), req.max_output_tokens, "max_output_tokens", default, "input")]
    response_id, created = _new_id("resp"), P.now()
    job = _Job(state, ENDPOINT, [(text, ids)], params, response_id, lora)
    job.submit()
    try:
        context = _ResponseContext(state, req, response_id, created, reply_format, ids, params[0].stop)
        job.watch(request)
        if req.stream:
            return _EventStream(_events(job, context), job)
        try:
            outputs = await _collect(job)
        except _ClientGone:
            return Response(status_code=499)
        return _json_response(context.whole(outputs[0]))
    except BaseException:
        job.close()
        raise


def _new_id(prefix: str) -> str:
    """A fresh id in OpenAI's Responses shape: ``resp_...``, ``msg_...``, ``rs_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------- output items


@dataclass(eq=False)
class _Item:
    """One output item as it is written: a ``reasoning`` item, a ``message`` or a ``function_call``."""

    kind: str
    id: str
    text: str = ""  # the reasoning, the message's text or the call's arguments
    name: str = ""
    call_id: str = ""
    status: str = "in_progress"

    def json(self, opening: bool = False) -> dict[str, Any]:
        """The item as the API gives it; ``opening``: as ``response.output_item.added`` gives it."""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": self.status, "call_id": self.call_id,
                    "name": self.name, "arguments": "" if opening else self.text}
        content = [] if opening else [self.part()]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": self.status, "summary": [], "content": content}
        return {"id": self.id, "type": "message", "status": self.status, "role": "assistant", "content": content}

    def part(self, text: str | None = None) -> dict[str, Any]:
        """The item's content part (its text, or ``text``)."""
        text = self.text if text is None else text
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}


class _OutputItems:
    """The output items of one response, built from the chat deltas of its reply
    (:meth:`~metrale.entrypoints.server.replies._Reply.feed`): :meth:`feed` and :meth:`finish`
    return the stream events of what is new (without ``sequence_number``); :attr:`items` holds
    the items. Reasoning, text and calls each go to the open item of their kind, a new one opened
    (and the one before closed) when the kind changes."""

    def __init__(self) -> None:
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (``reasoning_content``, ``content``, ``tool_calls``)."""
        events: list[dict[str, Any]] = []
        for kind, key, event in (("reasoning", "reasoning_content", "response.reasoning_text.delta"),
                                 ("message", "content", "response.output_text.delta")):
            text = delta.get(key)
            if not text:
                continue
            item = self._current(kind, events)
            item.text += text
            events.append({"type": event, "item_id": item.id, "output_index": self.items.index(item), "content_index": 0,
                           "delta": text, **({"logprobs": []} if kind == "message" else {})})
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function") or {}
            if "id" in piece:
                call = _Item("function_call", _new_id("fc"), name=function.get("name") or "", call_id=piece["id"])
                self._start(call, events)
                self._calls[piece["index"]] = call
            call = self._calls[piece["index"]]
            arguments = function.get("arguments") or ""
            if arguments:
                call.text += arguments
                if call is self._open:  # (a parser's late piece of an earlier call only joins its arguments)
                    events.append({"type": "response.function_call_arguments.delta", "item_id": call.id,
                                   "output_index": self.items.index(call), "delta": arguments})
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events that close the output: the last item's, ``incomplete`` when the reply was
        cut; a reply that wrote nothing gets an empty message."""
        events: list[dict[str, Any]] = []
        if not self.items:
            self._current("message", events)
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    def _current(self, kind: str, events: list[dict[str, Any]]) -> _Item:
        if self._open is not None and self._open.kind == kind:
            return self._open
        item = _Item(kind, _new_id("rs" if kind == "reasoning" else "msg"))
        self._start(item, events)
        events.append({"type": "response.content_part.added", "item_id": item.id, "output_index": self.items.index(item),
                       "content_index": 0, "part": item.part("")})
        return item

    def _start(self, item: _Item, events: list[dict[str, Any]]) -> None:
        self._close(events, "completed")
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": item.json(opening=True)})

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        item.status = status
        index = self.items.index(item)
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where, "name": item.name,
                           "arguments": item.text})
        else:
            if item.kind == "reasoning":
                events.append({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": item.text})
            else:
                events.append({"type": "response.output_text.done", **where, "content_index": 0, "text": item.text,
                               "logprobs": []})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": item.part()})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item.json()})

    def reasoning(self) -> str:
        """All the reasoning text of the output."""
        return "".join(item.text for item in self.items if item.kind == "reasoning")


# -------------------------------------------------------------------------------- responses


class _ResponseContext:
    """What a response object is built from: the request (echoed as OpenAI echoes it), the
    response's id and the reply's format."""

    def __init__(self, state: _State, req: ResponsesRequest, response_id: str, created: int, reply_format: _ReplyFormat,
                 prompt_token_ids: list[int], stops: Any) -> None:
        self.state = state
        self.req = req
        self.id = response_id
        self.created = created
        self.reply_format = reply_format
        self.prompt_token_ids = prompt_token_ids
        self.stops = tuple(stops)

    def new_reply(self) -> _Reply:
        """The reader of the reply (its text, reasoning and calls)."""
        return _Reply(self.reply_format, self.state.llm.tokenizer, self.prompt_token_ids, self.stops)

    def response(self, status: str, items: list[_Item], used: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object: ``status`` ``in_progress``, ``completed``, ``incomplete`` or ``failed``."""
        req = self.req
        text = dict(req.text or {}) if req.given("text") else {}
        if text.get("format") is None:
            text["format"] = {"type": "text"}
        tools = list(req.tools or []) if req.given("tools") else []
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": req.model,
            "output": [item.json() for item in items],
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": _reasoning_options(req),
            "store": False,
            "temperature": req.temperature,
            "text": text,
            "tool_choice": req.tool_choice if req.given("tool_choice") else "auto",
            "tools": tools,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": used,
            "metadata": dict(req.metadata or {}),
            "background": False,
        }

    def usage(self, output: RequestOutput, items: _OutputItems) -> dict[str, Any]:
        """OpenAI's usage of a finished response; its reasoning tokens are those of the reasoning
        text, tokenized again (the reply's tokens are not split at the reasoning's end)."""
        generated = len(output.outputs[0].token_ids)
        reasoning = items.reasoning()
        reasoning_tokens = 0
        if reasoning:
            try:
                reasoning_tokens = min(len(self.state.llm.encode(reasoning, add_special_tokens=False)), generated)
            except MetraleError:
                reasoning_tokens = 0
        prompt = len(output.prompt_token_ids)
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": output.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt + generated}

    def read(self, reply: _Reply, items: _OutputItems, output: RequestOutput) -> Iterator[dict[str, Any]]:
        """The events of ``output``, the reply's latest state (its final one closes the items)."""
        completion = output.outputs[0]
        yield from items.feed(reply.feed(completion.text or "", completion.token_ids, completion.finish_reason,
                                         completion.stop_reason))
        if completion.finish_reason is not None:
            yield from items.finish(self.incomplete(reply, completion.finish_reason))

    @staticmethod
    def incomplete(reply: _Reply, finish_reason: str) -> bool:
        """Whether the reply was cut (by ``max_output_tokens`` or the context) before it ended."""
        return reply.finish_reason(finish_reason) == "length"

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        """The response object of a finished request."""
        completion = output.outputs[0]
        failure = _failure(output, completion.finish_reason)
        if failure is not None:
            raise failure
        reply, items = self.new_reply(), _OutputItems()
        for _ in self.read(reply, items, output):
            pass
        status = "incomplete" if self.incomplete(reply, completion.finish_reason or "stop") else "completed"
        return self.response(status, items.items, self.usage(output, items))


def _sse(event: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI sends them: ``event: TYPE`` and ``data: JSON``."""
    return b"event: " + event["type"].encode("ascii") + b"\ndata: " + P.dumps(event) + b"\n\n"


async def _events(job: _Job, context: _ResponseContext) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed response: ``response.created``,
    ``response.in_progress``, the output items' events, then ``response.completed`` (or
    ``response.incomplete``); an engine failure or abort as an ``error`` event and
    ``response.failed``; nothing more once the client went away."""
    numbers = itertools.count()
    reply, items = context.new_reply(), _OutputItems()

    def event(data: dict[str, Any]) -> bytes:
        return _sse({**data, "sequence_number": next(numbers)})

    def failed(message: str, code: str | None) -> Iterator[bytes]:
        yield event({"type": "error", "code": code, "message": message, "param": None})
        yield event({"type": "response.failed", "response": context.response(
            "failed", items.items, error={"code": "server_error", "message": message})})

    try:
        yield event({"type": "response.created", "response": context.response("in_progress", [])})
        yield event({"type": "response.in_progress", "response": context.response("in_progress", [])})
        last: RequestOutput | None = None
        while (item := await job.next()) is not None:
            _, output = item
            completion = output.outputs[0]
            failure = _failure(output, completion.finish_reason)
            if failure is not None:
                for data in failed(failure.message, failure.code):
                    yield data
                return
            for new in context.read(reply, items, output):
                yield event(new)
            last = output
        if last is None or last.outputs[0].finish_reason is None:
            return  # the client went away
        incomplete = context.incomplete(reply, last.outputs[0].finish_reason)
        status = "incomplete" if incomplete else "completed"
        yield event({"type": f"response.{status}", "response": context.response(status, items.items,
                                                                                 context.usage(last, items))})
    except Exception:
        logger.exception("a responses stream failed")
        for data in failed("the server failed while answering this request", "internal_error"):
            yield data
    finally:
        job.close()
