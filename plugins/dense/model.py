"""The dense decoder (:ref:`families-dense`): pre-norm GQA attention + SwiGLU layers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec
from metrale.layers.attention import (
    AttentionGeometry,
    AttentionWeights,
    load_attention_weights,
    normed_attention_block,
    sharded_geometry,
)
from metrale.layers.loading import DecoderEnds
from metrale.layers.lora import attention_lora, ends_lora, mlp_lora
from metrale.layers.lora_stacks import LoraLayout
from metrale.layers.mlp import MlpWeights, load_mlp_weights, normed_swiglu_mlp
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.dense.config import DenseConfig

# Buffers older exports saved beside the weights; they are recomputed, never read.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class DenseLayer:
    """One decoder layer: ``h = x + attention(norm(x))``, ``out = h + mlp(norm(h))``."""

    input_norm: Any
    attention: AttentionWeights
    post_norm: Any
    mlp: MlpWeights
    geometry: AttentionGeometry

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: DenseConfig,
             geometry: AttentionGeometry) -> "DenseLayer":
        c, vector = config, (config.hidden_size,)
        return cls(
            input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
            attention=load_attention_weights(checkpoint, backend, f"{prefix}.self_attn", geometry,
                                             qkv_bias=c.qkv_bias, o_bias=c.o_bias, qk_norm=c.qk_norm),
            post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            mlp=load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size, bias=c.mlp_bias),
            geometry=sharded_geometry(geometry, backend.shard),
        )

    def forward(self, backend: Any, x: Any, residual: Any, cache_layer: Any, batch: ForwardBatch,
                eps: float) -> tuple[Any, Any]:
        """``(mlp output, residual)`` of this layer; the residual add is fused into the next norm."""
        x, residual = normed_attention_block(backend, self.geometry, self.attention, cache_layer, x, residual,
                                             self.input_norm, eps, batch)
        return normed_swiglu_mlp(backend, self.mlp, x, residual, self.post_norm, eps, batch=batch)


class DenseModel(FamilyModel):
    """A loaded Llama / Mistral / Qwen2 / Qwen3 model."""

    # Every layer reads the batch through its device row metadata and row_starts only.
    mixed_graph_capturable = True
    # Heads, the intermediate size and the vocabulary split over the ranks (metrale.backends.parallel).
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: DenseConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        base = AttentionGeometry(
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            inv_freq=backend.constant(c.rope.inverse_frequencies()),
            attention_factor=c.rope.attention_factor(),
            norm_eps=c.rms_norm_eps,
        )
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        self.layers = [
            DenseLayer.load(checkpoint, backend, f"model.layers.{index}", c,
                            replace(base, sliding_window=c.layer_windows[index]))
            for index in range(c.num_layers)
        ]
        # A rank of a tensor-parallel group caches its key/value heads only.
        self.kv_heads = self.layers[0].geometry.num_kv_heads if self.layers else c.num_kv_heads
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    def cache_spec(self) -> CacheSpec:
        c = self.config
        return CacheSpec(tuple(
            PagedKVSpec(self.kv_heads, c.head_dim, sliding_window=w, k_scale=layer.attention.k_scale,
                        v_scale=layer.attention.v_scale)
            for w, layer in zip(c.layer_windows, self.layers)
        ))

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoraLayout:
        c, limits = self.config, {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
        stacks = [
            (index, stack)
            for index, layer in enumerate(self.layers)
            for stack in (attention_lora(self.backend, layer.attention, layer.geometry, limits)
                          + mlp_lora(self.backend, layer.mlp, c.hidden_size, c.intermediate_size, limits))
        ]
        return LoraLayout(stacks, ends_lora(self.backend, self.ends, c.hidden_size, max_loras))

    def forward_batch(self, batch: ForwardBatch) -> Any:
        eps = self.config.rms_norm_eps
        x, residual = self.ends.embed_tokens(self.backend, batch), None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            x, residual = layer.forward(self.backend, x, residual, cache_layer, batch, eps)
        return self.ends.logits(self.backend, x, residual, batch, eps)
