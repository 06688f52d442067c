"""A dense checkpoint whose config.json is wrong is refused with a CheckpointError naming the file,
the field and the value, before anything sized by the config is allocated.

Each case edits the config.json of a copy of the embedded ``tiny-dense`` (Llama: 4 layers, hidden
128, 4 heads of 32, 2 KV heads, intermediate 320, vocabulary 3072, tied embeddings).
"""

from __future__ import annotations

import math
import re

import pytest

import metrale
from conftest import edited_copy, load_refused, set_fields

HUGE = 10**9


def test_the_unedited_copy_loads(tmp_path, warm_plugin_manager):
    """The control of every test below: copying the checkpoint breaks nothing."""
    llm = metrale.LLM(edited_copy("tiny-dense", tmp_path / "copy"), device="cpu", show_progress=False,
                      plugin_manager=warm_plugin_manager)
    assert llm.vocab_size == 3072


@pytest.mark.parametrize(
    "field",
    ["num_hidden_layers", "head_dim", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads"],
)
def test_huge_dimension_is_refused_before_any_allocation(tmp_path, warm_plugin_manager, field):
    path = edited_copy("tiny-dense", tmp_path / "ckpt", set_fields(**{field: HUGE}))
    load_refused(path, f"{field}={HUGE}", warm_plugin_manager)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_hidden_layers": 3},
         r"num_hidden_layers=3, but the checkpoint has model\.layers\.\{i\}\.\* tensors for i = 0\.\.3"),
        ({"num_hidden_layers": 5}, r"num_hidden_layers=5, .* i = 0\.\.3"),
        ({"vocab_size": 3000}, r"'model\.embed_tokens\.weight' has shape \[3072, 128\], .*vocab_size=3000"),
        ({"head_dim": 16}, r"'model\.layers\.0\.self_attn\.q_proj\.weight' .*head_dim=16"),
        ({"num_key_value_heads": 4}, r"'model\.layers\.0\.self_attn\.k_proj\.weight' .*num_key_value_heads=4"),
        ({"intermediate_size": 256}, r"'model\.layers\.0\.mlp\.gate_proj\.weight' .*intermediate_size=256"),
        ({"tie_word_embeddings": False}, r"tie_word_embeddings=false implies a tensor 'lm_head\.weight'"),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else None,
)
def test_config_that_disagrees_with_the_tensors_is_refused(tmp_path, warm_plugin_manager, fields, message):
    load_refused(edited_copy("tiny-dense", tmp_path / "ckpt", set_fields(**fields)), message, warm_plugin_manager)


# (field, value written to config.json, what the message says of it); ``__`` reaches into a section.
WRONG_TYPES = [
    ("hidden_size", "128", 'hidden_size is "128"'),
    ("num_hidden_layers", 4.0, "num_hidden_layers is 4.0"),
    ("num_attention_heads", True, "num_attention_heads is true"),
    ("num_attention_heads", 0, "num_attention_heads is 0"),
    ("head_dim", -32, "head_dim is -32"),
    ("intermediate_size", [320], "intermediate_size is [320]"),
    ("num_key_value_heads", "2", 'num_key_value_heads is "2"'),
    ("max_position_embeddings", 1024.5, "max_position_embeddings is 1024.5"),
    ("rms_norm_eps", "1e-6", 'rms_norm_eps is "1e-6"'),
    ("rms_norm_eps", math.nan, "rms_norm_eps is NaN"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps is -1e-06"),
    ("tie_word_embeddings", "true", 'tie_word_embeddings is "true"'),
    ("attention_bias", 1, "attention_bias is 1"),
    ("mlp_bias", 0, "mlp_bias is 0"),
    ("sliding_window", "4", 'sliding_window is "4"'),
    ("layer_types", "full_attention", 'layer_types is "full_attention"'),
    ("layer_types", ["full_attention", "dense"], 'layer_types[1] is "dense"'),
    ("rope_parameters", ["default"], 'rope_parameters is ["default"]'),
    ("rope_parameters", "default", 'rope_parameters is "default"'),
    ("rope_scaling", 2.0, "rope_scaling is 2.0"),
    ("rope_parameters__rope_theta", "1e4", 'rope_parameters.rope_theta is "1e4"'),
    ("rope_parameters__rope_theta", math.inf, "rope_parameters.rope_theta is Infinity"),
    ("rope_parameters__rope_type", 3, "rope_parameters.rope_type is 3"),
    ("rope_parameters__factor", "x", 'rope_parameters.factor is "x"'),
    ("rope_parameters__partial_rotary_factor", 2.0, "rope_parameters.partial_rotary_factor is 2.0"),
    ("rope_parameters__truncate", "no", 'rope_parameters.truncate is "no"'),
    ("model_type", 3, "model_type is 3"),
    ("architectures", "LlamaForCausalLM", 'architectures is "LlamaForCausalLM"'),
    ("eos_token_id", "x", 'eos_token_id is "x"'),
    ("eos_token_id", [0, 1.5], "eos_token_id[1] is 1.5"),
]


@pytest.mark.parametrize("field, value, said", WRONG_TYPES, ids=[said for _, _, said in WRONG_TYPES])
def test_field_of_the_wrong_type_or_range_is_refused(tmp_path, warm_plugin_manager, field, value, said):
    path = edited_copy("tiny-dense", tmp_path / "ckpt", set_fields(**{field: value}))
    load_refused(path, "^" + re.escape(f"{path / 'config.json'}: {said}; expected"), warm_plugin_manager)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"vocab_size": None}, r"lacks vocab_size"),
        ({"num_hidden_layers": None, "hidden_size": None}, r"lacks hidden_size, num_hidden_layers"),
        ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ({"head_dim": None, "num_attention_heads": 256, "num_key_value_heads": 256},
         r"head_dim is not given and hidden_size=128 // num_attention_heads=256 is 0"),
        ({"head_dim": 33}, r"rotary dimension 33 \(head_dim 33"),
        ({"rope_parameters__partial_rotary_factor": 0.3},
         r"rotary dimension 9 \(head_dim 32 x partial_rotary_factor 0\.3\)"),
        ({"rope_parameters__rope_type": "dynamic"}, r"RoPE type 'dynamic' is not supported"),
        ({"rope_parameters__rope_type": "linear"}, r"linear RoPE scaling needs a 'factor'"),
        ({"rope_parameters__rope_theta": 1.0}, r"rope_theta is 1\.0; expected a number > 1"),
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
          "sliding_window": 4, "layer_types": ["full_attention"] * 3},
         r"layer_types has 3 entries for num_hidden_layers=4"),
    ],
    ids=["no-vocab", "no-hidden-no-layers", "heads-kv", "head-dim-0", "odd-rotary", "partial-odd", "dynamic",
         "linear-no-factor", "theta-1", "layer-types-length"],
)
def test_inconsistent_config_is_refused(tmp_path, warm_plugin_manager, fields, message):
    path = edited_copy("tiny-dense", tmp_path / "ckpt", set_fields(**fields))
    load_refused(path, "^" + re.escape(str(path / "config.json")) + ":? " + message, warm_plugin_manager)
