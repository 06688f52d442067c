"""A GPT-OSS checkpoint whose config.json is wrong, or asks for what the family does not serve, is
refused with a CheckpointError naming the file, the field and the value, before anything sized by
the config is allocated; a config without the optional fields reads transformers' defaults."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import load_refused
from metrale.errors import CheckpointError
from metrale.plugins.gpt_oss.config import DEFAULT_ROPE_THETA, GptOssConfig

HUGE = 10**9


def edited(source, folder, **fields):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                   "num_local_experts"])
def test_huge_sizes_are_refused_before_any_allocation(tmp_path, gpt_oss_checkpoints, warm_plugin_manager, field):
    fields = {field: HUGE}
    if field == "num_hidden_layers":
        fields["layer_types"] = None  # (derived from the count, as transformers does when it is missing)
    load_refused(edited(gpt_oss_checkpoints["gpt_oss"], tmp_path / "ckpt", **fields), f"{field}={HUGE}",
                 warm_plugin_manager, peak_mb=128)


@pytest.mark.parametrize("fields, match", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than the num_local_experts=4 experts"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"swiglu_limit": 0}, "swiglu_limit is 0; expected a number > 0"),
    ({"swiglu_limit": None}, "swiglu_limit"),
    ({"swiglu_alpha": "1.702"}, "swiglu_alpha"),
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=4"),
    ({"layer_types": ["full_attention", "local", "full_attention", "full_attention"]}, r"layer_types\[1\]"),
    ({"sliding_window": None}, "sliding_window is null but layer_types has sliding_attention layers"),
    ({"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic' is not supported"),
    ({"model_type": "gpt_oss2"}, "model_type 'gpt_oss2'"),
])
def test_bad_fields_are_refused(tmp_path, gpt_oss_checkpoints, warm_plugin_manager, fields, match):
    load_refused(edited(gpt_oss_checkpoints["gpt_oss"], tmp_path / "ckpt", **fields), match, warm_plugin_manager)


def test_more_experts_declared_than_the_router_scores_are_refused(tmp_path, gpt_oss_checkpoints, warm_plugin_manager):
    load_refused(edited(gpt_oss_checkpoints["gpt_oss"], tmp_path / "ckpt", num_local_experts=5),
                 r"mlp.router.weight' has shape \[4, 64\], but config.json's num_local_experts=5", warm_plugin_manager)


def test_an_intermediate_size_the_experts_do_not_have_is_refused(tmp_path, gpt_oss_checkpoints, warm_plugin_manager):
    load_refused(edited(gpt_oss_checkpoints["gpt_oss"], tmp_path / "ckpt", intermediate_size=48),
                 r"experts.gate_up_proj' has shape \[4, 64, 192\], but config.json's num_local_experts=4 "
                 r"intermediate_size=48", warm_plugin_manager)


def test_missing_sinks_are_refused(tmp_path, gpt_oss_checkpoints, warm_plugin_manager):
    from safetensors.numpy import load_file, save_file

    folder = edited(gpt_oss_checkpoints["gpt_oss"], tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.sinks"]
    save_file(tensors, str(folder / "model.safetensors"))
    load_refused(folder, r"num_attention_heads=4 implies a tensor 'model.layers.0.self_attn.sinks'", warm_plugin_manager)


def test_absent_fields_take_transformers_defaults():
    """transformers' GptOssConfig() and this family read the same geometry from an empty config."""
    from transformers import GptOssConfig as Reference

    reference = Reference()
    config = GptOssConfig.from_dict({"model_type": "gpt_oss"})
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.num_experts, config.top_k, config.sliding_window,
            config.max_position_embeddings, config.rms_norm_eps, config.swiglu_alpha, config.swiglu_limit,
            config.attention_bias, config.tie_word_embeddings) == (
        reference.vocab_size, reference.hidden_size, reference.intermediate_size, reference.num_hidden_layers,
        reference.num_attention_heads, reference.num_key_value_heads, reference.head_dim, reference.num_local_experts,
        reference.num_experts_per_tok, reference.sliding_window, reference.max_position_embeddings,
        reference.rms_norm_eps, reference.swiglu_alpha, reference.swiglu_limit, reference.attention_bias,
        reference.tie_word_embeddings)
    assert list(config.layer_types) == reference.layer_types
    rope = reference.rope_parameters
    assert config.rope.rope_type == rope["rope_type"] == "yarn"
    assert config.rope.theta == rope["rope_theta"] == DEFAULT_ROPE_THETA
    for key in ("factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"):
        assert config.rope.scaling[key] == rope[key], key


def test_the_released_config_reads(tmp_path):
    """The fields of openai/gpt-oss-20b's config.json (transformers 4.x names: rope_scaling and
    rope_theta; no swiglu_alpha)."""
    released = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }
    config = GptOssConfig.from_dict(released)
    assert (config.num_layers, config.num_experts, config.top_k, config.swiglu_alpha, config.rope.theta) == (
        24, 32, 4, 1.702, 150000.0)
    assert config.layer_windows[:2] == (128, None) and config.rope.scaling["truncate"] is False
    with pytest.raises(CheckpointError, match="hidden_act"):
        GptOssConfig.from_dict({**released, "hidden_act": 1})
