"""The MLA family's view of ``config.json`` (:ref:`families-mla-config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from metrale.errors import CheckpointError
from metrale.layers.mlp import expect_mlp_shapes
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.loading.rope import RopeParameters, rope_parameters, yarn_mscale

REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)

# transformers' config-class defaults for fields a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(q_lora_rank=1536, moe_intermediate_size=1407, n_routed_experts=64, num_experts_per_tok=None,
                        n_shared_experts=2, first_k_dense_replace=0, n_group=None, topk_group=None,
                        topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=2048),
    "deepseek_v3": dict(q_lora_rank=1536, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
                        topk_method="noaux_tc", routed_scaling_factor=2.5, max_position_embeddings=4096),
}

# The fields above that transformers' classes type as optional (an explicit null stays None, and
# the reader's ``or`` then gives the neutral value: no q LoRA, one group). A null in the others
# is refused, as the classes refuse it; V3's first_k_dense_replace is typed optional but its
# layers compare with it, so a null fails there too.
_NULLABLE: dict[str, tuple[str, ...]] = {
    "deepseek_v2": ("q_lora_rank", "num_experts_per_tok", "n_group", "topk_group", "topk_method"),
    "deepseek_v3": ("q_lora_rank", "num_experts_per_tok", "n_group", "topk_group"),
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
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "MlaConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        fields = ConfigFields(config, source)
        model_type = fields.text("model_type", "deepseek_v3")
        if model_type not in _DEFAULTS:
            raise fields.error(f"the MLA family serves deepseek_v2 and deepseek_v3, not model_type {model_type!r}")
        missing = [name for name in REQUIRED_FIELDS if not fields.has(name)]
        if missing:
            raise CheckpointError(f"{source} lacks {', '.join(missing)}")
        defaults = _DEFAULTS[model_type]

        def pick(name: str, read: Callable[..., Any], **options: Any) -> Any:
            """The field as config.json gives it, else transformers' default. A null stays None
            where transformers' class types the field as optional (q_lora_rank: null is no q
            LoRA) and is refused where it does not (n_routed_experts), as the class refuses it."""
            null = None if name in _NULLABLE[model_type] else REFUSED
            return read(name, defaults[name], null=null, **options)

        experts = pick("n_routed_experts", fields.integer) or 0
        top_k = pick("num_experts_per_tok", fields.integer) or 0
        n_group = pick("n_group", fields.integer) or 1
        topk_group = pick("topk_group", fields.integer) or 1
        moe_width = pick("moe_intermediate_size", fields.integer) or 0
        if experts:
            if not 1 <= top_k <= experts:
                raise fields.error(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={experts}]")
            if experts % n_group:
                raise fields.error(f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
            if topk_group > n_group:
                raise fields.error(f"topk_group={topk_group} exceeds n_group={n_group}")
            if moe_width < 1:
                raise fields.error("moe_intermediate_size must be a positive int when n_routed_experts > 0")
        method = "noaux_tc" if model_type == "deepseek_v3" else pick("topk_method", fields.text)
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise fields.error(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        rope_dim = fields.size("qk_rope_head_dim")
        return cls(
            model_type=model_type,
            vocab_size=fields.size("vocab_size"),
            hidden_size=fields.size("hidden_size"),
            intermediate_size=fields.size("intermediate_size"),
            num_layers=fields.size("num_hidden_layers"),
            num_heads=fields.size("num_attention_heads"),
            q_lora_rank=pick("q_lora_rank", fields.integer) or None,
            kv_lora_rank=fields.size("kv_lora_rank"),
            qk_nope_head_dim=fields.size("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=fields.size("v_head_dim"),
            moe_intermediate_size=moe_width,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=pick("n_shared_experts", fields.integer) or 0,
            first_k_dense_replace=pick("first_k_dense_replace", fields.integer) or 0,
            n_group=n_group,
            topk_group=topk_group,
            topk_method=method,
            # transformers' V2 never renormalises the top-k weights, whatever the config says;
            # V3 tests the field's truth, so null is false there.
            norm_topk_prob=fields.flag("norm_topk_prob", True, null=False) if model_type == "deepseek_v3" else False,
            routed_scaling_factor=pick("routed_scaling_factor", fields.number, positive=True),
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True, null=REFUSED),
            attention_bias=fields.flag("attention_bias", False, null=REFUSED),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False, null=REFUSED),
            max_position_embeddings=pick("max_position_embeddings", fields.size),
            rope=rope_parameters(config, rope_dim, source=source),
            # V3 tests the field's truth as well: null means adjacent pairs.
            interleaved_rope=model_type == "deepseek_v2" or fields.flag("rope_interleave", True, null=False),
            num_mtp_layers=fields.integer("num_nextn_predict_layers", 0),
        )

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layers (MTP
        layers at ``num_hidden_layers`` and above allowed), the embedding, the first layer's
        attention, the first dense and first MoE layer's MLP and expert count are the ones this
        config implies. Reads headers only; call it before allocating anything sized by the config."""
        c, hidden = self, self.hidden_size
        heads, r, d_n, d_r, d_v = c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}",
                                extra_ok=True)
        # Layers past num_hidden_layers must be multi-token-prediction modules (which have eh_proj),
        # and a decoder layer must not be one.
        for index in range(min(c.num_layers, max(checkpoint.layer_indices("model.layers."), default=-1) + 1)):
            if checkpoint.has(f"model.layers.{index}.eh_proj.weight"):
                raise CheckpointError(
                    f"{checkpoint.path}: config.json's num_hidden_layers={c.num_layers} counts model.layers.{index} as a "
                    "decoder layer, but it holds a multi-token-prediction module (eh_proj.weight)"
                )
        for index in checkpoint.layer_indices("model.layers."):
            if index >= c.num_layers and (index >= c.num_layers + c.num_mtp_layers
                                          or not checkpoint.has(f"model.layers.{index}.eh_proj.weight")):
                raise CheckpointError(
                    f"{checkpoint.path}: config.json's num_hidden_layers={c.num_layers} num_nextn_predict_layers="
                    f"{c.num_mtp_layers} leave model.layers.{index} neither a decoder layer nor a "
                    "multi-token-prediction layer (those have an eh_proj.weight)"
                )
        moe = f"n_routed_experts={c.n_routed_experts} first_k_dense_replace={c.first_k_dense_replace}"
        for index in range(c.num_layers):
            checkpoint.expect_tensor(f"model.layers.{index}.mlp.gate.weight", c.is_moe_layer(index), because=moe)
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        attn = "model.layers.0.self_attn"
        latent = f"kv_lora_rank={r} qk_rope_head_dim={d_r} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.kv_a_proj_with_mqa.weight", (r + d_r, hidden), because=latent)
        checkpoint.expect_shape(f"{attn}.kv_b_proj.weight", (heads * (d_n + d_v), r),
                                because=f"num_attention_heads={heads} qk_nope_head_dim={d_n} v_head_dim={d_v} "
                                        f"kv_lora_rank={r}")
        checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, heads * d_v),
                                because=f"num_attention_heads={heads} v_head_dim={d_v} hidden_size={hidden}")
        query = f"num_attention_heads={heads} qk_nope_head_dim={d_n} qk_rope_head_dim={d_r}"
        if c.q_lora_rank is None:
            checkpoint.expect_shape(f"{attn}.q_proj.weight", (heads * (d_n + d_r), hidden),
                                    because=f"{query} hidden_size={hidden} q_lora_rank=null")
        else:
            rank = c.q_lora_rank
            checkpoint.expect_shape(f"{attn}.q_a_proj.weight", (rank, hidden),
                                    because=f"q_lora_rank={rank} hidden_size={hidden}")
            checkpoint.expect_shape(f"{attn}.q_b_proj.weight", (heads * (d_n + d_r), rank),
                                    because=f"{query} q_lora_rank={rank}")
        if c.n_routed_experts == 0 or c.first_k_dense_replace > 0:
            expect_mlp_shapes(checkpoint, "model.layers.0.mlp", hidden, c.intermediate_size,
                              because=f"intermediate_size={c.intermediate_size} hidden_size={hidden}")
        if c.n_routed_experts and c.first_k_dense_replace < c.num_layers:
            mlp = f"model.layers.{c.first_k_dense_replace}.mlp"
            experts, width = c.n_routed_experts, c.moe_intermediate_size
            checkpoint.expect_count(experts, f"{mlp}.experts.", because=f"n_routed_experts={experts}")
            checkpoint.expect_shape(f"{mlp}.gate.weight", (experts, hidden),
                                    because=f"n_routed_experts={experts} hidden_size={hidden}")
            expect_mlp_shapes(checkpoint, f"{mlp}.experts.0", hidden, width,
                              because=f"moe_intermediate_size={width} hidden_size={hidden}")
            if c.n_shared_experts:
                expect_mlp_shapes(checkpoint, f"{mlp}.shared_experts", hidden, width * c.n_shared_experts,
                                  because=f"n_shared_experts={c.n_shared_experts} moe_intermediate_size={width} "
                                          f"hidden_size={hidden}")
