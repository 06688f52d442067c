"""The model runner: what happens between a forward-contract call and a family's
``forward_batch``.

A :class:`ModelRunner` belongs to one model and its cache. For each call it checks the segments,
reserves their cache (all or nothing), builds the step's flat :class:`~metrale.batch.ForwardBatch`,
and runs it -- replayed from a captured CUDA graph when the batch is a decode step or a mixed
step the graphs accept, else eagerly with the row metadata copied to the device -- then advances each
sequence's cached length. Sampling the step's tokens is :mod:`metrale.runner.sampling`'s.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

from metrale.batch import ForwardBatch, Segment
from metrale.errors import CacheError, OutOfCacheBlocksError

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs segments of sequences through ``model.forward_batch`` on ``model.backend``."""

    def __init__(self, model: Any, cache: Any) -> None:
        # The model owns its runner; the runner refers back to it weakly (no reference cycle).
        self._model = weakref.ref(model)
        self.backend = model.backend
        self.cache = cache
        self.max_model_len = model.max_model_len
        #: The CUDA-graph replayer of decode steps, or None (CPU, graphs off, or a model that
        #: cannot be captured).
        self.graphs: Any = None
        if getattr(self.backend, "cuda_graphs", False) and getattr(model, "graph_capturable", True):
            from metrale.runner.graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(model, self.backend)

    @property
    def model(self) -> Any:
        return self._model()

    def check(self, segments: Sequence[Segment]) -> None:
        """Each sequence once, each segment starting at its sequence's cached length, none past
        the model's context."""
        seen: set[int] = set()
        for segment in segments:
            seq = segment.seq
            if seq.seq_id in seen:
                raise CacheError(f"sequence {seq.seq_id} appears twice in one forward call")
            seen.add(seq.seq_id)
            if segment.start != seq.num_cached:
                raise CacheError(
                    f"sequence {seq.seq_id} has {seq.num_cached} cached tokens but the call starts "
                    f"at position {segment.start}"
                )
            if segment.end > self.max_model_len:
                raise CacheError(
                    f"sequence {seq.seq_id} would reach {segment.end} tokens, past the model's "
                    f"context of {self.max_model_len}"
                )

    def blocks_needed(self, segments: Sequence[Segment]) -> int:
        cache = self.cache
        return sum(cache.blocks_needed(s.seq, s.end) for s in segments) if cache.spec.uses_blocks else 0

    def run(self, segments: Sequence[Segment]) -> Any:
        """Reserve cache for ``segments`` (all or nothing), run them, advance each sequence's
        cached length; returns the logits rows the segments ask for."""
        cache = self.cache
        self.check(segments)
        missing = [cache.blocks_needed(s.seq, s.end) for s in segments] if cache.spec.uses_blocks else [0] * len(segments)
        needed = sum(missing)
        if needed > cache.num_free_blocks:
            raise OutOfCacheBlocksError(f"the call needs {needed} KV blocks, only {cache.num_free_blocks} are free")
        for segment, blocks in zip(segments, missing):
            # (Nothing to reserve for a sequence whose blocks already cover the call and that
            # needs no recurrent-state slot: most sequences of a decode step.)
            if blocks or cache.state_slots is not None:
                cache.reserve(segment.seq, segment.end)
        batch = ForwardBatch.build(list(segments), cache.block_size)
        with self.backend.activate():
            if self.graphs is not None and self.graphs.accepts(batch):
                logits = self.graphs.run(batch)
            elif self.graphs is not None and self.graphs.mixed_shape(batch) is not None:
                logits = self.graphs.run_mixed(batch)
            else:
                logits = self.model.forward_batch(self.backend.prepare_batch(batch))
        for segment in segments:
            segment.seq.num_cached = segment.end
        return logits
