"""pytest plugin of the conformance kit (entry point ``pytest11: metrale``).

Fixtures:

* ``metrale_plugin_manager`` -- a fresh plugin manager with the built-ins and entry points;
* ``metrale_cpu_llm`` -- a factory ``(path, **options) -> LLM`` that loads a checkpoint on the CPU
  backend without progress bars.

It imports nothing heavy when pytest loads it.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest


@pytest.fixture
def metrale_plugin_manager() -> Any:
    from metrale.model.plugin_manager import get_plugin_manager

    return get_plugin_manager()


@pytest.fixture
def metrale_cpu_llm() -> Callable[..., Any]:
    from metrale.entrypoints.llm import LLM

    def load(path: Any, **options: Any) -> Any:
        options.setdefault("show_progress", False)
        return LLM(path, device="cpu", **options)

    return load
