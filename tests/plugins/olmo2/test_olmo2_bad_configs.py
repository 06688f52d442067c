"""An OLMo-2 checkpoint whose config.json (or a norm's shape) is wrong is refused with a
CheckpointError naming the file, the field and the value, before anything sized by the config is
allocated; a null is read as transformers reads it (each case edits a copy of a tiny checkpoint:
hidden 64, 4 heads of 16, 2 key/value heads, 3 layers, intermediate 96, vocabulary 128)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import olmo2_fixtures
import pytest

from conftest import load_refused
from metrale.errors import CheckpointError
from metrale.plugins.olmo2.config import Olmo2Config

olmo2_checkpoints = olmo2_fixtures.olmo2_checkpoints

HUGE = 10**9


def edited(source, folder, **fields):
    """A copy of checkpoint ``source`` in ``folder`` with ``fields`` set in its config.json."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def with_tensors(source, folder, **replaced):
    """A copy of checkpoint ``source`` in ``folder`` with the tensors ``replaced`` (``__`` for
    ``.`` in their names) put in its weights file."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.update({name.replace("__", "."): value for name, value in replaced.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("variant", olmo2_fixtures.VARIANTS)
@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                                   "num_attention_heads", "head_dim"])
def test_huge_sizes_are_refused_before_any_allocation(tmp_path, olmo2_checkpoints, warm_plugin_manager, variant,
                                                      field):
    path = edited(olmo2_checkpoints[variant], tmp_path / "ckpt", **{field: HUGE})
    load_refused(path, f"{field}={HUGE}", warm_plugin_manager)


PER_HEAD = np.ones(16, dtype=np.float32)  # a Qwen3-style norm of one head's 16 values


@pytest.mark.parametrize("replaced, match", [
    ({"model__layers__0__self_attn__q_norm__weight": PER_HEAD},
     r"'model\.layers\.0\.self_attn\.q_norm\.weight' has shape \[16\], but config\.json's num_attention_heads=4 "
     r"head_dim=16 hidden_size=64 implies \[64\]"),
    ({"model__layers__0__self_attn__k_norm__weight": np.ones(64, dtype=np.float32)},
     r"'model\.layers\.0\.self_attn\.k_norm\.weight' has shape \[64\], but config\.json's num_key_value_heads=2 "
     r"head_dim=16 hidden_size=64 implies \[32\]"),
], ids=["per-head-q-norm", "k-norm-of-query-width"])
def test_a_norm_of_the_wrong_width_is_refused_before_any_allocation(tmp_path, olmo2_checkpoints, warm_plugin_manager,
                                                                    replaced, match):
    load_refused(with_tensors(olmo2_checkpoints["plain"], tmp_path / "ckpt", **replaced), match, warm_plugin_manager)


def test_a_wrong_norm_in_a_later_layer_is_refused(tmp_path, olmo2_checkpoints):
    import metrale

    path = with_tensors(olmo2_checkpoints["plain"], tmp_path / "ckpt",
                        model__layers__2__self_attn__q_norm__weight=PER_HEAD)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.self_attn\.q_norm\.weight' has shape \[16\], "
                                              r"expected \[64\]"):
        metrale.LLM(path, device="cpu", show_progress=False)


def test_biases_the_config_promises_must_be_there(tmp_path, olmo2_checkpoints, warm_plugin_manager):
    load_refused(edited(olmo2_checkpoints["plain"], tmp_path / "ckpt", attention_bias=True),
                 r"attention_bias=true .* implies a tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'",
                 warm_plugin_manager)


# (field, value written to config.json, what the message says of it).
WRONG_VALUES = [
    ("hidden_size", "64", 'hidden_size is "64"'),
    ("num_hidden_layers", 3.0, "num_hidden_layers is 3.0"),
    ("num_attention_heads", True, "num_attention_heads is true"),
    ("num_attention_heads", 0, "num_attention_heads is 0"),
    ("num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("head_dim", -16, "head_dim is -16"),
    ("intermediate_size", [96], r"intermediate_size is \[96\]"),
    ("max_position_embeddings", 256.5, "max_position_embeddings is 256.5"),
    ("rms_norm_eps", "1e-5", 'rms_norm_eps is "1e-5"'),
    ("rms_norm_eps", math.nan, "rms_norm_eps is NaN"),
    ("rms_norm_eps", 0, "rms_norm_eps is 0"),
    ("attention_bias", 1, "attention_bias is 1"),
    ("tie_word_embeddings", "false", 'tie_word_embeddings is "false"'),
    ("hidden_act", "gelu", 'hidden_act is "gelu"; expected one of "silu", "swish"'),
    ("partial_rotary_factor", 0.5, "partial rotary embeddings .* are not part of OLMo-2"),
    ("rope_parameters", "default", 'rope_parameters is "default"'),
]


@pytest.mark.parametrize("field, value, match", WRONG_VALUES,
                         ids=[f"{field}={value!r}" for field, value, _ in WRONG_VALUES])
def test_a_field_of_the_wrong_type_or_range_is_refused(tmp_path, olmo2_checkpoints, warm_plugin_manager, field, value,
                                                       match):
    load_refused(edited(olmo2_checkpoints["plain"], tmp_path / "ckpt", **{field: value}), match, warm_plugin_manager)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_a_missing_size_is_refused(tmp_path, olmo2_checkpoints, warm_plugin_manager, field):
    path = edited(olmo2_checkpoints["plain"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    del config[field]
    (path / "config.json").write_text(json.dumps(config))
    load_refused(path, f"lacks {field}", warm_plugin_manager)


FIELDS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
# Every field the reader reads, with what an explicit null gives: refused, or these attributes.
NULLS = [
    ("vocab_size", "refused"),
    ("hidden_size", "refused"),
    ("intermediate_size", "refused"),
    ("num_hidden_layers", "refused"),
    ("num_attention_heads", "refused"),
    ("rms_norm_eps", "refused"),
    ("attention_bias", "refused"),
    ("tie_word_embeddings", "refused"),
    ("max_position_embeddings", "refused"),
    ("hidden_act", "refused"),
    ("head_dim", "refused"),  # the class takes it; the attention then multiplies by None
    ("num_key_value_heads", {"num_kv_heads": 4}),
    ("rope_parameters", {"rope": Olmo2Config.from_dict(FIELDS).rope}),
]


@pytest.mark.parametrize("field, expected", NULLS, ids=[field for field, _ in NULLS])
def test_a_null_reads_as_transformers_reads_it(field, expected):
    """Against transformers itself: a null its config class (or, for ``head_dim``, its model)
    refuses is refused; one it takes gives the value it resolves it to."""
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import Olmo2Config as TransformersConfig
    from transformers import Olmo2ForCausalLM

    fields = {**FIELDS, field: None}
    if expected == "refused":
        with pytest.raises(CheckpointError, match=rf"config\.json: {field} is null; expected .*null is not accepted"):
            Olmo2Config.from_dict(fields)
        with pytest.raises((StrictDataclassError, TypeError)):
            with torch.device("meta"):
                Olmo2ForCausalLM(TransformersConfig(**fields))
        return
    ours = Olmo2Config.from_dict(fields)
    assert {name: getattr(ours, name) for name in expected} == expected
    theirs = TransformersConfig(**fields)
    if field == "num_key_value_heads":
        assert theirs.num_key_value_heads == ours.num_kv_heads
    else:
        assert theirs.rope_parameters == {"rope_theta": ours.rope.theta, "rope_type": ours.rope.rope_type}


def test_missing_fields_take_the_defaults_of_transformers_class():
    """A config.json with the required sizes only reads as transformers' ``Olmo2Config`` fills it in."""
    from transformers import Olmo2Config as TransformersConfig

    required = {name: FIELDS[name] for name in FIELDS if name != "num_key_value_heads"}
    ours, theirs = Olmo2Config.from_dict(required), TransformersConfig(**required)
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.attention_bias == theirs.attention_bias
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.hidden_size // theirs.num_attention_heads
    assert theirs.hidden_act == "silu"
    assert {"rope_theta": ours.rope.theta, "rope_type": ours.rope.rope_type} == theirs.rope_parameters
