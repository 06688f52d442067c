"""Tiny perturbed DeepSeek-V2 and DeepSeek-V3 checkpoints (FAMILIES.md §7)."""

from __future__ import annotations

import pytest

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1)


def mla_configs():
    """(model class, config) of the DeepSeek-V2 (group-limited routing, YaRN, no q LoRA) and
    DeepSeek-V3 (q LoRA, sigmoid routing with bias, YaRN with mscale != mscale_all_dim) tests."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = {"type": "yarn", "rope_type": "yarn", "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "rope_theta": 10000.0}
    return {
        "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(
            **BASE, **MLA, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
            topk_group=2, routed_scaling_factor=1.5,
            rope_scaling={**yarn, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
            **BASE, **MLA, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            rope_scaling={**yarn, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.8})),
    }


def build_mla_checkpoint(model_class, config, path, seed, dtype=None):
    """Perturbed weights, and a router bias that is not zero (a buffer the generic perturbation skips)."""
    import torch

    from metrale.testing.hf import perturb_weights

    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_weights(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mla_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    return {name: build_mla_checkpoint(cls, config, root / name, seed=20 + index)
            for index, (name, (cls, config)) in enumerate(mla_configs().items())}
