"""The GPT-OSS decoder (:ref:`families-gpt-oss`): pre-norm GQA attention with biases and learned
sinks, alternating sliding-window and full layers, YaRN RoPE, and in every layer routed experts
with biases and a clamped SwiGLU (:class:`~metrale.layers.experts.ClampedSwigluMoe`), stored at
full precision or MXFP4."""

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
from metrale.layers.experts import ClampedSwigluMoe
from metrale.layers.loading import DecoderEnds
from metrale.layers.lora import attention_lora, ends_lora
from metrale.layers.lora_stacks import LoraLayout
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.dense.model import IGNORED_TENSOR_SUFFIXES
from metrale.plugins.gpt_oss.config import GptOssConfig


@dataclass
class GptOssLayer:
    """One decoder layer: ``h = x + attention(norm(x))``, ``out = h + experts(norm(h))``."""

    input_norm: Any
    attention: AttentionWeights
    post_norm: Any
    moe: ClampedSwigluMoe
    geometry: AttentionGeometry

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, index: int, config: GptOssConfig,
             geometry: AttentionGeometry) -> "GptOssLayer":
        c, prefix, vector = config, f"model.layers.{index}", (config.hidden_size,)
        return cls(
            input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
            attention=load_attention_weights(checkpoint, backend, f"{prefix}.self_attn", geometry,
                                             qkv_bias=c.attention_bias, o_bias=c.attention_bias),
            post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            moe=ClampedSwigluMoe.load(checkpoint, backend, f"{prefix}.mlp", num_experts=c.num_experts,
                                      hidden=c.hidden_size, width=c.intermediate_size, top_k=c.top_k,
                                      alpha=c.swiglu_alpha, limit=c.swiglu_limit),
            geometry=sharded_geometry(geometry, backend.shard),
        )


class GptOssModel(FamilyModel):
    """A loaded GPT-OSS model."""

    # Heads (with their sinks), the experts (or their intermediate size) and the vocabulary split
    # over the ranks.
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: GptOssConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
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
            rotary_dim=c.rope.rotary_dim if c.rope.rotary_dim != c.head_dim else None,
            sinks=True,
        )
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        self.layers = [
            GptOssLayer.load(checkpoint, backend, index, c, replace(base, sliding_window=window))
            for index, window in enumerate(c.layer_windows)
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
        stacks = [(index, stack) for index, layer in enumerate(self.layers)
                  for stack in attention_lora(self.backend, layer.attention, layer.geometry, limits)]
        # (The patterns match a bare "experts" too: no projection of "mlp" is served to place it.)
        refused = {
            r"(mlp\.)?experts(\..*)?": "LoRA on the routed experts is not served (only on the attention projections)",
            r"(mlp\.)?router(\..*)?": "the router is not a LoRA target",
        }
        return LoraLayout(stacks, ends_lora(self.backend, self.ends, c.hidden_size, max_loras), refused)

    def forward_batch(self, batch: ForwardBatch) -> Any:
        backend, eps = self.backend, self.config.rms_norm_eps
        x, residual = self.ends.embed_tokens(backend, batch), None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            x, residual = normed_attention_block(backend, layer.geometry, layer.attention, cache_layer, x, residual,
                                                 layer.input_norm, eps, batch)
            h, residual = backend.ops.rmsnorm_residual(x, residual, layer.post_norm, eps)
            x = layer.moe.forward(backend, h, *self.route(layer.moe, h))
        return self.ends.logits(backend, x, residual, batch, eps)

    def route(self, moe: ClampedSwigluMoe, h: Any) -> tuple[Any, Any]:
        """The experts ``moe`` chooses for ``h`` (a method of the model, so tests can record it)."""
        return moe.route(self.backend, h)
