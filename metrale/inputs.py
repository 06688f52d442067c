"""Prompt types under vLLM's names (``from metrale.inputs import TokensPrompt``): what
:meth:`metrale.LLM.generate` takes besides a string or a list of token ids
(:mod:`metrale.entrypoints.prompts`)."""

from metrale.entrypoints.prompts import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
