"""The blocks of a GPT-NeoX layer, each with its weights, its loading and its forward.

Attention reuses Metrale's :class:`~metrale.layers.attention.AttentionGeometry` and
:class:`~metrale.layers.attention.AttentionWeights`; its forward is written here because it
passes ``rotary_dim`` (partial rotary) to ``qkv_rope_cache``. The norms are LayerNorms with a
bias and the MLP is a plain GELU MLP with biases, so both are written here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from metrale.batch import ForwardBatch
from metrale.checkpoint import Checkpoint
from metrale.layers.attention import AttentionGeometry, AttentionWeights


@dataclass
class LayerNormWeights:
    """``weight [H]`` (a matrix-product weight: bf16 on the GPU) and ``bias [H]`` (float32)."""

    weight: Any
    bias: Any

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, size: int) -> "LayerNormWeights":
        """Read ``{prefix}.weight`` and ``{prefix}.bias``."""
        return cls(
            weight=backend.load_weight(checkpoint, (f"{prefix}.weight", (size,))),
            bias=backend.constant(checkpoint.tensor(f"{prefix}.bias", (size,))),
        )


def regroup_qkv_rows(rows: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """GPT-NeoX's fused ``query_key_value`` rows, ``[q k v]`` of ``head_dim`` rows each per head
    (``[n_h * 3 * d, ...]``), as ``[q of every head | k of every head | v of every head]``: the
    layout ``qkv_rope_cache`` splits. Works on a weight ``[3 H, H]`` and on a bias ``[3 H]``."""
    per_head = rows.reshape(num_heads, 3, head_dim, *rows.shape[1:])
    return np.ascontiguousarray(np.swapaxes(per_head, 0, 1).reshape(rows.shape))


@dataclass
class NeoxAttention:
    """Multi-head attention with partial rotary: ``qkv`` regrouped at load, RoPE on the first
    ``rotary_dim`` dims of each head (half-split pairs), then ``dense``."""

    geometry: AttentionGeometry
    rotary_dim: int
    weights: AttentionWeights

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, geometry: AttentionGeometry, rotary_dim: int,
             *, bias: bool) -> "NeoxAttention":
        """Read ``{prefix}.query_key_value`` and ``{prefix}.dense`` (with their biases when
        ``bias``), regrouping the fused rows once, on the host."""
        g, hidden = geometry, geometry.hidden_size
        qkv = checkpoint.tensor(f"{prefix}.query_key_value.weight", (3 * hidden, hidden))
        weights = AttentionWeights(
            qkv=backend.weight(regroup_qkv_rows(qkv, g.num_heads, g.head_dim)),
            o=backend.load_weight(checkpoint, (f"{prefix}.dense.weight", (hidden, hidden))),
        )
        if bias:
            qkv_bias = checkpoint.tensor(f"{prefix}.query_key_value.bias", (3 * hidden,))
            weights.qkv_bias = backend.constant(regroup_qkv_rows(qkv_bias, g.num_heads, g.head_dim))
            weights.o_bias = backend.constant(checkpoint.tensor(f"{prefix}.dense.bias", (hidden,)))
        return cls(geometry, rotary_dim, weights)

    def forward(self, backend: Any, cache_layer: Any, h: Any, batch: ForwardBatch) -> Any:
        """Causal self-attention of ``h [N, H]``; writes the rows' K/V into ``cache_layer``."""
        ops, g, w = backend.ops, self.geometry, self.weights
        qkv = ops.linear(h, w.qkv, w.qkv_bias)
        q = ops.qkv_rope_cache(
            qkv, batch.positions, batch.slot_mapping, g.inv_freq, g.attention_factor, g.num_heads, g.num_kv_heads,
            g.head_dim, cache_layer.k, cache_layer.v, None, None, g.norm_eps, 0.0, False, rotary_dim=self.rotary_dim,
        )
        out = ops.paged_attention(q, cache_layer.k, cache_layer.v, batch, g.scale, None)
        return ops.linear(out, w.o, w.o_bias)


@dataclass
class GeluMlp:
    """``dense_4h_to_h(gelu(dense_h_to_4h(h)))``: ``up [I, H]``, ``down [H, I]``, both with a bias."""

    up: Any
    up_bias: Any
    down: Any
    down_bias: Any
    #: "none" (erf GELU) or "tanh".
    approximate: str

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, hidden_size: int, intermediate_size: int,
             approximate: str) -> "GeluMlp":
        """Read ``{prefix}.dense_h_to_4h`` and ``{prefix}.dense_4h_to_h`` with their biases."""
        up, down = f"{prefix}.dense_h_to_4h", f"{prefix}.dense_4h_to_h"
        return cls(
            up=backend.load_weight(checkpoint, (f"{up}.weight", (intermediate_size, hidden_size))),
            up_bias=backend.constant(checkpoint.tensor(f"{up}.bias", (intermediate_size,))),
            down=backend.load_weight(checkpoint, (f"{down}.weight", (hidden_size, intermediate_size))),
            down_bias=backend.constant(checkpoint.tensor(f"{down}.bias", (hidden_size,))),
            approximate=approximate,
        )

    def forward(self, backend: Any, h: Any) -> Any:
        ops = backend.ops
        return ops.linear(ops.gelu(ops.linear(h, self.up, self.up_bias), self.approximate), self.down, self.down_bias)


@dataclass
class NeoxLayer:
    """One GPT-NeoX layer.

    Parallel residual: ``x + attention(ln_in(x)) + mlp(ln_post(x))``; sequential:
    ``y = x + attention(ln_in(x))``, then ``y + mlp(ln_post(y))``.
    """

    input_norm: LayerNormWeights
    attention: NeoxAttention
    post_norm: LayerNormWeights
    mlp: GeluMlp
    parallel: bool
    eps: float

    def forward(self, backend: Any, x: Any, residual: Any, cache_layer: Any, batch: ForwardBatch) -> tuple[Any, Any]:
        """``(update, residual)``: the layer's output is ``update + residual``; the add is fused
        into the next norm. ``residual`` None means the stream is ``x`` itself (the first layer)."""
        ops, eps = backend.ops, self.eps
        h, stream = ops.layernorm_residual(x, residual, self.input_norm.weight, self.input_norm.bias, eps)
        if self.parallel:
            h_mlp = ops.layernorm(stream, self.post_norm.weight, self.post_norm.bias, eps)
            return self.attention.forward(backend, cache_layer, h, batch) + self.mlp.forward(backend, h_mlp), stream
        attended = self.attention.forward(backend, cache_layer, h, batch)
        h, stream = ops.layernorm_residual(attended, stream, self.post_norm.weight, self.post_norm.bias, eps)
        return self.mlp.forward(backend, h), stream
