"""The MLA decoder (:ref:`families-mla`): multi-head latent attention and DeepSeek MoE layers.

Per token and layer the paged latent cache holds the normalised latent ``c [r]`` followed by the
RoPE key ``k_pe [d_r]``. Prompt rows attend in the expanded form (keys and values re-expanded
from the cached latents through ``kv_b_proj``); decode rows in the absorbed form (queries
projected into the latent space, attention over the latents, values through the value half of
``kv_b_proj``). Both are the same function (:ref:`families-mla-absorbed`); the tests check it.

Decode batches run on backend ops that need no host synchronisation: the per-head projections
(``head_linear``), the latent attention, the router and the chosen experts (``moe_route``,
``moe_experts``). Prompts run the expanded form per sequence and their experts as grouped matrix
products, which synchronise with the host. Decode steps are
captured into CUDA graphs like the dense family's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedLatentSpec
from metrale.checkpoint import Checkpoint
from metrale.family import FamilyModel
from metrale.layers.experts import StackedExperts, load_stacked_experts, routed_experts
from metrale.layers.loading import DecoderEnds
from metrale.layers.mlp import MlpWeights, load_mlp_weights, swiglu_mlp
from metrale.plugins.mla.config import MlaConfig

#: transformers normalises the query and latent bottlenecks with this eps, whatever the config says.
LATENT_NORM_EPS = 1e-6

IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)



@dataclass
class MlaAttentionWeights:
    """One layer's attention. ``q`` (no q LoRA) or ``q_a`` + ``q_a_norm`` + ``q_b``; ``kv_a``
    ``[r + d_r, H]``; ``kv_b`` ``[n_h (d_n + d_v), r]`` for the expanded form and, for the
    absorbed form, its key half transposed per head ``w_uk_t [n_h r, d_n]`` and its value half
    ``w_uv [n_h d_v, r]`` (weights for ``head_linear``)."""

    kv_a: Any
    kv_a_norm: Any
    kv_b: Any
    w_uk_t: Any
    w_uv: Any
    o: Any
    q: Any = None
    q_a: Any = None
    q_a_norm: Any = None
    q_b: Any = None
    q_a_bias: Any = None
    kv_a_bias: Any = None
    o_bias: Any = None


@dataclass
class MoeWeights:
    """Router ``gate [E, H]`` (float32, as transformers keeps it), V3's ``bias [E]``, the routed
    experts and the shared expert (None without one)."""

    gate: Any
    bias: Any
    experts: StackedExperts
    shared: MlpWeights | None


@dataclass
class MlaLayer:
    """Latent attention, then a dense MLP or the MoE (``feed_forward``)."""

    input_norm: Any
    attention: MlaAttentionWeights
    post_norm: Any
    feed_forward: MlpWeights | MoeWeights


class MlaModel(FamilyModel):
    """A loaded DeepSeek-V2 / V3 model."""

    #: Decode rows take the absorbed form (False: the expanded form, as prompt rows; for tests).
    absorbed_decode = True

    def __init__(self, config: MlaConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        self.inv_freq = backend.constant(c.rope.inverse_frequencies())
        self.attention_factor = c.rope.attention_factor()
        self.scale = c.softmax_scale
        vector = (c.hidden_size,)
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        self.layers = []
        for index in range(c.num_layers):
            prefix = f"model.layers.{index}"
            feed_forward: MlpWeights | MoeWeights = (
                self._load_moe(checkpoint, f"{prefix}.mlp") if c.is_moe_layer(index)
                else load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size)
            )
            self.layers.append(MlaLayer(
                input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
                attention=self._load_attention(checkpoint, f"{prefix}.self_attn"),
                post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
                feed_forward=feed_forward,
            ))
        # Multi-token-prediction modules (model.layers.{L + k}.*): kept for speculative decoding.
        # (The prefixes come from the layers present, not from num_nextn_predict_layers, which
        # checkpoints that dropped these weights still declare.)
        mtp_prefixes = tuple(f"model.layers.{i}." for i in checkpoint.layer_indices("model.layers.")
                             if c.num_layers <= i < c.num_layers + c.num_mtp_layers)
        self.mtp_weights = {
            name: backend.constant(checkpoint.tensor(name))
            for name in checkpoint.names() if mtp_prefixes and name.startswith(mtp_prefixes)
        }
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    # ------------------------------------------------------------------------------ loading

    def _load_attention(self, checkpoint: Checkpoint, prefix: str) -> MlaAttentionWeights:
        c, backend = self.config, self.backend
        heads, r, d_n, d_r, d_v, hidden = (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                           c.v_head_dim, c.hidden_size)
        kv_b_shape = (heads * (d_n + d_v), r)
        kv_b_host = checkpoint.tensor(f"{prefix}.kv_b_proj.weight", kv_b_shape).reshape(heads, d_n + d_v, r)
        weights = MlaAttentionWeights(
            kv_a=backend.load_weight(checkpoint, (f"{prefix}.kv_a_proj_with_mqa.weight", (r + d_r, hidden))),
            kv_a_norm=backend.load_weight(checkpoint, (f"{prefix}.kv_a_layernorm.weight", (r,))),
            kv_b=backend.load_weight(checkpoint, (f"{prefix}.kv_b_proj.weight", kv_b_shape)),
            w_uk_t=backend.weight(kv_b_host[:, :d_n, :].transpose(0, 2, 1).reshape(heads * r, d_n)),
            w_uv=backend.weight(kv_b_host[:, d_n:, :].reshape(heads * d_v, r)),
            o=backend.load_weight(checkpoint, (f"{prefix}.o_proj.weight", (hidden, heads * d_v))),
        )
        q_rows = heads * (d_n + d_r)
        if c.q_lora_rank is None:
            weights.q = backend.load_weight(checkpoint, (f"{prefix}.q_proj.weight", (q_rows, hidden)))
        else:
            rank = c.q_lora_rank
            weights.q_a = backend.load_weight(checkpoint, (f"{prefix}.q_a_proj.weight", (rank, hidden)))
            weights.q_a_norm = backend.load_weight(checkpoint, (f"{prefix}.q_a_layernorm.weight", (rank,)))
            weights.q_b = backend.load_weight(checkpoint, (f"{prefix}.q_b_proj.weight", (q_rows, rank)))
        if c.attention_bias:
            if c.q_lora_rank is not None:
                weights.q_a_bias = backend.constant(checkpoint.tensor(f"{prefix}.q_a_proj.bias", (c.q_lora_rank,)))
            weights.kv_a_bias = backend.constant(checkpoint.tensor(f"{prefix}.kv_a_proj_with_mqa.bias", (r + d_r,)))
            weights.o_bias = backend.constant(checkpoint.tensor(f"{prefix}.o_proj.bias", (hidden,)))
        return weights

    def _load_moe(self, checkpoint: Checkpoint, prefix: str) -> MoeWeights:
        c, backend = self.config, self.backend
        experts, hidden, width = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        bias_name = f"{prefix}.gate.e_score_correction_bias"
        return MoeWeights(
            gate=backend.constant(checkpoint.tensor(f"{prefix}.gate.weight", (experts, hidden))),
            bias=backend.constant(checkpoint.tensor(bias_name, (experts,))) if c.is_v3 else None,
            experts=load_stacked_experts(checkpoint, backend, f"{prefix}.experts", experts, hidden, width),
            shared=load_mlp_weights(checkpoint, backend, f"{prefix}.shared_experts", hidden,
                                    width * c.n_shared_experts) if c.n_shared_experts else None,
        )

    # ------------------------------------------------------------------------------ contract

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(tuple(PagedLatentSpec(self.config.latent_width) for _ in range(self.config.num_layers)))

    def is_mla(self) -> bool:
        return True

    def forward_batch(self, batch: ForwardBatch) -> Any:
        ops, eps = self.backend.ops, self.config.rms_norm_eps
        x, residual = self.ends.embed_tokens(self.backend, batch), None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            h, residual = ops.rmsnorm_residual(x, residual, layer.input_norm, eps)
            x = self._attention(layer.attention, cache_layer, h, batch)
            h, residual = ops.rmsnorm_residual(x, residual, layer.post_norm, eps)
            ffn = layer.feed_forward
            x = self._moe(ffn, h) if isinstance(ffn, MoeWeights) else swiglu_mlp(self.backend, ffn, h)
        return self.ends.logits(self.backend, x, residual, batch, eps)

    # ----------------------------------------------------------------------------- attention

    def _attention(self, w: MlaAttentionWeights, cache_layer: Any, h: Any, batch: ForwardBatch) -> Any:
        ops, c, xp = self.backend.ops, self.config, self.backend.xp
        heads, d_n, d_r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        rows = h.shape[0]
        if w.q is not None:
            q = ops.linear(h, w.q)
        else:
            q = ops.linear(ops.rmsnorm(ops.linear(h, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
        q = q.reshape(rows, heads, d_n + d_r)
        # The rows' normalised latents and rotated rope keys go into the paged cache.
        ops.latent_cache_write(ops.linear(h, w.kv_a, w.kv_a_bias), w.kv_a_norm, LATENT_NORM_EPS, batch.positions,
                               self.inv_freq, self.attention_factor, c.interleaved_rope, batch.slot_mapping,
                               cache_layer.latent)
        if self.absorbed_decode and rows == len(batch.row_starts) - 1:
            return self._absorbed(w, cache_layer, q, batch)
        # Prompt rows: q with its last d_r dims rotated (the query op with q's own nope part).
        rotated = ops.latent_query(q[:, :, :d_n], q, batch.positions, self.inv_freq, self.attention_factor,
                                   c.interleaved_rope)
        out = xp.empty((rows, heads, c.v_head_dim), dtype=xp.float32)
        starts = batch.row_starts
        for index, segment in enumerate(batch.segments):
            first, last = int(starts[index]), int(starts[index + 1])
            keys = self._cached(cache_layer, segment.seq.block_table, segment.end)
            causal = np.arange(segment.start, segment.end)
            out[first:last] = self._expanded(w, rotated[first:last, :, :d_n], rotated[first:last, :, d_n:], keys, causal)
        return ops.linear(out.reshape(rows, heads * c.v_head_dim), w.o, w.o_bias)

    def _absorbed(self, w: MlaAttentionWeights, cache_layer: Any, q: Any, batch: ForwardBatch) -> Any:
        """Decode rows (one per sequence): the queries projected into the latent space and joined
        with their rotated rope part, attention over the cached latents, the value half of
        ``kv_b_proj`` after, then ``o_proj``."""
        ops, c = self.backend.ops, self.config
        rows, heads, r = q.shape[0], c.num_heads, c.kv_lora_rank
        q_latent = ops.head_linear(q[:, :, : c.qk_nope_head_dim], w.w_uk_t)
        queries = ops.latent_query(q_latent, q, batch.positions, self.inv_freq, self.attention_factor, c.interleaved_rope)
        mixed = ops.latent_attention(queries, cache_layer.latent, batch, r, self.scale)
        values = ops.head_linear(mixed.reshape(rows, heads, r), w.w_uv)
        return ops.linear(values.reshape(rows, heads * c.v_head_dim), w.o, w.o_bias)

    def _cached(self, cache_layer: Any, block_table: list[int], end: int) -> Any:
        """Float32 ``[end, r + d_r]``: the cached latents and rope keys of positions ``[0, end)``."""
        latent = cache_layer.latent
        blocks = block_table[: -(-end // latent.shape[1])]
        values = latent[self.backend.xp.asarray(blocks)].reshape(-1, latent.shape[2])[:end]
        return self.backend.ops.to_float32(values)

    def _expanded(self, w: MlaAttentionWeights, q_nope: Any, q_pe: Any, keys: Any, positions: np.ndarray) -> Any:
        """``[T, n_h, d_v]``: keys and values re-expanded from the latents (prompt rows)."""
        c, xp = self.config, self.backend.xp
        r, d_n = c.kv_lora_rank, c.qk_nope_head_dim
        expanded = self.backend.ops.linear(xp.ascontiguousarray(keys[:, :r]), w.kv_b)
        expanded = self.backend.ops.to_float32(expanded).reshape(keys.shape[0], c.num_heads, d_n + c.v_head_dim)
        k_nope, values = expanded[:, :, :d_n], expanded[:, :, d_n:]
        scores = xp.einsum("thd,shd->hts", q_nope, k_nope) + xp.einsum("thd,sd->hts", q_pe, keys[:, r:])
        return xp.einsum("hts,shd->thd", self._softmax(scores, positions), values)

    def _softmax(self, scores: Any, positions: np.ndarray) -> Any:
        """Causal softmax of ``scores [n_h, T, S]`` (row t sees keys up to ``positions[t]``)."""
        xp = self.backend.xp
        scores = scores * np.float32(self.scale)
        hidden = xp.asarray(np.arange(scores.shape[2])[None, :] > positions[:, None])
        scores = xp.where(hidden[None], np.float32(-np.inf), scores)
        scores = scores - scores.max(axis=2, keepdims=True)
        weights = xp.exp(scores)
        return (weights / weights.sum(axis=2, keepdims=True)).astype(xp.float32)

    # ----------------------------------------------------------------------------------- MoE

    def route(self, moe: MoeWeights, h: Any) -> tuple[Any, Any]:
        """Top-k experts ``[N, k]`` and their weights ``[N, k]`` (float32) for ``h`` (:ref:`families-mla-moe`)."""
        c = self.config
        return self.backend.ops.moe_route(
            h, moe.gate, moe.bias, c.topk_method, c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob,
            c.routed_scaling_factor,
        )

    def _moe(self, moe: MoeWeights, h: Any) -> Any:
        chosen, weights = self.route(moe, h)
        out = routed_experts(self.backend, moe.experts, h, chosen, weights)
        if moe.shared is not None:
            out = out + swiglu_mlp(self.backend, moe.shared, h)
        return out
