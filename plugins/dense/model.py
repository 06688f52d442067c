"""The dense decoder (docs/families.rst, "Dense layer forward"): pre-norm attention + SwiGLU layers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec
from metrale.checkpoint import Checkpoint
from metrale.family import FamilyModel
from metrale.plugins.dense.config import DenseConfig
from metrale.plugins.dense.layers import (
    AttentionGeometry,
    AttentionWeights,
    MlpWeights,
    attention_block,
    load_attention_weights,
    load_mlp_weights,
    swiglu_mlp,
)

# Buffers older exports saved beside the weights; they are recomputed, never read.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class DenseLayer:
    input_norm: Any
    attention: AttentionWeights
    post_norm: Any
    mlp: MlpWeights
    geometry: AttentionGeometry


class DenseModel(FamilyModel):
    """A loaded Llama / Mistral / Qwen2 / Qwen3 model."""

    def __init__(self, config: DenseConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = config
        c = config
        base = AttentionGeometry(
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            inv_freq=backend.constant(c.rope.inverse_frequencies()),
            attention_factor=c.rope.attention_factor(),
            norm_eps=c.rms_norm_eps,
        )
        vector = (c.hidden_size,)
        self.embed = backend.load_weight(checkpoint, ("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
        self.layers = []
        for index in range(c.num_layers):
            prefix = f"model.layers.{index}"
            geometry = replace(base, sliding_window=c.layer_windows[index])
            self.layers.append(
                DenseLayer(
                    input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
                    attention=load_attention_weights(
                        checkpoint, backend, f"{prefix}.self_attn", geometry,
                        qkv_bias=c.qkv_bias, o_bias=c.o_bias, qk_norm=c.qk_norm,
                    ),
                    post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
                    mlp=load_mlp_weights(
                        checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size, bias=c.mlp_bias
                    ),
                    geometry=geometry,
                )
            )
        self.norm = backend.load_weight(checkpoint, ("model.norm.weight", vector))
        if c.tie_word_embeddings and not checkpoint.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = backend.load_weight(checkpoint, ("lm_head.weight", (c.vocab_size, c.hidden_size)))
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    def cache_spec(self) -> CacheSpec:
        c = self.config
        return CacheSpec(
            tuple(PagedKVSpec(c.num_kv_heads, c.head_dim, sliding_window=w) for w in c.layer_windows)
        )

    def forward_batch(self, batch: ForwardBatch) -> Any:
        ops, eps = self.backend.ops, self.config.rms_norm_eps
        x = ops.embedding(self.embed, batch.token_ids)
        residual = None
        for layer, cache_layer in zip(self.layers, self.cache.layers):
            h, residual = ops.rmsnorm_residual(x, residual, layer.input_norm, eps)
            x = attention_block(self.backend, layer.geometry, layer.attention, cache_layer, h, batch)
            h, residual = ops.rmsnorm_residual(x, residual, layer.post_norm, eps)
            x = swiglu_mlp(self.backend, layer.mlp, h)
        rows = batch.logits_rows
        h, _ = ops.rmsnorm_residual(x[rows], residual[rows], self.norm, eps)
        return ops.linear(h, self.lm_head)
