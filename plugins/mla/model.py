"""The MLA decoder (:ref:`families-mla`): multi-head latent attention and DeepSeek MoE layers.

Per token and layer the paged latent cache holds the normalised latent ``c [r]`` followed by the
RoPE key ``k_pe [d_r]``. Prompt rows attend in the expanded form (keys and values re-expanded
from the cached latents through ``kv_b_proj``); decode rows and a speculative verify's rows
(``FamilyModel.verifying``) in the absorbed form (queries
projected into the latent space, attention over the latents, values through the value half of
``kv_b_proj``). Both are the same function (:ref:`families-mla-absorbed`); the tests check it.

Decode batches run on backend ops that need no host synchronisation: the per-head projections
(``head_linear``), the latent attention, the router and the chosen experts (``moe_route``,
``moe_experts``). Prompts run the expanded form per sequence and their experts as grouped matrix
products, which synchronise with the host. Decode steps are
captured into CUDA graphs like the dense family's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedLatentSpec
from metrale.errors import ConfigError
from metrale.layers.attention import load_kv_cache_scales
from metrale.layers.experts import StackedExperts, load_stacked_experts, routed_experts
from metrale.layers.loading import DecoderEnds, load_stacked
from metrale.layers.lora import ends_lora, linear_with_lora, mlp_lora, new_stack, normed_projection
from metrale.layers.lora_stacks import LoraLayout
from metrale.layers.mlp import MlpWeights, load_mlp_weights, swiglu_mlp
from metrale.layers.mtp import MtpModule, MtpTensors
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.mla.config import MlaConfig

#: transformers normalises the query and latent bottlenecks with this eps, whatever the config says.
LATENT_NORM_EPS = 1e-6

IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)
#: Rows of a page of the prompt rows' expanded keys and values: a power of two of at least 8, so
#: that every prompt attention kernel serves them (the Hopper kernel loads a page a tensor copy).
EXPANDED_PAGE_ROWS = 16



@dataclass
class LatentAttention:
    """One layer's multi-head latent attention: its weights, their loading and its forward.

    ``q_kv_a`` stacks the two projections of the normed input, ``q_proj`` (no q LoRA) or
    ``q_a_proj`` (its first ``q_columns`` rows), then ``kv_a_proj_with_mqa [r + d_r, H]``, so one
    op computes the input norm and both (``q_kv_a_bias`` the biases, zero for ``q_proj``, or
    None); with q LoRA, ``q_a_norm`` and ``q_b`` follow. ``kv_b [n_h (d_n + d_v), r]`` serves the
    expanded form and, for the absorbed form, its key half transposed per head ``w_uk_t [n_h r,
    d_n]`` and its value half ``w_uv [n_h d_v, r]`` (weights of ``head_linear``)."""

    config: MlaConfig
    q_kv_a: Any
    q_columns: int
    kv_a_norm: Any
    kv_b: Any
    w_uk_t: Any
    w_uv: Any
    o: Any
    q_a_norm: Any = None
    q_b: Any = None
    q_kv_a_bias: Any = None
    o_bias: Any = None
    #: The adapter slots of ``q_kv_a``, ``q_b`` and ``o`` when LoRA is on (:meth:`enable_lora`).
    lora_q_kv_a: Any = None
    lora_q_b: Any = None
    lora_o: Any = None
    #: The checkpoint's static FP8 scale of the cached latents: its ``k_scale`` (None: none); an
    #: FP8 cache quantizes with it.
    cache_scale: float | None = None
    #: On a rank of a tensor-parallel group: its query heads of the ``whole_heads`` (``config``
    #: holds its own count); None on a whole model.
    head_part: slice | None = None
    whole_heads: int = 0

    def enable_lora(self, backend: Any, limits: dict) -> list[Any]:
        """Adapter slots for ``q_proj`` / ``q_a_proj`` with ``kv_a_proj_with_mqa``, ``q_b_proj``
        and ``o_proj`` (``kv_b_proj`` is folded into the absorbed form, and refused)."""
        c = self.config
        q_name = "self_attn.q_proj" if c.q_lora_rank is None else "self_attn.q_a_proj"
        kv_a_rows = c.kv_lora_rank + c.qk_rope_head_dim
        head_rows = c.qk_nope_head_dim + c.qk_rope_head_dim
        q_kv_a_parts: dict[str, Any] = {}
        q_b_parts: dict[str, Any] = {}
        o_parts: dict[str, Any] = {}
        part = self.head_part
        if part is not None:
            # A rank's query heads: their rows of q_proj / q_b_proj, o_proj's columns of their
            # values; the latent projections are whole on every rank.
            q_rows = np.arange(part.start * head_rows, part.stop * head_rows)
            whole_q = self.whole_heads * head_rows
            first = q_rows if c.q_lora_rank is None else np.arange(self.q_columns)
            q_kv_a_parts = {"row_maps": (first, np.arange(kv_a_rows)),
                            "module_rows": (whole_q if c.q_lora_rank is None else self.q_columns, kv_a_rows),
                            "sharded": True}
            q_b_parts = {"row_maps": (q_rows,), "module_rows": (whole_q,), "sharded": True}
            o_parts = {"column_map": slice(part.start * c.v_head_dim, part.stop * c.v_head_dim),
                       "module_in": self.whole_heads * c.v_head_dim, "sharded": True}
        self.lora_q_kv_a = new_stack(backend, self, "q_kv_a", (q_name, "self_attn.kv_a_proj_with_mqa"),
                                     (self.q_columns, kv_a_rows), limits, **q_kv_a_parts)
        self.lora_o = new_stack(backend, self, "o", ("self_attn.o_proj",), (c.hidden_size,), limits, **o_parts)
        stacks = [self.lora_q_kv_a, self.lora_o]
        if c.q_lora_rank is not None:
            self.lora_q_b = new_stack(backend, self, "q_b", ("self_attn.q_b_proj",), (int(self.q_b.shape[0]),), limits,
                                      **q_b_parts)
            stacks.append(self.lora_q_b)
        return stacks

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: MlaConfig) -> "LatentAttention":
        """The layer's weights; on a rank of a tensor-parallel group (``backend.shard``) its query
        heads only: their rows of ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``, ``o_proj``'s
        columns of them (the ranks' outputs summed, its bias on rank 0); the latent projections
        (``q_a_proj``, ``kv_a_proj_with_mqa``) and so the latent cache are whole on every rank."""
        c, shard = config, backend.shard
        heads, r, d_n, d_r, d_v, hidden = (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                           c.v_head_dim, c.hidden_size)
        part = shard.split(heads, "num_attention_heads")
        local = part.stop - part.start
        kv_b_shape = (heads * (d_n + d_v), r)
        kv_b_rows = slice(part.start * (d_n + d_v), part.stop * (d_n + d_v))
        kv_b_host = checkpoint.tensor(f"{prefix}.kv_b_proj.weight", kv_b_shape, kv_b_rows).reshape(local, d_n + d_v, r)
        q_rows, q_part = heads * (d_n + d_r), slice(part.start * (d_n + d_r), part.stop * (d_n + d_r))
        # q_proj, or q_a_proj under q LoRA, then kv_a_proj_with_mqa: stacked into one weight (kept
        # quantized where the checkpoint quantizes both).
        if c.q_lora_rank is None:
            q_name, q_columns = f"{prefix}.q_proj", local * (d_n + d_r)
            q_spec: tuple = (f"{q_name}.weight", (q_rows, hidden), q_part, None)
        else:
            q_name, q_columns = f"{prefix}.q_a_proj", c.q_lora_rank
            q_spec = (f"{q_name}.weight", (q_columns, hidden))
        kv_a_name = f"{prefix}.kv_a_proj_with_mqa"
        kv_a_spec = (f"{kv_a_name}.weight", (r + d_r, hidden))
        q_kv_a = load_stacked(checkpoint, backend, q_spec, kv_a_spec)
        block = cls(
            config=replace(c, num_heads=local),
            q_kv_a=q_kv_a,
            q_columns=q_columns,
            kv_a_norm=backend.load_weight(checkpoint, (f"{prefix}.kv_a_layernorm.weight", (r,))),
            kv_b=backend.load_weight(checkpoint, (f"{prefix}.kv_b_proj.weight", kv_b_shape, kv_b_rows, None)),
            w_uk_t=backend.weight(kv_b_host[:, :d_n, :].transpose(0, 2, 1).reshape(local * r, d_n)),
            w_uv=backend.weight(kv_b_host[:, d_n:, :].reshape(local * d_v, r)),
            o=backend.load_weight(checkpoint, (f"{prefix}.o_proj.weight", (hidden, heads * d_v), None,
                                               slice(part.start * d_v, part.stop * d_v))),
        )
        if shard.sharded:
            block.head_part, block.whole_heads = part, heads
        if c.q_lora_rank is not None:
            rank = c.q_lora_rank
            block.q_a_norm = backend.load_weight(checkpoint, (f"{prefix}.q_a_layernorm.weight", (rank,)))
            block.q_b = backend.load_weight(checkpoint, (f"{prefix}.q_b_proj.weight", (q_rows, rank), q_part, None))
        if c.attention_bias:
            # (q_proj has no bias in transformers' DeepSeek attention; q_a_proj and kv_a_proj do.)
            q_bias = (np.zeros(q_columns, np.float32) if c.q_lora_rank is None
                      else checkpoint.tensor(f"{q_name}.bias", (q_columns,)))
            block.q_kv_a_bias = backend.constant(np.concatenate([q_bias, checkpoint.tensor(f"{kv_a_name}.bias",
                                                                                           (r + d_r,))]))
            o_bias = checkpoint.tensor(f"{prefix}.o_proj.bias", (hidden,))
            block.o_bias = backend.constant(o_bias) if shard.rank == 0 else None
        # The latent cache holds keys and values in one row: the key scale serves it (as vLLM's
        # MLA cache); the value scale is read and left unused.
        block.cache_scale, _ = load_kv_cache_scales(checkpoint, prefix)
        return block

    def forward(self, backend: Any, rope: "LatentRope", cache_layer: Any, x: Any, residual: Any, input_norm: Any,
                eps: float, batch: ForwardBatch, absorbed: bool = True, verifying: bool = False) -> tuple[Any, Any]:
        """``(out [N, H], residual)``: the input norm of ``x + residual`` and the stacked
        projections in one op, the rows' latents written into ``cache_layer``, then decode rows
        (one per sequence) and a verify's rows (``verifying``: computed as decode rows, each
        seeing its sequence up to its own position) in the absorbed form when ``absorbed``,
        prompt rows in the expanded form."""
        ops, c = backend.ops, self.config
        heads, d_n, d_r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        rows = x.shape[0]
        projected, residual = normed_projection(backend, x, residual, input_norm, eps, self.q_kv_a, self.lora_q_kv_a,
                                                batch, offset=0.0, bias=self.q_kv_a_bias)
        q, kv_a = projected[:, : self.q_columns], projected[:, self.q_columns :]
        if self.q_b is not None:
            q = linear_with_lora(backend, ops.rmsnorm(q, self.q_a_norm, LATENT_NORM_EPS), self.q_b, None, self.lora_q_b,
                                 batch)
        q = q.reshape(rows, heads, d_n + d_r)
        # The rows' normalised latents and rotated rope keys go into the paged cache.
        ops.latent_cache_write(kv_a, self.kv_a_norm, LATENT_NORM_EPS, batch.positions, rope.inv_freq,
                               rope.attention_factor, c.interleaved_rope, batch.slot_mapping, cache_layer.latent)
        if absorbed and (verifying or rows == len(batch.row_starts) - 1):
            return self._absorbed(backend, rope, cache_layer, q, batch), residual
        return self._expanded(backend, rope, cache_layer, q, batch), residual

    def _absorbed(self, backend: Any, rope: "LatentRope", cache_layer: Any, q: Any, batch: ForwardBatch) -> Any:
        """Decode rows: the queries projected into the latent space and joined with their rotated
        rope part, attention over the cached latents, the value half of ``kv_b_proj``, ``o_proj``."""
        ops, c = backend.ops, self.config
        rows, heads, r = q.shape[0], c.num_heads, c.kv_lora_rank
        q_latent = ops.head_linear(q[:, :, : c.qk_nope_head_dim], self.w_uk_t)
        queries = ops.latent_query(q_latent, q, batch.positions, rope.inv_freq, rope.attention_factor, c.interleaved_rope)
        mixed = ops.latent_attention(queries, cache_layer.latent, batch, r, rope.scale)
        values = ops.head_linear(mixed.reshape(rows, heads, r), self.w_uv)
        return backend.all_reduce(linear_with_lora(backend, values.reshape(rows, heads * c.v_head_dim), self.o,
                                                   self.o_bias, self.lora_o, batch))

    def _expanded(self, backend: Any, rope: "LatentRope", cache_layer: Any, q: Any, batch: ForwardBatch) -> Any:
        """Prompt rows: keys and values re-expanded from every segment's cached latents, then the
        backend's paged attention over them.

        The expanded keys ``[K, n_h, d_n + d_r]`` (the rope key shared by every head) and values
        ``[K, n_h, d_v]`` of all segments lie one after the other, each segment's rows padded to
        whole pages of :data:`EXPANDED_PAGE_ROWS` (``K`` = the sum of the padded ends; a padding
        row repeats the segment's last key, which no query sees there); seen as a cache of such
        pages, segment ``s``'s block table lists its own pages, so that the prompt attention
        kernels that need pages of several rows (the Hopper one) serve it too."""
        ops, c, xp = backend.ops, self.config, backend.xp
        heads, d_n, r = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank
        # q with its last d_r dims rotated (the query op with q's own nope part).
        rotated = ops.latent_query(q[:, :, :d_n], q, batch.positions, rope.inv_freq, rope.attention_factor,
                                   c.interleaved_rope)
        slots, view = self._expanded_layout(backend, batch, cache_layer.latent.shape[1])
        cached = cache_layer.rows(slots)  # [K, r + d_r] (dequantized from an FP8 cache)
        expanded = ops.to_bf16(ops.linear(xp.ascontiguousarray(cached[:, :r]), self.kv_b))
        expanded = expanded.reshape(len(slots), heads, d_n + c.v_head_dim)
        if cached.dtype != expanded.dtype:  # float32 rows of an FP8 cache beside a bf16 product
            cached = ops.to_bf16(cached)
        keys = xp.empty((len(slots), heads, d_n + c.qk_rope_head_dim), dtype=expanded.dtype)
        keys[:, :, :d_n] = expanded[:, :, :d_n]
        keys[:, :, d_n:] = cached[:, None, r:]
        values = xp.ascontiguousarray(expanded[:, :, d_n:])
        pages = len(slots) // EXPANDED_PAGE_ROWS
        out = ops.paged_attention(rotated, keys.reshape(pages, EXPANDED_PAGE_ROWS, heads, keys.shape[2]),
                                  values.reshape(pages, EXPANDED_PAGE_ROWS, heads, c.v_head_dim), view, rope.scale, None)
        return backend.all_reduce(linear_with_lora(backend, out, self.o, self.o_bias, self.lora_o, batch))

    @staticmethod
    def _expanded_layout(backend: Any, batch: ForwardBatch, block_size: int) -> tuple[Any, ForwardBatch]:
        """The cache slots of every segment's keys ``[K]`` (device), each segment's padded to whole
        pages of :data:`EXPANDED_PAGE_ROWS` with its last key's slot, and ``batch`` with block
        tables over those pages; made once per batch, shared by the layers."""
        layout = batch.extras.get("mla_expanded_layout")
        if layout is None:
            xp = backend.xp
            ends = [segment.end for segment in batch.segments]
            page_counts = [-(-end // EXPANDED_PAGE_ROWS) for end in ends]
            first_pages = np.concatenate([[0], np.cumsum(page_counts)]).astype(np.int64)
            slots = np.concatenate([
                np.asarray(segment.seq.block_table, dtype=np.int64)[rows // block_size] * block_size + rows % block_size
                for segment, end, count in zip(batch.segments, ends, page_counts)
                for rows in [np.minimum(np.arange(count * EXPANDED_PAGE_ROWS), end - 1)]
            ])
            width = max(page_counts)
            tables = np.where(np.arange(width)[None, :] < np.asarray(page_counts)[:, None],
                              first_pages[:-1, None] + np.arange(width)[None, :], 0).astype(np.int32)
            layout = batch.extras["mla_expanded_layout"] = (xp.asarray(slots), replace(batch, block_tables=xp.asarray(tables)))
        return layout


@dataclass(frozen=True)
class LatentRope:
    """What every latent attention layer shares: the RoPE table and factor, the softmax scale."""

    inv_freq: Any
    attention_factor: float
    scale: float


@dataclass
class DeepseekMoe:
    """DeepSeek's MoE: router ``gate [E, H]`` (float32, as transformers keeps it), V3's correction
    ``bias [E]``, the routed experts and the shared experts (None without them)."""

    config: MlaConfig
    gate: Any
    bias: Any
    experts: StackedExperts
    shared: MlpWeights | None

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: MlaConfig) -> "DeepseekMoe":
        c = config
        experts, hidden, width = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        bias_name = f"{prefix}.gate.e_score_correction_bias"
        return cls(
            config=c,
            gate=backend.constant(checkpoint.tensor(f"{prefix}.gate.weight", (experts, hidden))),
            bias=backend.constant(checkpoint.tensor(bias_name, (experts,))) if c.is_v3 else None,
            experts=load_stacked_experts(checkpoint, backend, f"{prefix}.experts", experts, hidden, width),
            shared=load_mlp_weights(checkpoint, backend, f"{prefix}.shared_experts", hidden,
                                    width * c.n_shared_experts) if c.n_shared_experts else None,
        )

    def route(self, backend: Any, h: Any) -> tuple[Any, Any]:
        """Top-k experts ``[N, k]`` and their weights ``[N, k]`` (float32) for ``h`` (:ref:`families-mla-moe`)."""
        c = self.config
        return backend.ops.moe_route(
            h, self.gate, self.bias, c.topk_method, c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob,
            c.routed_scaling_factor,
        )

    def forward(self, backend: Any, h: Any, chosen: Any, weights: Any, batch: ForwardBatch | None = None) -> Any:
        """The chosen experts' weighted outputs plus the shared experts' (with each row's adapter
        update of theirs when ``batch`` has adapter rows)."""
        out = routed_experts(backend, self.experts, h, chosen, weights)
        if self.shared is not None:
            out = out + swiglu_mlp(backend, self.shared, h, batch)
        return out


@dataclass
class MlaLayer:
    """Latent attention, then a dense MLP or the MoE (``feed_forward``)."""

    input_norm: Any
    attention: LatentAttention
    post_norm: Any
    feed_forward: MlpWeights | DeepseekMoe

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, index: int, config: MlaConfig) -> "MlaLayer":
        """Decoder layer ``index`` (``model.layers.{index}.*``; an MTP module's layer too)."""
        c, prefix, vector = config, f"model.layers.{index}", (config.hidden_size,)
        feed_forward: MlpWeights | DeepseekMoe = (
            DeepseekMoe.load(checkpoint, backend, f"{prefix}.mlp", c) if c.is_moe_layer(index)
            else load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size)
        )
        return cls(
            input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
            attention=LatentAttention.load(checkpoint, backend, f"{prefix}.self_attn", c),
            post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            feed_forward=feed_forward,
        )


def mtp_tensors(prefix: str) -> MtpTensors:
    """Where DeepSeek-V3 keeps the MTP module ``prefix`` (``model.layers.{L}``) beside its
    decoder layer's tensors; its layer counts as present with its input norm and latent
    projection."""
    return MtpTensors(f"{prefix}.enorm.weight", f"{prefix}.hnorm.weight", f"{prefix}.eh_proj.weight",
                      f"{prefix}.shared_head.norm.weight",
                      (f"{prefix}.input_layernorm.weight", f"{prefix}.self_attn.kv_a_proj_with_mqa.weight"))


def load_mtp_module(checkpoint: Checkpoint, backend: Any, config: MlaConfig) -> MtpModule | None:
    """DeepSeek-V3's first multi-token-prediction module ``model.layers.{L}.*``
    (:class:`~metrale.layers.mtp.MtpModule`: ``enorm``, ``hnorm``, ``eh_proj``, an MLA decoder
    layer with its own latent cache layer, ``shared_head.norm``) when ``checkpoint`` holds every
    part of it (:func:`mtp_tensors`), else None. Every tensor under the MTP prefixes is accounted
    for: deeper modules, and the ``shared_head.head`` and ``embed_tokens`` copies of the main
    model's (whose own serve instead), are skipped."""
    c = config
    present = [i for i in checkpoint.layer_indices("model.layers.") if c.num_layers <= i < c.num_layers + c.num_mtp_layers]
    module = None
    if c.num_layers in present:
        module = MtpModule.load(checkpoint, backend, mtp_tensors(f"model.layers.{c.num_layers}"), c.hidden_size,
                                lambda: MlaLayer.load(checkpoint, backend, c.num_layers, c))
    prefixes = tuple(f"model.layers.{i}." for i in present)
    if prefixes:
        checkpoint.skip([name for name in checkpoint.names() if name.startswith(prefixes)])
    return module


class MlaModel(FamilyModel):
    """A loaded DeepSeek-V2 / V3 model."""

    # Query heads, MLP and expert widths (or the experts) and the vocabulary split over the ranks.
    tensor_parallel_capable = True
    batch_invariant_capable = True

    #: Decode rows take the absorbed form (False: the expanded form, as prompt rows; for tests).
    absorbed_decode = True

    def __init__(self, config: MlaConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        self.rope = LatentRope(backend.constant(c.rope.inverse_frequencies()), c.rope.attention_factor(),
                               c.softmax_scale)
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        self.layers = [MlaLayer.load(checkpoint, backend, index, c) for index in range(c.num_layers)]
        #: DeepSeek-V3's first multi-token-prediction module (``model.layers.{L}.*``), the ``mtp``
        #: drafter's model (:mod:`metrale.plugins.mtp`); None when the checkpoint has no
        #: complete one. (Modules come from the layers present, not from num_nextn_predict_layers,
        #: which checkpoints that dropped these weights still declare.)
        self.mtp = load_mtp_module(checkpoint, backend, c)
        #: Set by :meth:`prepare_speculation` for the ``mtp`` drafter: the cache holds one more
        #: latent layer (the module's) and every forward leaves its rows' final hidden states in
        #: :attr:`step_outputs`.
        self.mtp_drafting = False
        #: The ``mtp`` drafter (:class:`~metrale.plugins.mtp.MtpDrafter`) once built.
        self.mtp_rows: Any = None
        checkpoint.skip([n for n in checkpoint.names() if n.endswith(IGNORED_TENSOR_SUFFIXES)])

    # ------------------------------------------------------------------------------ contract

    def cache_spec(self) -> CacheSpec:
        width = self.config.latent_width
        # (The MTP module's layer, when drafting, quantizes with scales of its own rows.)
        return CacheSpec(tuple(PagedLatentSpec(width, scale=layer.attention.cache_scale) for layer in self.layers)
                         + ((PagedLatentSpec(width),) if self.mtp_drafting else ()))

    def prepare_speculation(self, config: Any) -> None:
        if config.method == "mtp":
            if self.mtp is None:
                raise ConfigError("speculative_config method 'mtp' needs a multi-token-prediction module in the "
                                  "checkpoint (model.layers.{num_hidden_layers}.*: enorm, hnorm, eh_proj, a decoder "
                                  "layer, shared_head.norm); this one has none")
            self.mtp_drafting = True

    def is_mla(self) -> bool:
        return True

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoraLayout:
        c, backend, limits = self.config, self.backend, {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
        stacks = []
        for index, layer in enumerate(self.layers):
            ffn = layer.feed_forward
            mlp = ffn if isinstance(ffn, MlpWeights) else ffn.shared
            prefix = "mlp" if isinstance(ffn, MlpWeights) else "mlp.shared_experts"
            width = c.intermediate_size if isinstance(ffn, MlpWeights) else c.moe_intermediate_size * c.n_shared_experts
            layer_stacks = layer.attention.enable_lora(backend, limits)
            if mlp is not None:
                layer_stacks += mlp_lora(backend, mlp, c.hidden_size, width, limits, prefix)
            stacks += [(index, stack) for stack in layer_stacks]
        refused = {
            r"self_attn\.kv_b_proj": "decode folds kv_b_proj into the absorbed attention's per-head products",
            r"mlp\.experts(\..*)?": "LoRA on the routed experts is not served (only on the shared experts and the "
                                    "dense layers' MLPs)",
            r"mlp\.gate": "the router is not a LoRA target",
        }
        return LoraLayout(stacks, ends_lora(backend, self.ends, c.hidden_size, max_loras), refused)

    def forward_batch(self, batch: ForwardBatch) -> Any:
        eps = self.config.rms_norm_eps
        x, residual = self.ends.embed_tokens(self.backend, batch), None
        for layer, cache_layer in zip(self.layers, self._require_cache().layers):
            x, residual = self.layer_forward(layer, cache_layer, x, residual, batch)
        if self.mtp_drafting:
            # The MTP drafter's input: every row's state after the final norm (the logits as
            # always; the sum is a new array, as the CUDA residual norm updates its residual).
            self.step_outputs = {"hidden": self.backend.ops.rmsnorm(x + residual, self.ends.norm, eps)}
        return self.ends.logits(self.backend, x, residual, batch, eps)

    def layer_forward(self, layer: MlaLayer, cache_layer: Any, x: Any, residual: Any,
                      batch: ForwardBatch) -> tuple[Any, Any]:
        """One decoder layer: ``(out, residual)`` from its input ``x + residual``."""
        ops, eps = self.backend.ops, self.config.rms_norm_eps
        # Batch-invariant: every row in the expanded form, as a step of decode rows alone would
        # take the absorbed one and a mixed step the expanded one.
        absorbed = self.absorbed_decode and not self.backend.batch_invariant
        x, residual = layer.attention.forward(self.backend, self.rope, cache_layer, x, residual, layer.input_norm,
                                              eps, batch, absorbed, self.verifying)
        h, residual = ops.rmsnorm_residual(x, residual, layer.post_norm, eps)
        ffn = layer.feed_forward
        if isinstance(ffn, DeepseekMoe):
            return ffn.forward(self.backend, h, *self.route(ffn, h), batch), residual
        return swiglu_mlp(self.backend, ffn, h, batch), residual

    def mtp_forward(self, batch: ForwardBatch, hidden: Any) -> tuple[Any, Any]:
        """The MTP module over ``batch`` (decode rows: row ``i``'s token ``t_{i+1}``) with the
        final states ``hidden [rows, H]`` float32: ``(logits, the module's output states)``
        (:mod:`metrale.plugins.mtp`)."""
        if self.mtp is None:
            raise ConfigError(f"{type(self).__name__} has no multi-token-prediction module to run")
        cache_layer = self._require_cache().layers[self.config.num_layers]
        return self.mtp.forward(self.backend, self.ends, batch, hidden, self.config.rms_norm_eps,
                                lambda layer, x: self.layer_forward(layer, cache_layer, x, None, batch))

    def after_run(self, segments: list[Any], batch: ForwardBatch) -> None:
        if self.mtp_drafting and self.mtp_rows is not None:
            self.mtp_rows.observe(segments, batch, self.step_outputs["hidden"])

    def prime_drafter(self, seqs: list[Any]) -> None:
        if self.mtp_drafting and self.mtp_rows is not None:
            self.mtp_rows.catch_up(seqs)

    def route(self, moe: DeepseekMoe, h: Any) -> tuple[Any, Any]:
        """The experts ``moe`` chooses for ``h`` (a method of the model, so tests can record it)."""
        return moe.route(self.backend, h)
