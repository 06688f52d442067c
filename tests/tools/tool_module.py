"""The repository's tool scripts (tools/...) imported as modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(relative: str, name: str) -> ModuleType:
    """The script ``tools/<relative>`` run as module ``name``, registered in ``sys.modules``
    (dataclasses look their module up there; the scripts find ``tools/timing.py`` themselves)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
