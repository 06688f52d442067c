"""The hook specs mirror the forward contract and document themselves."""

from __future__ import annotations

import inspect

import pytest

from metrale.model import hookspecs
from metrale.model.family import FamilyPlugin
from metrale.model.forward import SEGMENT_METHODS, ModelForward

SPECS = {name: obj for name, obj in vars(hookspecs).items() if name.startswith("metrale_") and callable(obj)}

CONTRACT_METHODS = [
    "prefill", "prefill_chunk", "prefill_twophase", "decode", "decode_batch", "mixed_forward",
    "prefill_batch_chunk", "prefill_batch_chunk_rows", "normalize_ssm_states", "hc_mult", "is_mla",
    "kv_block_size", "prefill_tail_split",
]


def test_every_contract_method_has_a_spec():
    for method in CONTRACT_METHODS:
        assert f"metrale_{method}" in SPECS, f"no hook spec for contract method {method}"


@pytest.mark.parametrize("method", CONTRACT_METHODS + ["score"])
def test_spec_arguments_mirror_the_facade_method(method):
    """The spec's parameters are the facade method's, then ``segments`` for the methods the engine
    calls with its planned rows (contract 1.3: :meth:`ModelForward.run` passes ``step.segments``)."""
    facade = [p for p in inspect.signature(getattr(ModelForward, method)).parameters if p != "self"]
    spec = list(inspect.signature(SPECS[f"metrale_{method}"]).parameters)
    extra = ["segments"] if method in SEGMENT_METHODS else []
    assert spec == ["model", *facade, *extra]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_docstring_says_who_calls_it_and_what_it_returns(name):
    doc = inspect.getdoc(SPECS[name]) or ""
    assert "Called" in doc, f"{name}: the docstring must say who calls it"
    assert "Return" in doc, f"{name}: the docstring must say what it returns"


def test_stage_and_registration_specs_exist():
    for name in ("flush", "stamp", "drafter", "end_graph_capture", "families", "load_model", "cache_spec"):
        assert f"metrale_{name}" in SPECS


def test_family_plugin_helper_implements_every_dispatch_and_query_hook():
    implemented = {name for name in dir(FamilyPlugin) if name.startswith("metrale_")}
    stage_hooks = {"metrale_flush", "metrale_stamp", "metrale_drafter", "metrale_end_graph_capture", "metrale_register_ops",
                   "metrale_drafters", "metrale_tool_parsers", "metrale_reasoning_parsers"}
    assert implemented == set(SPECS) - stage_hooks


def test_contract_version_is_major_minor():
    major, minor = hookspecs.CONTRACT_VERSION.split(".")
    assert major.isdigit() and minor.isdigit()
