"""A Gemma checkpoint whose config.json is wrong, or asks for what the family does not serve, is
refused with a CheckpointError naming the file, the field and the value, before anything sized by
the config is allocated."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import load_refused

HUGE = 10**9


def edited(source, folder, **fields):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"])
def test_huge_sizes_are_refused_before_any_allocation(tmp_path, gemma_checkpoints, warm_plugin_manager, field):
    fields = {field: HUGE}
    if field == "num_hidden_layers":
        fields["layer_types"] = None  # (derived from the count, as transformers does when it is missing)
    load_refused(edited(gemma_checkpoints["gemma2"], tmp_path / "ckpt", **fields), f"{field}={HUGE}",
                 warm_plugin_manager, peak_mb=128)


@pytest.mark.parametrize("fields, match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not served"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=4"),
    ({"layer_types": ["full_attention", "local", "full_attention", "full_attention"]}, r"layer_types\[1\]"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ({"query_pre_attn_scalar": None}, "query_pre_attn_scalar"),
    ({"sliding_window": None}, "sliding_window is null but layer_types has sliding_attention layers"),
    ({"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ({"model_type": "gemma4"}, "model_type 'gemma4'"),
])
def test_bad_fields_are_refused(tmp_path, gemma_checkpoints, warm_plugin_manager, fields, match):
    load_refused(edited(gemma_checkpoints["gemma2"], tmp_path / "ckpt", **fields), match, warm_plugin_manager)


def test_a_bad_rope_of_one_layer_type_is_named(tmp_path, gemma_checkpoints, warm_plugin_manager):
    rope = {"full_attention": {"rope_type": "linear", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    load_refused(edited(gemma_checkpoints["gemma3"], tmp_path / "ckpt", rope_parameters=rope),
                 "linear RoPE scaling needs a 'factor'.*full_attention layers", warm_plugin_manager)
