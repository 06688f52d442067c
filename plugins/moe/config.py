"""The MoE family's view of ``config.json`` (:ref:`families-dense-moe-config`): the
attention fields as the dense family reads them for the matching dense model type (Qwen3 for
``qwen3_moe``, Qwen2 for ``qwen2_moe``, Mistral for ``mixtral``), and the experts'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.layers.experts import EXPERT_NAMES, MIXTRAL_EXPERT_NAMES
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.plugins.dense.config import DenseConfig

#: The dense model type whose attention (biases, QK-norm, windows, defaults) each MoE type shares.
ATTENTION_OF = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
# transformers' config-class defaults for fields a config.json may omit.
_DEFAULT_EXPERTS = {"qwen3_moe": 128, "qwen2_moe": 60, "mixtral": 8}
_DEFAULT_TOP_K = {"qwen3_moe": 8, "qwen2_moe": 4, "mixtral": 2}
_DEFAULT_INTERMEDIATE = {"qwen3_moe": 6144, "qwen2_moe": 5632, "mixtral": 14336}


@dataclass(frozen=True)
class MoeConfig:
    """A MoE checkpoint's geometry: ``attention`` (a :class:`~metrale.plugins.dense.config.DenseConfig`
    read as the matching dense type; its ``intermediate_size`` is the dense layers') and the
    experts: ``num_experts`` routed experts of ``moe_intermediate_size``, ``top_k`` per token,
    renormalised as ``norm_topk_prob`` says (Mixtral always), a shared expert of
    ``shared_expert_intermediate_size`` with its gate (Qwen2-MoE), and which layers are sparse
    (``decoder_sparse_step``, ``mlp_only_layers``)."""

    model_type: str
    attention: DenseConfig
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int | None
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    #: The field ``num_experts`` was read from (``num_local_experts`` for Mixtral and where given).
    experts_field: str = "num_experts"

    @property
    def max_position_embeddings(self) -> int:
        return self.attention.max_position_embeddings

    @property
    def hidden_size(self) -> int:
        return self.attention.hidden_size

    @property
    def expert_names(self) -> tuple[str, str, str]:
        return MIXTRAL_EXPERT_NAMES if self.model_type == "mixtral" else EXPERT_NAMES

    @property
    def moe_prefix(self) -> str:
        """The sparse block's name in a layer (``block_sparse_moe`` in Mixtral, ``mlp`` in Qwen's)."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` runs the routed experts (else a dense MLP): transformers' rule."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "MoeConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        fields = ConfigFields(config, source)
        model_type = fields.text("model_type", "qwen3_moe")
        if model_type not in ATTENTION_OF:
            raise fields.error(f"model_type {model_type!r} is not one of {', '.join(ATTENTION_OF)}")
        mixtral = model_type == "mixtral"
        dense_view = {**config, "model_type": ATTENTION_OF[model_type]}
        if "intermediate_size" not in dense_view:
            dense_view["intermediate_size"] = _DEFAULT_INTERMEDIATE[model_type]
        attention = DenseConfig.from_dict(dense_view, source)
        experts_field = "num_local_experts" if mixtral or fields.has("num_local_experts") else "num_experts"
        num_experts = fields.size(experts_field, _DEFAULT_EXPERTS[model_type], null=REFUSED)
        top_k = fields.size("num_experts_per_tok", _DEFAULT_TOP_K[model_type], null=REFUSED)
        if top_k > num_experts:
            raise fields.error(f"num_experts_per_tok={top_k} is more than the {num_experts} experts")
        if mixtral:
            width, renormalise, shared, step, dense_layers = attention.intermediate_size, True, None, 1, ()
        else:
            width = fields.size("moe_intermediate_size", 768 if model_type == "qwen3_moe" else 1408, null=REFUSED)
            renormalise = fields.flag("norm_topk_prob", False, null=REFUSED)
            shared = (fields.size("shared_expert_intermediate_size", 5632, null=REFUSED)
                      if model_type == "qwen2_moe" else None)
            step = fields.size("decoder_sparse_step", 1, null=REFUSED)
            dense_layers = tuple(fields.integers("mlp_only_layers", ()))
        return cls(model_type=model_type, attention=attention, num_experts=num_experts, top_k=top_k,
                   moe_intermediate_size=width, norm_topk_prob=renormalise, shared_expert_intermediate_size=shared,
                   decoder_sparse_step=step, mlp_only_layers=dense_layers, experts_field=experts_field)

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the layer count, the embeddings, the
        first layer's attention and the first sparse layer's router and experts have the shapes
        this config implies. Reads headers only."""
        c, hidden = self.attention, self.attention.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        attn = "model.layers.0.self_attn"
        q = f"num_attention_heads={c.num_heads} head_dim={c.head_dim} hidden_size={hidden}"
        kv = f"num_key_value_heads={c.num_kv_heads} head_dim={c.head_dim} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.q_proj.weight", (c.num_heads * c.head_dim, hidden), because=q)
        checkpoint.expect_shape(f"{attn}.k_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        sparse = [i for i in range(c.num_layers) if self.sparse(i)]
        if sparse:
            prefix = f"model.layers.{sparse[0]}.{self.moe_prefix}"
            experts = f"{self.experts_field}={self.num_experts} hidden_size={hidden}"
            checkpoint.expect_shape(f"{prefix}.gate.weight", (self.num_experts, hidden), because=experts)
            gate_name = self.expert_names[0]
            checkpoint.expect_shape(f"{prefix}.experts.0.{gate_name}.weight", (self.moe_intermediate_size, hidden),
                                    because=f"moe_intermediate_size={self.moe_intermediate_size} hidden_size={hidden}")
            if not checkpoint.has(f"{prefix}.experts.{self.num_experts - 1}.{gate_name}.weight"):
                raise CheckpointError(f"{checkpoint.path}: {prefix} lacks expert {self.num_experts - 1} "
                                      f"({self.experts_field}={self.num_experts})")
