"""The Qwen3-Next hybrid decoder (:ref:`families-gdn`): gated attention and Gated DeltaNet layers.

Full-attention layers keep K and V in paged blocks; Gated DeltaNet layers keep, per sequence, a
conv state (the last ``K - 1`` conv inputs, ``[C, K - 1]``) and a float32 recurrent state
``[H_v, d_k, d_v]`` in the sequence's state slot; the state carries across chunks and calls.
Every norm of the decoder is zero-centred (``1 + w``) except the gated output norm of the GDN
layers.

Everything runs on backend ops. Decode rows take the conv update and one recurrence step per row,
in place in the slots the batch names (the dummy slot for padding rows). Prompt tokens of every
sequence take the conv in one op (``gdn_conv_prompts``), then the gated delta rule in one op,
``gdn_prompt_rule`` (the chunked form, chunks of :data:`metrale.kernels.gated_delta.CHUNK`
tokens: on the CPU in NumPy, on the GPU on tensor cores for heads of 64 or 128 dims, else a kernel
that walks the tokens with the state in registers). Decode steps are captured into CUDA graphs like the dense family's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec, RecurrentStateSpec
from metrale.errors import CacheError, ConfigError, NonFiniteStateError
from metrale.layers.attention import load_kv_cache_scales
from metrale.layers.experts import SoftmaxMoe
from metrale.layers.loading import DecoderEnds, load_stacked
from metrale.layers.lora import ends_lora, linear_with_lora, mlp_lora, new_stack, normed_projection
from metrale.layers.lora_stacks import LoraLayout
from metrale.layers.mlp import MlpWeights, load_mlp_weights, swiglu_mlp
from metrale.layers.mtp import MtpModule, MtpTensors
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import FamilyModel
from metrale.plugins.gdn.config import GdnConfig
from metrale.sequence import SequenceState

IGNORED_TENSOR_PREFIXES = ("mtp.",)  # the MTP module's tensors not loaded (load_mtp_module)


@dataclass
class GatedAttention:
    """A gated full-attention layer: its weights, their loading and its forward.

    ``qkv_gate [(2 n_h + 2 n_kv) d, H]``: the query rows of ``q_proj``, then ``k_proj`` and
    ``v_proj`` (its first ``qkv_columns`` rows), then the gate rows of ``q_proj`` (which
    interleaves query and gate rows per head), so one op computes the input norm and all of them;
    ``o``, zero-centred ``q_norm`` / ``k_norm [d]``."""

    config: GdnConfig
    qkv_gate: Any
    qkv_columns: int
    o: Any
    q_norm: Any
    k_norm: Any
    #: The adapter slots of ``qkv_gate`` and ``o`` when LoRA is on (:meth:`enable_lora`).
    lora_qkv_gate: Any = None
    lora_o: Any = None
    #: The checkpoint's static FP8 scales of the cached keys and values (None: none).
    k_scale: float | None = None
    v_scale: float | None = None
    #: On a rank of a tensor-parallel group: its query heads and its key/value heads of the
    #: model's ``(num_heads, num_kv_heads)`` (``config`` holds its own counts); None on a whole model.
    shard_heads: tuple[slice, slice] | None = None
    whole_heads: tuple[int, int] = (0, 0)

    def enable_lora(self, backend: Any, limits: dict) -> list[Any]:
        """Adapter slots for ``q_proj`` (its query rows and its gate rows, where the fused weight
        holds them), ``k_proj``, ``v_proj`` and ``o_proj``; on a rank of a tensor-parallel group
        its heads' rows of the first three and its heads' columns of ``o_proj``."""
        c = self.config
        heads, kv, d, hidden = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
        all_heads, all_kv = self.whole_heads if self.shard_heads is not None else (heads, kv)
        head_part, kv_part = self.shard_heads if self.shard_heads is not None else (slice(0, heads), slice(0, kv))
        # q_proj's rows per head: d query rows, then d gate rows (load's regrouping).
        per_head = np.arange(all_heads * 2 * d).reshape(all_heads, 2, d)[head_part]
        kv_rows = np.arange(kv_part.start * d, kv_part.stop * d)
        sharded = self.shard_heads is not None
        self.lora_qkv_gate = new_stack(
            backend, self, "qkv_gate", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"),
            (heads * d, kv * d, kv * d, heads * d), limits,
            row_maps=(per_head[:, 0].reshape(-1), kv_rows if sharded else None, kv_rows if sharded else None,
                      per_head[:, 1].reshape(-1)),
            module_rows=(2 * all_heads * d, all_kv * d, all_kv * d, 2 * all_heads * d), sharded=sharded)
        o_parts = ({"column_map": slice(head_part.start * d, head_part.stop * d), "module_in": all_heads * d,
                    "sharded": True} if sharded else {})
        self.lora_o = new_stack(backend, self, "o", ("self_attn.o_proj",), (hidden,), limits, **o_parts)
        return [self.lora_qkv_gate, self.lora_o]

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: GdnConfig) -> "GatedAttention":
        """The layer's weights; on a rank of a tensor-parallel group its query heads' rows of
        ``q_proj`` (queries and gates), its key/value heads' of ``k_proj`` / ``v_proj``, and
        ``o_proj``'s columns of its heads (the ranks' outputs summed)."""
        c, shard = config, backend.shard
        d, hidden = c.head_dim, c.hidden_size
        heads, kv = shard.split(c.num_heads, "num_attention_heads"), shard.kv_heads(c.num_heads, c.num_kv_heads)
        local, local_kv = heads.stop - heads.start, kv.stop - kv.start
        # Per head, q_proj holds d query rows then d gate rows: regrouped (each head's rows read as
        # a part) so that the product gives [q | k | v] for qkv_rope_cache, then the gates.
        q_shape, kv_shape = (c.num_heads * 2 * d, hidden), (c.num_kv_heads * d, hidden)
        kv_rows = slice(kv.start * d, kv.stop * d)
        head_rows = [2 * d * (heads.start + h) for h in range(local)]
        queries = [(f"{prefix}.q_proj.weight", q_shape, slice(row, row + d), None) for row in head_rows]
        gates = [(f"{prefix}.q_proj.weight", q_shape, slice(row + d, row + 2 * d), None) for row in head_rows]
        keys_values = [(f"{prefix}.{name}.weight", kv_shape, kv_rows, None) for name in ("k_proj", "v_proj")]
        k_scale, v_scale = load_kv_cache_scales(checkpoint, prefix)
        return cls(
            shard_heads=(heads, kv) if shard.sharded else None,
            whole_heads=(c.num_heads, c.num_kv_heads),
            config=rank_config(c, shard),
            qkv_gate=load_stacked(checkpoint, backend, *queries, *keys_values, *gates),
            qkv_columns=(local + 2 * local_kv) * d,
            o=backend.load_weight(checkpoint, (f"{prefix}.o_proj.weight", (hidden, c.num_heads * d), None,
                                               slice(heads.start * d, heads.stop * d))),
            q_norm=backend.load_weight(checkpoint, (f"{prefix}.q_norm.weight", (d,))),
            k_norm=backend.load_weight(checkpoint, (f"{prefix}.k_norm.weight", (d,))),
            k_scale=k_scale,
            v_scale=v_scale,
        )


    def forward(self, backend: Any, inv_freq: Any, cache_layer: Any, x: Any, residual: Any, input_norm: Any,
                eps: float, batch: ForwardBatch) -> tuple[Any, Any]:
        """``(out [N, H], residual)``: the input norm of ``x + residual`` (zero-centred) and the
        projections in one op, then the attention, the output gate and ``o_proj`` (summed over
        the ranks of a tensor-parallel group)."""
        ops, c, xp = backend.ops, self.config, backend.xp
        heads, d = c.num_heads, c.head_dim
        projected, residual = normed_projection(backend, x, residual, input_norm, eps, self.qkv_gate,
                                                self.lora_qkv_gate, batch)
        qkv, gate = (xp.ascontiguousarray(part) for part in (projected[:, : self.qkv_columns],
                                                              projected[:, self.qkv_columns :]))
        q = ops.qkv_rope_cache(
            qkv, batch.positions, batch.slot_mapping, inv_freq, 1.0, heads, c.num_kv_heads, d,
            cache_layer.k, cache_layer.v, self.q_norm, self.k_norm, c.rms_norm_eps, 1.0,
        )
        out = ops.paged_attention(q, cache_layer.k, cache_layer.v, batch, d**-0.5, None)
        out = linear_with_lora(backend, ops.sigmoid_gate(out, gate), self.o, None, self.lora_o, batch)
        return backend.all_reduce(out), residual


def rank_config(config: GdnConfig, shard: Any) -> GdnConfig:
    """``config`` as a rank of a tensor-parallel group sees it: its query, key/value, linear key
    and linear value heads (each linear key head with the value heads it groups)."""
    if not shard.sharded:
        return config
    c = config
    heads, kv = shard.split(c.num_heads, "num_attention_heads"), shard.kv_heads(c.num_heads, c.num_kv_heads)
    keys = shard.split(c.linear_key_heads, "linear_num_key_heads")
    local_keys = keys.stop - keys.start
    return replace(c, num_heads=heads.stop - heads.start, num_kv_heads=kv.stop - kv.start,
                   linear_key_heads=local_keys, linear_value_heads=local_keys * (c.linear_value_heads // c.linear_key_heads))


@dataclass
class GatedDeltaNet:
    """A Gated DeltaNet layer: its weights, their loading and its forward.

    ``in_proj`` stacks ``in_proj_qkvz [2 H_k d_k + 2 H_v d_v, H]`` (its first ``qkvz_columns``
    rows) and ``in_proj_ba [2 H_v, H]`` (both grouped by key head), so one op computes the input
    norm and both; the conv weight ``[C, K]``, ``A_log`` and ``dt_bias [H_v]``, the gated norm
    ``[d_v]``, ``out``."""

    config: GdnConfig
    in_proj: Any
    qkvz_columns: int
    conv: Any
    a_log: Any
    dt_bias: Any
    norm: Any
    out: Any
    #: The adapter slots of ``in_proj`` and ``out`` when LoRA is on (:meth:`enable_lora`).
    lora_in: Any = None
    lora_out: Any = None
    #: On a rank of a tensor-parallel group: its rows of ``in_proj_qkvz`` and ``in_proj_ba`` and
    #: its columns of ``out_proj``, and the three whole sizes; None on a whole model.
    shard_parts: tuple[slice, slice, slice] | None = None
    whole_sizes: tuple[int, int, int] = (0, 0, 0)

    def enable_lora(self, backend: Any, limits: dict) -> list[Any]:
        """Adapter slots for ``in_proj_qkvz`` with ``in_proj_ba``, and ``out_proj``; on a rank of a
        tensor-parallel group its key heads' groups of rows of the first two and its value heads'
        columns of ``out_proj``."""
        c = self.config
        in_parts: dict[str, Any] = {}
        out_parts: dict[str, Any] = {}
        if self.shard_parts is not None:
            (qkvz, ba, out), (all_qkvz, all_ba, all_out) = self.shard_parts, self.whole_sizes
            in_parts = {"row_maps": (np.arange(qkvz.start, qkvz.stop), np.arange(ba.start, ba.stop)),
                        "module_rows": (all_qkvz, all_ba), "sharded": True}
            out_parts = {"column_map": out, "module_in": all_out, "sharded": True}
        self.lora_in = new_stack(backend, self, "in_proj", ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"),
                                 (self.qkvz_columns, 2 * c.linear_value_heads), limits, **in_parts)
        self.lora_out = new_stack(backend, self, "out", ("linear_attn.out_proj",), (c.hidden_size,), limits,
                                  **out_parts)
        return [self.lora_in, self.lora_out]

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: GdnConfig) -> "GatedDeltaNet":
        """The layer's weights; on a rank of a tensor-parallel group its linear key heads with
        the value heads each groups: their rows of ``in_proj_qkvz`` / ``in_proj_ba`` (grouped by
        key head), their conv channels, gates and ``out_proj`` columns (the ranks' outputs
        summed); each rank keeps its heads' conv and recurrent states."""
        c, shard = config, backend.shard
        hidden, hk, hv, dk, dv = (c.hidden_size, c.linear_key_heads, c.linear_value_heads, c.linear_key_dim,
                                  c.linear_value_dim)
        keys = shard.split(hk, "linear_num_key_heads")
        ratio = hv // hk
        values = slice(keys.start * ratio, keys.stop * ratio)
        group = 2 * dk + 2 * ratio * dv  # in_proj_qkvz rows of one key head
        local_keys, local_values = keys.stop - keys.start, values.stop - values.start
        conv = (checkpoint.tensor(f"{prefix}.conv1d.weight", (c.conv_channels, 1, c.conv_kernel))
                .reshape(c.conv_channels, c.conv_kernel))
        # The conv channels are [q | k | v] over every head: the rank's heads' of each.
        conv = np.concatenate([conv[keys.start * dk : keys.stop * dk],
                               conv[hk * dk + keys.start * dk : hk * dk + keys.stop * dk],
                               conv[2 * hk * dk + values.start * dv : 2 * hk * dk + values.stop * dv]])
        qkvz_columns = 2 * local_keys * dk + 2 * local_values * dv
        return cls(
            shard_parts=(slice(keys.start * group, keys.stop * group),
                         slice(keys.start * 2 * ratio, keys.stop * 2 * ratio),
                         slice(values.start * dv, values.stop * dv)) if shard.sharded else None,
            whole_sizes=(2 * hk * dk + 2 * hv * dv, 2 * hv, hv * dv),
            config=rank_config(c, shard),
            in_proj=load_stacked(
                checkpoint, backend,
                (f"{prefix}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, hidden),
                 slice(keys.start * group, keys.stop * group), None),
                (f"{prefix}.in_proj_ba.weight", (2 * hv, hidden), slice(keys.start * 2 * ratio, keys.stop * 2 * ratio),
                 None)),
            qkvz_columns=qkvz_columns,
            conv=backend.constant(conv),
            a_log=backend.constant(checkpoint.tensor(f"{prefix}.A_log", (hv,))[values]),
            dt_bias=backend.constant(checkpoint.tensor(f"{prefix}.dt_bias", (hv,))[values]),
            norm=backend.constant(checkpoint.tensor(f"{prefix}.norm.weight", (dv,))),
            out=backend.load_weight(checkpoint, (f"{prefix}.out_proj.weight", (hidden, hv * dv), None,
                                                 slice(values.start * dv, values.stop * dv))),
        )

    def forward(self, backend: Any, cache_layer: Any, x: Any, residual: Any, input_norm: Any, eps: float,
                batch: ForwardBatch, stash: "RowStates | None" = None) -> tuple[Any, Any]:
        """``(out [N, H], residual)``: the input norm of ``x + residual`` (zero-centred) and the
        projections in one op, then the layer; the rows' conv and recurrent states (in their
        slots) move on. With ``stash`` (a speculative verify), the rows of each segment take one
        decode step each, in order, and the states after every row are kept in ``stash``."""
        ops, c, xp = backend.ops, self.config, backend.xp
        rows = x.shape[0]
        hk, hv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
        # The projections are grouped by key head in the checkpoint (docs/families.rst, "Gated
        # DeltaNet layer", step 2): the ops regroup them into the conv input, z and the gates.
        projected, residual = normed_projection(backend, x, residual, input_norm, eps, self.in_proj, self.lora_in, batch)
        qkvz, ba = (xp.ascontiguousarray(part) for part in (projected[:, : self.qkvz_columns],
                                                             projected[:, self.qkvz_columns :]))
        if stash is not None:
            return self._verify_rows(backend, cache_layer, qkvz, ba, batch, stash), residual
        if rows == len(batch.row_starts) - 1:
            # One token per sequence: the un-grouping, the gates, the conv update, one recurrence
            # step in the slots and the gated norm, as one op.
            gated = ops.gdn_decode(qkvz, ba, self.conv, cache_layer.conv, self.a_log, self.dt_bias, cache_layer.state,
                                   batch.state_slots, self.norm, c.rms_norm_eps, hk, hv, dk, dv)
            out = linear_with_lora(backend, gated.reshape(rows, hv * dv), self.out, None, self.lora_out, batch)
            return backend.all_reduce(out), residual
        inputs, z = ops.gdn_ungroup(qkvz, hk, hv, dk, dv)
        g, beta = ops.gdn_gates(ba, self.a_log, self.dt_bias, hk)
        slots = np.array([segment.seq.state_slot for segment in batch.segments], dtype=np.int32)
        starts = np.asarray(batch.row_starts, dtype=np.int32)
        mixed = ops.gdn_conv_prompts(inputs, self.conv, cache_layer.conv, slots, starts)
        q, k, v = ops.gdn_split_heads(mixed, hk, hv, dk, dv)
        out = ops.gdn_prompt_rule(q, k, v, g, beta, cache_layer.state, slots, starts)
        # Gated norm per value head (plain weight), then out_proj.
        gated = ops.gated_rmsnorm(out, z, self.norm, c.rms_norm_eps)
        out = linear_with_lora(backend, gated.reshape(rows, hv * dv), self.out, None, self.lora_out, batch)
        return backend.all_reduce(out), residual

    def _verify_rows(self, backend: Any, cache_layer: Any, qkvz: Any, ba: Any, batch: ForwardBatch,
                     stash: "RowStates") -> Any:
        """A verify's rows as decode steps: step ``j`` takes row ``j`` of every segment that has
        one (the decode op, in the segments' slots), then copies those slots' conv and recurrent
        states into ``stash`` at the rows' indices. The slots end as of each segment's last row."""
        ops, c, xp = backend.ops, self.config, backend.xp
        hk, hv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
        starts = np.asarray(batch.row_starts, dtype=np.int64)
        lengths = np.diff(starts)
        slots = np.array([segment.seq.state_slot for segment in batch.segments], dtype=np.int64)
        conv_rows = xp.empty((qkvz.shape[0], *cache_layer.conv.shape[1:]), dtype=cache_layer.conv.dtype)
        state_rows = xp.empty((qkvz.shape[0], *cache_layer.state.shape[1:]), dtype=cache_layer.state.dtype)
        gated = None
        for step in range(int(lengths.max())):
            taking = np.flatnonzero(lengths > step)
            rows = xp.asarray(starts[taking] + step)
            step_slots = xp.asarray(slots[taking].astype(np.int32))
            out = ops.gdn_decode(xp.take(qkvz, rows, axis=0), xp.take(ba, rows, axis=0), self.conv, cache_layer.conv,
                                 self.a_log, self.dt_bias, cache_layer.state, step_slots, self.norm, c.rms_norm_eps,
                                 hk, hv, dk, dv)
            if gated is None:
                gated = xp.empty((qkvz.shape[0], *out.shape[1:]), dtype=out.dtype)
            gated[rows] = out
            conv_rows[rows] = cache_layer.conv[step_slots]
            state_rows[rows] = cache_layer.state[step_slots]
        stash.layers.append((cache_layer, conv_rows, state_rows))
        if gated is None:  # no rows: a verify names at least one per sequence
            raise CacheError("a verify without rows")
        return backend.all_reduce(linear_with_lora(backend, gated.reshape(qkvz.shape[0], hv * dv), self.out, None,
                                                   self.lora_out, batch))


@dataclass
class RowStates:
    """The conv and recurrent states of every Gated DeltaNet layer after each row of a verify:
    per layer ``(cache layer, conv [rows, C, K - 1], state [rows, H_v, d_k, d_v])``, and each
    verified sequence's first row, by ``seq_id``."""

    first_row: dict[int, int]
    layers: list[tuple[Any, Any, Any]]


class SparseMoe(SoftmaxMoe):
    """Qwen3-Next's MoE (:ref:`families-gdn-moe`): the softmax-routed experts of
    :class:`~metrale.layers.experts.SoftmaxMoe` with the shared expert and its gate."""

    @classmethod
    def load_layer(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: GdnConfig) -> "SparseMoe":
        c = config
        moe = SoftmaxMoe.load(checkpoint, backend, prefix, num_experts=c.num_experts, hidden=c.hidden_size,
                              width=c.moe_intermediate_size, top_k=c.num_experts_per_tok, renormalise=c.norm_topk_prob,
                              shared_width=c.shared_expert_intermediate_size, shared_gate=True)
        return cls(**vars(moe))


@dataclass
class GdnLayer:
    """A gated attention or a Gated DeltaNet mixer, then a dense MLP or the sparse MoE."""

    input_norm: Any
    post_norm: Any
    mixer: GatedAttention | GatedDeltaNet
    feed_forward: MlpWeights | SparseMoe

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, config: GdnConfig, *, attention: bool,
             moe: bool) -> "GdnLayer":
        """The decoder layer at ``prefix`` (``model.layers.{i}``, or the MTP module's ``mtp.layers.0``)."""
        c, vector = config, (config.hidden_size,)
        return cls(
            input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
            post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            mixer=(GatedAttention.load(checkpoint, backend, f"{prefix}.self_attn", c) if attention
                   else GatedDeltaNet.load(checkpoint, backend, f"{prefix}.linear_attn", c)),
            feed_forward=(SparseMoe.load_layer(checkpoint, backend, f"{prefix}.mlp", c) if moe
                          else load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size)),
        )


#: Where Qwen3-Next keeps its multi-token-prediction module ``mtp.*``; its layer
#: ``mtp.layers.0`` counts as present with its input norm and query projection.
MTP_TENSORS = MtpTensors("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                         "mtp.norm.weight", ("mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.q_proj.weight"))


def load_mtp_module(checkpoint: Checkpoint, backend: Any, config: GdnConfig) -> MtpModule | None:
    """Qwen3-Next's multi-token-prediction module ``mtp.*`` (:class:`~metrale.layers.mtp.MtpModule`:
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, a gated-attention decoder layer
    with its own KV cache layer, ``norm``; zero-centred norms) when ``checkpoint`` holds all of
    :data:`MTP_TENSORS` (its layer's feed-forward a MoE where ``mtp.layers.0.mlp.gate.weight`` is
    present), else None; the other ``mtp.*`` tensors (deeper layers) are skipped by the model."""
    c = config
    return MtpModule.load(checkpoint, backend, MTP_TENSORS, c.hidden_size,
                          lambda: GdnLayer.load(checkpoint, backend, "mtp.layers.0", c, attention=True,
                                                moe=checkpoint.has("mtp.layers.0.mlp.gate.weight")),
                          offset=1.0)


class GdnModel(FamilyModel):
    """A loaded Qwen3-Next model."""

    # Attention heads, linear key heads (with their value heads), MLP and expert widths (or the
    # experts) and the vocabulary split over the ranks.
    tensor_parallel_capable = True
    batch_invariant_capable = True

    def __init__(self, config: GdnConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        # Only attention layers rotate; without one, head_dim is not checked against any tensor.
        self.inv_freq = backend.constant(c.rope.inverse_frequencies()) if "full_attention" in c.layer_types else None
        self.ends = DecoderEnds.load(checkpoint, backend, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     tie_word_embeddings=c.tie_word_embeddings)
        self.layers = [GdnLayer.load(checkpoint, backend, f"model.layers.{index}", c,
                                     attention=c.layer_types[index] == "full_attention", moe=c.moe_layers[index])
                       for index in range(c.num_layers)]
        #: The checkpoint's multi-token-prediction module (``mtp.*``), the ``mtp`` drafter's model
        #: (:mod:`metrale.plugins.mtp`); None when the checkpoint has no complete one.
        self.mtp = load_mtp_module(checkpoint, backend, c)
        if self.mtp is not None and self.inv_freq is None:
            self.inv_freq = backend.constant(c.rope.inverse_frequencies())
        #: Set by :meth:`prepare_speculation` for the ``mtp`` drafter: the cache holds one more
        #: attention layer (the module's) and every forward leaves its rows' final states in
        #: :attr:`step_outputs`.
        self.mtp_drafting = False
        #: The ``mtp`` drafter (:class:`~metrale.plugins.mtp.MtpDrafter`) once built.
        self.mtp_rows: Any = None
        checkpoint.skip([n for n in checkpoint.names() if n.startswith(IGNORED_TENSOR_PREFIXES)])
        # Speculation: the row states of the verify running or awaiting its verdict, and the
        # verdicts not folded into their slots yet (slot -> (sequence, row states, row kept last)).
        self._verify_states: RowStates | None = None
        self._pending: dict[int, tuple[SequenceState, RowStates, int]] = {}

    # ------------------------------------------------------------------------------ contract

    def cache_spec(self) -> CacheSpec:
        c = rank_config(self.config, self.backend.shard)  # a rank's heads' states and keys/values
        state = RecurrentStateSpec((c.conv_channels, c.conv_kernel - 1),
                                   (c.linear_value_heads, c.linear_key_dim, c.linear_value_dim))
        layers = tuple(
            PagedKVSpec(c.num_kv_heads, c.head_dim, k_scale=getattr(layer.mixer, "k_scale", None),
                        v_scale=getattr(layer.mixer, "v_scale", None))
            if kind == "full_attention" else state for kind, layer in zip(c.layer_types, self.layers)
        )
        return CacheSpec(layers + ((PagedKVSpec(c.num_kv_heads, c.head_dim),) if self.mtp_drafting else ()))

    def prepare_speculation(self, config: Any) -> None:
        if config.method == "mtp":
            if self.mtp is None:
                raise ConfigError("speculative_config method 'mtp' needs a multi-token-prediction module in the "
                                  "checkpoint (mtp.*: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, "
                                  "layers.0); this one has none")
            self.mtp_drafting = True

    #: Tokens at least left after the tail split (``prefill_tail_split``).
    min_tail = 256

    def prefill_tail_split(self, tokens: Any) -> int | None:
        """Where to split a prompt so a state snapshot lands near its tail (prefix cache on):
        with block size ``bs`` and ``tb`` the last multiple of ``bs`` strictly below the length,
        ``min(tb - bs, floor((len - min_tail) / bs) * bs)``, or None when that is not positive
        (and always None without state snapshots: the prefix cache off)."""
        if self.cache is None or self.cache.snapshots is None or not self.cache.snapshots.count:
            return None
        size, length = self.cache.block_size, len(tokens)
        below = (length - 1) // size * size
        split = min(below - size, (length - self.min_tail) // size * size)
        return split if split > 0 else None

    # ------------------------------------------------------------------------- speculation

    def verify(self, tokens: Any, seqs: Any, stream: Any) -> Any:
        """The derived verify, its Gated DeltaNet layers stepping row by row and keeping the
        states after every row (:class:`RowStates`); the slots end as of each sequence's last
        row, and :meth:`verdict` leaves the state of the rows kept pending."""
        try:
            return super().verify(tokens, seqs, stream)
        except BaseException:
            self._verify_states = None
            raise

    def begin_verify(self, segments: list[Any]) -> None:
        """What is pending folded in, then the verify's :class:`RowStates` set up: each
        sequence's first row."""
        self.flush_pending()
        first, row = {}, 0
        for segment in segments:
            first[segment.seq.seq_id], row = row, row + len(segment.token_ids)
        self._verify_states = RowStates(first, [])

    def verdict(self, seqs: Any, rows: Any, accepted: Any, stream: Any) -> bool:
        """The derived verdict (the cached lengths rewound); a sequence that kept fewer rows than
        it verified has the states after its last kept row pending in its slot, folded in by
        :meth:`flush_pending` before anything reads the slot."""
        states = self._verify_states
        if states is not None and any(seq.seq_id not in states.first_row for seq in seqs):
            raise CacheError("verdict for a sequence the last verify did not run")
        super().verdict(seqs, rows, accepted, stream)
        if states is not None:
            for seq, count, kept in zip(seqs, rows, accepted):
                if kept + 1 < count and seq.state_slot is not None:
                    self._pending[seq.state_slot] = (seq, states, states.first_row[seq.seq_id] + kept)
        # The row states live on only through what is pending (freed by the flush).
        self._verify_states = None
        return True

    def flush_pending(self) -> None:
        """Fold every pending verdict into its slot: the conv and recurrent states after the
        sequence's last kept row, copied from the verify's :class:`RowStates`. A slot whose
        sequence let it go since (finished, aborted, preempted) is skipped: its next owner starts
        from its own state."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        with self.backend.activate():
            for slot, (seq, states, row) in pending.items():
                if seq.state_slot != slot:
                    continue
                for cache_layer, conv_rows, state_rows in states.layers:
                    cache_layer.conv[slot] = conv_rows[row]
                    cache_layer.state[slot] = state_rows[row]

    def normalize_ssm_states(self, seq: SequenceState, stream: Any) -> None:
        """Raise :class:`~metrale.errors.NonFiniteStateError` if the sequence's recurrent or conv
        state holds NaN or infinity (never rescales)."""
        self.flush_pending()
        slot = seq.state_slot
        if slot is None:
            return
        xp = self.backend.xp
        for index, layer in enumerate(self._require_cache().layers):
            if hasattr(layer, "state"):
                # On the backend's stream: after the step that wrote the state.
                with self.backend.activate():
                    finite = bool(xp.isfinite(layer.state[slot]).all()) and bool(xp.isfinite(layer.conv[slot]).all())
                if not finite:
                    raise NonFiniteStateError(
                        f"sequence {seq.seq_id}: the recurrent state of layer {index} holds NaN or infinity"
                    )

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoraLayout:
        c, backend, limits = self.config, self.backend, {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
        stacks = []
        for index, layer in enumerate(self.layers):
            ffn = layer.feed_forward
            layer_stacks = layer.mixer.enable_lora(backend, limits)
            if isinstance(ffn, SparseMoe):
                layer_stacks += mlp_lora(backend, ffn.shared, c.hidden_size, c.shared_expert_intermediate_size, limits,
                                         "mlp.shared_expert")
            else:
                layer_stacks += mlp_lora(backend, ffn, c.hidden_size, c.intermediate_size, limits)
            stacks += [(index, stack) for stack in layer_stacks]
        refused = {
            r"mlp\.experts(\..*)?": "LoRA on the routed experts is not served (only on the shared expert and the "
                                    "dense layers' MLPs)",
            r"mlp\.(gate|shared_expert_gate)": "the router and the shared expert's gate are not LoRA targets",
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
            self.step_outputs = {"hidden": self.backend.ops.rmsnorm(x + residual, self.ends.norm, eps, 1.0)}
        return self.ends.logits(self.backend, x, residual, batch, eps, 1.0)

    def layer_forward(self, layer: GdnLayer, cache_layer: Any, x: Any, residual: Any,
                      batch: ForwardBatch) -> tuple[Any, Any]:
        """One decoder layer: ``(out, residual)`` from its input ``x + residual``."""
        ops, eps = self.backend.ops, self.config.rms_norm_eps
        mixer, ffn = layer.mixer, layer.feed_forward
        if isinstance(mixer, GatedAttention):
            x, residual = mixer.forward(self.backend, self.inv_freq, cache_layer, x, residual, layer.input_norm,
                                        eps, batch)
        else:
            x, residual = mixer.forward(self.backend, cache_layer, x, residual, layer.input_norm, eps, batch,
                                        self._verify_states if self.verifying else None)
        h, residual = ops.rmsnorm_residual(x, residual, layer.post_norm, eps, 1.0)
        if isinstance(ffn, SparseMoe):
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

    def route(self, moe: SparseMoe, h: Any) -> tuple[Any, Any]:
        """The experts ``moe`` chooses for ``h`` (a method of the model, so tests can record it)."""
        return moe.route(self.backend, h)
