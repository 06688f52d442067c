"""The GPT-OSS family's view of ``config.json`` (:ref:`families-gpt-oss-config`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.loading.rope import RopeParameters, rope_parameters

MODEL_TYPE = "gpt_oss"
LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers' GptOssConfig defaults for the fields a config.json may omit.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
}
#: The RoPE theta of a config that names none (transformers' ``GptOssConfig.default_theta``).
DEFAULT_ROPE_THETA = 150000.0
#: The RoPE of a config with neither ``rope_parameters`` nor ``rope_scaling`` (transformers' default).
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssConfig:
    """Geometry and options of a GPT-OSS checkpoint, transformers' defaults applied.

    ``layer_types`` says per layer whether it slides (over the last ``sliding_window`` positions)
    or attends fully; every layer's feed-forward is the routed experts: ``num_experts`` experts
    of ``intermediate_size``, ``top_k`` per token, their SwiGLU clamped at ``swiglu_limit`` with
    the sigmoid gain ``swiglu_alpha``. Nothing here is sized by ``num_layers`` until
    :meth:`check_tensors` has compared it with the checkpoint: ``layer_types`` is computed on
    first use.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    #: The file's ``layer_types``, or None: sliding and full layers alternate, the first sliding.
    given_layer_types: tuple[str, ...] | None
    swiglu_alpha: float
    swiglu_limit: float
    rope: RopeParameters
    #: The field ``num_experts`` was read from (``num_local_experts``, or its alias ``num_experts``).
    experts_field: str = "num_local_experts"

    @cached_property
    def layer_types(self) -> tuple[str, ...]:
        """``sliding_attention`` or ``full_attention`` per layer."""
        if self.given_layer_types is not None:
            return self.given_layer_types
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window per layer (None = full attention)."""
        return tuple(self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "GptOssConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked.
        ``hidden_act`` is read (a string) but not used: the experts' activation is the clamped
        SwiGLU whatever it says, as in transformers."""
        fields = ConfigFields(config, source)
        model_type = fields.text("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise fields.error(f"model_type {model_type!r} is not {MODEL_TYPE!r}")
        d = _DEFAULTS
        hidden = fields.size("hidden_size", d["hidden_size"], null=REFUSED)
        heads = fields.size("num_attention_heads", d["num_attention_heads"], null=REFUSED)
        kv_heads = fields.size("num_key_value_heads", d["num_key_value_heads"], null=heads)
        head_dim = fields.size("head_dim", d["head_dim"], null=hidden // heads)
        if head_dim < 1:
            raise fields.error(f"head_dim is null and hidden_size={hidden} // num_attention_heads={heads} is 0")
        if heads % kv_heads:
            raise fields.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        layers = fields.size("num_hidden_layers", d["num_hidden_layers"], null=REFUSED)
        experts_field = "num_experts" if not fields.present("num_local_experts") and fields.present("num_experts") \
            else "num_local_experts"
        experts = fields.size(experts_field, d["num_local_experts"], null=REFUSED)
        top_k = fields.size("num_experts_per_tok", d["num_experts_per_tok"], null=REFUSED)
        if top_k > experts:
            raise fields.error(f"num_experts_per_tok={top_k} is more than the {experts_field}={experts} experts")
        fields.text("hidden_act", "silu")
        window = fields.size("sliding_window", d["sliding_window"], null=None)
        kinds = fields.texts("layer_types", None, choices=LAYER_TYPES)
        if kinds is not None and len(kinds) != layers:
            raise fields.error(f"layer_types has {len(kinds)} entries for num_hidden_layers={layers}")
        slides = "sliding_attention" in kinds if kinds is not None else layers > 0
        if window is None and slides:
            raise fields.error("sliding_window is null but layer_types has sliding_attention layers")
        return cls(
            vocab_size=fields.size("vocab_size", d["vocab_size"], null=REFUSED),
            hidden_size=hidden,
            intermediate_size=fields.size("intermediate_size", d["intermediate_size"], null=REFUSED),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            num_experts=experts,
            top_k=top_k,
            rms_norm_eps=fields.number("rms_norm_eps", d["rms_norm_eps"], positive=True, null=REFUSED),
            attention_bias=fields.flag("attention_bias", True, null=REFUSED),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False, null=REFUSED),
            max_position_embeddings=fields.size("max_position_embeddings", d["max_position_embeddings"], null=REFUSED),
            sliding_window=window,
            given_layer_types=tuple(kinds) if kinds is not None else None,
            swiglu_alpha=fields.number("swiglu_alpha", d["swiglu_alpha"], positive=True, null=REFUSED),
            swiglu_limit=fields.number("swiglu_limit", d["swiglu_limit"], positive=True, null=REFUSED),
            rope=_rope(config, fields, head_dim, source),
            experts_field=experts_field,
        )

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layer count and
        the shapes of the embeddings, the first layer's attention (its sinks included), router
        and experts are the ones this config implies (the experts as stored: ``[E, in, out]`` at
        full precision, ``[E, out, in]`` MXFP4). Reads headers only; call it before allocating
        anything sized by the config."""
        c, hidden = self, self.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
        q = f"num_attention_heads={c.num_heads} head_dim={c.head_dim} hidden_size={hidden}"
        kv = f"num_key_value_heads={c.num_kv_heads} head_dim={c.head_dim} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.q_proj.weight", (c.num_heads * c.head_dim, hidden), because=q)
        checkpoint.expect_shape(f"{attn}.k_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.v_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, c.num_heads * c.head_dim), because=q)
        checkpoint.expect_shape(f"{attn}.sinks", (c.num_heads,), because=f"num_attention_heads={c.num_heads}")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            checkpoint.expect_shape(f"model.layers.0.{norm}.weight", (hidden,), because=f"hidden_size={hidden}")
        experts = f"{c.experts_field}={c.num_experts}"
        width = f"intermediate_size={c.intermediate_size}"
        checkpoint.expect_shape(f"{mlp}.router.weight", (c.num_experts, hidden),
                                because=f"{experts} hidden_size={hidden}")
        checkpoint.expect_shape(f"{mlp}.router.bias", (c.num_experts,), because=experts)
        gate_up, down = f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj"
        both = f"{experts} {width} hidden_size={hidden}"
        if checkpoint.is_quantized(gate_up):
            checkpoint.expect_shape(gate_up, (c.num_experts, 2 * c.intermediate_size, hidden), because=both)
        else:
            checkpoint.expect_shape(gate_up, (c.num_experts, hidden, 2 * c.intermediate_size), because=both)
        if checkpoint.is_quantized(down):
            checkpoint.expect_shape(down, (c.num_experts, hidden, c.intermediate_size), because=both)
        else:
            checkpoint.expect_shape(down, (c.num_experts, c.intermediate_size, hidden), because=both)
        checkpoint.expect_shape(f"{gate_up}_bias", (c.num_experts, 2 * c.intermediate_size),
                                because=f"{experts} {width}")
        checkpoint.expect_shape(f"{down}_bias", (c.num_experts, hidden), because=f"{experts} hidden_size={hidden}")


def _rope(config: Mapping[str, Any], fields: ConfigFields, head_dim: int, source: str) -> RopeParameters:
    """The checkpoint's RoPE (:func:`~metrale.loading.rope.rope_parameters`) with GPT-OSS's
    defaults: :data:`DEFAULT_ROPE` when the file has neither ``rope_parameters`` nor
    ``rope_scaling``, a theta of :data:`DEFAULT_ROPE_THETA` when it names none."""
    view = dict(config)
    sections = [fields.section(name) for name in ("rope_parameters", "rope_scaling")]
    if not any(section is not None and section.values for section in sections):
        view["rope_parameters"] = dict(DEFAULT_ROPE)
    named = any(section is not None and section.has("rope_theta") for section in sections)
    if not (named or fields.has("rope_theta") or fields.has("rotary_emb_base")):
        view["rope_theta"] = DEFAULT_ROPE_THETA
    return rope_parameters(view, head_dim, source=source)
