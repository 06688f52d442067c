"""The OLMo-2 decoder (:ref:`families-olmo2`): post-norm GQA attention and SwiGLU layers whose q and
k projections are RMS-normalised over their whole width before RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec
from metrale.layers.attention import (
    AttentionGeometry,
    AttentionWeights,
    attention_from_qkv,
    load_attention_weights,
    sharded_geometry,
)
from metrale.layers.loading import DecoderEnds
from metrale.layers.lora import attention_lora, ends_lora, linear_with_lora, mlp_lora
from metrale.layers.lora_stacks import LoraLayout
from metrale.layers.mlp import MlpWeights, load_mlp_weights, swiglu_mlp
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.olmo2.config import Olmo2Config

# Buffers older exports saved beside the weights; they are recomputed, never read.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class WholeProjectionNorms:
    """OLMo-2's ``q_norm`` and ``k_norm``: RMSNorms over a token's whole query projection
    (``num_heads * head_dim`` values) and whole key projection (``num_kv_heads * head_dim``), not
    over each head, applied to the ``qkv`` columns in place.

    On a rank of a tensor-parallel group the rank holds some of the heads, so a norm's mean square
    is the ranks' sums of squares added (one ``all_reduce`` of both sums) over the whole width;
    where key heads are fewer than ranks each is held by ``key_copies`` ranks, and its squares are
    counted that many times. The weights are then float32 constants of the rank's columns."""

    q_weight: Any
    k_weight: Any
    #: This rank's columns of the query and of the key projection in ``qkv``.
    q_columns: int
    k_columns: int
    eps: float
    #: ``[q_width, kv_width * key_copies]`` (the divisors of the summed squares), None on one rank.
    divisors: Any = None

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: Olmo2Config) -> "WholeProjectionNorms":
        """Read ``{prefix}.q_norm.weight`` and ``{prefix}.k_norm.weight`` (this rank's part of each)."""
        c, shard = config, backend.shard
        q_name, k_name = f"{prefix}.q_norm.weight", f"{prefix}.k_norm.weight"
        if not shard.sharded:
            return cls(q_weight=backend.load_weight(checkpoint, (q_name, (c.q_width,))),
                       k_weight=backend.load_weight(checkpoint, (k_name, (c.kv_width,))),
                       q_columns=c.q_width, k_columns=c.kv_width, eps=c.rms_norm_eps)
        d = c.head_dim
        heads = shard.split(c.num_heads, "num_attention_heads")
        kv = shard.kv_heads(c.num_heads, c.num_kv_heads)
        q_part, kv_part = slice(heads.start * d, heads.stop * d), slice(kv.start * d, kv.stop * d)
        key_copies = max(1, shard.size // c.num_kv_heads)
        return cls(q_weight=backend.constant(checkpoint.tensor(q_name, (c.q_width,))[q_part]),
                   k_weight=backend.constant(checkpoint.tensor(k_name, (c.kv_width,))[kv_part]),
                   q_columns=q_part.stop - q_part.start, k_columns=kv_part.stop - kv_part.start, eps=c.rms_norm_eps,
                   divisors=backend.constant(np.array([c.q_width, c.kv_width * key_copies], dtype=np.float32)))

    def apply(self, backend: Any, qkv: Any) -> None:
        """Normalise the query and key columns of ``qkv [N, q + 2 kv]`` (float32) in place."""
        q_cols = slice(0, self.q_columns)
        k_cols = slice(self.q_columns, self.q_columns + self.k_columns)
        if self.divisors is None:
            ops = backend.ops
            # The norm's output is a matrix-product input (bf16 on the GPU, as transformers rounds
            # it in bf16); the rotary op reads float32.
            qkv[:, q_cols] = ops.to_float32(ops.rmsnorm(qkv[:, q_cols], self.q_weight, self.eps))
            qkv[:, k_cols] = ops.to_float32(ops.rmsnorm(qkv[:, k_cols], self.k_weight, self.eps))
            return
        xp = backend.xp
        q, k = qkv[:, q_cols], qkv[:, k_cols]
        squares = backend.all_reduce(xp.stack([xp.sum(q * q, axis=1), xp.sum(k * k, axis=1)], axis=1))
        scales = 1.0 / xp.sqrt(squares / self.divisors + np.float32(self.eps))
        qkv[:, q_cols] = q * scales[:, 0:1] * self.q_weight
        qkv[:, k_cols] = k * scales[:, 1:2] * self.k_weight


@dataclass
class Olmo2Layer:
    """One decoder layer: ``h = x + post_attention_norm(attention(x))``, ``out = h +
    post_feedforward_norm(mlp(h))``; the attention's q and k normalised by
    :class:`WholeProjectionNorms` before RoPE."""

    attention: AttentionWeights
    norms: WholeProjectionNorms
    post_attention_norm: Any
    mlp: MlpWeights
    post_feedforward_norm: Any
    geometry: AttentionGeometry

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: Olmo2Config,
             geometry: AttentionGeometry) -> "Olmo2Layer":
        """Read layer ``prefix`` (this rank's part of it); ``geometry`` is the whole block's."""
        c, vector = config, (config.hidden_size,)
        return cls(
            attention=load_attention_weights(checkpoint, backend, f"{prefix}.self_attn", geometry,
                                             qkv_bias=c.attention_bias, o_bias=c.attention_bias),
            norms=WholeProjectionNorms.load(checkpoint, backend, f"{prefix}.self_attn", c),
            post_attention_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            mlp=load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size),
            post_feedforward_norm=backend.load_weight(checkpoint,
                                                      (f"{prefix}.post_feedforward_layernorm.weight", vector)),
            geometry=sharded_geometry(geometry, backend.shard),
        )

    def forward(self, backend: Any, x: Any, residual: Any, cache_layer: Any, batch: ForwardBatch,
                eps: float) -> tuple[Any, Any]:
        """``(normed mlp output, h)`` of this layer for its input ``x + residual`` (``x`` alone
        when ``residual`` is None); the two are summed by the next layer or the final norm."""
        ops, a = backend.ops, self.attention
        hidden = x if residual is None else x + residual
        qkv = linear_with_lora(backend, hidden, a.qkv, a.qkv_bias, a.lora_qkv, batch)
        self.norms.apply(backend, qkv)
        attended = attention_from_qkv(backend, self.geometry, a, cache_layer, qkv, batch)
        h = hidden + ops.to_float32(ops.rmsnorm(attended, self.post_attention_norm, eps))
        out = swiglu_mlp(backend, self.mlp, h, batch)
        return ops.to_float32(ops.rmsnorm(out, self.post_feedforward_norm, eps)), h


class Olmo2Model(FamilyModel):
    """A loaded OLMo-2 model."""

    # Every layer reads the batch through its device row metadata only (ops and array arithmetic).
    mixed_graph_capturable = True
    # Heads (the q/k norms joined over the ranks), the intermediate size and the vocabulary split
    # over the ranks (metrale.backends.parallel).
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: Olmo2Config, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        geometry = AttentionGeometry(
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
        self.layers = [Olmo2Layer.load(checkpoint, backend, f"model.layers.{index}", c, geometry)
                       for index in range(c.num_layers)]
        # A rank of a tensor-parallel group caches its key/value heads only.
        self.kv_heads = self.layers[0].geometry.num_kv_heads
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(tuple(
            PagedKVSpec(self.kv_heads, self.config.head_dim, k_scale=layer.attention.k_scale,
                        v_scale=layer.attention.v_scale)
            for layer in self.layers
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
