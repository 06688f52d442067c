"""Anthropic's Messages API served on the chat machinery: ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` (``docs/serving.rst``, "Anthropic Messages API").

A request is checked field by field and turned into the chat completions request that means the
same (:func:`_chat_request`): its ``system`` and ``messages`` become chat messages (a
``tool_use`` block an assistant message's ``tool_calls``, a ``tool_result`` block a ``tool``
message), its ``tools`` functions, its ``tool_choice`` the chat ``tool_choice`` (``any`` is
``"required"``, ``tool`` a named function: both forced through the same grammar), its
``thinking`` the chat template's thinking switch. From there on it runs as a chat request does:
the same template, limits, sampling parameters, parsers, engine request, metrics and
disconnect handling. The reply is read by the same :class:`~metrale.entrypoints.server.replies._Reply`,
and its reasoning, text and tool calls become ``thinking``, ``text`` and ``tool_use`` blocks
(:class:`_Blocks`), whole or as Anthropic's stream of events.

Errors are raised as the other endpoints raise them and answered in Anthropic's shape
(:func:`~metrale.entrypoints.server.anthropic_protocol.anthropic_errors`).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from starlette.responses import Response

from metrale.entrypoints.server import anthropic_protocol as A
from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.checks import (
    _chat_prompt,
    _check_model,
    _check_structured_output,
    _params_for_prompt,
    _parse,
    _sampling_options,
)
from metrale.entrypoints.server.jobs import _ClientGone, _collect, _EventStream, _failure, _Job
from metrale.entrypoints.server.replies import MAX_FUNCTION_NAME, MAX_TOOLS, _constrain, _Reply, _reply_format, _ReplyFormat
from metrale.entrypoints.server.state import MAX_STOP, MAX_STOP_LENGTH, _json_response, _State
from metrale.params import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

#: The chat template variables that switch a model's thinking on and off (Qwen3's
#: ``enable_thinking``, DeepSeek-V3.1's ``thinking``); ``thinking`` sets the ones a template reads.
THINKING_SWITCHES = ("enable_thinking", "thinking")
#: Content block types that carry other media than text (refused: the models read text only).
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
#: Names of the tool choices and their chat equivalents (``tool``: a named function).
_TOOL_CHOICES = ("auto", "any", "tool", "none")

# ------------------------------------------------------------------------ the request as chat


def _fail(where: str, message: str) -> P.APIError:
    """A 400 whose message starts with the place of the bad value (``messages[1].content``)."""
    return P.APIError(400, f"{where} {message}", param=where)


def _text_of(blocks: list[Any], where: str) -> str:
    """The text of a list of text blocks (a ``tool_result``'s or the ``system``'s), joined."""
    texts = []
    for index, block in enumerate(blocks):
        label = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _MEDIA_BLOCKS:
            raise _fail(label, f"is a block of type {kind!r}; this server's models read text only")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _fail(label, f"must be a text block {{'type': 'text', 'text': '...'}}, got {P.clip(block)}")
        texts.append(block["text"])
    return "".join(texts)


def _system_message(system: Any) -> dict[str, Any]:
    """``system`` (a string or text blocks) as the chat's system message."""
    if isinstance(system, str):
        return {"role": "system", "content": system}
    if isinstance(system, list):
        return {"role": "system", "content": _text_of(system, "system")}
    raise _fail("system", f"must be a string or a list of text blocks, got {P.clip(system)}")


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_result`` block as a chat ``tool`` message."""
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _fail(f"{where}.tool_use_id", f"must be the id of the tool_use it answers, got {P.clip(tool_use_id)}")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = _text_of(content, f"{where}.content")
    else:
        raise _fail(f"{where}.content", f"must be a string or a list of text blocks, got {P.clip(content)}")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _fail(f"{where}.is_error", f"must be true or false, got {P.clip(is_error)}")
    result: dict[str, Any] = {"role": "tool", "tool_call_id": tool_use_id, "content": text}
    if is_error:
        result["is_error"] = True  # for templates that show it; the others render the content alone
    return result


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_use`` block as a chat tool call (its ``input`` the arguments' JSON text)."""
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise _fail(f"{where}.{key}", f"must be a non-empty string, got {P.clip(block.get(key))}")
    if not isinstance(block.get("input"), dict):
        raise _fail(f"{where}.input", f"must be an object, got {P.clip(block.get('input'))}")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _turn_messages(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One turn of the conversation as chat messages: an assistant turn one message (its text
    blocks joined, its ``tool_use`` blocks its ``tool_calls``, its ``thinking`` its
    ``reasoning_content``); a user turn a ``tool`` message per ``tool_result`` block and a user
    message per run of text blocks, in their order."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise _fail(f"{where}.content", f"must be a string or a non-empty list of content blocks, got {P.clip(content)}")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    allowed = ("text", "tool_use", "thinking", "redacted_thinking") if role == "assistant" else ("text", "tool_result")
    for index, block in enumerate(content):
        label = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise _fail(label, f"must be a content block with a 'type', got {P.clip(block)}")
        assert isinstance(block, dict)
        if kind in _MEDIA_BLOCKS:
            raise _fail(label, f"is a block of type {kind!r}; this server's models read text only")
        if kind not in allowed:
            article = "an" if role == "assistant" else "a"
            raise _fail(label, f"is a block of type {P.clip(kind)}; {article} {role} turn may hold blocks of type "
                        f"{', '.join(allowed)}")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _fail(f"{label}.text", f"must be a string, got {P.clip(block.get('text'))}")
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append(_tool_result(block, label))
        elif kind == "tool_use":
            calls.append(_tool_call(block, label))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _fail(f"{label}.thinking", f"must be a string, got {P.clip(block.get('thinking'))}")
            thinking.append(block["thinking"])
        # a redacted_thinking block is opaque (another server's encryption): nothing to render
    if role == "user":
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
        return out
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return [message]


def _chat_messages(req: A.CountTokensRequest) -> list[dict[str, Any]]:
    """The request's ``system`` and ``messages`` as chat messages, checked."""
    messages = req.messages
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", f"must be a non-empty list of messages, got {P.clip(messages)}")
    out = [_system_message(req.system)] if req.given("system") else []
    for index, item in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise _fail(where, f"must be an object with 'role' and 'content', got {P.clip(item)}")
        role = item.get("role")
        if role not in ("user", "assistant"):
            raise _fail(f"{where}.role", f"must be 'user' or 'assistant', got {P.clip(role)}")
        if "content" not in item:
            raise _fail(f"{where}.content", "is required")
        out += _turn_messages(role, item["content"], where)
    if messages[-1].get("role") == "assistant":
        raise _fail(f"messages[{len(messages) - 1}]", "is an assistant turn: continuing the assistant's own text "
                    "(a prefill) is not supported; end with a user turn")
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic's tools as chat functions (``input_schema`` their ``parameters``)."""
    if not isinstance(tools, list):
        raise _fail("tools", f"must be a list of tools, got {P.clip(tools)}")
    if len(tools) > MAX_TOOLS:
        raise _fail("tools", f"holds {len(tools)} tools; at most {MAX_TOOLS} are accepted")
    functions: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _fail(where, f"must be an object with 'name' and 'input_schema', got {P.clip(tool)}")
        if tool.get("type", "custom") not in ("custom", None):
            raise _fail(f"{where}.type", f"is {P.clip(tool.get('type'))}: only client tools (type 'custom', with an "
                        "input_schema) are served")
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_FUNCTION_NAME:
            raise _fail(f"{where}.name", f"must be a non-empty string of at most {MAX_FUNCTION_NAME} characters, "
                        f"got {P.clip(name)}")
        if name in names:
            raise _fail(f"{where}.name", f"{name!r} names a tool given before; names must differ")
        names.add(name)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _fail(f"{where}.description", f"must be a string, got {P.clip(description)}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise _fail(f"{where}.input_schema", f"must be a JSON schema of type 'object', got {P.clip(schema)}")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if description is not None:
            function["description"] = description
        functions.append({"type": "function", "function": function})
    return functions


def _chat_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[Any, bool | None]:
    """The chat ``tool_choice`` and ``parallel_tool_calls`` (None: not given) of Anthropic's
    ``tool_choice``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in _TOOL_CHOICES:
        raise _fail("tool_choice", "must be {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} or "
                    f"{{'type': 'none'}}, got {P.clip(choice)}")
    assert isinstance(choice, dict)
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _fail("tool_choice.disable_parallel_tool_use", f"must be true or false, got {P.clip(disable)}")
    parallel = None if disable is None else not disable
    names = [tool["function"]["name"] for tool in tools]
    if kind in ("any", "tool") and not tools:
        raise _fail("tool_choice", f"{kind!r} needs tools")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _fail("tool_choice.name", f"must name one of the tools, got {P.clip(name)}")
        if name not in names:
            given = ", ".join(repr(n) for n in names)
            raise _fail("tool_choice.name", f"{P.clip(name)} is not among the tools ({given})")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"any": "required"}.get(kind, kind), parallel


def _thinking_switch(thinking: Any, max_tokens: int | None) -> bool:
    """Whether ``thinking`` (``{"type": "enabled", "budget_tokens": N}``, ``{"type":
    "adaptive"}`` or ``{"type": "disabled"}``) switches the thinking on."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _fail("thinking", "must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} or "
                    f"{{'type': 'disabled'}}, got {P.clip(thinking)}")
    assert isinstance(thinking, dict)
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1:
            raise _fail("thinking.budget_tokens", f"must be a positive int, got {P.clip(budget)}")
        if max_tokens is not None and budget >= max_tokens:
            raise _fail("thinking.budget_tokens", f"({budget}) must be less than max_tokens ({max_tokens})")
    return kind != "disabled"


@functools.lru_cache(maxsize=8)
def _template_switches(sources: tuple[str, ...]) -> tuple[str, ...]:
    """The thinking switches (:data:`THINKING_SWITCHES`) the chat templates ``sources`` read."""
    import jinja2
    from jinja2 import meta

    from metrale.entrypoints.chat import _environment

    environment = _environment()
    names: set[str] = set()
    for source in sources:
        try:
            names |= meta.find_undeclared_variables(environment.parse(source))
        except jinja2.TemplateError:  # (a template that does not parse was refused when loaded)
            continue
    return tuple(name for name in THINKING_SWITCHES if name in names)


def _check_stop_sequences(value: Any) -> list[str]:
    """``stop_sequences``, within the limits of the chat's ``stop``."""
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _fail("stop_sequences", f"must be a list of strings, got {P.clip(value)}")
    if len(value) > MAX_STOP:
        raise _fail("stop_sequences", f"holds {len(value)} strings; at most {MAX_STOP} are accepted")
    for stop in value:
        if not stop or len(stop) > MAX_STOP_LENGTH:
            raise _fail("stop_sequences", f"must hold non-empty strings of at most {MAX_STOP_LENGTH} characters, "
                        f"got {P.clip(stop)}")
    return value


def _chat_request(state: _State, req: A.CountTokensRequest) -> P.ChatCompletionRequest:
    """The chat completions request that means what ``req`` does (only the fields it gives)."""
    max_tokens = req.max_tokens if isinstance(req, A.MessagesRequest) else None
    chat: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req)}
    tools = _chat_tools(req.tools) if req.given("tools") else []
    if tools:
        chat["tools"] = tools
    if req.given("tool_choice"):
        chat["tool_choice"], parallel = _chat_tool_choice(req.tool_choice, tools)
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    if req.given("thinking"):
        enabled = _thinking_switch(req.thinking, max_tokens)
        template = state.llm.chat_template
        switches = _template_switches(tuple(template.templates.values())) if template is not None else ()
        if switches:
            chat["chat_template_kwargs"] = {name: enabled for name in switches}
    if isinstance(req, A.MessagesRequest):
        chat["max_tokens"] = req.max_tokens
        if req.given("stop_sequences"):
            chat["stop"] = _check_stop_sequences(req.stop_sequences)
        for name in ("temperature", "top_p", "top_k"):
            if req.given(name):
                chat[name] = getattr(req, name)
    return P.ChatCompletionRequest.model_validate(chat)


# ------------------------------------------------------------------------------- the replies


class _Blocks:
    """A reply's content blocks built from its chat deltas (:meth:`_Reply.feed`): reasoning
    makes a ``thinking`` block, content a ``text`` block, each tool call a ``tool_use`` block;
    a block ends when a block of another kind starts. :meth:`take` returns the stream events of
    a delta; :attr:`content` is the message's ``content``."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the last block while it may grow
        self._arguments: dict[int, str] = {}  # a tool_use block's input JSON text, by block index
        self._calls: dict[int, int] = {}  # the block index of each tool call, by the call's index

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        self.content.append(block)
        self._open = block["type"]
        wire = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [*events, ("content_block_start", {"index": len(self.content) - 1, "content_block": wire})]

    def _grow(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = [] if self._open == kind else self._start(
            {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""})
        self.content[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        return [*events, ("content_block_delta", {"index": len(self.content) - 1, "delta": delta})]

    def take(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """The events of one chat delta: its reasoning, its content, then its tool calls (the
        order a reply holds them in)."""
        events: list[tuple[str, dict[str, Any]]] = []
        if delta.get("reasoning_content"):
            events += self._grow("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._grow("text", delta["content"])
        for item in delta.get("tool_calls", ()):
            if "id" in item:
                events += self._start({"type": "tool_use", "id": A.tool_use_id(item["id"]),
                                       "name": item["function"]["name"], "input": {}})
                self._calls[item["index"]] = len(self.content) - 1
            arguments = item["function"].get("arguments") or ""
            index = self._calls.get(item["index"])
            if arguments and index is not None:
                self._arguments[index] = self._arguments.get(index, "") + arguments
                events.append(("content_block_delta", {"index": index,
                                                       "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The event that ends the open block, if one is open."""
        if self._open is None:
            return []
        self._open = None
        index = len(self.content) - 1
        if index in self._arguments:
            try:
                self.content[index]["input"] = json.loads(self._arguments[index])
            except ValueError:  # a streamed call whose syntax broke once sent: its input stays as started
                pass
        return [("content_block_stop", {"index": index})]


class _MessageContext:
    """What an answer is built from: the request's model and id, its prompt and stop sequences,
    and how its reply is read."""

    def __init__(self, state: _State, model: str, message_id: str, reply_format: _ReplyFormat,
                 prompt_token_ids: Sequence[int], stops: Sequence[str], stop_token_ids: Sequence[int]) -> None:
        self.state = state
        self.model = model
        self.id = message_id
        self.reply_format = reply_format
        self.prompt_token_ids = list(prompt_token_ids)
        self.stops = tuple(stops)
        self.stop_token_ids = tuple(stop_token_ids)

    def new_reply(self) -> _Reply:
        """The reader of the reply."""
        return _Reply(self.reply_format, self.state.llm.tokenizer, self.prompt_token_ids, self.stops)

    def stop(self, reply: _Reply, completion: CompletionOutput) -> tuple[str, str | None]:
        """The ``stop_reason`` and ``stop_sequence`` of a finished reply."""
        finish = reply.finish_reason(completion.finish_reason)
        if finish == "tool_calls":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        reason = P.stop_reason(completion, self.state.eos_token_ids, self.stop_token_ids)
        if isinstance(reason, str) and reason in self.stops:
            return "stop_sequence", reason
        return "end_turn", None

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The whole answer of a finished request."""
        completion = output.outputs[0]
        failure = _failure(output, completion.finish_reason)
        if failure is not None:
            raise failure
        reply = self.new_reply()
        blocks = _Blocks()
        blocks.take(reply.feed(completion.text or "", completion.token_ids, completion.finish_reason,
                               completion.stop_reason))
        blocks.close()
        stop_reason, stop_sequence = self.stop(reply, completion)
        used = A.usage(len(output.prompt_token_ids), len(completion.token_ids))
        return A.message(self.id, self.model, blocks.content, stop_reason, stop_sequence, used)


async def _message_events(job: _Job, context: _MessageContext) -> AsyncIterator[bytes]:
    """Anthropic's stream of one answer: ``message_start``, a ``ping``, each block's
    ``content_block_start``, deltas and ``content_block_stop``, then ``message_delta`` (the stop
    reason and the output tokens) and ``message_stop``; a failure once started as an ``error``
    event; nothing more once the client went away."""
    try:
        start = A.message(context.id, context.model, [], None, None, A.usage(len(context.prompt_token_ids), 0))
        yield A.event("message_start", {"message": start})
        yield A.event("ping", {})
        reply = context.new_reply()
        blocks = _Blocks()
        while (item := await job.next()) is not None:
            _, output = item
            completion = output.outputs[0]
            failure = _failure(output, completion.finish_reason)
            if failure is not None:
                yield A.error_event(failure)
                return
            delta = reply.feed(completion.text or "", completion.token_ids, completion.finish_reason,
                               completion.stop_reason)
            for name, data in blocks.take(delta):
                yield A.event(name, data)
            if completion.finish_reason is None:
                continue
            for name, data in blocks.close():
                yield A.event(name, data)
            stop_reason, stop_sequence = context.stop(reply, completion)
            yield A.event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                            "usage": {"output_tokens": len(completion.token_ids)}})
            yield A.event("message_stop", {})
            return
    except Exception:
        logger.exception("a messages stream failed")
        yield A.error_event(P.APIError(500, "the server failed while answering this request"))
    finally:
        job.close()


# ------------------------------------------------------------------------------ the handlers


async def _messages(state: _State, request: Request) -> Response:
    """``POST /v1/messages``."""
    req: A.MessagesRequest = await _parse(request, A.MessagesRequest)  # type: ignore[arg-type]
    chat = _chat_request(state, req)
    lora = _check_model(state, chat)
    reply_format = _reply_format(state, chat)
    text, ids = _chat_prompt(state, chat)
    options = _sampling_options(state, chat, n=1, logprobs=None, logprobs_param="top_logprobs")
    source = _constrain(reply_format, options, chat, None)
    await _check_structured_output(state, chat, options, source)
    params = _params_for_prompt(state, options, len(ids), req.max_tokens, "max_tokens", None, "messages")
    message_id = A.new_message_id()
    job = _Job(state, A.ANTHROPIC_PATH, [(text, ids)], [params], message_id, lora)
    job.submit()
    try:
        context = _MessageContext(state, req.model, message_id, reply_format, ids, params.stop, params.stop_token_ids)
        job.watch(request)
        if req.stream:
            return _EventStream(_message_events(job, context), job)
        try:
            outputs = await _collect(job)
        except _ClientGone:
            return Response(status_code=499)
        return _json_response(context.response(outputs[0]))
    except BaseException:
        job.close()
        raise


async def _count_tokens(state: _State, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as ``/v1/messages`` would render
    them, without generating."""
    req: A.CountTokensRequest = await _parse(request, A.CountTokensRequest)  # type: ignore[arg-type]
    chat = _chat_request(state, req)
    _check_model(state, chat)
    _reply_format(state, chat)
    _, ids = _chat_prompt(state, chat)
    return _json_response({"input_tokens": len(ids)})
