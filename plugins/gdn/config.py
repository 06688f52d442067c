"""The GDN family's view of ``config.json`` (:ref:`families-gdn-config`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.layers.mlp import expect_mlp_shapes
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.loading.rope import RopeParameters, rope_parameters

REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
)


LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class GdnConfig:
    """Geometry and options of a Qwen3-Next checkpoint.

    Nothing here is sized by ``num_layers`` until :meth:`check_tensors` has compared it with the
    checkpoint: ``layer_types`` (when config.json leaves it to ``full_attention_interval``) and
    ``moe_layers`` are computed on first use.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
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
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeParameters
    #: ``layer_types`` as config.json gives it, else every ``full_attention_interval``-th layer
    #: attends; MoE layers are every ``decoder_sparse_step``-th but ``mlp_only_layers``.
    given_layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    @cached_property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's mixer: ``"full_attention"`` or ``"linear_attention"`` (Gated DeltaNet)."""
        if self.given_layer_types is not None:
            return self.given_layer_types
        interval = self.full_attention_interval
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(self.num_layers))

    @cached_property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is the sparse MoE block (else a dense SwiGLU MLP)."""
        step, dense_only = self.decoder_sparse_step, self.mlp_only_layers
        return tuple(self.num_experts > 0 and i not in dense_only and (i + 1) % step == 0
                     for i in range(self.num_layers))

    @property
    def conv_channels(self) -> int:
        """C = 2 H_k d_k + H_v d_v: the causal conv runs over q, k and v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "GdnConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        # A null in a field with a default is refused, as Qwen3NextConfig refuses it (none of these
        # is typed optional there); layer_types and mlp_only_layers, which are, read null as missing.
        fields = ConfigFields(config, source)
        missing = [name for name in REQUIRED_FIELDS if not fields.has(name)]
        if missing:
            raise CheckpointError(f"{source} lacks {', '.join(missing)}")
        layers = fields.size("num_hidden_layers")
        layer_types = fields.texts("layer_types", None, choices=LAYER_TYPES)
        if layer_types is not None and len(layer_types) != layers:
            raise fields.error(f"layer_types has {len(layer_types)} entries for num_hidden_layers={layers}")
        heads, kv_heads = fields.size("num_attention_heads"), fields.size("num_key_value_heads")
        hidden = fields.size("hidden_size")
        head_dim = fields.size("head_dim", hidden // heads, null=REFUSED)
        if head_dim < 1:
            raise fields.error(f"head_dim is not given and hidden_size={hidden} // num_attention_heads={heads} is 0")
        key_heads, value_heads = fields.size("linear_num_key_heads"), fields.size("linear_num_value_heads")
        if value_heads % key_heads:
            raise fields.error(f"linear_num_value_heads={value_heads} is not a multiple of "
                               f"linear_num_key_heads={key_heads}")
        if heads % kv_heads:
            raise fields.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        experts = fields.integer("num_experts", 0, null=REFUSED)
        top_k = fields.integer("num_experts_per_tok", 0, null=REFUSED)
        if experts and not 1 <= top_k <= experts:
            raise fields.error(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
        return cls(
            vocab_size=fields.size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.integer("intermediate_size", 0, null=REFUSED),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            linear_key_heads=key_heads,
            linear_value_heads=value_heads,
            linear_key_dim=fields.size("linear_key_head_dim"),
            linear_value_dim=fields.size("linear_value_head_dim"),
            # The conv state keeps the last K - 1 inputs: K = 1 would keep none.
            conv_kernel=fields.integer("linear_conv_kernel_dim", 4, minimum=2, null=REFUSED),
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=fields.integer("moe_intermediate_size", 0, null=REFUSED),
            shared_expert_intermediate_size=fields.integer("shared_expert_intermediate_size", 0, null=REFUSED),
            norm_topk_prob=fields.flag("norm_topk_prob", True, null=REFUSED),
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True, null=REFUSED),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False, null=REFUSED),
            max_position_embeddings=fields.size("max_position_embeddings", 32768, null=REFUSED),
            rope=rope_parameters(config, head_dim, default_partial_factor=0.25, source=source),
            given_layer_types=tuple(layer_types) if layer_types is not None else None,
            full_attention_interval=fields.size("full_attention_interval", 4, null=REFUSED),
            decoder_sparse_step=fields.size("decoder_sparse_step", 1, null=REFUSED),
            mlp_only_layers=frozenset(fields.integers("mlp_only_layers", [])),
        )

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layer count, the
        embedding and the first layer of each kind (gated attention, Gated DeltaNet, dense MLP,
        MoE with its expert count) have the shapes this config implies. Reads headers only; call
        it before allocating anything sized by the config."""
        c, hidden = self, self.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        # The layer count is checked: the per-layer tuples are now small.
        moe = f"num_experts={c.num_experts} decoder_sparse_step={c.decoder_sparse_step} mlp_only_layers"
        for index, (kind, sparse) in enumerate(zip(c.layer_types, c.moe_layers)):
            prefix = f"model.layers.{index}"
            given = (f"layer_types[{index}]={kind!r}" if c.given_layer_types is not None
                     else f"full_attention_interval={c.full_attention_interval}")
            checkpoint.expect_tensor(f"{prefix}.self_attn.q_proj.weight", kind == "full_attention", because=given)
            checkpoint.expect_tensor(f"{prefix}.mlp.gate.weight", sparse, because=moe)
        first = {kind: c.layer_types.index(kind) for kind in LAYER_TYPES if kind in c.layer_types}
        if "full_attention" in first:
            attn, d = f"model.layers.{first['full_attention']}.self_attn", c.head_dim
            q = f"num_attention_heads={c.num_heads} head_dim={d} hidden_size={hidden}"
            kv = f"num_key_value_heads={c.num_kv_heads} head_dim={d} hidden_size={hidden}"
            checkpoint.expect_shape(f"{attn}.q_proj.weight", (c.num_heads * 2 * d, hidden),
                                    because=f"{q} (query and gate rows)")
            checkpoint.expect_shape(f"{attn}.k_proj.weight", (c.num_kv_heads * d, hidden), because=kv)
            checkpoint.expect_shape(f"{attn}.v_proj.weight", (c.num_kv_heads * d, hidden), because=kv)
            checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, c.num_heads * d), because=q)
        if "linear_attention" in first:
            delta = f"model.layers.{first['linear_attention']}.linear_attn"
            hk, hv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
            dims = (f"linear_num_key_heads={hk} linear_key_head_dim={dk} linear_num_value_heads={hv} "
                    f"linear_value_head_dim={dv}")
            checkpoint.expect_shape(f"{delta}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, hidden),
                                    because=f"{dims} hidden_size={hidden}")
            checkpoint.expect_shape(f"{delta}.in_proj_ba.weight", (2 * hv, hidden),
                                    because=f"linear_num_value_heads={hv} hidden_size={hidden}")
            checkpoint.expect_shape(f"{delta}.conv1d.weight", (c.conv_channels, 1, c.conv_kernel),
                                    because=f"{dims} linear_conv_kernel_dim={c.conv_kernel}")
            checkpoint.expect_shape(
                f"{delta}.out_proj.weight", (hidden, hv * dv),
                because=f"linear_num_value_heads={hv} linear_value_head_dim={dv} hidden_size={hidden}",
            )
        if False in c.moe_layers:
            expect_mlp_shapes(checkpoint, f"model.layers.{c.moe_layers.index(False)}.mlp", hidden, c.intermediate_size,
                              because=f"intermediate_size={c.intermediate_size} hidden_size={hidden}")
        if True in c.moe_layers:
            mlp, experts = f"model.layers.{c.moe_layers.index(True)}.mlp", c.num_experts
            checkpoint.expect_count(experts, f"{mlp}.experts.", because=f"num_experts={experts}")
            checkpoint.expect_shape(f"{mlp}.gate.weight", (experts, hidden),
                                    because=f"num_experts={experts} hidden_size={hidden}")
            width, shared = c.moe_intermediate_size, c.shared_expert_intermediate_size
            expect_mlp_shapes(checkpoint, f"{mlp}.experts.0", hidden, width,
                              because=f"moe_intermediate_size={width} hidden_size={hidden}")
            expect_mlp_shapes(checkpoint, f"{mlp}.shared_expert", hidden, shared,
                              because=f"shared_expert_intermediate_size={shared} hidden_size={hidden}")
