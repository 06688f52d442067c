"""Tool-call and reasoning parsers: how the OpenAI server reads a model's own syntax for tool calls
and for its thinking out of the text it generated.

A chat model that calls tools writes the call in a syntax of its family (Hermes' and Qwen's
``<tool_call>{...}</tool_call>``, Mistral's ``[TOOL_CALLS]``, ...), and a reasoning model writes
its thinking before its answer between markers (``<think>...</think>``). The server turns that
text into OpenAI's fields -- ``message.tool_calls``, ``message.reasoning_content``, and their
deltas in a stream -- with a :class:`ToolParser` (``--tool-call-parser NAME``) and a
:class:`ReasoningParser` (``--reasoning-parser NAME``). Both are plugins: a plugin declares
parser classes by name through the hooks ``metrale_tool_parsers`` and
``metrale_reasoning_parsers`` (:mod:`metrale.model.hookspecs`), subclasses of the classes here
(part of the plugin contract, like the hook specifications); the server collects them
(:func:`metrale.entrypoints.parsers.tool_parsers`), and the built-in ones come from
:mod:`metrale.plugins.parsers` through the same hooks.

**One method per parser.** A parser reads the whole text generated so far, and says how far it
is settled: :meth:`ToolParser.parse` returns where the content before the calls ends and each
call as far as the text shows it; :meth:`ReasoningParser.split` returns the reasoning and the
content. Called on a growing text, its answers only grow (what it once returned stays a prefix
of what it returns later): it holds back a tail that may still turn into a marker. The stream
drivers (:class:`ToolCallStream`, :class:`ReasoningStream`) send what is new at each step, and a
non-streamed reply is the same driver run once on the whole text -- so a stream's deltas add up
to the non-streamed reply, whatever the chunks.

**Broken syntax.** A reply whose tool-call syntax is malformed (JSON that does not parse, a call
that never names its function, text cut by ``max_tokens``) is answered as plain content; a parser
never raises on what a model writes. A stream that had already sent a call's first deltas when
its syntax broke cannot take them back: its further text is dropped, and the choice finishes
with the calls it sent.

**Arguments.** A call's ``arguments`` is the JSON text the model wrote, as written (so that the
pieces a stream sends join into it exactly); :func:`scan_json` checks it as it grows.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

__all__ = [
    "CallPiece",
    "ExtractedToolCalls",
    "ObjectMember",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "ToolCall",
    "ToolCallParse",
    "ToolCallStream",
    "ToolDelta",
    "ReasoningDelta",
    "ToolParser",
    "held_marker",
    "new_call_id",
    "scan_json",
    "scan_object",
]


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` and 24 hex digits (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------- scanning JSON

_WHITESPACE = " \t\r\n"
_LITERALS = ("true", "false", "null")


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def _scan_string(text: str, start: int) -> tuple[str, int]:
    """A JSON string starting at ``start`` (a ``"``): ``(status, end)`` as :func:`scan_json`."""
    index = start + 1
    length = len(text)
    while index < length:
        char = text[index]
        if char == '"':
            return "complete", index + 1
        if char == "\\":
            if index + 1 >= length:
                return "partial", length
            escape = text[index + 1]
            if escape == "u":
                digits = text[index + 2:index + 6]
                if not all(c in "0123456789abcdefABCDEF" for c in digits):
                    return "invalid", index
                if len(digits) < 4:
                    return "partial", length
                index += 6
                continue
            if escape not in '"\\/bfnrt':
                return "invalid", index
            index += 2
            continue
        if ord(char) < 0x20:
            return "invalid", index
        index += 1
    return "partial", length


def _scan_number(text: str, start: int) -> tuple[str, int]:
    index = start
    length = len(text)
    if index < length and text[index] == "-":
        index += 1
    if index >= length:
        return "partial", length
    if text[index] == "0":
        index += 1
    elif text[index].isdigit() and text[index].isascii():
        while index < length and text[index] in "0123456789":
            index += 1
    else:
        return "invalid", index
    if index < length and text[index] == ".":
        index += 1
        if index >= length:
            return "partial", length
        if text[index] not in "0123456789":
            return "invalid", index
        while index < length and text[index] in "0123456789":
            index += 1
    if index < length and text[index] in "eE":
        index += 1
        if index < length and text[index] in "+-":
            index += 1
        if index >= length:
            return "partial", length
        if text[index] not in "0123456789":
            return "invalid", index
        while index < length and text[index] in "0123456789":
            index += 1
    # A number that reaches the end of the text may still go on.
    return ("partial", length) if index >= length else ("complete", index)


def scan_json(text: str, start: int = 0) -> tuple[str, int]:
    """Scan the JSON value that starts at ``text[start]`` (no whitespace before it).

    Returns ``("complete", end)`` with ``end`` just past the value; ``("partial", len(text))``
    when the text ends inside a value that is valid so far (a number at the very end counts as
    partial: more digits may follow); or ``("invalid", index)`` at the first character no JSON
    value can have there."""
    stack: list[str] = []  # "[" or "{" per open container; "{:" while an object waits for a value
    index = start
    length = len(text)
    expect_value = True
    while True:
        if expect_value:
            if index >= length:
                return "partial", length
            char = text[index]
            if char == "{":
                index = _skip_space(text, index + 1)
                if index >= length:
                    return "partial", length
                if text[index] == "}":
                    index += 1
                    expect_value = False
                else:
                    stack.append("{")
                    index = _expect_key(text, index)
                    if index < 0:
                        return ("partial", length) if index == -1 else ("invalid", -index - 2)
                continue
            if char == "[":
                index = _skip_space(text, index + 1)
                if index >= length:
                    return "partial", length
                if text[index] == "]":
                    index += 1
                    expect_value = False
                else:
                    stack.append("[")
                continue
            if char == '"':
                status, index = _scan_string(text, index)
            elif char == "-" or char in "0123456789":
                status, end = _scan_number(text, index)
                if status == "partial" and stack:
                    return "partial", length
                status, index = status, end
            elif char in "tfn":
                word = next((w for w in _LITERALS if w[0] == char), "")
                piece = text[index:index + len(word)]
                if not word.startswith(piece):
                    return "invalid", index
                if len(piece) < len(word):
                    return "partial", length
                status, index = "complete", index + len(word)
            else:
                return "invalid", index
            if status != "complete":
                return status, index
            expect_value = False
            continue
        if not stack:
            return "complete", index
        index = _skip_space(text, index)
        if index >= length:
            return "partial", length
        char = text[index]
        top = stack[-1]
        if char == ",":
            index = _skip_space(text, index + 1)
            if index >= length:
                return "partial", length
            if top == "{":
                index = _expect_key(text, index)
                if index < 0:
                    return ("partial", length) if index == -1 else ("invalid", -index - 2)
            expect_value = True
            continue
        if (char == "}" and top == "{") or (char == "]" and top == "["):
            stack.pop()
            index += 1
            continue
        return "invalid", index


def _expect_key(text: str, index: int) -> int:
    """Past ``"key" :`` and the whitespace after it, at ``index``; -1 when the text ends first,
    ``-2 - position`` at a character that does not belong there."""
    length = len(text)
    if text[index] != '"':
        return -2 - index
    status, index = _scan_string(text, index)
    if status != "complete":
        return -1 if status == "partial" else -2 - index
    index = _skip_space(text, index)
    if index >= length:
        return -1
    if text[index] != ":":
        return -2 - index
    index = _skip_space(text, index + 1)
    return -1 if index >= length else index


@dataclass(frozen=True)
class ObjectMember:
    """One member of a JSON object as far as the text shows it: its key and the span of its
    value (``end`` is where the text ends while ``status`` is ``"partial"``)."""

    key: str
    start: int
    status: str
    end: int


def scan_object(text: str, start: int) -> tuple[str, int, list[ObjectMember]]:
    """Scan the JSON object that starts at ``text[start]`` (a ``{``) member by member.

    Returns ``(status, end, members)``: ``status`` and ``end`` as :func:`scan_json`'s for the
    whole object; ``members`` the members whose key is complete, the last one possibly with a
    partial value."""
    members: list[ObjectMember] = []
    length = len(text)
    index = _skip_space(text, start + 1)
    if index >= length:
        return "partial", length, members
    if text[index] == "}":
        return "complete", index + 1, members
    while True:
        if text[index] != '"':
            return "invalid", index, members
        status, key_end = _scan_string(text, index)
        if status != "complete":
            return status, key_end, members
        key = json.loads(text[index:key_end])
        index = _skip_space(text, key_end)
        if index >= length:
            return "partial", length, members
        if text[index] != ":":
            return "invalid", index, members
        index = _skip_space(text, index + 1)
        if index >= length:
            return "partial", length, members
        status, end = scan_json(text, index)
        members.append(ObjectMember(key, index, status, end))
        if status != "complete":
            return status, end, members
        index = _skip_space(text, end)
        if index >= length:
            return "partial", length, members
        if text[index] == "}":
            return "complete", index + 1, members
        if text[index] != ",":
            return "invalid", index, members
        index = _skip_space(text, index + 1)
        if index >= length:
            return "partial", length, members


def held_marker(text: str, markers: Sequence[str], start: int = 0) -> int:
    """Where in ``text[start:]`` a tail begins that may still grow into one of ``markers``:
    the length of ``text`` when no proper prefix of a marker ends it."""
    for at in range(max(start, len(text) - max((len(m) for m in markers), default=0) + 1), len(text)):
        tail = text[at:]
        if any(marker.startswith(tail) for marker in markers):
            return at
    return len(text)


# ----------------------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class CallPiece:
    """One tool call as far as the text shows it: the function's ``name`` and the JSON text of
    its ``arguments`` so far (as the model wrote it), ``complete`` once the call has ended."""

    name: str
    arguments: str
    complete: bool = False


@dataclass(frozen=True)
class ToolCallParse:
    """What :meth:`ToolParser.parse` reads from a text: the content before the calls is
    ``text[:content_end]``; ``calls`` are the calls found, in order; ``failed`` says the text's
    tool-call syntax is broken for good (the whole reply is then plain content)."""

    content_end: int
    calls: tuple[CallPiece, ...] = ()
    failed: bool = False


@dataclass
class ToolCall:
    """A parsed tool call, as OpenAI's ``message.tool_calls`` entries give it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_json(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole reply read by a :class:`ToolParser`: its ``content`` (None when the calls are
    all there is) and its ``tool_calls`` (empty: the reply is plain content)."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        """Whether the reply calls at least one tool."""
        return bool(self.tool_calls)


class ToolParser:
    """Reads the tool calls a model writes in its own syntax (see the module docstring).

    A subclass implements :meth:`parse`; the server makes one instance per reply, with the
    request's ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``).
    """

    #: False when the parser's markers are special tokens, which the text must then keep: the
    #: server decodes the reply's tokens with them for this parser (vLLM's flag of this name).
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        #: The request's tools.
        self.tools = list(tools or [])

    def parse(self, text: str, final: bool) -> ToolCallParse:
        """Read ``text``, the reply so far (``final``: the whole reply).

        Returns a :class:`ToolCallParse`. While ``final`` is False the answer must only grow as
        the text grows: ``content_end`` never moves back, a call once returned keeps its name
        and its ``arguments`` only get longer, and ``failed`` is set only once no continuation
        can mend the syntax. A text with no tool call has ``content_end`` at its end, less a
        tail that may still become the start of one."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The tool calls of a whole reply (and its content), or the reply as plain content when
        it holds none or its syntax is broken."""
        stream = ToolCallStream(self)
        stream.feed(model_output, final=True)
        return stream.result()


@dataclass
class ToolDelta:
    """What a step of a :class:`ToolCallStream` adds: ``content`` text, and OpenAI's tool-call
    deltas (``{"index", "id", "type", "function": {"name", "arguments"}}`` for a call's first,
    ``{"index", "function": {"arguments"}}`` for its later pieces)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream:
    """Runs a :class:`ToolParser` over a growing text: :meth:`feed` takes the whole text so far
    and returns what is new (a :class:`ToolDelta`); :meth:`result` is the reply as a whole.

    Content is sent only once it holds more than whitespace (a reply that is nothing but calls
    has ``content`` None); a reply with no call ends with all of its text as content. With
    ``limit``, calls past the first ``limit`` are dropped (``parallel_tool_calls: false``)."""

    def __init__(self, parser: ToolParser, limit: int | None = None) -> None:
        self.parser = parser
        self.limit = limit
        #: Whether the whole reply was read and its calls are complete (False before the end).
        self.complete = False
        self.content = ""
        self.calls: list[ToolCall] = []
        self._sent_arguments: list[int] = []
        self._content_sent = 0
        self._broken = False
        self._done = False

    @property
    def tools_called(self) -> bool:
        """Whether a call has been sent."""
        return bool(self.calls)

    def feed(self, text: str, final: bool = False) -> ToolDelta:
        """What ``text`` (the whole reply so far; ``final``: all of it) adds to what was sent."""
        delta = ToolDelta()
        if self._done:
            return delta
        if self._broken:
            self._send_content(text, len(text), delta, force=True)
            self._done = final
            return delta
        try:
            parsed = self.parser.parse(text, final)
        except Exception:  # a parser's bug must not fail the reply: its text is content
            parsed = ToolCallParse(len(text), failed=True)
        broken = parsed.failed or (final and (not parsed.calls or not all(_usable(call) for call in parsed.calls)))
        if broken:
            if not self.calls:
                self._broken = True
                self._send_content(text, len(text), delta, force=True)
            self._done = final or bool(self.calls)
            return delta
        self._send_content(text, min(parsed.content_end, len(text)), delta, force=False)
        for index, piece in enumerate(parsed.calls[:self.limit]):
            if index == len(self.calls):
                call = ToolCall(piece.name, "")
                self.calls.append(call)
                self._sent_arguments.append(0)
                delta.tool_calls.append({"index": index, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": ""}})
            call = self.calls[index]
            new = piece.arguments[self._sent_arguments[index]:]
            if new:
                call.arguments += new
                self._sent_arguments[index] = len(piece.arguments)
                delta.tool_calls.append({"index": index, "function": {"arguments": new}})
        self._done = final
        self.complete = final
        return delta

    def _send_content(self, text: str, end: int, delta: ToolDelta, force: bool) -> None:
        settled = text[:end]
        if end <= self._content_sent or (not force and not settled.strip()):
            return
        delta.content += settled[self._content_sent:]
        self.content += settled[self._content_sent:]
        self._content_sent = end

    def result(self) -> ExtractedToolCalls:
        """The reply so far as a whole."""
        if not self.calls:
            return ExtractedToolCalls(self.content, [])
        return ExtractedToolCalls(self.content if self.content.strip() else None, list(self.calls))


def _usable(call: CallPiece) -> bool:
    """Whether a call of a whole reply can be answered: complete, with JSON arguments."""
    if not call.complete or not call.name:
        return False
    try:
        json.loads(call.arguments)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------- reasoning


@dataclass(frozen=True)
class ReasoningSplit:
    """A reply read by a :class:`ReasoningParser`: the ``reasoning`` and the ``content``."""

    reasoning: str
    content: str


class ReasoningParser:
    """Splits a reply into the model's reasoning and its answer (see the module docstring).

    A subclass implements :meth:`split`, and :meth:`structured_output_prefix` when a structured
    output may follow the reasoning; the server makes one instance per reply, with the request's
    ``chat_template_kwargs`` (a reasoning switched off there, such as Qwen3's
    ``enable_thinking=False``, means no reasoning to read).
    """

    #: As :attr:`ToolParser.skip_special_tokens`: False when the markers are special tokens.
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        #: The request's ``chat_template_kwargs``.
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Split ``text``, the reply so far (``final``: the whole reply), into reasoning and
        content, the markers left out of both.

        While ``final`` is False the answer must only grow as the text grows: each field stays a
        prefix of what a longer text gives (a tail that may still become a marker is held
        back)."""
        raise NotImplementedError

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        """The reasoning and the content of a whole reply (None for an empty one)."""
        split = self.split(model_output, True)
        return split.reasoning or None, split.content or None

    def structured_output_prefix(self) -> str | None:
        """Lark rules (llguidance's dialect) defining the rule ``reasoning_prefix``: what a reply
        holds before its answer -- the reasoning with its markers, optional where the model may
        answer without it. A structured output (``response_format``, a forced tool call) lets
        it pass and constrains the answer after it. Other rules it defines start with
        ``reasoning_``. None: the constraint applies from the reply's first token."""
        return None


@dataclass
class ReasoningDelta:
    """What a step of a :class:`ReasoningStream` adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Runs a :class:`ReasoningParser` over a growing text: :meth:`feed` takes the whole text so
    far and returns what is new; :attr:`reasoning` and :attr:`content` are all that was sent."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        """What ``text`` (the whole reply so far; ``final``: all of it) adds."""
        try:
            split = self.parser.split(text, final)
        except Exception:  # a parser's bug must not fail the reply: its text is content
            split = ReasoningSplit("", text) if not (self.reasoning or self.content) else ReasoningSplit(
                self.reasoning, self.content)
        delta = ReasoningDelta()
        # A parser that breaks its promise to only grow loses the difference, never the reply.
        if split.reasoning.startswith(self.reasoning):
            delta.reasoning = split.reasoning[len(self.reasoning):]
            self.reasoning = split.reasoning
        if split.content.startswith(self.content):
            delta.content = split.content[len(self.content):]
            self.content = split.content
        return delta
