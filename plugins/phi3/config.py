"""The Phi-3 family's view of ``config.json`` (:ref:`families-phi3-config`): the fields the dense
family shares, read by :class:`~metrale.plugins.dense.config.DenseConfig` with Phi-3's defaults,
and Phi-3's own -- the RoPE section as transformers' ``Phi3Config`` reads it (``longrope``, its
legacy names ``su`` and ``yarn``), a sliding window on every layer, no biases."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import REFUSED, ConfigFields
from metrale.loading.rope import LONGROPE, RopeParameters, rope_parameters
from metrale.plugins.dense.config import DenseConfig

#: transformers' ``Phi3Config`` defaults of the fields whose dense defaults differ.
DEFAULT_MAX_POSITIONS = 4096
DEFAULT_ORIGINAL_MAX_POSITIONS = 4096
DEFAULT_RMS_NORM_EPS = 1e-5
#: The RoPE types ``Phi3Config`` accepts, after it renames its legacy ``su`` and ``yarn`` to ``longrope``.
ROPE_TYPES = ("default", LONGROPE)
LEGACY_LONGROPE_NAMES = ("su", "yarn")
#: The only activation of the fused gate/up MLP the family serves (every Phi-3 and Phi-4 checkpoint's).
ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class Phi3Config:
    """A Phi-3 / Phi-4 checkpoint's geometry and options.

    ``decoder`` holds the sizes, norm epsilon, tying, RoPE (:class:`RopeParameters`, possibly
    ``longrope``) and sliding window as the dense family holds them (every layer slides when the
    window is not None; there are no biases and no QK-norm); ``original_max_position_embeddings``
    is the pretraining context that chooses LongRoPE's factors."""

    decoder: DenseConfig
    original_max_position_embeddings: int

    @property
    def max_position_embeddings(self) -> int:
        return self.decoder.max_position_embeddings

    @property
    def rope(self) -> RopeParameters:
        return self.decoder.rope

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused ``qkv_proj``: ``(n_h + 2 n_kv) d``."""
        d = self.decoder
        return (d.num_heads + 2 * d.num_kv_heads) * d.head_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "Phi3Config":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        fields = ConfigFields(config, source)
        model_type = fields.text("model_type", "phi3")
        if model_type != "phi3":
            raise fields.error(f"model_type {model_type!r} is not 'phi3'")
        fields.text("hidden_act", "silu", choices=ACTIVATIONS, null=REFUSED)
        # Phi3Attention reads head_dim as it is: a null would be its size.
        fields.size("head_dim", None, null=REFUSED)
        original = fields.size("original_max_position_embeddings", DEFAULT_ORIGINAL_MAX_POSITIONS, null=REFUSED)
        window = fields.size("sliding_window", None, null=None)
        defaults = {"max_position_embeddings": DEFAULT_MAX_POSITIONS, "rms_norm_eps": DEFAULT_RMS_NORM_EPS}
        shared = {**config, **{name: value for name, value in defaults.items() if name not in config}}
        # The RoPE fields are read below, as Phi3Config reads them; the dense reader sees none.
        decoder = DenseConfig.from_dict({**shared, "rope_parameters": None, "rope_scaling": None}, source)
        rope = rope_parameters(_rope_view(fields, shared, original), decoder.head_dim, source=source, longrope=True)
        if rope.rope_type not in ROPE_TYPES:
            raise fields.error(f"RoPE type {rope.rope_type!r} is not one Phi-3 serves (supported: "
                               f"{', '.join(ROPE_TYPES)}, and the legacy names {', '.join(LEGACY_LONGROPE_NAMES)} of "
                               f"{LONGROPE})")
        decoder = replace(decoder, rope=rope, sliding_window=window, window_layer_types=None, max_window_layers=0,
                          qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
        return cls(decoder=decoder, original_max_position_embeddings=original)

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the layer count, the embeddings and
        the first layer's fused ``qkv_proj`` and ``gate_up_proj``, ``o_proj`` and ``down_proj``
        have the shapes this config implies. Reads headers only; call it before allocating
        anything sized by the config."""
        c, hidden = self.decoder, self.decoder.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
        heads = f"num_attention_heads={c.num_heads} head_dim={c.head_dim} hidden_size={hidden}"
        qkv = f"num_attention_heads={c.num_heads} num_key_value_heads={c.num_kv_heads} head_dim={c.head_dim} " \
              f"hidden_size={hidden}"
        width = f"intermediate_size={c.intermediate_size} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.qkv_proj.weight", (self.qkv_rows, hidden), because=qkv)
        checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, c.num_heads * c.head_dim), because=heads)
        checkpoint.expect_shape(f"{mlp}.gate_up_proj.weight", (2 * c.intermediate_size, hidden), because=width)
        checkpoint.expect_shape(f"{mlp}.down_proj.weight", (hidden, c.intermediate_size), because=width)


def _rope_view(fields: ConfigFields, config: Mapping[str, Any], original: int) -> dict[str, Any]:
    """``config`` with its RoPE fields as ``Phi3Config`` reads them, for
    :func:`~metrale.loading.rope.rope_parameters`: a non-empty ``rope_scaling`` wins over
    ``rope_parameters`` (both are checked to be objects), the legacy types ``su`` and ``yarn`` are
    ``longrope``, and the top-level ``original_max_position_embeddings`` (4096 when missing) is
    always there, so it wins over the section's."""
    fields.section("rope_parameters")
    legacy = fields.section("rope_scaling")
    view = {**config, "original_max_position_embeddings": original}
    if legacy is not None and legacy.values:
        view["rope_parameters"] = None  # rope_parameters() then reads rope_scaling, naming it in errors
    chosen = "rope_parameters" if view.get("rope_parameters") else "rope_scaling"
    section = view.get(chosen)
    if isinstance(section, Mapping):
        kind = section.get("rope_type", section.get("type"))
        if kind in LEGACY_LONGROPE_NAMES:
            view[chosen] = {**section, "rope_type": LONGROPE}
    return view
