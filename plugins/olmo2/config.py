"""The OLMo-2 family's view of ``config.json`` (:ref:`families-olmo2`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.layers.mlp import expect_mlp_shapes
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.loading.rope import RopeParameters, rope_parameters

REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: The names transformers gives SiLU, the gate of OLMo-2's SwiGLU MLP.
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class Olmo2Config:
    """Geometry and options of an OLMo-2 checkpoint, with transformers' ``Olmo2Config`` defaults
    applied to the fields a config.json may omit.

    ``attention_bias`` gives q, k, v and o projections a bias each; the q/k norms always span the
    whole projection (``num_heads * head_dim`` and ``num_kv_heads * head_dim`` values)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeParameters

    @property
    def q_width(self) -> int:
        """Values of one token's query projection (the width of ``q_norm``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Values of one token's key (or value) projection (the width of ``k_norm``)."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "Olmo2Config":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked.

        Nulls are read as transformers reads them: ``num_key_value_heads`` null is
        ``num_attention_heads``, ``rope_parameters`` null the default RoPE; every other field the
        model reads is refused as null (its class, or the model for ``head_dim``, fails on it)."""
        fields = ConfigFields(config, source)
        missing = [name for name in REQUIRED_FIELDS if not fields.present(name)]
        if missing:
            raise CheckpointError(f"{source} lacks {', '.join(missing)}")
        hidden = fields.size("hidden_size", null=REFUSED)
        heads = fields.size("num_attention_heads", null=REFUSED)
        kv_heads = fields.size("num_key_value_heads", heads)
        # Olmo2Config does not declare head_dim, but the attention reads one a config.json gives.
        head_dim = fields.size("head_dim", hidden // heads, null=REFUSED)
        if head_dim < 1:
            raise fields.error(f"head_dim is not given and hidden_size={hidden} // num_attention_heads={heads} is 0")
        if heads % kv_heads:
            raise fields.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        fields.text("hidden_act", "silu", choices=SILU_NAMES, null=REFUSED)
        rope = rope_parameters(config, head_dim, source=source)
        if rope.rotary_dim != head_dim:
            # OLMo-2 rotates whole heads; its default RoPE would ignore a partial factor.
            raise fields.error(f"partial rotary embeddings (rotary dimension {rope.rotary_dim} of head_dim "
                               f"{head_dim}) are not part of OLMo-2")
        return cls(
            vocab_size=fields.size("vocab_size", null=REFUSED),
            hidden_size=hidden,
            intermediate_size=fields.size("intermediate_size", null=REFUSED),
            num_layers=fields.size("num_hidden_layers", null=REFUSED),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-5, positive=True, null=REFUSED),
            attention_bias=fields.flag("attention_bias", False, null=REFUSED),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False, null=REFUSED),
            max_position_embeddings=fields.size("max_position_embeddings", 2048, null=REFUSED),
            rope=rope,
        )

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layer count and
        the shapes of the embedding, the first layer (projections, biases, the four norms) and
        the LM head are the ones this config implies. Reads headers only; call it before
        allocating anything sized by the config."""
        c, hidden = self, self.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        checkpoint.expect_shape("model.norm.weight", (hidden,), because=f"hidden_size={hidden}")
        layer, attn = "model.layers.0", "model.layers.0.self_attn"
        q = f"num_attention_heads={c.num_heads} head_dim={c.head_dim} hidden_size={hidden}"
        kv = f"num_key_value_heads={c.num_kv_heads} head_dim={c.head_dim} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.q_proj.weight", (c.q_width, hidden), because=q)
        checkpoint.expect_shape(f"{attn}.k_proj.weight", (c.kv_width, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.v_proj.weight", (c.kv_width, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, c.q_width), because=q)
        checkpoint.expect_shape(f"{attn}.q_norm.weight", (c.q_width,), because=q)
        checkpoint.expect_shape(f"{attn}.k_norm.weight", (c.kv_width,), because=kv)
        if c.attention_bias:
            for name, width, because in (("q_proj", c.q_width, q), ("k_proj", c.kv_width, kv),
                                         ("v_proj", c.kv_width, kv), ("o_proj", hidden, f"hidden_size={hidden}")):
                checkpoint.expect_shape(f"{attn}.{name}.bias", (width,), because=f"attention_bias=true {because}")
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            checkpoint.expect_shape(f"{layer}.{norm}.weight", (hidden,), because=f"hidden_size={hidden}")
        expect_mlp_shapes(checkpoint, f"{layer}.mlp", hidden, c.intermediate_size,
                          because=f"intermediate_size={c.intermediate_size} hidden_size={hidden}")
