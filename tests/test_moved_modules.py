"""Earlier module paths keep importing (plugins written against contract 1.0 and 1.1 use them):
each is the module that now lives in a room, and a split module answers each of its names."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from metrale import _moved


@pytest.mark.parametrize("earlier", sorted(_moved.MOVED_MODULES))
def test_an_earlier_path_is_the_moved_module(earlier):
    module = importlib.import_module(earlier)
    now = importlib.import_module(_moved.MOVED_MODULES[earlier])
    assert module is now
    assert module.__name__ == _moved.MOVED_MODULES[earlier]
    assert module.__spec__.name == _moved.MOVED_MODULES[earlier]


def test_submodules_of_a_moved_package_follow_it():
    from metrale.entrypoints.server import protocol
    from metrale.server.protocol import ChatCompletionRequest

    assert importlib.import_module("metrale.server.protocol") is protocol
    assert ChatCompletionRequest is protocol.ChatCompletionRequest


@pytest.mark.parametrize("name, now", [
    ("LoRARequest", "metrale.loading.lora"), ("load_adapter", "metrale.loading.lora"),
    ("LoraLayout", "metrale.layers.lora_stacks"), ("LoraStack", "metrale.layers.lora_stacks"),
    ("LoraManager", "metrale.engine.lora_slots"), ("adapter_tiles", "metrale.kernels.lora_tiles"),
    ("ADAPTER_TILE_ROWS", "metrale.kernels.lora_tiles"), ("adapter_route", "metrale.batch"),
])
def test_a_split_module_answers_each_name_from_its_part(name, now):
    import metrale.lora

    assert getattr(metrale.lora, name) is getattr(importlib.import_module(now), name)


def test_earlier_import_statements_work_in_a_fresh_interpreter():
    """What plugins of contract 1.0 and 1.1 write, before anything else imported the rooms."""
    code = "\n".join([
        "from metrale.family import FamilyModel, FamilyPlugin, FamilySpec",
        "from metrale.checkpoint import Checkpoint, float32_to_bf16",
        "from metrale.rope import rope_parameters",
        "from metrale.config_fields import ConfigFields",
        "from metrale.backend import CpuBackend, get_backend",
        "from metrale.lora import LoraLayout",
        "from metrale.hookspecs import CONTRACT_VERSION, hookimpl",
        "import metrale.plugin_manager, metrale.forward, metrale.executor, metrale.parallel",
        "from metrale import api",
        "assert api.LLM.__module__ == 'metrale.entrypoints.llm'",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_an_unknown_name_of_a_split_module_is_an_attribute_error():
    import metrale.lora

    with pytest.raises(AttributeError, match="no_such_name"):
        metrale.lora.no_such_name  # noqa: B018
