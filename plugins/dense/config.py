"""The dense family's view of ``config.json`` (docs/families.rst, "Dense config fields")."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.config_fields import AS_ABSENT, REFUSED, ConfigFields
from metrale.loading.rope import RopeParameters, rope_parameters
from metrale.plugins.dense.layers import expect_mlp_shapes

# transformers' config-class defaults for fields a config.json may omit.
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}

# An explicit null, as transformers' config classes take it: where a class types the field as
# optional, its rule for None (num_key_value_heads -> num_attention_heads, head_dim ->
# hidden_size // num_attention_heads); where it does not, the class refuses the file. Fields a
# model type's class does not declare are not read for that type.
_NULL_KV_HEADS_REFUSED = ("mistral",)
_NULL_HEAD_DIM_REFUSED = ("qwen3", "qwen2")  # Qwen2's attention would take the None as the size
_BIAS_FIELDS = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}

REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DenseConfig:
    """Geometry and options of a dense checkpoint, with per-model-type defaults applied.

    Nothing here is sized by ``num_layers`` until :meth:`check_tensors` has compared it with the
    checkpoint: ``layer_windows`` is computed on first use.
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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeParameters
    #: Sliding window of the windowed layers (None: every layer attends fully), and which layers
    #: are windowed: ``window_layer_types`` when given, else those from ``max_window_layers`` on.
    sliding_window: int | None = None
    window_layer_types: tuple[str, ...] | None = None
    max_window_layers: int = 0

    @cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window per layer (None = full attention)."""
        window, layers = self.sliding_window, self.num_layers
        if window is None:
            return (None,) * layers
        if self.window_layer_types is not None:
            return tuple(window if kind == "sliding_attention" else None for kind in self.window_layer_types)
        return tuple(window if i >= self.max_window_layers else None for i in range(layers))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "DenseConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        fields = ConfigFields(config, source)
        model_type = fields.text("model_type", "llama")
        missing = [name for name in REQUIRED_FIELDS if not fields.has(name)]
        if missing:
            raise CheckpointError(f"{source} lacks {', '.join(missing)}")
        hidden = fields.size("hidden_size")
        heads = fields.size("num_attention_heads")
        kv_heads = fields.size("num_key_value_heads", _DEFAULT_KV_HEADS.get(model_type, heads),
                               null=REFUSED if model_type in _NULL_KV_HEADS_REFUSED else heads)
        head_dim = fields.size("head_dim", _DEFAULT_HEAD_DIM.get(model_type, hidden // heads),
                               null=REFUSED if model_type in _NULL_HEAD_DIM_REFUSED else hidden // heads)
        if head_dim < 1:
            raise fields.error(f"head_dim is not given and hidden_size={hidden} // num_attention_heads={heads} is 0")
        if heads % kv_heads:
            raise fields.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        layers = fields.size("num_hidden_layers")
        biases = _BIAS_FIELDS.get(model_type, ())
        attention_bias = fields.flag("attention_bias", False, null=REFUSED if "attention_bias" in biases else AS_ABSENT)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "mistral":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias
        mlp_bias = fields.flag("mlp_bias", False, null=REFUSED if "mlp_bias" in biases else AS_ABSENT)
        return cls(
            model_type=model_type,
            vocab_size=fields.size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.size("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True, null=REFUSED),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=fields.flag("tie_word_embeddings", False, null=REFUSED),
            max_position_embeddings=fields.size(
                "max_position_embeddings", _DEFAULT_MAX_POSITIONS.get(model_type, 2048), null=REFUSED
            ),
            rope=rope_parameters(config, head_dim, source=source),
            **_window_fields(fields, model_type, layers),
        )

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layer count and
        the shapes of the embedding, the first layer and the LM head are the ones this config
        implies. Reads headers only; call it before allocating anything sized by the config."""
        c, hidden = self, self.hidden_size
        checkpoint.expect_count(c.num_layers, "model.layers.", because=f"num_hidden_layers={c.num_layers}")
        checkpoint.expect_embeddings(c.vocab_size, hidden, c.tie_word_embeddings)
        attn = "model.layers.0.self_attn"
        q = f"num_attention_heads={c.num_heads} head_dim={c.head_dim} hidden_size={hidden}"
        kv = f"num_key_value_heads={c.num_kv_heads} head_dim={c.head_dim} hidden_size={hidden}"
        checkpoint.expect_shape(f"{attn}.q_proj.weight", (c.num_heads * c.head_dim, hidden), because=q)
        checkpoint.expect_shape(f"{attn}.k_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.v_proj.weight", (c.num_kv_heads * c.head_dim, hidden), because=kv)
        checkpoint.expect_shape(f"{attn}.o_proj.weight", (hidden, c.num_heads * c.head_dim), because=q)
        expect_mlp_shapes(checkpoint, "model.layers.0.mlp", hidden, c.intermediate_size,
                          because=f"intermediate_size={c.intermediate_size} hidden_size={hidden}")


def _window_fields(fields: ConfigFields, model_type: str, layers: int) -> dict[str, Any]:
    """The sliding-window fields of :class:`DenseConfig` (Mistral: every layer; Qwen2/3: the
    layers ``layer_types`` or ``max_window_layers`` choose, when ``use_sliding_window``)."""
    window = fields.integer("sliding_window", None) or None  # null: no window (transformers' rule)
    qwen = model_type in ("qwen2", "qwen3")
    use_sliding_window = fields.flag("use_sliding_window", False, null=REFUSED if qwen else AS_ABSENT)
    layer_types = fields.texts("layer_types", None, choices=LAYER_TYPES)  # null: derived, as when missing
    max_window_layers = fields.integer("max_window_layers", 28, null=REFUSED if qwen else AS_ABSENT)
    if model_type == "mistral":
        return {"sliding_window": window}
    if model_type not in ("qwen2", "qwen3") or window is None or not use_sliding_window:
        return {}
    if layer_types is not None:
        if len(layer_types) != layers:
            raise fields.error(f"layer_types has {len(layer_types)} entries for num_hidden_layers={layers}")
        return {"sliding_window": window, "window_layer_types": tuple(layer_types)}
    return {"sliding_window": window, "max_window_layers": max_window_layers}
