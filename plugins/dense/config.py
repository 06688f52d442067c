"""The dense family's view of ``config.json`` (docs/families.rst, "Dense config fields")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from metrale.errors import CheckpointError
from metrale.rope import RopeParameters, rope_parameters

# transformers' config-class defaults for fields a config.json may omit.
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}

REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class DenseConfig:
    """Geometry and options of a dense checkpoint, with per-model-type defaults applied."""

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
    layer_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeParameters

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "DenseConfig":
        model_type = config.get("model_type", "llama")
        missing = [name for name in REQUIRED_FIELDS if config.get(name) is None]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = config.get("num_key_value_heads") or _DEFAULT_KV_HEADS.get(model_type, heads)
        head_dim = config.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type) or hidden // heads
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        layers = int(config["num_hidden_layers"])
        attention_bias = bool(config.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "mistral":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            layer_windows=_layer_windows(config, model_type, layers),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(
                config.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS.get(model_type, 2048)
            ),
            rope=rope_parameters(config, int(head_dim)),
        )


def _layer_windows(config: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    """Sliding window per layer (None = full attention)."""
    window = config.get("sliding_window")
    if model_type == "mistral":
        return (int(window) if window else None,) * layers
    if model_type not in ("qwen2", "qwen3") or not window or not config.get("use_sliding_window", False):
        return (None,) * layers
    layer_types = config.get("layer_types")
    if layer_types:
        if len(layer_types) != layers:
            raise CheckpointError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    first = int(config.get("max_window_layers", 28))
    return tuple(int(window) if i >= first else None for i in range(layers))
