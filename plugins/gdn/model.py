"""The Qwen3-Next hybrid decoder (:ref:`families-gdn`): gated attention and Gated DeltaNet layers.

Full-attention layers keep K and V in paged blocks; Gated DeltaNet layers keep, per sequence, a
conv state (the last ``K - 1`` conv inputs, ``[C, K - 1]``) and a float32 recurrent state
``[H_v, d_k, d_v]`` in the sequence's state slot; the state carries across chunks and calls.
Every norm of the decoder is zero-centred (``1 + w``) except the gated output norm of the GDN
layers.

Decode rows run on backend ops (the conv update and one recurrence step per row, in place in the
slots the batch names, the dummy slot for padding rows). Prompt tokens run their conv per
sequence on the backend's array module (``backend.xp``), then the gated delta rule of every
sequence in one op, ``gdn_prompt_rule`` (on the CPU the chunked form, chunks of
:data:`metrale.kernels.gated_delta.CHUNK` tokens; on the GPU a kernel that keeps the state in
registers). Decode steps are captured into CUDA graphs like the dense family's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec, RecurrentStateSpec
from metrale.checkpoint import Checkpoint
from metrale.errors import NonFiniteStateError
from metrale.family import FamilyModel
from metrale.plugins.dense.layers import MlpWeights, load_mlp_weights, swiglu_mlp
from metrale.plugins.gdn.config import GdnConfig
from metrale.plugins.mla.model import as_float32
from metrale.plugins.moe_layers import StackedExperts, load_stacked_experts, routed_experts
from metrale.sequence import SequenceState

#: Tokens per chunk of the chunked gated delta rule.
#: transformers' fixed eps of the q / k L2 normalisation.
L2_NORM_EPS = 1e-6
IGNORED_TENSOR_PREFIXES = ("mtp.",)  # multi-token prediction: transformers has none for Qwen3-Next


@dataclass
class GatedAttentionWeights:
    """``q [n_h 2d, H]`` (per head: query rows, then gate rows), ``kv [2 n_kv d, H]``, ``o``,
    zero-centred ``q_norm`` / ``k_norm [d]``."""

    q: Any
    kv: Any
    o: Any
    q_norm: Any
    k_norm: Any


@dataclass
class DeltaNetWeights:
    """``qkvz [2 H_k d_k + 2 H_v d_v, H]`` and ``ba [2 H_v, H]`` (grouped by key head), the conv
    weight ``[C, K]``, ``A_log`` and ``dt_bias [H_v]``, the gated norm ``[d_v]``, ``out``."""

    qkvz: Any
    ba: Any
    conv: Any
    a_log: Any
    dt_bias: Any
    norm: Any
    out: Any


@dataclass
class SparseMoeWeights:
    """Softmax router ``gate [E, H]``, routed experts, the shared expert and its gate ``[1, H]``."""

    gate: Any
    experts: StackedExperts
    shared: MlpWeights
    shared_gate: Any


@dataclass
class GdnLayer:
    input_norm: Any
    post_norm: Any
    attention: GatedAttentionWeights | None = None
    delta: DeltaNetWeights | None = None
    mlp: MlpWeights | None = None
    moe: SparseMoeWeights | None = None


def l2_normalised(xp: Any, x: Any) -> Any:
    return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + np.float32(L2_NORM_EPS))


class GdnModel(FamilyModel):
    """A loaded Qwen3-Next model."""


    def __init__(self, config: GdnConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        # Only attention layers rotate; without one, head_dim is not checked against any tensor.
        self.inv_freq = backend.constant(c.rope.inverse_frequencies()) if "full_attention" in c.layer_types else None
        vector = (c.hidden_size,)
        self.embed = backend.load_weight(checkpoint, ("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
        self.layers = []
        for index in range(c.num_layers):
            prefix = f"model.layers.{index}"
            layer = GdnLayer(
                input_norm=backend.load_weight(checkpoint, (f"{prefix}.input_layernorm.weight", vector)),
                post_norm=backend.load_weight(checkpoint, (f"{prefix}.post_attention_layernorm.weight", vector)),
            )
            if c.layer_types[index] == "full_attention":
                layer.attention = self._load_attention(checkpoint, f"{prefix}.self_attn")
            else:
                layer.delta = self._load_delta(checkpoint, f"{prefix}.linear_attn")
            if c.moe_layers[index]:
                layer.moe = self._load_moe(checkpoint, f"{prefix}.mlp")
            else:
                layer.mlp = load_mlp_weights(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size)
            self.layers.append(layer)
        self.norm = backend.load_weight(checkpoint, ("model.norm.weight", vector))
        if c.tie_word_embeddings and not checkpoint.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = backend.load_weight(checkpoint, ("lm_head.weight", (c.vocab_size, c.hidden_size)))
        checkpoint.skip([n for n in checkpoint.names() if n.startswith(IGNORED_TENSOR_PREFIXES)])

    # ------------------------------------------------------------------------------ loading

    def _load_attention(self, checkpoint: Checkpoint, prefix: str) -> GatedAttentionWeights:
        c, backend = self.config, self.backend
        d, hidden = c.head_dim, c.hidden_size
        return GatedAttentionWeights(
            q=backend.load_weight(checkpoint, (f"{prefix}.q_proj.weight", (c.num_heads * 2 * d, hidden))),
            kv=backend.load_weight(checkpoint, (f"{prefix}.k_proj.weight", (c.num_kv_heads * d, hidden)),
                                   (f"{prefix}.v_proj.weight", (c.num_kv_heads * d, hidden))),
            o=backend.load_weight(checkpoint, (f"{prefix}.o_proj.weight", (hidden, c.num_heads * d))),
            q_norm=backend.load_weight(checkpoint, (f"{prefix}.q_norm.weight", (d,))),
            k_norm=backend.load_weight(checkpoint, (f"{prefix}.k_norm.weight", (d,))),
        )

    def _load_delta(self, checkpoint: Checkpoint, prefix: str) -> DeltaNetWeights:
        c, backend = self.config, self.backend
        hidden, hk, hv, dk, dv = (c.hidden_size, c.linear_key_heads, c.linear_value_heads, c.linear_key_dim,
                                  c.linear_value_dim)
        return DeltaNetWeights(
            qkvz=backend.load_weight(checkpoint, (f"{prefix}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, hidden))),
            ba=backend.load_weight(checkpoint, (f"{prefix}.in_proj_ba.weight", (2 * hv, hidden))),
            conv=backend.constant(checkpoint.tensor(f"{prefix}.conv1d.weight", (c.conv_channels, 1, c.conv_kernel))
                                  .reshape(c.conv_channels, c.conv_kernel)),
            a_log=backend.constant(checkpoint.tensor(f"{prefix}.A_log", (hv,))),
            dt_bias=backend.constant(checkpoint.tensor(f"{prefix}.dt_bias", (hv,))),
            norm=backend.constant(checkpoint.tensor(f"{prefix}.norm.weight", (dv,))),
            out=backend.load_weight(checkpoint, (f"{prefix}.out_proj.weight", (hidden, hv * dv))),
        )

    def _load_moe(self, checkpoint: Checkpoint, prefix: str) -> SparseMoeWeights:
        c, backend = self.config, self.backend
        hidden = c.hidden_size
        return SparseMoeWeights(
            gate=backend.constant(checkpoint.tensor(f"{prefix}.gate.weight", (c.num_experts, hidden))),
            experts=load_stacked_experts(checkpoint, backend, f"{prefix}.experts", c.num_experts, hidden,
                                         c.moe_intermediate_size),
            shared=load_mlp_weights(checkpoint, backend, f"{prefix}.shared_expert", hidden,
                                    c.shared_expert_intermediate_size),
            shared_gate=backend.constant(checkpoint.tensor(f"{prefix}.shared_expert_gate.weight", (1, hidden))),
        )

    # ------------------------------------------------------------------------------ contract

    def cache_spec(self) -> CacheSpec:
        c = self.config
        state = RecurrentStateSpec((c.conv_channels, c.conv_kernel - 1),
                                   (c.linear_value_heads, c.linear_key_dim, c.linear_value_dim))
        return CacheSpec(tuple(
            PagedKVSpec(c.num_kv_heads, c.head_dim) if kind == "full_attention" else state for kind in c.layer_types
        ))

    #: Tokens at least left after the tail split (``prefill_tail_split``).
    min_tail = 256

    def prefill_tail_split(self, tokens: Any) -> int | None:
        """Where to split a prompt so a state snapshot lands near its tail (prefix cache on):
        with block size ``bs`` and ``tb`` the last multiple of ``bs`` strictly below the length,
        ``min(tb - bs, floor((len - min_tail) / bs) * bs)``, or None when that is not positive
        (and always None with the prefix cache off)."""
        if not self.prefix_caching or self.cache is None:
            return None
        size, length = self.cache.block_size, len(tokens)
        below = (length - 1) // size * size
        split = min(below - size, (length - self.min_tail) // size * size)
        return split if split > 0 else None

    def normalize_ssm_states(self, seq: SequenceState, stream: Any) -> None:
        """Raise :class:`~metrale.errors.NonFiniteStateError` if the sequence's recurrent or conv
        state holds NaN or infinity (never rescales)."""
        slot = seq.state_slot
        if slot is None:
            return
        xp = self.backend.xp
        for index, layer in enumerate(self._require_cache().layers):
            if hasattr(layer, "state"):
                finite = bool(xp.isfinite(layer.state[slot]).all()) and bool(xp.isfinite(layer.conv[slot]).all())
                if not finite:
                    raise NonFiniteStateError(
                        f"sequence {seq.seq_id}: the recurrent state of layer {index} holds NaN or infinity"
                    )

    def forward_batch(self, batch: ForwardBatch) -> Any:
        ops, eps = self.backend.ops, self.config.rms_norm_eps
        x = ops.embedding(self.embed, batch.token_ids)
        residual = None
        for layer, cache_layer in zip(self.layers, self.cache.layers):
            h, residual = ops.rmsnorm_residual(x, residual, layer.input_norm, eps, 1.0)
            if layer.attention is not None:
                x = self._attention(layer.attention, cache_layer, h, batch)
            else:
                x = self._delta(layer.delta, cache_layer, h, batch)
            h, residual = ops.rmsnorm_residual(x, residual, layer.post_norm, eps, 1.0)
            x = swiglu_mlp(self.backend, layer.mlp, h) if layer.moe is None else self._moe(layer.moe, h)
        rows = batch.logits_rows
        h, _ = ops.rmsnorm_residual(x[rows], residual[rows], self.norm, eps, 1.0)
        return ops.linear(h, self.lm_head)

    # -------------------------------------------------------------------------------- mixers

    def _attention(self, w: GatedAttentionWeights, cache_layer: Any, h: Any, batch: ForwardBatch) -> Any:
        ops, c, xp = self.backend.ops, self.config, self.backend.xp
        rows, heads, d = h.shape[0], c.num_heads, c.head_dim
        projected = ops.linear(h, w.q).reshape(rows, heads, 2 * d)
        query = xp.ascontiguousarray(projected[:, :, :d]).reshape(rows, heads * d)
        gate = projected[:, :, d:].reshape(rows, heads * d)
        qkv = xp.concatenate([query, ops.linear(h, w.kv)], axis=1)
        q = ops.qkv_rope_cache(
            qkv, batch.positions, batch.slot_mapping, self.inv_freq, 1.0, heads, c.num_kv_heads, d,
            cache_layer.k, cache_layer.v, w.q_norm, w.k_norm, c.rms_norm_eps, 1.0,
        )
        out = ops.paged_attention(q, cache_layer.k, cache_layer.v, batch, d**-0.5, None)
        return ops.linear(ops.sigmoid_gate(out, gate), w.o)

    def _delta(self, w: DeltaNetWeights, cache_layer: Any, h: Any, batch: ForwardBatch) -> Any:
        ops, c, xp = self.backend.ops, self.config, self.backend.xp
        rows = h.shape[0]
        hk, hv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
        ratio = hv // hk
        # Un-group the projections (grouped by key head in the checkpoint, docs/families.rst, "Gated DeltaNet layer", step 2).
        grouped = ops.linear(h, w.qkvz).reshape(rows, hk, 2 * dk + 2 * ratio * dv)
        q = grouped[:, :, :dk].reshape(rows, hk * dk)
        k = grouped[:, :, dk : 2 * dk].reshape(rows, hk * dk)
        v = grouped[:, :, 2 * dk : 2 * dk + ratio * dv].reshape(rows, hv * dv)
        z = grouped[:, :, 2 * dk + ratio * dv :].reshape(rows, hv, dv)
        ba = ops.linear(h, w.ba).reshape(rows, hk, 2 * ratio)
        b, a = ba[:, :, :ratio].reshape(rows, hv), ba[:, :, ratio:].reshape(rows, hv)
        inputs = xp.concatenate([q, k, v], axis=1)  # [N, C]: the conv input
        beta = (1.0 / (1.0 + xp.exp(-b))).astype(xp.float32)
        softplus = xp.logaddexp(0.0, a + w.dt_bias)
        g = (-xp.exp(w.a_log) * softplus).astype(xp.float32)
        if rows == len(batch.row_starts) - 1:
            out = self._delta_decode(w, cache_layer, inputs, g, beta, batch)
        else:
            out = self._delta_prompts(w, cache_layer, inputs, g, beta, batch)
        # Gated norm per value head (plain weight), then out_proj.
        gated = ops.gated_rmsnorm(out, z, w.norm, c.rms_norm_eps)
        return ops.linear(gated.reshape(rows, hv * dv), w.out)

    def _split_heads(self, mixed: Any) -> tuple[Any, Any, Any]:
        """Conv outputs ``[T, C]`` -> L2-normalised (q scaled) q, k expanded to the value heads, v."""
        c, xp = self.config, self.backend.xp
        hk, hv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
        q = l2_normalised(xp, mixed[:, : hk * dk].reshape(-1, hk, dk)) * np.float32(dk**-0.5)
        k = l2_normalised(xp, mixed[:, hk * dk : 2 * hk * dk].reshape(-1, hk, dk))
        v = mixed[:, 2 * hk * dk :].reshape(-1, hv, dv)
        return xp.repeat(q, hv // hk, axis=1), xp.repeat(k, hv // hk, axis=1), v

    def _delta_decode(self, w: DeltaNetWeights, cache_layer: Any, inputs: Any, g: Any, beta: Any,
                      batch: ForwardBatch) -> Any:
        """One token per sequence: the conv update and one recurrence step, in the slots, on ops."""
        ops, xp = self.backend.ops, self.backend.xp
        slots = xp.asarray(batch.state_slots)  # one row per sequence; padding rows: the dummy slot
        mixed = ops.gdn_conv_update(inputs, w.conv, cache_layer.conv, slots)
        q, k, v = self._split_heads(mixed)
        return ops.gdn_recurrent_step(q, k, v, g, beta, cache_layer.state, slots)

    def _delta_prompts(self, w: DeltaNetWeights, cache_layer: Any, inputs: Any, g: Any, beta: Any,
                        batch: ForwardBatch) -> Any:
        """Each sequence's new tokens through the conv, then every sequence through the gated delta
        rule in one op (the chunked form on the CPU)."""
        xp = self.backend.xp
        starts = [int(start) for start in batch.row_starts]
        mixed = xp.empty(inputs.shape, dtype=xp.float32)
        slots = []
        for index, segment in enumerate(batch.segments):
            slot = segment.seq.state_slot
            mixed[starts[index] : starts[index + 1]] = self._conv(w, cache_layer, slot,
                                                                  inputs[starts[index] : starts[index + 1]])
            slots.append(slot)
        q, k, v = self._split_heads(mixed)
        return self.backend.ops.gdn_prompt_rule(q, k, v, g, beta, cache_layer.state, xp.asarray(np.array(slots, np.int32)),
                                                xp.asarray(np.array(starts, np.int32)))

    def _conv(self, w: DeltaNetWeights, cache_layer: Any, slot: int, inputs: Any) -> Any:
        """Causal depthwise conv + SiLU of ``inputs [T, C]`` after the slot's last ``K - 1``
        inputs; the slot keeps the new last ``K - 1``."""
        xp, width = self.backend.xp, self.config.conv_kernel
        history = cache_layer.conv[slot].T  # [K - 1, C]
        window = xp.concatenate([history, inputs.astype(xp.float32)], axis=0)
        count = inputs.shape[0]
        mixed = sum(window[j : j + count] * w.conv[:, j] for j in range(width))
        tail = window[-(width - 1):].T
        cache_layer.conv[slot] = tail
        return mixed / (1.0 + xp.exp(-mixed))

    def route(self, moe: SparseMoeWeights, h: Any) -> tuple[Any, Any]:
        """Top-k experts ``[N, k]`` and weights: softmax over the router logits, renormalised as
        ``norm_topk_prob`` says, no scaling or group limit (:ref:`families-gdn-moe`)."""
        c = self.config
        return self.backend.ops.moe_route(h, moe.gate, None, "greedy", 1, 1, c.num_experts_per_tok,
                                          c.norm_topk_prob, 1.0)

    def _moe(self, moe: SparseMoeWeights, h: Any) -> Any:
        xp = self.backend.xp
        chosen, weights = self.route(moe, h)
        out = routed_experts(self.backend, moe.experts, h, chosen, weights)
        # (A reduction rather than a matrix product: CuPy's cuBLAS calls cannot be graph-captured.)
        shared_gate = (as_float32(self.backend, h) * moe.shared_gate[0]).sum(axis=1, keepdims=True)  # [N, 1]
        return out + swiglu_mlp(self.backend, moe.shared, h) / (1.0 + xp.exp(-shared_gate))

