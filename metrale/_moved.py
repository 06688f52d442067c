"""Earlier module paths that keep importing.

Modules that moved into the package's rooms (``entrypoints``, ``model``, ``loading``,
``backends``, ``benchmarks``, ``structured``) stay importable under the paths plugins written against earlier
contract versions use: ``import metrale.rope`` or ``from metrale.family import FamilyModel``
gives the module object that now lives at its new path, so the names, classes and monkeypatches
are the same objects. A module split in parts (``metrale.lora``) is served by a module whose
attributes come from its parts, looked up on first use.

:func:`install` puts the finder on ``sys.meta_path``; ``metrale/__init__.py`` calls it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Sequence

#: Earlier path -> the module it is now (a package's submodules follow it: ``metrale.server.app``
#: is ``metrale.entrypoints.server.app``).
MOVED_MODULES: dict[str, str] = {
    "metrale.api": "metrale.entrypoints.llm",
    "metrale.async_llm": "metrale.entrypoints.async_llm",
    "metrale.engine_process": "metrale.entrypoints.engine_process",
    "metrale.frontend": "metrale.entrypoints.frontend",
    "metrale.chat": "metrale.entrypoints.chat",
    "metrale.prompts": "metrale.entrypoints.prompts",
    "metrale.streams": "metrale.entrypoints.streams",
    "metrale.engine_hold": "metrale.entrypoints.engine_hold",
    "metrale.cli": "metrale.entrypoints.cli",
    "metrale.server": "metrale.entrypoints.server",
    "metrale.family": "metrale.model.family",
    "metrale.hookspecs": "metrale.model.hookspecs",
    "metrale.plugin_manager": "metrale.model.plugin_manager",
    "metrale.forward": "metrale.model.forward",
    "metrale.checkpoint": "metrale.loading.checkpoint",
    "metrale.config_fields": "metrale.loading.config_fields",
    "metrale.rope": "metrale.loading.rope",
    "metrale.cuda_backend": "metrale.backends.cuda",
    "metrale.parallel": "metrale.backends.parallel",
    "metrale.executor": "metrale.backends.executor",
    "metrale._rank_worker": "metrale.backends.rank_worker",
    "metrale.bench": "metrale.benchmarks.latency",
    "metrale.bench_serve": "metrale.benchmarks.serve",
    "metrale.bench_throughput": "metrale.benchmarks.throughput",
    "metrale.grammar_sandbox": "metrale.structured.sandbox",
}

#: Earlier path -> the modules that now hold its names, searched in order.
SPLIT_MODULES: dict[str, tuple[str, ...]] = {
    "metrale.backend": ("metrale.backends.base", "metrale.backends.devices"),
    "metrale.lora": ("metrale.loading.lora", "metrale.layers.lora_stacks", "metrale.engine.lora_slots",
                     "metrale.kernels.lora_tiles", "metrale.batch"),
}


def current_name(name: str) -> str | None:
    """The module an earlier path ``name`` (or a submodule of one) now is, or None."""
    for earlier, now in MOVED_MODULES.items():
        if name == earlier or name.startswith(earlier + "."):
            return now + name[len(earlier):]
    return None


class _SplitModule(types.ModuleType):
    """An earlier module whose names now live in ``parts``: each attribute is looked up there."""

    def __init__(self, name: str, parts: tuple[str, ...]) -> None:
        super().__init__(name, f"Earlier path of {', '.join(parts)}.")
        self.__parts = parts

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        for part in self.__parts:
            module = importlib.import_module(part)
            if hasattr(module, attribute):
                value = getattr(module, attribute)
                setattr(self, attribute, value)
                return value
        raise AttributeError(f"module {self.__name__!r} has no attribute {attribute!r}")

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        for part in self.__parts:
            names |= {name for name in dir(importlib.import_module(part)) if not name.startswith("_")}
        return sorted(names)


class _Loader(importlib.abc.Loader):
    """Hands the import system a module that already exists (a moved module, run at its own
    path) or a new :class:`_SplitModule`."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._own_spec = getattr(module, "__spec__", None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the earlier path's spec on the module; a moved module keeps
        # its own, so that it still reports where it lives.
        if self._own_spec is not None:
            module.__spec__ = self._own_spec


class _EarlierPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("metrale."):
            return None
        if fullname in SPLIT_MODULES:
            parts = SPLIT_MODULES[fullname]
            return importlib.machinery.ModuleSpec(fullname, _Loader(_SplitModule(fullname, parts)))
        now = current_name(fullname)
        if now is None:
            return None
        module = importlib.import_module(now)
        return importlib.machinery.ModuleSpec(fullname, _Loader(module), is_package=hasattr(module, "__path__"))


def install() -> None:
    """Put the finder of earlier paths first on ``sys.meta_path`` (once): a submodule of a moved
    package (``metrale.server.protocol``) must resolve to the module at its new path before the
    path finder, which would find the same file in the package's folder, loads it a second time."""
    if not any(isinstance(finder, _EarlierPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EarlierPathFinder())
