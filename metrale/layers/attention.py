"""Grouped-query attention over the paged KV cache: its geometry, weights, loading and forward.

A public building block: any family may build its model from it (the dense family does).
Weights are held fused (one ``qkv`` matrix), so the block runs one matrix product per input.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from metrale.backends.parallel import Shard
from metrale.batch import ForwardBatch
from metrale.errors import ConfigError, QuantizationError
from metrale.layers.lora import linear_with_lora, normed_projection
from metrale.loading.checkpoint import Checkpoint


@dataclass(frozen=True)
class AttentionGeometry:
    """Heads and sizes of one attention block. ``inv_freq`` is the RoPE table; ``rotary_dim``
    the dims of each head it rotates (partial rotary), None for ``2 * len(inv_freq)``.
    ``softcap`` caps the attention logits to ``softcap * tanh(logit / softcap)`` before the
    softmax (Gemma-2's ``attn_logit_softcapping``; None: off); with ``sinks`` each query head has a
    learned sink logit (``{prefix}.sinks``, GPT-OSS) in its softmax's denominator, never attended.
    Both reach the ``paged_attention`` op (:mod:`metrale.ops`), so a family with them needs no
    attention of its own. ``query_scale`` replaces the logits' ``head_dim ** -0.5`` (Gemma's
    ``query_pre_attn_scalar ** -0.5``); ``norm_offset`` is added to the q/k norm weights (1.0 for a
    zero-centred norm, Gemma-3's ``x * (1 + w)``)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: np.ndarray
    attention_factor: float = 1.0
    sliding_window: int | None = None
    norm_eps: float = 1e-6
    rotary_dim: int | None = None
    softcap: float | None = None
    sinks: bool = False
    query_scale: float | None = None
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, numbers.Real)
                                         or not 0 < self.softcap < float("inf")):
            raise ConfigError(f"attention softcap must be a positive number or None, got {self.softcap!r}")
        if not isinstance(self.sinks, bool):
            raise ConfigError(f"attention sinks must be True or False, got {self.sinks!r}")
        if self.query_scale is not None and (isinstance(self.query_scale, bool)
                                             or not isinstance(self.query_scale, numbers.Real)
                                             or not 0 < self.query_scale < float("inf")):
            raise ConfigError(f"attention query_scale must be a positive number or None, got {self.query_scale!r}")

    @property
    def scale(self) -> float:
        """The factor of the attention logits ``q . k``."""
        return float(self.query_scale) if self.query_scale is not None else self.head_dim**-0.5


@dataclass
class AttentionWeights:
    """``qkv [(n_h + 2 n_kv) d, H]``, ``o [H, n_h d]``; optional biases and per-head q/k norms;
    the sink logits ``sinks [n_h]`` (a constant) of a geometry with sinks; the adapter slots of
    the two products when LoRA is on (:mod:`metrale.layers.lora`)."""

    qkv: Any
    o: Any
    qkv_bias: Any = None
    o_bias: Any = None
    q_norm: Any = None
    k_norm: Any = None
    lora_qkv: Any = None
    lora_o: Any = None
    sinks: Any = None
    #: The checkpoint's static FP8 scales of the cached keys and values (None: none,
    #: :func:`load_kv_cache_scales`); an FP8 cache quantizes with them.
    k_scale: float | None = None
    v_scale: float | None = None
    #: On a rank of a tensor-parallel group: the rank's rows of ``q_proj`` and of ``k_proj`` /
    #: ``v_proj`` (``o_proj``'s columns are its query rows), and those projections' whole output
    #: sizes; None on a whole model. The adapter stacks take the same parts of an adapter.
    shard_rows: tuple[slice, slice] | None = None
    module_sizes: tuple[int, int] | None = None


#: Where checkpoints store the static FP8 KV-cache scales of an attention block ``{prefix}``
#: (compressed-tensors' ``kv_cache_scheme``): ``{prefix}.k_scale``, or on the projection.
KV_SCALE_NAMES = {"k": ("k_scale", "k_proj.k_scale"), "v": ("v_scale", "v_proj.v_scale")}


def load_kv_cache_scales(checkpoint: Checkpoint, prefix: str) -> tuple[float | None, float | None]:
    """``(k_scale, v_scale)``: the static FP8 KV-cache scales the checkpoint stores for the
    attention block ``prefix`` (:data:`KV_SCALE_NAMES`), None where it stores none.

    Every such tensor is read (so consumed), whatever cache the engine keeps: a bf16 or float32
    cache ignores them. A scale of several values (per head) counts as its largest, so no head's
    values saturate sooner than its own scale makes them; one not positive raises
    :class:`~metrale.errors.QuantizationError`."""
    scales: dict[str, float | None] = {}
    for kind, suffixes in KV_SCALE_NAMES.items():
        found = [checkpoint.tensor(f"{prefix}.{suffix}") for suffix in suffixes if checkpoint.has(f"{prefix}.{suffix}")]
        if not found:
            scales[kind] = None
            continue
        value = float(np.max(found[0])) if found[0].size else 0.0
        if not value > 0:
            raise QuantizationError(f"{prefix}.{suffixes[0]}: a KV-cache scale must be positive, got {value}")
        scales[kind] = value
    return scales["k"], scales["v"]


def sharded_geometry(geometry: AttentionGeometry, shard: Shard) -> AttentionGeometry:
    """The geometry of ``shard``'s part of an attention block: its query heads and its key/value
    heads (split, or the one it shares, :meth:`~metrale.backends.parallel.Shard.kv_heads`)."""
    if not shard.sharded:
        return geometry
    heads = shard.split(geometry.num_heads, "num_attention_heads")
    kv = shard.kv_heads(geometry.num_heads, geometry.num_kv_heads)
    return replace(geometry, num_heads=heads.stop - heads.start, num_kv_heads=kv.stop - kv.start)


def load_attention_weights(
    checkpoint: Checkpoint,
    backend: Any,
    prefix: str,
    geometry: AttentionGeometry,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
) -> AttentionWeights:
    """Read ``{prefix}.{q,k,v,o}_proj`` (and biases / ``q_norm`` / ``k_norm``, ``{prefix}.sinks``
    when ``geometry.sinks``, the static KV-cache scales where the checkpoint has them,
    :func:`load_kv_cache_scales`) and fuse q, k, v.

    ``geometry`` is the whole block's; on a rank of a tensor-parallel group (``backend.shard``)
    the rank's heads only (:func:`sharded_geometry`): q, k and v rows of its heads, ``o_proj``'s
    columns of its query heads (the ranks' outputs are summed, ``o_proj``'s bias added on rank 0
    only; the sinks of its query heads)."""
    g, shard = geometry, backend.shard
    q_rows, kv_rows, d = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, g.head_dim
    heads = shard.split(g.num_heads, "num_attention_heads")
    kv = shard.kv_heads(g.num_heads, g.num_kv_heads)
    q_part, kv_part = slice(heads.start * d, heads.stop * d), slice(kv.start * d, kv.stop * d)
    weights = AttentionWeights(
        qkv=backend.load_weight(
            checkpoint,
            (f"{prefix}.q_proj.weight", (q_rows, g.hidden_size), q_part, None),
            (f"{prefix}.k_proj.weight", (kv_rows, g.hidden_size), kv_part, None),
            (f"{prefix}.v_proj.weight", (kv_rows, g.hidden_size), kv_part, None),
        ),
        o=backend.load_weight(checkpoint, (f"{prefix}.o_proj.weight", (g.hidden_size, q_rows), None, q_part)),
    )
    if shard.sharded:
        weights.shard_rows, weights.module_sizes = (q_part, kv_part), (q_rows, kv_rows)
    if qkv_bias:
        biases = [
            checkpoint.tensor(f"{prefix}.q_proj.bias", (q_rows,))[q_part],
            checkpoint.tensor(f"{prefix}.k_proj.bias", (kv_rows,))[kv_part],
            checkpoint.tensor(f"{prefix}.v_proj.bias", (kv_rows,))[kv_part],
        ]
        weights.qkv_bias = backend.constant(np.concatenate(biases))
    if o_bias:
        bias = checkpoint.tensor(f"{prefix}.o_proj.bias", (g.hidden_size,))
        weights.o_bias = backend.constant(bias) if shard.rank == 0 else None
    if qk_norm:
        weights.q_norm = backend.load_weight(checkpoint, (f"{prefix}.q_norm.weight", (g.head_dim,)))
        weights.k_norm = backend.load_weight(checkpoint, (f"{prefix}.k_norm.weight", (g.head_dim,)))
    if g.sinks:
        weights.sinks = backend.constant(checkpoint.tensor(f"{prefix}.sinks", (g.num_heads,))[heads])
    weights.k_scale, weights.v_scale = load_kv_cache_scales(checkpoint, prefix)
    return weights


def attention_block(
    backend: Any, geometry: AttentionGeometry, weights: AttentionWeights, cache_layer: Any, h: Any, batch: ForwardBatch
) -> Any:
    """Causal GQA self-attention of ``h [N, H]``; writes the rows' K/V into ``cache_layer``.

    ``geometry.inv_freq`` must be a backend array (``backend.constant``).
    """
    qkv = linear_with_lora(backend, h, weights.qkv, weights.qkv_bias, weights.lora_qkv, batch)
    return attention_from_qkv(backend, geometry, weights, cache_layer, qkv, batch)


def normed_attention_block(
    backend: Any, geometry: AttentionGeometry, weights: AttentionWeights, cache_layer: Any, x: Any, residual: Any,
    norm_weight: Any, eps: float, batch: ForwardBatch, norm_offset: float = 0.0,
) -> tuple[Any, Any]:
    """:func:`attention_block` of ``rmsnorm(x + residual)`` (the pre-norm of a decoder layer,
    through the ``rmsnorm_linear`` op: one kernel with the qkv projection where the backend has
    one; the norm and the product apart when the step has adapter rows); returns ``(attention
    output, x + residual)``."""
    qkv, summed = normed_projection(backend, x, residual, norm_weight, eps, weights.qkv, weights.lora_qkv, batch,
                                    offset=norm_offset, bias=weights.qkv_bias)
    return attention_from_qkv(backend, geometry, weights, cache_layer, qkv, batch), summed


def attention_from_qkv(
    backend: Any, geometry: AttentionGeometry, weights: AttentionWeights, cache_layer: Any, qkv: Any, batch: ForwardBatch
) -> Any:
    """The rest of :func:`attention_block` after the qkv projection: RoPE and the cache write,
    attention, the output projection."""
    ops, g = backend.ops, geometry
    partial: dict[str, Any] = {} if g.rotary_dim is None else {"rotary_dim": g.rotary_dim}
    if g.norm_offset:
        partial["norm_offset"] = g.norm_offset
    q = ops.qkv_rope_cache(
        qkv, batch.positions, batch.slot_mapping, g.inv_freq, g.attention_factor, g.num_heads, g.num_kv_heads,
        g.head_dim, cache_layer.k, cache_layer.v, weights.q_norm, weights.k_norm, g.norm_eps, **partial,
    )
    # (Only the options a block has: a plugin kernel of paged_attention may predate them.)
    options = {"softcap": g.softcap} if g.softcap is not None else {}
    if weights.sinks is not None:
        options["sinks"] = weights.sinks
    out = ops.paged_attention(q, cache_layer.k, cache_layer.v, batch, g.scale, g.sliding_window, **options)
    # (On a rank of a tensor-parallel group: its heads' part of o_proj, summed over the ranks.)
    return backend.all_reduce(linear_with_lora(backend, out, weights.o, weights.o_bias, weights.lora_o, batch))
