"""The Gemma family's view of ``config.json`` (:ref:`families-gemma-config`): Gemma-2
(``gemma2``) and Gemma-3's text model (``gemma3_text``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.loading.rope import RopeParameters, rope_parameters
from metrale.plugins.dense.layers import expect_mlp_shapes

MODEL_TYPES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")
#: ``hidden_activation`` -> the ``approximate`` of the ``gelu_and_mul`` op (torch's names).
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}

# transformers' config-class defaults for the fields a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window_pattern": 2},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "sliding_window_pattern": 6},
}
# Gemma-3's two RoPE tables: the global layers' theta and the local (sliding) layers'.
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclass(frozen=True)
class GemmaConfig:
    """Geometry and options of a Gemma-2 or Gemma-3 text checkpoint, transformers' defaults applied.

    ``layer_types`` says per layer whether it slides (``sliding_attention``, over the last
    ``sliding_window`` positions) or attends fully; ``rope`` holds one RoPE per layer type.
    Nothing here is sized by ``num_layers`` until :meth:`check_tensors` has compared it with the
    checkpoint: ``layer_types`` is computed on first use.
    """

    model_type: str
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
    #: Attention logits are scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``'s).
    query_pre_attn_scalar: float
    sliding_window: int | None
    #: The file's ``layer_types``, or None: every ``sliding_window_pattern``-th layer is global.
    given_layer_types: tuple[str, ...] | None
    sliding_window_pattern: int
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    #: The ``approximate`` of the GeGLU activation: ``"tanh"`` or ``"none"`` (:data:`ACTIVATIONS`).
    activation: str
    rope: Mapping[str, RopeParameters]

    @property
    def qk_norm(self) -> bool:
        """Whether each head's queries and keys pass an RMSNorm before RoPE (Gemma-3)."""
        return self.model_type == "gemma3_text"

    @cached_property
    def layer_types(self) -> tuple[str, ...]:
        """``sliding_attention`` or ``full_attention`` per layer."""
        if self.given_layer_types is not None:
            return self.given_layer_types
        pattern = self.sliding_window_pattern
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window per layer (None = full attention)."""
        return tuple(self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "GemmaConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        fields = ConfigFields(config, source)
        model_type = fields.text("model_type", "gemma2")
        if model_type not in MODEL_TYPES:
            raise fields.error(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        defaults = _DEFAULTS[model_type]
        if fields.flag("use_bidirectional_attention", False):
            raise fields.error("use_bidirectional_attention is true: an encoder (embedding) model, which is not served "
                               "for generation; this family serves causal Gemma models")
        hidden = fields.size("hidden_size", defaults["hidden_size"], null=REFUSED)
        heads = fields.size("num_attention_heads", defaults["num_attention_heads"], null=REFUSED)
        kv_heads = fields.size("num_key_value_heads", defaults["num_key_value_heads"], null=REFUSED)
        head_dim = fields.size("head_dim", defaults["head_dim"], null=REFUSED)
        if heads % kv_heads:
            raise fields.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        layers = fields.size("num_hidden_layers", defaults["num_hidden_layers"], null=REFUSED)
        activation = fields.text("hidden_activation", None) or fields.text("hidden_act", "gelu_pytorch_tanh")
        if activation not in ACTIVATIONS:
            raise fields.error(f"hidden_activation {activation!r} is not served (served: {', '.join(ACTIVATIONS)})")
        window = fields.size("sliding_window", 4096, null=None)
        kinds = fields.texts("layer_types", None, choices=LAYER_TYPES)
        pattern = fields.size("sliding_window_pattern", defaults["sliding_window_pattern"], null=REFUSED)
        if kinds is not None and len(kinds) != layers:
            raise fields.error(f"layer_types has {len(kinds)} entries for num_hidden_layers={layers}")
        slides = "sliding_attention" in kinds if kinds is not None else (pattern > 1 and layers > 0)
        if window is None and slides:
            raise fields.error("sliding_window is null but layer_types has sliding_attention layers")
        return cls(
            model_type=model_type,
            vocab_size=fields.size("vocab_size", defaults["vocab_size"], null=REFUSED),
            hidden_size=hidden,
            intermediate_size=fields.size("intermediate_size", defaults["intermediate_size"], null=REFUSED),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True, null=REFUSED),
            attention_bias=fields.flag("attention_bias", False, null=REFUSED),
            tie_word_embeddings=fields.flag("tie_word_embeddings", True, null=REFUSED),
            max_position_embeddings=fields.size("max_position_embeddings", defaults["max_position_embeddings"],
                                                null=REFUSED),
            query_pre_attn_scalar=fields.number("query_pre_attn_scalar", 256, positive=True, null=REFUSED),
            sliding_window=window,
            given_layer_types=tuple(kinds) if kinds is not None else None,
            sliding_window_pattern=pattern,
            attn_logit_softcapping=fields.number("attn_logit_softcapping", defaults["attn_logit_softcapping"],
                                                 positive=True, null=None),
            final_logit_softcapping=fields.number("final_logit_softcapping", defaults["final_logit_softcapping"],
                                                  positive=True, null=None),
            activation=ACTIVATIONS[activation],
            rope=_rope_by_layer_type(config, fields, model_type, head_dim, source),
        )

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layer count and
        the shapes of the embedding, the first layer and the LM head are the ones this config
        implies. Reads headers only; call it before allocating anything sized by the config."""
        c, hidden = self, self.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        prefix = "model.layers.0"
        attn = f"{prefix}.self_attn"
        q = f"num_attention_heads={c.num_heads} head_dim={c.head_dim} hidden_size={hidden}"
        kv = f"num_key_value_heads={c.num_kv_heads} head_dim={c.head_dim} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.q_proj.weight", (c.num_heads * c.head_dim, hidden), because=q)
        checkpoint.expect_shape(f"{attn}.k_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.v_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, c.num_heads * c.head_dim), because=q)
        if c.qk_norm:
            checkpoint.expect_shape(f"{attn}.q_norm.weight", (c.head_dim,), because=f"head_dim={c.head_dim}")
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            checkpoint.expect_shape(f"{prefix}.{norm}.weight", (hidden,), because=f"hidden_size={hidden}")
        expect_mlp_shapes(checkpoint, f"{prefix}.mlp", hidden, c.intermediate_size,
                          because=f"intermediate_size={c.intermediate_size} hidden_size={hidden}")


def _rope_by_layer_type(config: Mapping[str, Any], fields: ConfigFields, model_type: str, head_dim: int,
                        source: str) -> dict[str, RopeParameters]:
    """One :class:`~metrale.loading.rope.RopeParameters` per layer type. Gemma-2: one RoPE for
    all. Gemma-3: ``rope_parameters`` keyed by layer type as transformers 5.x writes it, or the
    older fields (``rope_theta`` and ``rope_scaling`` for the full layers, ``rope_local_base_freq``
    unscaled for the sliding ones)."""
    if model_type == "gemma2":
        shared = rope_parameters(config, head_dim, source=source)
        return {kind: shared for kind in LAYER_TYPES}
    section = fields.section("rope_parameters")
    nested = section is not None and any(section.has(kind) for kind in LAYER_TYPES)
    result = {}
    for kind in LAYER_TYPES:
        if nested:
            assert section is not None
            per_kind = section.section(kind)
            values = dict(per_kind.values) if per_kind is not None else {}
        elif kind == "full_attention":
            values = dict(section.values) if section is not None else {}
            legacy = fields.section("rope_scaling")
            if legacy is not None:
                values = {**legacy.values, **values}
            theta = fields.number("rope_theta", None, positive=True)
            if theta is not None:
                values.setdefault("rope_theta", theta)
        else:
            values = {"rope_type": "default"}
            local = fields.number("rope_local_base_freq", None, positive=True)
            if local is not None:
                values["rope_theta"] = local
        values.setdefault("rope_theta", _GEMMA3_THETA[kind])
        view = {key: value for key, value in config.items() if key not in ("rope_scaling", "rope_theta")}
        view["rope_parameters"] = values
        try:
            result[kind] = rope_parameters(view, head_dim, source=source)
        except CheckpointError as error:
            raise CheckpointError(f"{error} (the RoPE of the {kind} layers)") from error
    return result
