"""The tool-call and reasoning parsers the installed plugins declare, as the OpenAI server looks
them up by name (``--tool-call-parser NAME``, ``--reasoning-parser NAME``). The parser classes
and their contract are :mod:`metrale.model.parsers` (re-exported here)."""

from __future__ import annotations

from typing import Any, Mapping

from metrale.errors import ConfigError, PluginError
from metrale.model.parsers import (
    CallPiece,
    ExtractedToolCalls,
    ObjectMember,
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
    ToolCall,
    ToolCallParse,
    ToolCallStream,
    ToolDelta,
    ToolParser,
    held_marker,
    new_call_id,
    scan_json,
    scan_object,
)

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
    "get_reasoning_parser",
    "get_tool_parser",
    "held_marker",
    "new_call_id",
    "reasoning_parsers",
    "scan_json",
    "scan_object",
    "tool_parsers",
]


# ------------------------------------------------------------------------------- the registry


def _collect(hook: str, manager: Any) -> dict[str, type]:
    if manager is None:
        from metrale.model.plugin_manager import get_plugin_manager

        manager = get_plugin_manager()
    found: dict[str, type] = {}
    origin: dict[str, str] = {}
    caller = getattr(manager.hook, hook)
    for implementation in caller.get_hookimpls():  # (in registration order)
        answer = implementation.function()
        plugin_name = implementation.plugin_name
        if answer is None:
            continue
        if not isinstance(answer, Mapping):
            raise PluginError(f"plugin {plugin_name!r}: {hook} must return a dict of name -> parser class, got "
                              f"{type(answer).__name__}", plugin=plugin_name)
        for name, parser in answer.items():
            if not isinstance(name, str) or not name or not isinstance(parser, type):
                raise PluginError(f"plugin {plugin_name!r}: {hook} must map names to parser classes, got "
                                  f"{name!r}: {parser!r}", plugin=plugin_name)
            if name in found:
                raise PluginError(f"the {hook.removeprefix('metrale_').replace('_', ' ')[:-1]} {name!r} is declared by "
                                  f"plugins {origin[name]!r} and {plugin_name!r}; block one of them "
                                  "(METRALE_BLOCKED_PLUGINS)", plugin=plugin_name)
            found[name] = parser
            origin[name] = plugin_name
    return found


def tool_parsers(manager: Any = None) -> dict[str, type[ToolParser]]:
    """Every tool-call parser the plugins declare (``metrale_tool_parsers``), by name; from
    ``manager``, or a new plugin manager. :class:`~metrale.errors.PluginError` for a name two
    plugins declare, or a hook that returns something else than names and classes."""
    parsers = _collect("metrale_tool_parsers", manager)
    for name, parser in parsers.items():
        if not issubclass(parser, ToolParser):
            raise PluginError(f"the tool parser {name!r} ({parser!r}) is not a metrale.model.parsers.ToolParser")
    return parsers


def reasoning_parsers(manager: Any = None) -> dict[str, type[ReasoningParser]]:
    """Every reasoning parser the plugins declare (``metrale_reasoning_parsers``), by name, as
    :func:`tool_parsers` collects them."""
    parsers = _collect("metrale_reasoning_parsers", manager)
    for name, parser in parsers.items():
        if not issubclass(parser, ReasoningParser):
            raise PluginError(f"the reasoning parser {name!r} ({parser!r}) is not a "
                              "metrale.model.parsers.ReasoningParser")
    return parsers


def get_tool_parser(name: str, manager: Any = None) -> type[ToolParser]:
    """The tool-call parser ``name``; :class:`~metrale.errors.ConfigError` listing the
    available ones when no plugin declares it."""
    return _named("tool-call parser", name, tool_parsers(manager))


def get_reasoning_parser(name: str, manager: Any = None) -> type[ReasoningParser]:
    """The reasoning parser ``name``; :class:`~metrale.errors.ConfigError` listing the
    available ones when no plugin declares it."""
    return _named("reasoning parser", name, reasoning_parsers(manager))


def _named(what: str, name: Any, parsers: dict[str, type]) -> Any:
    if not isinstance(name, str) or name not in parsers:
        available = ", ".join(sorted(parsers)) or "none"
        raise ConfigError(f"unknown {what} {name!r}; the installed plugins offer: {available}")
    return parsers[name]
