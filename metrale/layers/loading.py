"""The two ends of a decoder: the token embedding, and the final norm with the LM head.

Shared by every built-in family; public like the other blocks of :mod:`metrale.layers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.loading.checkpoint import Checkpoint


def load_stacked(checkpoint: Checkpoint, backend: Any, *parts: tuple) -> Any:
    """The weight ``parts`` (``(name, shape[, rows, columns])``) stacked along the rows as one
    weight of ``backend``: through ``backend.load_weight``, so a checkpoint that quantizes every
    part keeps the stack quantized; where some parts are quantized and others not (one product
    cannot take both) every part is read dequantized and the stack is a full-precision weight."""
    held = {checkpoint.is_quantized(part[0]) for part in parts}
    if len(held) > 1:
        return backend.weight(np.concatenate([checkpoint.tensor(*part) for part in parts]))
    return backend.load_weight(checkpoint, *parts)


@dataclass
class DecoderEnds:
    """``embed [V, H]``, the final RMSNorm weight ``norm [H]`` and ``lm_head [V, H]`` (the
    embedding itself when the config ties them and the checkpoint has no ``lm_head.weight``);
    ``token_rows``: the rows adapters replace in the two (:func:`metrale.layers.lora.ends_lora`).

    On a rank of a tensor-parallel group whose size divides the vocabulary, ``embed`` and
    ``lm_head`` hold the rank's rows ``vocab_part`` of it: an embedding row is read on the rank
    that holds it (zeros on the others, summed over the ranks), each rank's logits are gathered.
    Otherwise every rank holds the whole of both (``vocab_part`` None)."""

    embed: Any
    norm: Any
    lm_head: Any
    token_rows: dict = field(default_factory=dict)
    vocab_part: slice | None = None

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, *, vocab_size: int, hidden_size: int,
             tie_word_embeddings: bool) -> "DecoderEnds":
        """Read ``model.embed_tokens.weight``, ``model.norm.weight`` and ``lm_head.weight``."""
        shard = backend.shard
        part = shard.split(vocab_size, "vocab_size") if shard.sharded and vocab_size % shard.size == 0 else None
        embed = backend.load_weight(checkpoint, ("model.embed_tokens.weight", (vocab_size, hidden_size), part, None))
        norm = backend.load_weight(checkpoint, ("model.norm.weight", (hidden_size,)))
        if tie_word_embeddings and not checkpoint.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = backend.load_weight(checkpoint, ("lm_head.weight", (vocab_size, hidden_size), part, None))
        return cls(embed, norm, lm_head, vocab_part=part)

    def embed_tokens(self, backend: Any, batch: ForwardBatch) -> Any:
        """``[N, H]`` float32: the embedding rows of the batch's tokens (the rows a row's adapter
        replaces, replaced)."""
        part = self.vocab_part
        if part is None:
            x = backend.ops.embedding(self.embed, batch.token_ids)
        else:
            xp, ids = backend.xp, batch.token_ids
            local = xp.clip(ids - part.start, 0, part.stop - part.start - 1).astype(ids.dtype)
            x = backend.ops.embedding(self.embed, local)
            x = backend.all_reduce(x * ((ids >= part.start) & (ids < part.stop))[:, None])
        overlay = self.token_rows.get("embed_tokens")
        if overlay is not None and batch.adapter_slots is not None:
            x = backend.ops.lora_token_rows(x, batch.token_ids, batch.adapter_slots, overlay.tokens, overlay.rows)
        return x

    def logits(self, backend: Any, x: Any, residual: Any, batch: ForwardBatch, eps: float, offset: float = 0.0) -> Any:
        """Float32 logits ``[len(batch.logits_rows), V]``: the last residual add, the final norm
        and the LM head (the ``rmsnorm_linear`` op), on the rows that asked for logits only. In
        a step of :attr:`~metrale.batch.ForwardBatch.final_states` those rows' final normed
        states instead (float32 ``[len(batch.logits_rows), H]``): what pooling reads
        (:mod:`metrale.engine.pooling`)."""
        slots = batch.adapter_slots
        if batch.final_states:
            rows: Any = slice(None) if batch.every_row_logits else batch.logits_rows
            if not batch.every_row_logits and not len(rows):
                return backend.xp.zeros((0, int(self.norm.shape[0])), dtype=np.float32)
            normed, _ = backend.ops.rmsnorm_residual(x[rows], residual[rows], self.norm, eps, offset)
            return backend.ops.to_float32(normed)
        if not batch.every_row_logits:
            rows = batch.logits_rows
            x, residual = x[rows], residual[rows]
            slots = None if slots is None else slots[rows]
        overlay = self.token_rows.get("lm_head")
        if overlay is not None and slots is not None:
            normed, _ = backend.ops.rmsnorm_residual(x, residual, self.norm, eps, offset)
            logits = self.gather_logits(backend, backend.ops.linear(normed, self.lm_head))
            return backend.ops.lora_logit_rows(logits, normed, slots, overlay.tokens, overlay.rows)
        logits, _ = backend.ops.rmsnorm_linear(x, residual, self.norm, eps, offset, self.lm_head)
        return self.gather_logits(backend, logits)

    def gather_logits(self, backend: Any, logits: Any) -> Any:
        """Logits of ``lm_head``'s rows (a rank's part of the vocabulary) as the whole
        vocabulary's, gathered over the ranks (themselves when every rank holds every row)."""
        return logits if self.vocab_part is None else backend.all_gather(logits, axis=1)
