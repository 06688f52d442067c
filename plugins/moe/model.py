"""The MoE decoder (:ref:`families-dense-moe`): the dense family's pre-norm GQA attention, then
routed experts (:class:`~metrale.layers.experts.SoftmaxMoe`) or, in the layers ``mlp_only_layers`` and
``decoder_sparse_step`` leave dense, a SwiGLU MLP."""

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
from metrale.layers.experts import SoftmaxMoe
from metrale.layers.loading import DecoderEnds
from metrale.layers.lora import attention_lora, ends_lora, mlp_lora
from metrale.layers.lora_stacks import LoraLayout
from metrale.layers.mlp import MlpWeights, load_mlp_weights, normed_swiglu_mlp
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.dense.model import IGNORED_TENSOR_SUFFIXES
from metrale.plugins.moe.config import MoeConfig


@dataclass
class MoeLayer:
    """One decoder layer: ``h = x + attention(norm(x))``, ``out = h + ffn(norm(h))``, the
    feed-forward the routed experts or a dense MLP."""

    input_norm: Any
    attention: AttentionWeights
    post_norm: Any
    feed_forward: SoftmaxMoe | MlpWeights
    geometry: AttentionGeometry

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, index: int, config: MoeConfig,
             geometry: AttentionGeometry) -> "MoeLayer":
        c, a = config, config.attention
        prefix, vector = f"model.layers.{index}", (a.hidden_size,)
        if c.sparse(index):
            feed_forward: SoftmaxMoe | MlpWeights = SoftmaxMoe.load(
                checkpoint, backend, f"{prefix}.{c.moe_prefix}", num_experts=c.num_experts, hidden=a.hidden_size,
                width=c.moe_intermediate_size, top_k=c.top_k, renormalise=c.norm_topk_prob,
                shared_width=c.shared_expert_intermediate_size, shared_gate=True, expert_names=c.expert_names)
        else:
            feed_forward = load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", a.hidden_size, a.intermediate_size)
        return cls(
            input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
            attention=load_attention_weights(checkpoint, backend, f"{prefix}.self_attn", geometry,
                                             qkv_bias=a.qkv_bias, o_bias=a.o_bias, qk_norm=a.qk_norm),
            post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            feed_forward=feed_forward,
            geometry=sharded_geometry(geometry, backend.shard),
        )


class MoeModel(FamilyModel):
    """A loaded Qwen3-MoE / Qwen2-MoE / Mixtral model."""

    # Heads, the experts (or their intermediate size) and the vocabulary split over the ranks.
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: MoeConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        a = config.attention
        super().__init__(backend, vocab_size=a.vocab_size, max_model_len=max_model_len)
        self.config = config
        base = AttentionGeometry(
            hidden_size=a.hidden_size,
            num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            inv_freq=backend.constant(a.rope.inverse_frequencies()),
            attention_factor=a.rope.attention_factor(),
            norm_eps=a.rms_norm_eps,
        )
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                                     tie_word_embeddings=a.tie_word_embeddings)
        self.layers = [
            MoeLayer.load(checkpoint, backend, index, config, replace(base, sliding_window=a.layer_windows[index]))
            for index in range(a.num_layers)
        ]
        self.kv_heads = self.layers[0].geometry.num_kv_heads if self.layers else a.num_kv_heads
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    def cache_spec(self) -> CacheSpec:
        a = self.config.attention
        return CacheSpec(tuple(
            PagedKVSpec(self.kv_heads, a.head_dim, sliding_window=w, k_scale=layer.attention.k_scale,
                        v_scale=layer.attention.v_scale)
            for w, layer in zip(a.layer_windows, self.layers)
        ))

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoraLayout:
        c, a, backend = self.config, self.config.attention, self.backend
        limits = {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
        stacks = []
        for index, layer in enumerate(self.layers):
            layer_stacks = attention_lora(backend, layer.attention, layer.geometry, limits)
            ffn = layer.feed_forward
            if isinstance(ffn, MlpWeights):
                layer_stacks += mlp_lora(backend, ffn, a.hidden_size, a.intermediate_size, limits)
            elif ffn.shared is not None and c.shared_expert_intermediate_size is not None:
                layer_stacks += mlp_lora(backend, ffn.shared, a.hidden_size, c.shared_expert_intermediate_size, limits,
                                         "mlp.shared_expert")
            stacks += [(index, stack) for stack in layer_stacks]
        refused = {
            rf"{c.moe_prefix}\.experts(\..*)?": "LoRA on the routed experts is not served (only on the attention, the "
                                                "shared expert and the dense layers' MLPs)",
            rf"{c.moe_prefix}\.(gate|shared_expert_gate)": "the router is not a LoRA target",
        }
        return LoraLayout(stacks, ends_lora(backend, self.ends, a.hidden_size, max_loras), refused)

    def forward_batch(self, batch: ForwardBatch) -> Any:
        eps = self.config.attention.rms_norm_eps
        x, residual = self.ends.embed_tokens(self.backend, batch), None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            x, residual = normed_attention_block(self.backend, layer.geometry, layer.attention, cache_layer, x,
                                                 residual, layer.input_norm, eps, batch)
            ffn = layer.feed_forward
            if isinstance(ffn, MlpWeights):
                x, residual = normed_swiglu_mlp(self.backend, ffn, x, residual, layer.post_norm, eps, batch=batch)
            else:
                h, residual = self.backend.ops.rmsnorm_residual(x, residual, layer.post_norm, eps)
                x = ffn.forward(self.backend, h, *self.route(ffn, h), batch)
        return self.ends.logits(self.backend, x, residual, batch, eps)

    def route(self, moe: SoftmaxMoe, h: Any) -> tuple[Any, Any]:
        """The experts ``moe`` chooses for ``h`` (a method of the model, so tests can record it)."""
        return moe.route(self.backend, h)



