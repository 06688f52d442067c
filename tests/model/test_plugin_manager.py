"""Plugin discovery: built-ins, block list, entry points, contract versions, resolution."""

from __future__ import annotations

import types

import pytest

from metrale import hookimpl
from metrale.config import environment_flag, read_environment
from metrale.errors import ContractVersionError, PluginError, UnsupportedModelError
from metrale.model import plugin_manager as pm_module
from metrale.model.family import FamilyPlugin, FamilySpec, installed_families, resolve_family
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.model.plugin_manager import get_plugin_manager

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


class FakeDistribution:
    def __init__(self, name):
        self.name = name


class FakeEntryPoint:
    def __init__(self, name, loader, distribution="acme-family", value="acme.plugin"):
        self.name, self.value, self.dist = name, value, FakeDistribution(distribution)
        self._loader = loader

    def load(self):
        return self._loader()


def plugin_module(version=CONTRACT_VERSION, **hooks):
    module = types.ModuleType("acme_plugin")
    if version is not None:
        module.METRALE_CONTRACT_VERSION = version
    for name, function in hooks.items():
        setattr(module, name, function)
    return module


def with_entry_points(monkeypatch, *entry_points):
    monkeypatch.setattr(pm_module, "_entry_points", lambda: list(entry_points))


def test_every_call_builds_a_fresh_manager():
    first, second = get_plugin_manager(entry_points=False), get_plugin_manager(entry_points=False)
    assert first is not second
    first.unregister(name="dense")
    assert second.get_plugin("dense") is not None


def test_builtins_are_registered_with_their_distribution():
    manager = get_plugin_manager(entry_points=False)
    assert {"dense", "stages"} <= {name for name, _ in manager.list_name_plugin()}
    assert manager.distributions["dense"] == "metrale"
    assert resolve_family(manager, LLAMA).name == "dense"


def test_block_list_from_argument_and_environment():
    manager = get_plugin_manager(blocked=["dense"], entry_points=False)
    assert manager.get_plugin("dense") is None
    with pytest.raises(UnsupportedModelError):
        resolve_family(manager, LLAMA)
    env = read_environment({"METRALE_BLOCKED_PLUGINS": " stages , dense"})
    manager = get_plugin_manager(environment=env, entry_points=False)
    assert manager.get_plugin("stages") is None and manager.get_plugin("dense") is None


def test_entry_point_plugin_is_registered(monkeypatch):
    calls = []

    @hookimpl
    def metrale_flush(model, step):
        calls.append(step)

    with_entry_points(monkeypatch, FakeEntryPoint("acme", lambda: plugin_module(metrale_flush=metrale_flush)))
    manager = get_plugin_manager()
    assert manager.distributions["acme"] == "acme-family"
    manager.hook.metrale_flush(model=None, step="s")
    assert calls == ["s"]


def test_entry_points_can_be_turned_off(monkeypatch):
    with_entry_points(monkeypatch, FakeEntryPoint("acme", lambda: plugin_module()))
    assert get_plugin_manager(entry_points=False).get_plugin("acme") is None
    env = read_environment({"METRALE_NO_ENTRY_POINTS": "1"})
    assert get_plugin_manager(environment=env).get_plugin("acme") is None


def test_blocked_entry_point_is_never_imported(monkeypatch):
    def explode():
        raise AssertionError("a blocked plugin was imported")

    with_entry_points(monkeypatch, FakeEntryPoint("acme", explode))
    assert get_plugin_manager(blocked=["acme"]).get_plugin("acme") is None


def test_import_failure_names_plugin_and_distribution(monkeypatch):
    def broken():
        raise ImportError("No module named 'acme_missing'")

    with_entry_points(monkeypatch, FakeEntryPoint("acme", broken, distribution="acme-family"))
    with pytest.raises(PluginError) as raised:
        get_plugin_manager()
    message = str(raised.value)
    assert "'acme'" in message and "acme-family" in message and "acme_missing" in message
    assert raised.value.plugin == "acme" and raised.value.distribution == "acme-family"


@pytest.mark.parametrize("version", ["2.0", "0.9", "1.99", "one", None])
def test_contract_version_mismatch_fails_at_load(monkeypatch, version):
    with_entry_points(monkeypatch, FakeEntryPoint("acme", lambda: plugin_module(version=version)))
    with pytest.raises(ContractVersionError) as raised:
        get_plugin_manager()
    message = str(raised.value)
    assert "acme" in message and CONTRACT_VERSION in message


def test_older_minor_version_is_accepted(monkeypatch):
    major = CONTRACT_VERSION.split(".")[0]
    with_entry_points(monkeypatch, FakeEntryPoint("acme", lambda: plugin_module(version=f"{major}.0")))
    assert get_plugin_manager().get_plugin("acme") is not None


def test_hook_with_wrong_arguments_is_refused(monkeypatch):
    @hookimpl
    def metrale_flush(model, step, unexpected):
        return None

    with_entry_points(monkeypatch, FakeEntryPoint("acme", lambda: plugin_module(metrale_flush=metrale_flush)))
    with pytest.raises(PluginError, match="acme"):
        get_plugin_manager()


def test_plugin_class_is_instantiated(monkeypatch):
    class AcmePlugin(FamilyPlugin):
        METRALE_CONTRACT_VERSION = CONTRACT_VERSION
        family = FamilySpec("acme", ("AcmeForCausalLM",), ("acme",))

    with_entry_points(monkeypatch, FakeEntryPoint("acme", lambda: AcmePlugin))
    manager = get_plugin_manager()
    assert isinstance(manager.get_plugin("acme"), AcmePlugin)
    assert resolve_family(manager, {"architectures": ["AcmeForCausalLM"], "model_type": "acme"}).name == "acme"
    assert ("acme", "acme") in {(spec.name, plugin) for spec, plugin in installed_families(manager)}


def test_unknown_architecture_lists_known_ones_and_plugins():
    manager = get_plugin_manager(entry_points=False)
    with pytest.raises(UnsupportedModelError) as raised:
        resolve_family(manager, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    message = str(raised.value)
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message and "dense" in message


def test_model_type_with_a_foreign_architecture_is_refused():
    manager = get_plugin_manager(entry_points=False)
    with pytest.raises(UnsupportedModelError, match="LlamaForSequenceClassification"):
        resolve_family(manager, {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"})


def test_architecture_alone_resolves_when_model_type_is_missing():
    manager = get_plugin_manager(entry_points=False)
    assert resolve_family(manager, {"architectures": ["Qwen2ForCausalLM"]}).name == "dense"


def test_two_families_claiming_one_model_type_is_an_error(monkeypatch):
    class Rival(FamilyPlugin):
        METRALE_CONTRACT_VERSION = CONTRACT_VERSION
        family = FamilySpec("rival", ("LlamaForCausalLM",), ("llama",))

    with_entry_points(monkeypatch, FakeEntryPoint("rival", lambda: Rival))
    with pytest.raises(PluginError, match="METRALE_BLOCKED_PLUGINS"):
        resolve_family(get_plugin_manager(), LLAMA)


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("", True), ("1", True), ("0", False), ("off", False)])
def test_flags_with_a_true_default_are_off_only_when_asked(raw, expected):
    env = {} if raw is None else {"METRALE_DECODE_MMA": raw}
    assert read_environment(env).decode_mma is expected
    assert environment_flag("METRALE_DECODE_MMA", env, default=True) is expected
    assert environment_flag("METRALE_NO_PROGRESS", env) is False
