"""The built-in tool-call and reasoning parsers of the OpenAI server, declared through the public
hooks ``metrale_tool_parsers`` and ``metrale_reasoning_parsers`` as a third-party plugin would.

Tool-call parsers (``--tool-call-parser``): ``hermes`` (also Qwen2.5 and Qwen3), ``llama3_json``,
``mistral``, ``deepseek_v3`` and ``openai`` (GPT-OSS's harmony format). Reasoning parsers
(``--reasoning-parser``): ``deepseek_r1``, ``qwen3`` and ``openai_gptoss``.
"""

from __future__ import annotations

from metrale.model.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.plugins.parsers.reasoning import DeepSeekR1ReasoningParser, HarmonyReasoningParser, Qwen3ReasoningParser
from metrale.plugins.parsers.tools import (
    DeepSeekV3ToolParser,
    HarmonyToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)

METRALE_CONTRACT_VERSION = CONTRACT_VERSION


@hookimpl
def metrale_tool_parsers() -> dict[str, type]:
    return {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "mistral": MistralToolParser,
        "deepseek_v3": DeepSeekV3ToolParser,
        "openai": HarmonyToolParser,
    }


@hookimpl
def metrale_reasoning_parsers() -> dict[str, type]:
    return {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "qwen3": Qwen3ReasoningParser,
        "openai_gptoss": HarmonyReasoningParser,
    }
