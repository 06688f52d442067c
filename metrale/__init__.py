"""Metrale: a Python LLM inference engine for NVIDIA GPUs with pluggable model families.

The public API is re-exported here. Importing it loads neither CuPy nor numba and touches no
CUDA device.
"""

from metrale import _moved
from metrale._version import __version__
from metrale.entrypoints.async_llm import AsyncLLM
from metrale.entrypoints.llm import LLM
from metrale.entrypoints.prompts import TextPrompt, TokensPrompt
from metrale.loading.lora import LoRARequest
from metrale.model.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.params import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingParams,
    RequestOutput,
    SamplingParams,
)
from metrale.structured import StructuredOutputParams

_moved.install()

__all__ = [
    "LLM", "AsyncLLM", "SamplingParams", "StructuredOutputParams", "RequestOutput", "CompletionOutput", "Logprob",
    "LoRARequest", "TextPrompt", "TokensPrompt", "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "hookimpl",
    "CONTRACT_VERSION", "__version__",
]
