"""The GDN family's view of ``config.json`` (:ref:`families-gdn-config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.rope import RopeParameters, rope_parameters

REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
)


@dataclass(frozen=True)
class GdnConfig:
    """Geometry and options of a Qwen3-Next checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeParameters

    @property
    def conv_channels(self) -> int:
        """C = 2 H_k d_k + H_v d_v: the causal conv runs over q, k and v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "GdnConfig":
        missing = [name for name in REQUIRED_FIELDS if config.get(name) is None]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        layers = int(config["num_hidden_layers"])
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = int(config.get("full_attention_interval") or 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if len(layer_types) != layers or any(t not in ("full_attention", "linear_attention") for t in layer_types):
            raise CheckpointError(f"layer_types must give 'full_attention' or 'linear_attention' for each of {layers} layers")
        heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        if value_heads % key_heads or heads % kv_heads:
            raise CheckpointError("linear_num_value_heads must be a multiple of linear_num_key_heads, and "
                                  "num_attention_heads of num_key_value_heads")
        experts = int(config.get("num_experts") or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        moe_layers = tuple(experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or 0),
            num_layers=layers,
            layer_types=tuple(layer_types),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            linear_key_heads=key_heads,
            linear_value_heads=value_heads,
            linear_key_dim=int(config["linear_key_head_dim"]),
            linear_value_dim=int(config["linear_value_head_dim"]),
            conv_kernel=int(config.get("linear_conv_kernel_dim") or 4),
            num_experts=experts,
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            moe_layers=moe_layers,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
            rope=rope_parameters(config, head_dim, default_partial_factor=0.25),
        )
