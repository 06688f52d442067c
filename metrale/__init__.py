"""Metrale: a Python LLM inference engine for NVIDIA GPUs with pluggable model families.

The public API is re-exported here. Importing it loads neither CuPy nor numba and touches no
CUDA device.
"""

from metrale._version import __version__
from metrale.api import LLM
from metrale.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.params import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "hookimpl", "CONTRACT_VERSION", "__version__"]
