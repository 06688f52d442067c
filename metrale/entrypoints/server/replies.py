"""Tool calls and reasoning in chat replies: the request's ``tools`` and ``tool_choice`` checked
(:func:`_reply_format`), the constraint of a forced call built, and each choice's text read into
``content``, ``reasoning_content`` and ``tool_calls`` (:class:`_Reply`), whole or as a stream's
deltas (``docs/serving.rst``, "Tool calling" and "Reasoning").

``tool_choice`` is ``"none"`` (the tools are shown to the template, nothing is parsed),
``"auto"`` (the model's own call syntax is read by the server's ``--tool-call-parser``, when
``--enable-auto-tool-choice`` is set; else the reply is text), ``"required"`` or a named
function: forced, the reply is generated under a JSON schema (llguidance) -- the function's
``parameters`` for a named one; for ``"required"`` an object ``{"name", "parameters"}`` over the
tools, or an array of them with ``parallel_tool_calls`` -- and read back as the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from metrale.entrypoints.parsers import (
    CallPiece,
    ReasoningParser,
    ReasoningStream,
    ToolCallParse,
    ToolCallStream,
    ToolParser,
    scan_json,
    scan_object,
)
from metrale.entrypoints.server import protocol as P
from metrale.structured import StructuredOutputParams, after_prefix

#: The most tools a request may give.
MAX_TOOLS = 128
#: The longest function name accepted.
MAX_FUNCTION_NAME = 256
#: Prompt tokens given to the decoder of a reply's special tokens as context (as the engine's).
_PROMPT_CONTEXT_TOKENS = 6
_SPACE = " \t\r\n"

# ------------------------------------------------------------------------------ forced calls


class _NamedCall(ToolParser):
    """The reply of a forced named call: the arguments' JSON, nothing else."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ToolCallParse:
        start = len(text) - len(text.lstrip(_SPACE))
        if start >= len(text):
            return ToolCallParse(0)
        status, end = scan_json(text, start)
        if status == "invalid":
            return ToolCallParse(0, failed=True)
        return ToolCallParse(0, (CallPiece(self.name, text[start:end], status == "complete"),))


class _RequiredCalls(ToolParser):
    """The reply of ``tool_choice="required"``: ``{"name", "parameters"}``, or an array of such
    objects with ``parallel_tool_calls``."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel

    def parse(self, text: str, final: bool) -> ToolCallParse:
        position = len(text) - len(text.lstrip(_SPACE))
        if position >= len(text):
            return ToolCallParse(0)
        pieces: list[CallPiece] = []
        if self.parallel:
            if text[position] != "[":
                return ToolCallParse(0, failed=True)
            position = _skip(text, position + 1)
        while position < len(text):
            if text[position] != "{":
                return ToolCallParse(0, failed=True)
            status, end, members = scan_object(text, position)
            if status == "invalid":
                return ToolCallParse(0, failed=True)
            name = next((json.loads(text[m.start:m.end]) for m in members if m.key == "name" and m.status == "complete"),
                        None)
            if not isinstance(name, str):
                break
            arguments = next((text[m.start:m.end] for m in members if m.key == "parameters"), "")
            pieces.append(CallPiece(name, arguments, status == "complete"))
            if status != "complete" or not self.parallel:
                break
            position = _skip(text, end)
            if position >= len(text) or text[position] != ",":
                break
            position = _skip(text, position + 1)
        return ToolCallParse(0, tuple(pieces))


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in _SPACE:
        index += 1
    return index


# ------------------------------------------------------------------------ the request's format


@dataclass
class _ReplyFormat:
    """How a chat request's replies are read (one :class:`_Reply` per choice)."""

    #: Makes the tool-call parser of a reply (auto or forced), or None: no tool calls.
    tool_parser: Callable[[], ToolParser] | None = None
    #: Makes the reasoning parser of a reply, or None.
    reasoning_parser: Callable[[], ReasoningParser] | None = None
    #: Whether the reply's text is decoded with its special tokens (a parser reads them).
    special_tokens: bool = False
    #: Whether the reply carries ``reasoning_content`` (a reasoning parser is set).
    reasoning: bool = False
    #: The constraint of a forced call (before any reasoning prefix), or None.
    constraint: StructuredOutputParams | None = None
    #: The tools as the template sees them.
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: The most calls a reply may make (1 with ``parallel_tool_calls: false``), or None.
    call_limit: int | None = None

    @property
    def active(self) -> bool:
        """Whether anything is read out of the reply (else it is plain text)."""
        return self.tool_parser is not None or self.reasoning_parser is not None


def _reply_format(state: Any, req: P.ChatCompletionRequest) -> _ReplyFormat:
    """The checked ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of ``req`` and the
    parsers its replies are read with; a 400 naming the field for a bad value."""
    tools = _check_tools(req)
    choice = _check_tool_choice(req, tools)
    parallel = True
    if req.given("parallel_tool_calls"):
        parallel = bool(req.parallel_tool_calls)
    kwargs = dict(req.chat_template_kwargs or {})
    reasoning_class = state.reasoning_parser
    fmt = _ReplyFormat(tools=tools, call_limit=None if parallel else 1)
    if reasoning_class is not None:
        fmt.reasoning_parser = lambda: reasoning_class(kwargs)
        fmt.reasoning = True
        fmt.special_tokens = not reasoning_class.skip_special_tokens
    if not tools or choice == "none":
        return fmt
    if choice == "auto":
        parser_class = state.tool_parser if state.enable_auto_tool_choice else None
        if parser_class is not None:
            fmt.tool_parser = lambda: parser_class(tools)
            fmt.special_tokens = fmt.special_tokens or not parser_class.skip_special_tokens
        return fmt
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if choice == "required":
        fmt.tool_parser = lambda: _RequiredCalls(parallel)
        fmt.constraint = _required_constraint(list(functions.values()), parallel)
    else:
        fmt.tool_parser = lambda: _NamedCall(choice)
        fmt.constraint = StructuredOutputParams(json=_parameters(functions[choice]))
    return fmt


def _check_tools(req: P.ChatCompletionRequest) -> list[dict[str, Any]]:
    if not req.given("tools"):
        return []
    tools = list(req.tools or [])
    if len(tools) > MAX_TOOLS:
        raise P.APIError(400, f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", param="tools")
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if tool.get("type", "function") != "function":
            raise P.APIError(400, f"{where}.type must be 'function', got {P.clip(tool.get('type'))}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise P.APIError(400, f"{where}.function must be an object with a 'name', got {P.clip(function)}",
                             param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_FUNCTION_NAME:
            raise P.APIError(400, f"{where}.function.name must be a non-empty string of at most {MAX_FUNCTION_NAME} "
                             f"characters, got {P.clip(name)}", param=f"{where}.function.name")
        if name in names:
            raise P.APIError(400, f"{where}.function.name {name!r} names a function given before; names must differ",
                             param=f"{where}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise P.APIError(400, f"{where}.function.parameters must be a JSON schema object, got {P.clip(parameters)}",
                             param=f"{where}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise P.APIError(400, f"{where}.function.description must be a string, got {P.clip(description)}",
                             param=f"{where}.function.description")
    return tools


def _check_tool_choice(req: P.ChatCompletionRequest, tools: list[dict[str, Any]]) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or the name of the forced function."""
    if not req.given("tool_choice"):
        return "auto" if tools else "none"
    value = req.tool_choice
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise P.APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                             f"{{'name': ...}}}}, got {P.clip(value)}", param="tool_choice")
        if value == "required" and not tools:
            raise P.APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return value
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type", "function") != "function" or not isinstance(name, str):
        raise P.APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {P.clip(value)}", param="tool_choice")
    if not any(tool["function"]["name"] == name for tool in tools):
        given = ", ".join(repr(tool["function"]["name"]) for tool in tools) or "none"
        raise P.APIError(400, f"tool_choice names the function {P.clip(name)}, which is not among the tools ({given})",
                         param="tool_choice")
    return name


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return dict(parameters) if parameters else {"type": "object"}


def _required_constraint(functions: Sequence[Mapping[str, Any]], parallel: bool) -> StructuredOutputParams:
    """The schema of ``tool_choice="required"``: a call ``{"name", "parameters"}`` of one of the
    functions, or an array of at least one with ``parallel``."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": _parameters(function)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for function in functions]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "items": call} if parallel else call
    return StructuredOutputParams(json=schema)


def _constrain(fmt: _ReplyFormat, options: dict[str, Any], req: P.ChatCompletionRequest,
               source: str | None) -> str | None:
    """Put the structured output of ``fmt`` (a forced call) and the reasoning prefix into
    ``options``; returns the field a refused constraint is blamed on."""
    if fmt.constraint is not None:
        if options.get("structured_output") is not None:
            raise P.APIError(400, f"a forced tool call (tool_choice {P.clip(req.tool_choice)}) cannot be combined with "
                             f"{source or 'response_format'}", param="tool_choice")
        options["structured_output"] = fmt.constraint
        source = "tools"
    structured = options.get("structured_output")
    if structured is not None and fmt.reasoning_parser is not None:
        prefix = fmt.reasoning_parser().structured_output_prefix()
        if prefix:
            options["structured_output"] = after_prefix(structured, prefix)
    return source


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat template gets them: an assistant message's ``tool_calls`` with
    their ``arguments`` JSON text read into an object (chat templates write the object; vLLM
    does the same), after checking their shape; the caller's messages are not changed."""
    out = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            out.append(message)
            continue
        where = f"messages[{index}].tool_calls"
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise P.APIError(400, f"{where} must be a list of calls on an assistant message", param=where)
        converted = []
        for number, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise P.APIError(400, f"{where}[{number}] must be {{'id', 'type': 'function', 'function': {{'name', "
                                 f"'arguments'}}}}, got {P.clip(call)}", param=f"{where}[{number}]")
            assert isinstance(call, dict) and isinstance(function, dict)  # (what naming the function took)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise P.APIError(400, f"{where}[{number}].function.arguments is not JSON: {P.clip(arguments)}",
                                     param=f"{where}[{number}].function.arguments") from None
            converted.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": converted})
    for index, message in enumerate(messages):
        tool_call_id = message.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise P.APIError(400, f"messages[{index}].tool_call_id must be a string, got {P.clip(tool_call_id)}",
                             param=f"messages[{index}].tool_call_id")
    return out


# -------------------------------------------------------------------------------- the replies


class _RawText:
    """A reply's text decoded with its special tokens (for parsers whose markers are special
    tokens), cut as the engine cuts its own text: without the stop token that ended it, before
    the stop string that ended it, and holding back a tail that may become a stop string."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stops: Sequence[str]) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=False)
        self._stops = tuple(stops)
        self._text = ""
        self._ends: list[int] = []  # the text's length after each token

    def of(self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: Any) -> str:
        for token in token_ids[len(self._ends):]:
            piece = self._stream.step(self._tokenizer, token)
            if piece:
                self._text += piece
            self._ends.append(len(self._text))
        text = self._text
        if finish_reason is None:
            if self._stops:
                from metrale.engine.generation import held_back

                text = text[:len(text) - held_back(text, self._stops)]
            return text
        if finish_reason == "stop" and isinstance(stop_reason, int) and token_ids and token_ids[-1] == stop_reason:
            text = text[:self._ends[-2] if len(self._ends) > 1 else 0]
        elif finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in text:
            text = text[:text.find(stop_reason)]
        return text


class _Reply:
    """One choice's reply read as it grows: :meth:`feed` takes its latest output and returns the
    chat delta of what is new; :meth:`message` is the whole reply's message."""

    def __init__(self, fmt: _ReplyFormat, tokenizer: Any, prompt_token_ids: Sequence[int], stops: Sequence[str]) -> None:
        self.fmt = fmt
        self.raw = _RawText(tokenizer, prompt_token_ids, stops) if fmt.special_tokens and tokenizer is not None else None
        self.reasoning = ReasoningStream(fmt.reasoning_parser()) if fmt.reasoning_parser is not None else None
        self.tools = ToolCallStream(fmt.tool_parser(), fmt.call_limit) if fmt.tool_parser is not None else None
        self.finished = False
        self.content = ""

    def feed(self, text: str, token_ids: Sequence[int], finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
        """The delta of what the reply's latest output adds (``text``: the engine's text)."""
        if self.finished:
            return {}
        final = finish_reason is not None
        self.finished = final
        if self.raw is not None:
            text = self.raw.of(token_ids, finish_reason, stop_reason)
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final)
            if split.reasoning:
                delta["reasoning_content"] = split.reasoning
            content_text, new_content = self.reasoning.content, split.content
        else:
            content_text, new_content = text, text[len(self.content):]
        if self.tools is not None:
            tool_delta = self.tools.feed(content_text, final)
            new_content = tool_delta.content
            if tool_delta.tool_calls:
                delta["tool_calls"] = tool_delta.tool_calls
        if new_content:
            delta["content"] = new_content
            self.content += new_content
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The choice's ``finish_reason``: ``"tool_calls"`` once its calls are complete."""
        if finish_reason in ("stop", "length") and self.tools is not None and self.tools.tools_called and self.tools.complete:
            return "tool_calls"
        return finish_reason

    def message(self) -> dict[str, Any]:
        """The whole reply as a chat message."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None, "tool_calls": []}
        if self.tools is not None:
            result = self.tools.result()
            message["content"] = result.content if result.tool_calls else (self.content or None)
            message["tool_calls"] = [call.to_json() for call in result.tool_calls]
        if self.fmt.reasoning:
            message["reasoning_content"] = (self.reasoning.reasoning if self.reasoning is not None else "") or None
        return message
