"""The MLA family's view of ``config.json`` (:ref:`families-mla-config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.rope import RopeParameters, rope_parameters, yarn_mscale

REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)

# transformers' config-class defaults for fields a config.json may omit.
_DEFAULTS = {
    "deepseek_v2": dict(q_lora_rank=1536, moe_intermediate_size=1407, n_routed_experts=64, num_experts_per_tok=None,
                        n_shared_experts=2, first_k_dense_replace=0, n_group=None, topk_group=None,
                        topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=2048),
    "deepseek_v3": dict(q_lora_rank=1536, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
                        topk_method="noaux_tc", routed_scaling_factor=2.5, max_position_embeddings=4096),
}


@dataclass(frozen=True)
class MlaConfig:
    """Geometry and options of a DeepSeek-V2 / V3 checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeParameters
    interleaved_rope: bool
    num_mtp_layers: int

    @property
    def is_v3(self) -> bool:
        return self.model_type == "deepseek_v3"

    @property
    def latent_width(self) -> int:
        """Cached values per token and layer: the latent plus the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(d_n + d_r)^-1/2, times m(factor, mscale_all_dim)^2 for scaled RoPE (:ref:`families-mla-scale`)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all_dim = self.rope.scaling.get("mscale_all_dim") if self.rope.rope_type != "default" else None
        if mscale_all_dim:
            factor = self.rope.scaling.get("factor")
            if factor:
                scale *= yarn_mscale(float(factor), float(mscale_all_dim)) ** 2
        return scale

    def is_moe_layer(self, index: int) -> bool:
        return self.n_routed_experts > 0 and index >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "MlaConfig":
        model_type = config.get("model_type", "deepseek_v3")
        if model_type not in _DEFAULTS:
            raise CheckpointError(f"the MLA family serves deepseek_v2 and deepseek_v3, not {model_type!r}")
        missing = [name for name in REQUIRED_FIELDS if config.get(name) is None]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        defaults = _DEFAULTS[model_type]

        def field(name: str) -> Any:
            return config[name] if name in config else defaults[name]

        experts = int(field("n_routed_experts") or 0)
        top_k = field("num_experts_per_tok")
        if experts and not top_k:
            raise CheckpointError("num_experts_per_tok is needed with n_routed_experts")
        n_group = int(field("n_group") or 1)
        topk_group = int(field("topk_group") or 1)
        if experts and experts % n_group:
            raise CheckpointError(f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
        method = "noaux_tc" if model_type == "deepseek_v3" else str(field("topk_method"))
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise CheckpointError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        rope_dim = int(config["qk_rope_head_dim"])
        q_lora = field("q_lora_rank")
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(config["v_head_dim"]),
            moe_intermediate_size=int(field("moe_intermediate_size")),
            n_routed_experts=experts,
            num_experts_per_tok=int(top_k or 0),
            n_shared_experts=int(field("n_shared_experts") or 0),
            first_k_dense_replace=int(field("first_k_dense_replace") or 0),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=method,
            # transformers' V2 never renormalises the top-k weights, whatever the config says.
            norm_topk_prob=bool(config.get("norm_topk_prob", True)) if model_type == "deepseek_v3" else False,
            routed_scaling_factor=float(field("routed_scaling_factor")),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(field("max_position_embeddings")),
            rope=rope_parameters(config, rope_dim),
            interleaved_rope=model_type == "deepseek_v2" or bool(config.get("rope_interleave", True)),
            num_mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
        )
