"""The conformance kit's pytest plugin is registered through its entry point and its fixtures work."""

from __future__ import annotations

from metrale.model.family import resolve_family


def test_plugin_is_registered_by_entry_point(pytestconfig):
    plugin = pytestconfig.pluginmanager.get_plugin("metrale")
    assert plugin is not None and plugin.__name__ == "metrale.testing.pytest_plugin"


def test_plugin_manager_fixture_is_fresh(metrale_plugin_manager, request):
    other = request.getfixturevalue("metrale_plugin_manager")
    assert other is metrale_plugin_manager  # one per test
    assert resolve_family(metrale_plugin_manager, {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}).name == "dense"


def test_cpu_llm_fixture_loads_on_the_cpu(metrale_cpu_llm, dense_checkpoints):
    llm = metrale_cpu_llm(dense_checkpoints["qwen2"], max_model_len=64)
    assert llm.backend.name == "cpu" and llm.max_model_len == 64 and not llm.show_progress
