"""The built-in tool-call parsers: each reads one family's syntax for tool calls (see
:class:`metrale.model.parsers.ToolParser` for the contract every ``parse`` keeps)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from metrale.model.parsers import CallPiece, ToolCallParse, ToolParser, held_marker, scan_json, scan_object

_SPACE = " \t\r\n"


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in _SPACE:
        index += 1
    return index


@dataclass(frozen=True)
class _CallObject:
    """A JSON call object ``{"name": ..., "arguments": ...}`` as far as the text shows it."""

    status: str  # scan_object's status of the whole object
    end: int
    name: str | None  # None until the name is a complete string
    arguments: str  # the arguments' JSON text so far
    has_arguments: bool  # whether an arguments key was seen

    @property
    def piece(self) -> CallPiece:
        arguments = self.arguments if self.has_arguments or self.status != "complete" else "{}"
        return CallPiece(self.name or "", arguments, self.status == "complete")


def _call_object(text: str, start: int, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> _CallObject:
    """Read the call object at ``text[start]`` (a ``{``): its name, and the raw JSON of its
    arguments (a JSON string holding the arguments is decoded once complete)."""
    status, end, members = scan_object(text, start)
    name: str | None = None
    arguments = ""
    has_arguments = False
    for member in members:
        if member.key == "name":
            if member.status == "complete":
                value = json.loads(text[member.start:member.end])
                if not isinstance(value, str):
                    return _CallObject("invalid", member.start, None, "", False)
                name = value
        elif member.key in argument_keys and not has_arguments:
            has_arguments = True
            if text[member.start] == '"':  # arguments given as a JSON string of JSON
                if member.status == "complete":
                    decoded = json.loads(text[member.start:member.end])
                    arguments = decoded if isinstance(decoded, str) else ""
            else:
                arguments = text[member.start:member.end]
    if status == "complete" and name is None:
        status = "invalid"
    return _CallObject(status, end, name, arguments, has_arguments)


def _pieces(objects: list[_CallObject]) -> tuple[CallPiece, ...]:
    """The calls to report: every object up to the first whose name is still unknown."""
    pieces = []
    for item in objects:
        if item.name is None:
            break
        pieces.append(item.piece)
    return tuple(pieces)


# ------------------------------------------------------------------------------------- hermes


class HermesToolParser(ToolParser):
    """Hermes' and Qwen's calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
    block per call, after the reply's content (text after the calls is dropped)."""

    skip_special_tokens = False
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(self.start_marker)
        if first < 0:
            return ToolCallParse(held_marker(text, [self.start_marker]))
        objects: list[_CallObject] = []
        position = first
        while True:
            body = _skip_space(text, position + len(self.start_marker))
            if body >= len(text):
                break
            if text[body] != "{":
                return ToolCallParse(first, failed=True)
            item = _call_object(text, body)
            if item.status == "invalid":
                return ToolCallParse(first, failed=True)
            objects.append(item)
            if item.status != "complete":
                break
            after = _skip_space(text, item.end)
            if after >= len(text):
                break
            if text.startswith(self.end_marker, after):
                following = text.find(self.start_marker, after + len(self.end_marker))
            elif self.end_marker.startswith(text[after:]):
                break
            else:
                return ToolCallParse(first, failed=True)
            if following < 0:
                break
            position = following
        return ToolCallParse(first, _pieces(objects))


# -------------------------------------------------------------------------------- llama3_json


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+'s JSON calls: the reply is ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``), optionally after ``<|python_tag|>``, several calls separated by ``;``. A
    reply that does not start with a call object is content (an object without both keys is a
    JSON answer, not a call)."""

    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        start = _skip_space(text, 0)
        if text.startswith(self.python_tag, start):
            start = _skip_space(text, start + len(self.python_tag))
        elif start < len(text) and self.python_tag.startswith(text[start:]) and not final:
            return ToolCallParse(0)
        if start >= len(text):
            return ToolCallParse(0 if not final else len(text))
        if text[start] != "{":
            return ToolCallParse(len(text))
        objects: list[_CallObject] = []
        position = start
        while True:
            item = _call_object(text, position)
            if not objects and not (item.name is not None and item.has_arguments):
                # Not known to be a call yet: held while it may still become one, else content.
                if item.status == "partial" and self._may_be_call(text, position):
                    return ToolCallParse(0)
                return ToolCallParse(len(text))
            if item.status == "invalid":
                return ToolCallParse(0, failed=True)
            objects.append(item)
            if item.status != "complete":
                break
            after = _skip_space(text, item.end)
            if after >= len(text) or text[after] != ";":
                break
            position = _skip_space(text, after + 1)
            if position >= len(text) or text[position] != "{":
                break
        return ToolCallParse(0, _pieces(objects))

    @staticmethod
    def _may_be_call(text: str, start: int) -> bool:
        """Whether the partial object at ``start`` can still turn out to be a call: no member's key
        is other than name, arguments and parameters."""
        _, _, members = scan_object(text, start)
        return all(member.key in ("name", "arguments", "parameters") for member in members)


# ------------------------------------------------------------------------------------ mistral

_NAME = re.compile(r"[A-Za-z0-9_.:-]*")


class MistralToolParser(ToolParser):
    """Mistral's calls after the ``[TOOL_CALLS]`` token: a JSON array of ``{"name", "arguments"}``
    objects, or (tokenizer v11 and later) ``NAME[ARGS]{...}`` per call, each after its own
    ``[TOOL_CALLS]`` (an optional ``[CALL_ID]ID`` before ``[ARGS]`` is skipped)."""

    skip_special_tokens = False
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    call_id_marker = "[CALL_ID]"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(self.marker)
        if first < 0:
            return ToolCallParse(held_marker(text, [self.marker]))
        start = _skip_space(text, first + len(self.marker))
        if start >= len(text):
            return ToolCallParse(first)
        if text[start] == "[" and not text.startswith(self.args_marker, start) and not text.startswith(
                self.call_id_marker, start):
            return self._array(text, first, start)
        return self._named(text, first, start)

    def _array(self, text: str, first: int, start: int) -> ToolCallParse:
        objects: list[_CallObject] = []
        position = _skip_space(text, start + 1)
        while position < len(text):
            if text[position] == "]" and not objects:
                break
            if text[position] != "{":
                return ToolCallParse(first, failed=True)
            item = _call_object(text, position)
            if item.status == "invalid":
                return ToolCallParse(first, failed=True)
            objects.append(item)
            if item.status != "complete":
                break
            position = _skip_space(text, item.end)
            if position >= len(text) or text[position] == "]":
                break
            if text[position] != ",":
                return ToolCallParse(first, failed=True)
            position = _skip_space(text, position + 1)
        return ToolCallParse(first, _pieces(objects))

    def _named(self, text: str, first: int, start: int) -> ToolCallParse:
        pieces: list[CallPiece] = []
        position = start
        while True:
            name_end = _NAME.match(text, position).end()  # type: ignore[union-attr]
            name = text[position:name_end]
            rest = text[name_end:]
            if rest.startswith(self.call_id_marker):
                id_start = name_end + len(self.call_id_marker)
                args_at = text.find(self.args_marker, id_start)
                if args_at < 0:
                    break
                name_end = args_at
                rest = text[args_at:]
            if not rest.startswith(self.args_marker):
                if any(marker.startswith(rest) for marker in (self.args_marker, self.call_id_marker)):
                    break
                return ToolCallParse(first, failed=True)
            if not name:
                return ToolCallParse(first, failed=True)
            body = _skip_space(text, name_end + len(self.args_marker))
            if body >= len(text):
                pieces.append(CallPiece(name, ""))
                break
            status, end = scan_json(text, body)
            if status == "invalid":
                return ToolCallParse(first, failed=True)
            pieces.append(CallPiece(name, text[body:end], status == "complete"))
            if status != "complete":
                break
            after = _skip_space(text, end)
            if not text.startswith(self.marker, after):
                break
            position = _skip_space(text, after + len(self.marker))
            if position >= len(text):
                break
        return ToolCallParse(first, tuple(pieces))


# -------------------------------------------------------------------------------- deepseek_v3


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3's calls: ``<｜tool▁calls▁begin｜>``, then per call ``<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME`` and the arguments in a fenced JSON block (three backticks and ``json``) before
    ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``. DeepSeek-V3.1's
    ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` is read too."""

    skip_special_tokens = False
    calls_begin = "<｜tool▁calls▁begin｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    separator = "<｜tool▁sep｜>"
    call_end = "<｜tool▁call▁end｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    fence = "```json"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(self.calls_begin)
        if first < 0:
            return ToolCallParse(held_marker(text, [self.calls_begin]))
        pieces: list[CallPiece] = []
        position = _skip_space(text, first + len(self.calls_begin))
        while True:
            if position >= len(text) or self.call_begin.startswith(text[position:]) and not text.startswith(
                    self.call_begin, position):
                break
            if text.startswith(self.calls_end, position) or self.calls_end.startswith(text[position:]):
                break
            if not text.startswith(self.call_begin, position):
                return ToolCallParse(first, failed=True)
            header_start = position + len(self.call_begin)
            separator = text.find(self.separator, header_start)
            if separator < 0:
                break
            header = text[header_start:separator]
            after_separator = separator + len(self.separator)
            if header.strip() == "function":  # V3: the name, a newline, then a fenced JSON block
                newline = text.find("\n", after_separator)
                if newline < 0:
                    break
                name = text[after_separator:newline].strip()
                body = _skip_space(text, newline)
                if body >= len(text) or self.fence.startswith(text[body:body + len(self.fence)]) and len(
                        text) - body < len(self.fence):
                    if not name:
                        return ToolCallParse(first, failed=True)
                    pieces.append(CallPiece(name, ""))
                    break
                if not text.startswith(self.fence, body):
                    return ToolCallParse(first, failed=True)
                body = _skip_space(text, body + len(self.fence))
                fenced = True
            else:  # V3.1: the name is the header, the JSON follows the separator
                name = header.strip()
                body = _skip_space(text, after_separator)
                fenced = False
            if not name:
                return ToolCallParse(first, failed=True)
            if body >= len(text):
                pieces.append(CallPiece(name, ""))
                break
            status, end = scan_json(text, body)
            if status == "invalid":
                return ToolCallParse(first, failed=True)
            if status != "complete":
                pieces.append(CallPiece(name, text[body:end]))
                break
            after = _skip_space(text, end)
            if fenced:
                if text.startswith("```", after):
                    after = _skip_space(text, after + 3)
                elif "```".startswith(text[after:]):
                    pieces.append(CallPiece(name, text[body:end], final and after >= len(text)))
                    break
                else:
                    return ToolCallParse(first, failed=True)
            pieces.append(CallPiece(name, text[body:end], True))
            if text.startswith(self.call_end, after):
                position = _skip_space(text, after + len(self.call_end))
            elif after >= len(text) or self.call_end.startswith(text[after:]):
                break
            else:
                return ToolCallParse(first, failed=True)
        return ToolCallParse(first, tuple(pieces))


# ------------------------------------------------------------------------------------ harmony

#: The harmony format's special tokens.
HARMONY_START = "<|start|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_MESSAGE = "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class HarmonyToolParser(ToolParser):
    """GPT-OSS's calls in OpenAI's harmony format: a message on the ``commentary`` channel
    addressed to a function, ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {...}<|call|>`` (the recipient may also stand in the role part of the header,
    ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``). Use it with
    the ``openai_gptoss`` reasoning parser, which takes the analysis channel out and leaves the
    final channel's text, and the calls' messages as they are, for this one."""

    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = -1
        pieces: list[CallPiece] = []
        position = 0
        while True:
            found = self._next_call(text, position)
            if found is None:
                if first < 0:
                    return ToolCallParse(self._content_end(text, position))
                break
            header_start, name, body = found
            if first < 0:
                first = header_start
            if name is None:  # the header is not complete yet
                break
            body = _skip_space(text, body)
            if body >= len(text):
                pieces.append(CallPiece(name, ""))
                break
            status, end = scan_json(text, body)
            if status == "invalid":
                return ToolCallParse(first, failed=True)
            complete = status == "complete"
            pieces.append(CallPiece(name, text[body:end], complete))
            if not complete:
                break
            after = _skip_space(text, end)
            if after < len(text) and not any(text.startswith(m, after) or m.startswith(text[after:]) for m in HARMONY_ENDS):
                return ToolCallParse(first, failed=True)
            position = after
        return ToolCallParse(first, tuple(pieces))

    @staticmethod
    def _content_end(text: str, position: int) -> int:
        """The content before any call: all the text, less a tail that may become a header."""
        return held_marker(text, [HARMONY_START, HARMONY_CHANNEL], position)

    @staticmethod
    def _next_call(text: str, position: int) -> tuple[int, str | None, int] | None:
        """The next message header at or after ``position`` that addresses a function: where it
        starts, the function's name (None while the header is incomplete) and where its body
        starts; None when there is none."""
        while True:
            starts = [at for at in (text.find(HARMONY_START, position), text.find(HARMONY_CHANNEL, position)) if at >= 0]
            if not starts:
                return None
            start = min(starts)
            header_end = text.find(HARMONY_MESSAGE, start)
            if header_end < 0:  # a header still arriving may address a function
                return start, None, len(text)
            header = text[start:header_end]
            match = _RECIPIENT.search(header)
            if match is not None:
                return start, match.group(1), header_end + len(HARMONY_MESSAGE)
            position = header_end + len(HARMONY_MESSAGE)
