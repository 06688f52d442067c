"""The dense family's layers, which are the public building blocks of :mod:`metrale.layers`
(kept importable from here for plugins written against this module)."""

from metrale.layers.attention import (
    AttentionGeometry,
    AttentionWeights,
    attention_block,
    load_attention_weights,
)
from metrale.layers.mlp import MlpWeights, expect_mlp_shapes, load_mlp_weights, swiglu_mlp

__all__ = [
    "AttentionGeometry",
    "AttentionWeights",
    "MlpWeights",
    "attention_block",
    "expect_mlp_shapes",
    "load_attention_weights",
    "load_mlp_weights",
    "swiglu_mlp",
]
