"""The parallel-residual decoder, built from Metrale's public layers.

One layer: ``h = rms(x; w_ln, eps)``, then ``x = x + attention(h) + mlp(h)``. The checkpoint uses
Llama's tensor names, with a single ``layers.{i}.layernorm.weight`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec
from metrale.checkpoint import Checkpoint
from metrale.errors import CheckpointError
from metrale.family import FamilyModel
from metrale.plugins.dense.layers import (
    AttentionGeometry,
    AttentionWeights,
    MlpWeights,
    attention_block,
    load_attention_weights,
    load_mlp_weights,
    swiglu_mlp,
)
from metrale.rope import rope_parameters


@dataclass
class ParallelLayer:
    norm: Any
    attention: AttentionWeights
    mlp: MlpWeights


class ParallelBlockModel(FamilyModel):
    """A loaded parallel-residual model."""

    def __init__(self, checkpoint: Checkpoint, backend: Any, max_model_len: int | None) -> None:
        config = checkpoint.config
        try:
            vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
            heads, layers = int(config["num_attention_heads"]), int(config["num_hidden_layers"])
            intermediate = int(config["intermediate_size"])
        except KeyError as missing:
            raise CheckpointError(f"config.json lacks {missing}") from None
        positions = int(config.get("max_position_embeddings", 2048))
        super().__init__(backend, vocab_size=vocab, max_model_len=min(max_model_len or positions, positions))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        rope = rope_parameters(config, head_dim)
        self.geometry = AttentionGeometry(
            hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            inv_freq=backend.constant(rope.inverse_frequencies()), attention_factor=rope.attention_factor(),
            norm_eps=self.eps,
        )
        self.embed = backend.load_weight(checkpoint, ("model.embed_tokens.weight", (vocab, hidden)))
        self.layers = [
            ParallelLayer(
                norm=backend.load_weight(checkpoint, (f"model.layers.{i}.layernorm.weight", (hidden,))),
                attention=load_attention_weights(checkpoint, backend, f"model.layers.{i}.self_attn", self.geometry),
                mlp=load_mlp_weights(checkpoint, backend, f"model.layers.{i}.mlp", hidden, intermediate),
            )
            for i in range(layers)
        ]
        self.norm = backend.load_weight(checkpoint, ("model.norm.weight", (hidden,)))
        self.lm_head = backend.load_weight(checkpoint, ("lm_head.weight", (vocab, hidden)))

    def cache_spec(self) -> CacheSpec:
        g = self.geometry
        return CacheSpec(tuple(PagedKVSpec(g.num_kv_heads, g.head_dim) for _ in self.layers))

    def forward_batch(self, batch: ForwardBatch) -> Any:
        ops = self.backend.ops
        x = ops.embedding(self.embed, batch.token_ids)
        for layer, cache_layer in zip(self.layers, self.cache.layers):
            h = ops.rmsnorm(x, layer.norm, self.eps)
            attended = attention_block(self.backend, self.geometry, layer.attention, cache_layer, h, batch)
            x = x + attended + swiglu_mlp(self.backend, layer.mlp, h)
        h = ops.rmsnorm(x[batch.logits_rows], self.norm, self.eps)
        return ops.linear(h, self.lm_head)
