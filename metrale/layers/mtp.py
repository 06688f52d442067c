"""The multi-token-prediction (MTP) block that DeepSeek-V3 (MLA family) and Qwen3-Next (GDN
family) checkpoints carry beside the main model (:ref:`families-mtp`).

For a row at position ``i`` with the main model's final state ``h_i`` and the next token
``t_{i+1}``, the block computes ``projection([embedding_norm(E[t_{i+1}]); hidden_norm(h_i)])``,
runs it through one decoder layer of its family (with a cache layer of its own), then
``head_norm`` and the main model's LM head: the logits of ``t_{i+2}``. The families differ in
where the tensors live (:class:`MtpTensors`), in the decoder layer, and in their norms (plain or
zero-centred, ``1 + w``: the norm ``offset``). The ``mtp`` drafter (:mod:`metrale.plugins.mtp`)
runs the block through its model's ``mtp_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from metrale.batch import ForwardBatch
from metrale.layers.loading import DecoderEnds
from metrale.loading.checkpoint import Checkpoint


@dataclass(frozen=True)
class MtpTensors:
    """Where a checkpoint keeps one MTP module: the names of its four own weights, and the
    tensors of its decoder layer that must be present too (``layer_parts``) for the module to
    count as complete."""

    embedding_norm: str  # [H]
    hidden_norm: str  # [H]
    projection: str  # [H, 2H]
    head_norm: str  # [H]
    layer_parts: tuple[str, ...] = ()

    @property
    def required(self) -> tuple[str, ...]:
        """Every tensor a complete module has."""
        return (self.embedding_norm, self.hidden_norm, self.projection, self.head_norm, *self.layer_parts)


@dataclass
class MtpModule:
    """One MTP module: the norms of the token's embedding and of the main model's state
    ``[H]``, the projection of the two joined ``[H, 2H]``, the family's decoder ``layer``, the
    norm before the LM head ``[H]``, and the ``offset`` of every norm (``1.0``: zero-centred)."""

    embedding_norm: Any
    hidden_norm: Any
    projection: Any
    layer: Any
    head_norm: Any
    offset: float = 0.0

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, tensors: MtpTensors, hidden_size: int,
             load_layer: Callable[[], Any], offset: float = 0.0) -> "MtpModule | None":
        """The module at ``tensors`` with the decoder layer ``load_layer()`` reads, or None when
        ``checkpoint`` lacks any of :attr:`MtpTensors.required` (nothing is loaded then)."""
        if not all(checkpoint.has(name) for name in tensors.required):
            return None
        vector = (hidden_size,)
        embedding_norm = backend.load_weight(checkpoint, (tensors.embedding_norm, vector))
        hidden_norm = backend.load_weight(checkpoint, (tensors.hidden_norm, vector))
        projection = backend.load_weight(checkpoint, (tensors.projection, (hidden_size, 2 * hidden_size)))
        layer = load_layer()
        head_norm = backend.load_weight(checkpoint, (tensors.head_norm, vector))
        return cls(embedding_norm, hidden_norm, projection, layer, head_norm, offset)

    def forward(self, backend: Any, ends: DecoderEnds, batch: ForwardBatch, hidden: Any, eps: float,
                run_layer: Callable[[Any, Any], tuple[Any, Any]]) -> tuple[Any, Any]:
        """The module over ``batch`` (row ``i``'s token is ``t_{i+1}``) with the main model's
        final states ``hidden [rows, H]`` float32: ``(logits [rows, V], the module's output
        states [rows, H])``. ``run_layer(layer, x)`` runs the family's decoder layer over ``x``
        (no residual yet) in the module's cache layer and returns ``(out, residual)``."""
        ops, offset = backend.ops, self.offset
        embedded = ops.rmsnorm(ends.embed_tokens(backend, batch), self.embedding_norm, eps, offset)
        joined = backend.xp.concatenate([embedded, ops.rmsnorm(hidden, self.hidden_norm, eps, offset)], axis=1)
        x, residual = run_layer(self.layer, ops.linear(joined, self.projection))
        logits, summed = ops.rmsnorm_linear(x, residual, self.head_norm, eps, offset, ends.lm_head)
        return ends.gather_logits(backend, logits), summed
