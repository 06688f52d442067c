"""An MLA checkpoint whose config.json is wrong is refused with a CheckpointError naming the file,
the field and the value, before anything sized by the config is allocated.

Each case edits the config.json of a copy of the embedded ``tiny-mla`` (DeepSeek-V3: 3 layers,
layer 0 dense and layers 1-2 MoE; hidden 128, 4 heads, q LoRA 64, latent 32, nope / rope / v head
dims 32 / 16 / 32, 8 experts in 4 groups, top-2, expert width 64, one shared expert; one MTP
layer).
"""

from __future__ import annotations

import re

import pytest

import metrale
from conftest import edited_copy, load_refused, set_fields

HUGE = 10**9


def test_the_unedited_copy_loads(tmp_path, warm_plugin_manager):
    """The control of every test below: copying the checkpoint breaks nothing."""
    llm = metrale.LLM(edited_copy("tiny-mla", tmp_path / "copy"), device="cpu", show_progress=False,
                      plugin_manager=warm_plugin_manager)
    assert llm.vocab_size == 3072 and llm.model.mtp is not None


@pytest.mark.parametrize(
    "field",
    ["num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "q_lora_rank",
     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "moe_intermediate_size",
     "n_shared_experts", "first_k_dense_replace"],
)
def test_huge_dimension_is_refused_before_any_allocation(tmp_path, warm_plugin_manager, field):
    path = edited_copy("tiny-mla", tmp_path / "ckpt", set_fields(**{field: HUGE}))
    load_refused(path, f"{field}={HUGE}", warm_plugin_manager)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_hidden_layers": 5},
         r"num_hidden_layers=5, but the checkpoint has model\.layers\.\{i\}\.\* tensors for i = 0\.\.3"),
        # Layer 3 is the multi-token-prediction module: not read as a decoder layer.
        ({"num_hidden_layers": 4}, r"num_hidden_layers=4 counts model\.layers\.3 as a decoder layer, but it holds a "
                                   r"multi-token-prediction module"),
        # Layer 2 is a decoder layer, not an MTP module (those have eh_proj): not silently dropped.
        ({"num_hidden_layers": 2}, r"num_hidden_layers=2 num_nextn_predict_layers=1 leave model\.layers\.2 neither"),
        ({"kv_lora_rank": 16},
         r"'model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight' has shape \[48, 128\], .*kv_lora_rank=16"),
        ({"qk_rope_head_dim": 8}, r"kv_a_proj_with_mqa\.weight' .*qk_rope_head_dim=8"),
        ({"q_lora_rank": None}, r"q_lora_rank=null implies a tensor 'model\.layers\.0\.self_attn\.q_proj\.weight'"),
        ({"first_k_dense_replace": 0},
         r"first_k_dense_replace=0 implies a tensor 'model\.layers\.0\.mlp\.gate\.weight'"),
        ({"n_routed_experts": 0},
         r"n_routed_experts=0 first_k_dense_replace=1 implies no tensor 'model\.layers\.1\.mlp\.gate\.weight'"),
        ({"n_routed_experts": 16},
         r"n_routed_experts=16, but the checkpoint has model\.layers\.1\.mlp\.experts\.\{i\}\.\* tensors "
         r"for i = 0\.\.7"),
        ({"moe_intermediate_size": 32},
         r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' .*moe_intermediate_size=32"),
        ({"n_shared_experts": 2}, r"'model\.layers\.1\.mlp\.shared_experts\.gate_proj\.weight' .*n_shared_experts=2"),
        ({"tie_word_embeddings": False}, r"tie_word_embeddings=false implies a tensor 'lm_head\.weight'"),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else None,
)
def test_config_that_disagrees_with_the_tensors_is_refused(tmp_path, warm_plugin_manager, fields, message):
    load_refused(edited_copy("tiny-mla", tmp_path / "ckpt", set_fields(**fields)), message, warm_plugin_manager)


# (field, value written to config.json, what the message says of it); ``__`` reaches into a section.
WRONG_TYPES = [
    ("kv_lora_rank", "32", 'kv_lora_rank is "32"'),
    ("qk_rope_head_dim", 16.0, "qk_rope_head_dim is 16.0"),
    ("v_head_dim", 0, "v_head_dim is 0"),
    ("q_lora_rank", "64", 'q_lora_rank is "64"'),
    ("n_routed_experts", 8.0, "n_routed_experts is 8.0"),
    ("num_experts_per_tok", True, "num_experts_per_tok is true"),
    ("n_group", "4", 'n_group is "4"'),
    ("topk_group", [2], "topk_group is [2]"),
    ("first_k_dense_replace", -1, "first_k_dense_replace is -1"),
    ("n_shared_experts", 1.0, "n_shared_experts is 1.0"),
    ("num_nextn_predict_layers", "1", 'num_nextn_predict_layers is "1"'),
    ("routed_scaling_factor", "2.5", 'routed_scaling_factor is "2.5"'),
    ("routed_scaling_factor", -2.5, "routed_scaling_factor is -2.5"),
    ("norm_topk_prob", 1, "norm_topk_prob is 1"),
    ("rope_interleave", "yes", 'rope_interleave is "yes"'),
    ("rope_scaling", [], "rope_scaling is []"),
    ("rope_parameters__mscale_all_dim", "x", 'rope_parameters.mscale_all_dim is "x"'),
    ("rope_parameters__original_max_position_embeddings", 4096.0,
     "rope_parameters.original_max_position_embeddings is 4096.0"),
]


@pytest.mark.parametrize("field, value, said", WRONG_TYPES, ids=[said for _, _, said in WRONG_TYPES])
def test_field_of_the_wrong_type_or_range_is_refused(tmp_path, warm_plugin_manager, field, value, said):
    path = edited_copy("tiny-mla", tmp_path / "ckpt", set_fields(**{field: value}))
    load_refused(path, "^" + re.escape(f"{path / 'config.json'}: {said}; expected"), warm_plugin_manager)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_lora_rank": None}, r"lacks kv_lora_rank"),
        ({"n_group": 3}, r"n_routed_experts=8 is not a multiple of n_group=3"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, n_routed_experts=8\]"),
        ({"num_experts_per_tok": None}, r"num_experts_per_tok=0 must be in \[1, n_routed_experts=8\]"),
        ({"topk_group": 5}, r"topk_group=5 exceeds n_group=4"),
        ({"moe_intermediate_size": 0}, r"moe_intermediate_size must be a positive int"),
        ({"qk_rope_head_dim": 15}, r"rotary dimension 15"),
        ({"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "random"},
         r"topk_method 'random' is not supported"),
    ],
    ids=["no-latent", "groups", "top-k", "no-top-k", "topk-group", "expert-width-0", "odd-rope", "topk-method"],
)
def test_inconsistent_config_is_refused(tmp_path, warm_plugin_manager, fields, message):
    path = edited_copy("tiny-mla", tmp_path / "ckpt", set_fields(**fields))
    load_refused(path, "^" + re.escape(str(path / "config.json")) + ":? " + message, warm_plugin_manager)
