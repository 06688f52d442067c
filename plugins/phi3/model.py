"""The Phi-3 decoder (:ref:`families-phi3`): pre-norm GQA attention over a fused ``qkv_proj`` and a
SwiGLU MLP over a fused ``gate_up_proj``, the checkpoint's fused matrices loaded as they are."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec
from metrale.layers.attention import (
    AttentionGeometry,
    AttentionWeights,
    load_kv_cache_scales,
    normed_attention_block,
    sharded_geometry,
)
from metrale.layers.loading import DecoderEnds
from metrale.layers.lora import ends_lora, new_stack
from metrale.layers.lora_stacks import LoraLayout, LoraStack
from metrale.layers.mlp import MlpWeights, normed_swiglu_mlp
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.rope import LONGROPE
from metrale.model.family import FamilyModel
from metrale.plugins.phi3.config import Phi3Config

logger = logging.getLogger(__name__)

# Buffers older exports saved beside the weights; they are recomputed, never read.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def load_fused_rows(checkpoint: Checkpoint, backend: Any, name: str, shape: tuple[int, int],
                    parts: list[slice]) -> Any:
    """The rows ``parts`` of the weight ``name`` of ``shape``, stacked in order (on a rank of a
    tensor-parallel group its q, k and v rows, or its gate and up rows, of a fused matrix: the
    same tensor read once per part); one read of the whole matrix when the parts cover it in
    order."""
    if _contiguous(parts, shape[0]):
        return backend.load_weight(checkpoint, (name, shape))
    return backend.load_weight(checkpoint, *[(name, shape, part, None) for part in parts])


def _contiguous(parts: list[slice], rows: int) -> bool:
    """Whether ``parts`` are ``0 .. rows`` in order without a gap."""
    position = 0
    for part in parts:
        if part.start != position:
            return False
        position = part.stop
    return position == rows


def load_phi3_attention(checkpoint: Checkpoint, backend: Any, prefix: str, geometry: AttentionGeometry) -> AttentionWeights:
    """Read ``{prefix}.qkv_proj`` (q rows, then k, then v) and ``{prefix}.o_proj`` (and the static
    KV-cache scales where the checkpoint has them). On a rank of a tensor-parallel group the rank's
    heads only: its q, k and v rows of the fused matrix, ``o_proj``'s columns of its query heads."""
    g, shard = geometry, backend.shard
    d, q_rows, kv_rows = g.head_dim, g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    heads = shard.split(g.num_heads, "num_attention_heads")
    kv = shard.kv_heads(g.num_heads, g.num_kv_heads)
    q_part = slice(heads.start * d, heads.stop * d)
    k_part = slice(q_rows + kv.start * d, q_rows + kv.stop * d)
    v_part = slice(q_rows + kv_rows + kv.start * d, q_rows + kv_rows + kv.stop * d)
    weights = AttentionWeights(
        qkv=load_fused_rows(checkpoint, backend, f"{prefix}.qkv_proj.weight", (q_rows + 2 * kv_rows, g.hidden_size),
                            [q_part, k_part, v_part]),
        o=backend.load_weight(checkpoint, (f"{prefix}.o_proj.weight", (g.hidden_size, q_rows), None, q_part)),
    )
    weights.k_scale, weights.v_scale = load_kv_cache_scales(checkpoint, prefix)
    if shard.sharded:
        weights.shard_rows = (q_part, slice(kv.start * d, kv.stop * d))
        weights.module_sizes = (q_rows, kv_rows)
    return weights


def load_phi3_mlp(checkpoint: Checkpoint, backend: Any, prefix: str, hidden_size: int,
                  intermediate_size: int) -> MlpWeights:
    """Read ``{prefix}.gate_up_proj`` (gate rows, then up) and ``{prefix}.down_proj``. On a rank of
    a tensor-parallel group its part of the intermediate size only: those gate and up rows and
    ``down_proj``'s columns."""
    part = backend.shard.split(intermediate_size, "intermediate_size")
    up = slice(intermediate_size + part.start, intermediate_size + part.stop)
    sharded = backend.shard.sharded
    return MlpWeights(
        gate_up=load_fused_rows(checkpoint, backend, f"{prefix}.gate_up_proj.weight",
                                (2 * intermediate_size, hidden_size), [part, up]),
        down=backend.load_weight(checkpoint, (f"{prefix}.down_proj.weight", (hidden_size, intermediate_size), None,
                                              part)),
        shard_part=part if sharded else None,
        module_size=intermediate_size if sharded else None,
    )


def _fused_parts(attention: AttentionWeights, mlp: MlpWeights) -> tuple[dict, dict, dict, dict]:
    """The adapter stacks' parts of a rank of a tensor-parallel group (:func:`~metrale.layers.lora.new_stack`):
    its q, k and v rows of ``qkv_proj``'s adapter ``B`` (in the fused order), its query columns of
    ``o_proj``'s ``A``, its gate and up rows of ``gate_up_proj``'s ``B``, its columns of
    ``down_proj``'s ``A``; empty on a whole model."""
    if attention.shard_rows is None or attention.module_sizes is None or mlp.shard_part is None:
        return {}, {}, {}, {}
    (q_part, kv_part), (q_size, kv_size) = attention.shard_rows, attention.module_sizes
    qkv_rows = np.concatenate([np.arange(q_part.start, q_part.stop),
                               q_size + np.arange(kv_part.start, kv_part.stop),
                               q_size + kv_size + np.arange(kv_part.start, kv_part.stop)])
    part, whole = mlp.shard_part, int(mlp.module_size or 0)
    gate_up_rows = np.concatenate([np.arange(part.start, part.stop), whole + np.arange(part.start, part.stop)])
    return ({"row_maps": (qkv_rows,), "module_rows": (q_size + 2 * kv_size,), "sharded": True},
            {"column_map": q_part, "module_in": q_size, "sharded": True},
            {"row_maps": (gate_up_rows,), "module_rows": (2 * whole,), "sharded": True},
            {"column_map": part, "module_in": whole, "sharded": True})


@dataclass
class Phi3Layer:
    """One decoder layer: ``h = x + attention(norm(x))``, ``out = h + mlp(norm(h))``."""

    input_norm: Any
    attention: AttentionWeights
    post_norm: Any
    mlp: MlpWeights
    geometry: AttentionGeometry

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: Phi3Config,
             geometry: AttentionGeometry) -> "Phi3Layer":
        """Read layer ``prefix`` (``model.layers.{i}``); ``geometry`` is the whole block's."""
        c, vector = config.decoder, (config.decoder.hidden_size,)
        return cls(
            input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
            attention=load_phi3_attention(checkpoint, backend, f"{prefix}.self_attn", geometry),
            post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            mlp=load_phi3_mlp(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size),
            geometry=sharded_geometry(geometry, backend.shard),
        )

    def forward(self, backend: Any, x: Any, residual: Any, cache_layer: Any, batch: ForwardBatch,
                eps: float) -> tuple[Any, Any]:
        """``(mlp output, residual)`` of this layer; the residual add is fused into the next norm."""
        x, residual = normed_attention_block(backend, self.geometry, self.attention, cache_layer, x, residual,
                                             self.input_norm, eps, batch)
        return normed_swiglu_mlp(backend, self.mlp, x, residual, self.post_norm, eps, batch=batch)


class Phi3Model(FamilyModel):
    """A loaded Phi-3 / Phi-4 model.

    Its RoPE table is built once for ``max_model_len``: with ``longrope`` the long factors when
    ``max_model_len`` exceeds ``original_max_position_embeddings``, the short ones otherwise
    (:meth:`~metrale.loading.rope.RopeParameters.uses_long_factors`)."""

    # Every layer reads the batch through its device row metadata and row_starts only.
    mixed_graph_capturable = True
    # Heads, the intermediate size and the vocabulary split over the ranks (metrale.backends.parallel).
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: Phi3Config, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        c = config.decoder
        super().__init__(backend, vocab_size=c.vocab_size, max_model_len=max_model_len)
        self.config = config
        #: Whether the RoPE table holds LongRoPE's long factors (False for the other RoPE types).
        self.long_rope_factors = c.rope.uses_long_factors(max_model_len)
        if c.rope.rope_type == LONGROPE:
            logger.info("LongRoPE: the %s factors for max_model_len=%d (original_max_position_embeddings=%d)",
                        "long" if self.long_rope_factors else "short", max_model_len,
                        c.rope.scaling["original_max_position_embeddings"])
        base = AttentionGeometry(
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            inv_freq=backend.constant(c.rope.inverse_frequencies(max_model_len)),
            attention_factor=c.rope.attention_factor(),
            sliding_window=c.sliding_window,
            norm_eps=c.rms_norm_eps,
            rotary_dim=c.rope.rotary_dim,
        )
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        self.layers = [Phi3Layer.load(checkpoint, backend, f"model.layers.{index}", config, base)
                       for index in range(c.num_layers)]
        # A rank of a tensor-parallel group caches its key/value heads only.
        self.kv_heads = self.layers[0].geometry.num_kv_heads if self.layers else c.num_kv_heads
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    def cache_spec(self) -> CacheSpec:
        c = self.config.decoder
        return CacheSpec(tuple(
            PagedKVSpec(self.kv_heads, c.head_dim, sliding_window=c.sliding_window, k_scale=layer.attention.k_scale,
                        v_scale=layer.attention.v_scale)
            for layer in self.layers
        ))

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoraLayout:
        """Adapter slots on the four projections PEFT names in a Phi-3 layer, each fused matrix one
        target as the checkpoint stores it (``self_attn.qkv_proj``, ``self_attn.o_proj``,
        ``mlp.gate_up_proj``, ``mlp.down_proj``), and on the token rows of the two ends."""
        c, backend = self.config.decoder, self.backend
        limits = {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
        stacks: list[tuple[int, LoraStack]] = []
        for index, layer in enumerate(self.layers):
            g, attention, mlp = layer.geometry, layer.attention, layer.mlp
            qkv_rows = (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
            width = 2 * c.intermediate_size
            qkv_parts, o_parts, gate_up_parts, down_parts = _fused_parts(attention, mlp)
            if mlp.shard_part is not None:
                width = 2 * (mlp.shard_part.stop - mlp.shard_part.start)
            attention.lora_qkv = new_stack(backend, attention, "qkv", ("self_attn.qkv_proj",), (qkv_rows,), limits,
                                           **qkv_parts)
            attention.lora_o = new_stack(backend, attention, "o", ("self_attn.o_proj",), (g.hidden_size,), limits,
                                         **o_parts)
            mlp.lora_gate_up = new_stack(backend, mlp, "gate_up", ("mlp.gate_up_proj",), (width,), limits,
                                         **gate_up_parts)
            mlp.lora_down = new_stack(backend, mlp, "down", ("mlp.down_proj",), (c.hidden_size,), limits, **down_parts)
            stacks += [(index, stack) for stack in (attention.lora_qkv, attention.lora_o, mlp.lora_gate_up,
                                                    mlp.lora_down)]
        return LoraLayout(stacks, ends_lora(backend, self.ends, c.hidden_size, max_loras))

    def forward_batch(self, batch: ForwardBatch) -> Any:
        eps = self.config.decoder.rms_norm_eps
        x, residual = self.ends.embed_tokens(self.backend, batch), None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            x, residual = layer.forward(self.backend, x, residual, cache_layer, batch, eps)
        return self.ends.logits(self.backend, x, residual, batch, eps)
