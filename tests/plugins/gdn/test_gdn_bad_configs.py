"""A Qwen3-Next checkpoint whose config.json is wrong is refused with a CheckpointError naming the
file, the field and the value, before anything sized by the config is allocated.

Each case edits the config.json of a copy of the embedded ``tiny-gdn`` (layers: three Gated
DeltaNet, then one gated attention; hidden 128; attention 4 heads of 32, 2 KV heads, a quarter
rotary; DeltaNet 2 key and 4 value heads of 32, conv kernel 4; MoE in every layer: 8 experts,
top-2, expert and shared-expert width 48).
"""

from __future__ import annotations

import re

import pytest

import metrale
from conftest import edited_copy, load_refused, set_fields

HUGE = 10**9


def test_the_unedited_copy_loads(tmp_path, warm_plugin_manager):
    """The control of every test below: copying the checkpoint breaks nothing."""
    llm = metrale.LLM(edited_copy("tiny-gdn", tmp_path / "copy"), device="cpu", show_progress=False,
                      plugin_manager=warm_plugin_manager)
    assert llm.vocab_size == 3072


@pytest.mark.parametrize(
    "fields",
    [
        {"num_hidden_layers": HUGE, "layer_types": None},  # layer kinds from full_attention_interval
        {"num_hidden_layers": HUGE},  # layer_types lists 4
        {"hidden_size": HUGE},
        {"vocab_size": HUGE},
        {"head_dim": HUGE},
        {"num_attention_heads": HUGE},
        {"num_experts": HUGE},
        {"moe_intermediate_size": HUGE},
        {"shared_expert_intermediate_size": HUGE},
        {"linear_key_head_dim": HUGE},
        {"linear_value_head_dim": HUGE},
        {"linear_num_key_heads": HUGE},
        {"linear_num_value_heads": HUGE},
        {"linear_conv_kernel_dim": HUGE},
    ],
    ids=lambda fields: "-".join(f"{k}={v}" for k, v in fields.items()),
)
def test_huge_dimension_is_refused_before_any_allocation(tmp_path, warm_plugin_manager, fields):
    path = edited_copy("tiny-gdn", tmp_path / "ckpt", set_fields(**fields))
    load_refused(path, f"{next(iter(fields))}={HUGE}", warm_plugin_manager)


LINEAR, FULL = "linear_attention", "full_attention"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_hidden_layers": 3, "layer_types": [LINEAR] * 3},
         r"num_hidden_layers=3, but the checkpoint has model\.layers\.\{i\}\.\* tensors for i = 0\.\.3"),
        ({"layer_types": [LINEAR, LINEAR, FULL, FULL]},
         r"layer_types\[2\]='full_attention' implies a tensor 'model\.layers\.2\.self_attn\.q_proj\.weight'"),
        ({"layer_types": None, "full_attention_interval": 2},
         r"full_attention_interval=2 implies a tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers implies no tensor 'model\.layers\.1\.mlp\.gate\.weight'"),
        ({"num_experts": 0}, r"num_experts=0 .* implies no tensor 'model\.layers\.0\.mlp\.gate\.weight'"),
        ({"num_experts": 16},
         r"num_experts=16, but the checkpoint has model\.layers\.0\.mlp\.experts\.\{i\}\.\* tensors"),
        ({"head_dim": 16}, r"'model\.layers\.3\.self_attn\.q_proj\.weight' has shape \[256, 128\], .*head_dim=16"),
        ({"linear_value_head_dim": 16},
         r"'model\.layers\.0\.linear_attn\.in_proj_qkvz\.weight' has shape \[384, 128\], .*linear_value_head_dim=16"),
        ({"linear_conv_kernel_dim": 3}, r"'model\.layers\.0\.linear_attn\.conv1d\.weight' .*linear_conv_kernel_dim=3"),
        ({"moe_intermediate_size": 32},
         r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' .*moe_intermediate_size=32"),
        ({"tie_word_embeddings": False}, r"tie_word_embeddings=false implies a tensor 'lm_head\.weight'"),
    ],
    ids=["layers", "layer-types", "interval", "mlp-only", "no-experts", "experts", "head-dim", "value-dim", "conv",
         "expert-width", "untied"],
)
def test_config_that_disagrees_with_the_tensors_is_refused(tmp_path, warm_plugin_manager, fields, message):
    load_refused(edited_copy("tiny-gdn", tmp_path / "ckpt", set_fields(**fields)), message, warm_plugin_manager)


# (field, value written to config.json, what the message says of it); ``__`` reaches into a section.
WRONG_TYPES = [
    ("linear_num_key_heads", "2", 'linear_num_key_heads is "2"'),
    ("linear_key_head_dim", 32.0, "linear_key_head_dim is 32.0"),
    ("linear_conv_kernel_dim", 1, "linear_conv_kernel_dim is 1"),
    ("num_experts", True, "num_experts is true"),
    ("num_experts_per_tok", "2", 'num_experts_per_tok is "2"'),
    ("decoder_sparse_step", 0, "decoder_sparse_step is 0"),
    ("full_attention_interval", "4", 'full_attention_interval is "4"'),
    ("mlp_only_layers", "1", 'mlp_only_layers is "1"'),
    ("mlp_only_layers", [1.0], "mlp_only_layers[0] is 1.0"),
    ("layer_types", "linear_attention", 'layer_types is "linear_attention"'),
    ("layer_types", [LINEAR, LINEAR, "mamba", FULL], 'layer_types[2] is "mamba"'),
    ("norm_topk_prob", "true", 'norm_topk_prob is "true"'),
    ("partial_rotary_factor", "0.25", 'partial_rotary_factor is "0.25"'),  # also in rope_parameters: both read
    ("rope_parameters__partial_rotary_factor", 0, "rope_parameters.partial_rotary_factor is 0"),
]


@pytest.mark.parametrize("field, value, said", WRONG_TYPES, ids=[said for _, _, said in WRONG_TYPES])
def test_field_of_the_wrong_type_or_range_is_refused(tmp_path, warm_plugin_manager, field, value, said):
    path = edited_copy("tiny-gdn", tmp_path / "ckpt", set_fields(**{field: value}))
    load_refused(path, "^" + re.escape(f"{path / 'config.json'}: {said}; expected"), warm_plugin_manager)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"linear_num_value_heads": None}, r"lacks linear_num_value_heads"),
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
        ({"num_attention_heads": 3}, r"num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
        ({"layer_types": [LINEAR] * 3}, r"layer_types has 3 entries for num_hidden_layers=4"),
        ({"head_dim": 36}, r"rotary dimension 9 \(head_dim 36 x partial_rotary_factor 0\.25\)"),
    ],
    ids=["no-value-heads", "value-heads", "kv-heads", "top-k", "layer-types-length", "odd-rotary"],
)
def test_inconsistent_config_is_refused(tmp_path, warm_plugin_manager, fields, message):
    path = edited_copy("tiny-gdn", tmp_path / "ckpt", set_fields(**fields))
    load_refused(path, "^" + re.escape(str(path / "config.json")) + ":? " + message, warm_plugin_manager)
