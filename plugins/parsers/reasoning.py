"""The built-in reasoning parsers (see :class:`metrale.model.parsers.ReasoningParser` for the
contract every ``split`` keeps)."""

from __future__ import annotations

import re

from metrale.model.parsers import ReasoningParser, ReasoningSplit, held_marker

# Lark pieces of the structured-output prefixes: the thinking text runs lazily up to its end
# marker, and a few whitespace characters may separate it from the answer.
_THINK_TEXT = r"/(.|\n)*/"
_GAP = r"/[ \t\r\n]{0,8}/"


class _ThinkReasoningParser(ReasoningParser):
    """Reasoning between ``<think>`` and ``</think>`` at the start of the reply."""

    start_marker = "<think>"
    end_marker = "</think>"
    #: Whether the reply may begin without ``<think>`` and still be reasoning up to ``</think>``
    #: (the chat template opened the thinking in the prompt).
    start_optional = False

    def thinking(self) -> bool:
        """Whether the request lets the model think (its template kwargs may switch it off)."""
        return True

    def split(self, text: str, final: bool) -> ReasoningSplit:
        if not self.thinking():
            return ReasoningSplit("", text)
        if text.startswith(self.start_marker):
            start = len(self.start_marker)
        elif self.start_marker.startswith(text) and not final:
            return ReasoningSplit("", "")  # may still open the thinking
        elif self.start_optional:
            start = 0
        else:
            return ReasoningSplit("", text)
        end = text.find(self.end_marker, start)
        if end < 0:
            # Unfinished thinking (the reply was cut, or is still coming): all of it is reasoning.
            held = len(text) if final else held_marker(text, [self.end_marker], start)
            return ReasoningSplit(text[start:held], "")
        return ReasoningSplit(text[start:end], text[end + len(self.end_marker):])

    def structured_output_prefix(self) -> str | None:
        if not self.thinking():
            return None
        opening = f'"{self.start_marker}"' + ("?" if self.start_optional else "")
        think = f'reasoning_think[lazy]: {opening} {_THINK_TEXT} "{self.end_marker}"\n'
        if self.start_optional:
            return f"reasoning_prefix: reasoning_think {_GAP}\n{think}"
        return f"reasoning_prefix: (reasoning_think {_GAP})?\n{think}"


class DeepSeekR1ReasoningParser(_ThinkReasoningParser):
    """DeepSeek-R1: the reply is reasoning up to ``</think>``, then the answer. R1's chat template
    ends the prompt with ``<think>``, so the reply may start without it; a reply without
    ``</think>`` is reasoning only."""

    start_optional = True


class Qwen3ReasoningParser(_ThinkReasoningParser):
    """Qwen3: ``<think>...</think>`` at the start of the reply is the reasoning; a reply that does
    not start with ``<think>`` has none, and neither does a request whose
    ``chat_template_kwargs`` set ``enable_thinking`` to false."""

    def thinking(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False


# ------------------------------------------------------------------------------------ harmony

_START = "<|start|>"
_CHANNEL = "<|channel|>"
_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_MARKERS = (_START, _CHANNEL, _MESSAGE, *_ENDS)
_HEADER_MARKERS = (_START, _CHANNEL)
_RECIPIENT = re.compile(r"\bto=\S")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyReasoningParser(ReasoningParser):
    """GPT-OSS's harmony format: the ``analysis`` channel's messages are the reasoning; the
    ``final`` channel's (and the ``commentary`` preambles without a recipient) are the content.
    A message addressed to a recipient (a tool call) stays in the content as written, headers
    included, for the ``openai`` tool parser. Text outside any message is content too."""

    skip_special_tokens = False

    def split(self, text: str, final: bool) -> ReasoningSplit:
        reasoning: list[str] = []
        content: list[str] = []
        position = 0
        length = len(text)
        while position < length:
            if not text.startswith(_HEADER_MARKERS, position):
                if any(marker.startswith(text[position:]) for marker in _HEADER_MARKERS) and not final:
                    break  # a header may be starting
                following = [at for at in (text.find(_START, position), text.find(_CHANNEL, position)) if at >= 0]
                end = min(following) if following else (length if final else held_marker(text, _HEADER_MARKERS, position))
                content.append(text[position:end])
                if end <= position:
                    break
                position = end
                continue
            header_end = text.find(_MESSAGE, position)
            if header_end < 0:
                if final:
                    content.append(text[position:])
                break
            header = text[position:header_end]
            body_start = header_end + len(_MESSAGE)
            ends = [(at, marker) for marker in _ENDS if (at := text.find(marker, body_start)) >= 0]
            if ends:
                body_end, marker = min(ends)
                after = body_end + len(marker)
            else:
                body_end = length if final else held_marker(text, _ENDS, body_start)
                marker, after = "", length
            match = _CHANNEL_NAME.search(header)
            channel = match.group(1) if match else ""
            if _RECIPIENT.search(header):
                content.append(text[position:body_end] + marker)
            elif channel == "analysis":
                reasoning.append(text[body_start:body_end])
            else:
                content.append(text[body_start:body_end])
            if not ends:
                break
            position = after
        return ReasoningSplit("".join(reasoning), "".join(content))

    def structured_output_prefix(self) -> str | None:
        return ("reasoning_prefix: reasoning_analysis? <|channel|> \"final\" <|message|>\n"
                "reasoning_analysis: <|channel|> \"analysis\" <|message|> /(.|\\n)*/ <|end|> <|start|> \"assistant\"\n")
