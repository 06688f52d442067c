"""Building the plugin manager: hook specs, block list, built-in plugins, then entry points.

:func:`get_plugin_manager` builds a fresh manager on every call (never at import), so tests and
applications can hold managers with different plugin sets side by side.

A plugin is registered from a module, an object, or a class (instantiated with no arguments).
Third-party packages declare theirs as setuptools entry points of group ``metrale``::

    [options.entry_points]
    metrale =
        my_family = my_package.plugin
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Iterable

import pluggy

from metrale.config import EnvironmentConfig, read_environment
from metrale.errors import ContractVersionError, PluginError
from metrale.model import hookspecs

ENTRY_POINT_GROUP = "metrale"

#: The built-in plugins, each as (plugin name, module path, attribute holding the plugin object).
BUILTIN_PLUGINS: tuple[tuple[str, str, str], ...] = (
    ("dense", "metrale.plugins.dense.plugin", "plugin"),
    ("mla", "metrale.plugins.mla.plugin", "plugin"),
    ("gdn", "metrale.plugins.gdn.plugin", "plugin"),
    ("moe", "metrale.plugins.moe.plugin", "plugin"),
    ("phi3", "metrale.plugins.phi3.plugin", "plugin"),
    ("olmo2", "metrale.plugins.olmo2.plugin", "plugin"),
    ("gemma", "metrale.plugins.gemma.plugin", "plugin"),
    ("gpt_oss", "metrale.plugins.gpt_oss.plugin", "plugin"),
    ("stages", "metrale.plugins.stages", ""),
    ("ngram", "metrale.plugins.ngram", ""),
    ("mtp", "metrale.plugins.mtp", ""),
    ("parsers", "metrale.plugins.parsers", ""),
)


class MetralePluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers which distribution provided each plugin."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        #: plugin name -> distribution name ("metrale" for built-ins)
        self.distributions: dict[str, str] = {}


def parse_contract_version(value: Any) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; raises ValueError on anything else."""
    major, minor = str(value).strip().split(".")
    return int(major), int(minor)


def check_contract_version(plugin: Any, name: str, distribution: str) -> None:
    """Refuse a plugin that targets a contract version this engine does not implement."""
    ours = parse_contract_version(hookspecs.CONTRACT_VERSION)
    stated = getattr(plugin, "METRALE_CONTRACT_VERSION", None)
    where = f"plugin {name!r} (distribution {distribution!r})"
    if stated is None:
        raise ContractVersionError(
            f"{where} does not state METRALE_CONTRACT_VERSION; this engine implements contract "
            f"{hookspecs.CONTRACT_VERSION}",
            plugin=name,
            distribution=distribution,
        )
    try:
        theirs = parse_contract_version(stated)
    except ValueError:
        raise ContractVersionError(
            f"{where} states METRALE_CONTRACT_VERSION={stated!r}, which is not 'major.minor'; "
            f"this engine implements contract {hookspecs.CONTRACT_VERSION}",
            plugin=name,
            distribution=distribution,
        ) from None
    if theirs[0] != ours[0] or theirs[1] > ours[1]:
        raise ContractVersionError(
            f"{where} targets forward contract {stated}, but this engine implements "
            f"{hookspecs.CONTRACT_VERSION}; install a version of the plugin built for contract "
            f"{ours[0]}.x (<= {hookspecs.CONTRACT_VERSION}) or a matching metrale",
            plugin=name,
            distribution=distribution,
        )


def register_plugin(manager: MetralePluginManager, plugin: Any, name: str, distribution: str) -> None:
    """Validate and register one plugin object under ``name``."""
    if inspect.isclass(plugin):
        plugin = plugin()
    check_contract_version(plugin, name, distribution)
    try:
        manager.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as error:
        raise PluginError(
            f"plugin {name!r} (distribution {distribution!r}) cannot be registered: {error}",
            plugin=name,
            distribution=distribution,
        ) from error
    manager.distributions[name] = distribution


def _load_builtin(module_path: str, attribute: str) -> Any:
    module = importlib.import_module(module_path)
    return getattr(module, attribute) if attribute else module


def _entry_points() -> Iterable[metadata.EntryPoint]:
    return metadata.entry_points(group=ENTRY_POINT_GROUP)


def get_plugin_manager(
    *,
    blocked: Iterable[str] = (),
    entry_points: bool | None = None,
    environment: EnvironmentConfig | None = None,
) -> MetralePluginManager:
    """A new plugin manager with the built-in plugins and the installed entry points.

    ``blocked`` names plugins (built-in or entry point) not to register, in addition to
    ``METRALE_BLOCKED_PLUGINS``; ``entry_points=False`` skips third-party plugins (default: on,
    unless ``METRALE_NO_ENTRY_POINTS`` is set). A plugin that fails to import or to validate
    raises :class:`~metrale.errors.PluginError` naming it and its distribution.
    """
    env = environment or read_environment()
    manager = MetralePluginManager()
    manager.add_hookspecs(hookspecs)
    for name in (*env.blocked_plugins, *blocked):
        manager.set_blocked(name)
    for name, module_path, attribute in BUILTIN_PLUGINS:
        if manager.is_blocked(name):
            continue
        register_plugin(manager, _load_builtin(module_path, attribute), name, "metrale")
    if entry_points if entry_points is not None else not env.no_entry_points:
        for entry_point in _entry_points():
            if manager.is_blocked(entry_point.name):
                continue
            distribution = entry_point.dist.name if entry_point.dist is not None else "unknown"
            try:
                plugin = entry_point.load()
            except Exception as error:
                raise PluginError(
                    f"plugin {entry_point.name!r} (distribution {distribution!r}, entry point "
                    f"{entry_point.value!r}) failed to import: {type(error).__name__}: {error}",
                    plugin=entry_point.name,
                    distribution=distribution,
                ) from error
            register_plugin(manager, plugin, entry_point.name, distribution)
    return manager
