"""The Gemma decoder (:ref:`families-gemma`): sandwich-normed GQA attention with soft-capped or
QK-normed logits, alternating sliding-window and global layers, a GeGLU MLP, scaled embeddings
and a soft-capped LM head."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

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
from metrale.layers.lora import attention_lora, mlp_lora
from metrale.layers.lora_stacks import LoraLayout
from metrale.layers.mlp import MlpWeights, geglu_mlp, load_mlp_weights
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.dense.model import IGNORED_TENSOR_SUFFIXES
from metrale.plugins.gemma.config import GemmaConfig

#: Gemma's RMSNorm scales by ``1 + w`` (its weights are stored centred on zero).
NORM_OFFSET = 1.0


def embedding_scale(hidden_size: int, stored_dtype: str) -> float:
    """``sqrt(hidden_size)`` rounded to ``stored_dtype`` (a safetensors dtype name: ``BF16``, ``F16``,
    ``F32``): the factor Gemma multiplies its embedding rows by."""
    scale = np.float32(hidden_size**0.5)
    if stored_dtype == "BF16":
        bits = int(scale.view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return float(np.uint32(bits).view(np.float32))
    if stored_dtype == "F16":
        return float(np.float16(scale))
    return float(scale)


@dataclass
class GemmaLayer:
    """One decoder layer:
    ``h = x + post_attn_norm(attention(input_norm(x)))``,
    ``out = h + post_ffn_norm(mlp(pre_ffn_norm(h)))``, every norm ``rms(.) * (1 + w)``."""

    input_norm: Any
    attention: AttentionWeights
    post_attention_norm: Any
    pre_feedforward_norm: Any
    post_feedforward_norm: Any
    mlp: MlpWeights
    geometry: AttentionGeometry

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: GemmaConfig,
             geometry: AttentionGeometry) -> "GemmaLayer":
        c, vector = config, (config.hidden_size,)

        def norm(name: str) -> Any:
            return backend.load_weight(checkpoint, (f"{prefix}.{name}.weight", vector))

        return cls(
            input_norm=norm("input_layernorm"),
            attention=load_attention_weights(checkpoint, backend, f"{prefix}.self_attn", geometry,
                                             qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=c.qk_norm),
            post_attention_norm=norm("post_attention_layernorm"),
            pre_feedforward_norm=norm("pre_feedforward_layernorm"),
            post_feedforward_norm=norm("post_feedforward_layernorm"),
            mlp=load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size),
            geometry=sharded_geometry(geometry, backend.shard),
        )

    def forward(self, backend: Any, x: Any, residual: Any, cache_layer: Any, batch: ForwardBatch, eps: float,
                activation: str) -> tuple[Any, Any]:
        """``(normed MLP output, residual)`` of this layer: the stream is their sum, added in the
        next layer's first norm."""
        ops = backend.ops
        attended, stream = normed_attention_block(backend, self.geometry, self.attention, cache_layer, x, residual,
                                                  self.input_norm, eps, batch, norm_offset=NORM_OFFSET)
        attended = ops.to_float32(ops.rmsnorm(attended, self.post_attention_norm, eps, NORM_OFFSET))
        h, stream = ops.rmsnorm_residual(attended, stream, self.pre_feedforward_norm, eps, NORM_OFFSET)
        out = geglu_mlp(backend, self.mlp, h, activation, batch)
        return ops.to_float32(ops.rmsnorm(out, self.post_feedforward_norm, eps, NORM_OFFSET)), stream


class GemmaModel(FamilyModel):
    """A loaded Gemma-2 or Gemma-3 (text) model."""

    # Every layer reads the batch through its device row metadata and row_starts only.
    mixed_graph_capturable = True
    # Heads, the intermediate size and the vocabulary split over the ranks (metrale.backends.parallel).
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: GemmaConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE tables, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        geometries = {
            kind: AttentionGeometry(
                hidden_size=c.hidden_size,
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                inv_freq=backend.constant(rope.inverse_frequencies()),
                attention_factor=rope.attention_factor(),
                norm_eps=c.rms_norm_eps,
                rotary_dim=rope.rotary_dim if rope.rotary_dim != c.head_dim else None,
                softcap=c.attn_logit_softcapping,
                query_scale=c.query_pre_attn_scalar**-0.5,
                norm_offset=NORM_OFFSET if c.qk_norm else 0.0,
            )
            for kind, rope in c.rope.items()
        }
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        #: The embedding rows' factor, ``sqrt(hidden_size)`` in the embedding's stored dtype.
        self.embedding_scale = embedding_scale(c.hidden_size, checkpoint.info("model.embed_tokens.weight").dtype)
        self.layers = [
            GemmaLayer.load(checkpoint, backend, f"model.layers.{index}", c,
                            replace(geometries[kind], sliding_window=window))
            for index, (kind, window) in enumerate(zip(c.layer_types, c.layer_windows))
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
        scaled = "the embedding is scaled by sqrt(hidden_size) after its rows are read"
        refused = {"embed_tokens": f"adapters replacing embedding rows are not served for Gemma ({scaled})",
                   "lm_head": "adapters replacing LM-head rows are not served for Gemma (its head is the embedding)"}
        return LoraLayout(stacks, {}, refused)

    def forward_batch(self, batch: ForwardBatch) -> Any:
        c, backend = self.config, self.backend
        eps = c.rms_norm_eps
        x, residual = self.ends.embed_tokens(backend, batch) * self.embedding_scale, None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            x, residual = layer.forward(backend, x, residual, cache_layer, batch, eps, c.activation)
        logits = self.ends.logits(backend, x, residual, batch, eps, offset=NORM_OFFSET)
        cap = c.final_logit_softcapping
        if cap is None or batch.final_states:
            return logits
        xp = backend.xp
        return xp.tanh(logits / np.float32(cap)) * np.float32(cap)
