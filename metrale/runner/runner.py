"""The model runner: what happens between a forward-contract call and a family's
``forward_batch``.

A :class:`ModelRunner` belongs to one model and its cache. For each call it checks the segments,
reserves their cache (all or nothing), builds the step's flat :class:`~metrale.batch.ForwardBatch`,
and runs it -- replayed from a captured CUDA graph when the batch is a decode step or a mixed
step the graphs accept, else eagerly with the row metadata copied to the device -- then advances each
sequence's cached length. Sampling the step's tokens is :mod:`metrale.runner.sampling`'s.

A one-token segment whose sequence has a ``pending_token`` (sampled by a step still in flight,
:attr:`~metrale.sequence.SequenceState.pending_token`) carries a placeholder token: once the row
metadata is on the device, the op ``feed_tokens`` copies the sampled token into the row's input
(:class:`TokenFeed`), so the step is queued without waiting for the one before it.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any, Sequence

import numpy as np

from metrale.batch import ForwardBatch, Segment
from metrale.errors import CacheError, ConfigError, OutOfCacheBlocksError

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs segments of sequences through ``model.forward_batch`` on ``model.backend``."""

    def __init__(self, model: Any, cache: Any, ranks: Any = None) -> None:
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

            self.graphs = CudaGraphRunner(model, self.backend, cache)
        self.token_feed = TokenFeed(self.backend)
        #: The model's other ranks (:class:`metrale.backends.executor.RankExecutor`), sent every step
        #: before this rank runs it; None when the model runs on one rank.
        self.ranks: Any = ranks

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

    def run(self, segments: Sequence[Segment], final_states: bool = False) -> Any:
        """Reserve cache for ``segments`` (all or nothing), run them, advance each sequence's
        cached length; returns the logits rows the segments ask for -- with ``final_states``,
        those rows' final normed states (:attr:`~metrale.batch.ForwardBatch.final_states`, run
        eagerly)."""
        if final_states and self.ranks is not None:
            raise ConfigError("final states (pooling requests, embeddings) are not served with tensor parallelism")
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
        if final_states:
            batch.final_states = True
        feed = self.token_feed.plan(batch)
        if self.ranks is not None:
            self.ranks.submit(batch, verifying=bool(getattr(self.model, "verifying", False)))
        try:
            logits = self.forward(batch, feed) if not final_states else self.forward_states(batch)
        except BaseException as error:
            if self.ranks is not None:
                self.ranks.abandon(error)
            raise
        if self.ranks is not None:
            self.ranks.finish(self.backend)
        for segment in segments:
            segment.seq.num_cached = segment.end
        self.model.after_run(list(segments), batch)
        return logits

    def forward(self, batch: ForwardBatch, feed: Any = None) -> Any:
        """``batch``'s forward: replayed from a CUDA graph where the graphs take it, else
        eager; ``feed`` puts pending tokens into the rows (:class:`TokenFeed`). What a worker
        rank runs for each step the driver's runner submits (:mod:`metrale.backends.executor`)."""
        with self.backend.activate():
            if self.graphs is not None and self.graphs.accepts(batch):
                return self.graphs.run(batch, feed)
            if self.graphs is not None and self.graphs.accepts_verify(batch):
                return self.graphs.run_verify(batch, feed)
            if self.graphs is not None and self.graphs.mixed_shape(batch) is not None:
                return self.graphs.run_mixed(batch, feed)
            prepared = self.backend.prepare_batch(batch)
            if feed is not None:
                feed(prepared.token_ids)
            return self.model.forward_batch(prepared)

    def forward_states(self, batch: ForwardBatch) -> Any:
        """A :attr:`~metrale.batch.ForwardBatch.final_states` batch's forward, always eager: a
        graph recorded for logits never serves it (a batch of one-token prompts has a decode
        step's shape)."""
        with self.backend.activate():
            return self.model.forward_batch(self.backend.prepare_batch(batch))

    def capture_graphs(self, sizes: tuple[int, ...], mixed: tuple[int, int] | None = None) -> None:
        """Record the decode graphs of ``sizes`` ahead of time and, with ``mixed`` (``(decode
        rows, prompt tokens)``), those of mixed steps up to that shape (:meth:`metrale.LLM.capture_graphs`;
        a no-op without graphs). Every rank of a split model records the same, in step."""
        if self.graphs is None:
            return
        with self.backend.activate():
            self.graphs.capture(sizes)
            if mixed is not None:
                self.graphs.capture_mixed(*mixed)
        self.backend.synchronize()


class PendingTokens:
    """The pending tokens of one batch (:meth:`TokenFeed.plan`): ``groups`` holds, per sampler call
    that drew some of them, its device tokens, the batch rows that take them and their indices in
    those tokens. Called with a device copy of the batch's token ids, it feeds them in."""

    def __init__(self, feed: "TokenFeed", groups: list[tuple[Any, list[int], list[int]]]) -> None:
        self.feed = feed
        self.groups = groups

    def __call__(self, token_ids: Any) -> None:
        self.feed._feed(token_ids, self.groups)


class TokenFeed:
    """Feeds the pending tokens of a batch's sequences into its device token ids (see the module
    docstring): one small upload of the rows and indices, then the op ``feed_tokens`` per step
    whose tokens are pending (normally one, the step in flight). A decode step replayed from a
    graph packs the rows and indices of a single such step into its own metadata upload instead
    (:meth:`metrale.runner.graphs.CudaGraphRunner.run`)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._host: Any = None  # pinned int32 [2 * capacity]: rows, then indices
        self._device: Any = None
        self._uploaded: Any = None  # event recorded after the last upload of ``_host``

    def plan(self, batch: ForwardBatch) -> PendingTokens | None:
        """What feeds ``batch``'s pending tokens into a device copy of its token ids (laid out row
        for row like ``batch``'s), or None when no token is pending."""
        sources: dict[int, tuple[Any, list[int], list[int]]] = {}
        for index, segment in enumerate(batch.segments):
            pending = segment.seq.pending_token
            if pending is None:
                continue
            if len(segment.token_ids) != 1:
                raise CacheError(f"sequence {segment.seq.seq_id} has a pending token but {len(segment.token_ids)} "
                                 "tokens in this call: a pending token is the input of a one-token step")
            sampled, row = pending
            entry = sources.setdefault(id(sampled), (sampled.device, [], []))
            entry[1].append(int(batch.row_starts[index]))
            entry[2].append(int(row))
        if not sources:
            return None
        return PendingTokens(self, list(sources.values()))

    def _feed(self, token_ids: Any, groups: list[tuple[Any, list[int], list[int]]]) -> None:
        ops = self.backend.ops
        if self.backend.name == "cpu":
            for source, rows, indices in groups:
                ops.feed_tokens(token_ids, source, np.array(rows, np.int32), np.array(indices, np.int32))
            return
        rows = [row for group in groups for row in group[1]]
        indices = [index for group in groups for index in group[2]]
        device = self._upload(rows, indices)
        offset, count = 0, len(rows)
        for source, group_rows, _ in groups:
            end = offset + len(group_rows)
            ops.feed_tokens(token_ids, source, device[offset:end], device[count + offset : count + end])
            offset = end

    def _upload(self, rows: list[int], indices: list[int]) -> Any:
        """``rows`` then ``indices`` as one device int32 array (a view of the feed's buffer)."""
        import cupy
        import cupyx

        count = len(rows)
        if self._host is None or self._host.size < 2 * count:
            capacity = max(2 * count, 256)
            self._host = cupyx.empty_pinned((capacity,), dtype=np.int32)
            self._device = cupy.empty(capacity, dtype=np.int32)
            self._uploaded = None
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous upload has read the pinned buffer
        host = self._host
        host[:count] = rows
        host[count : 2 * count] = indices
        stream = self.backend.stream
        self._device.data.copy_from_host_async(host.ctypes.data_as(ctypes.c_void_p), 2 * count * 4, stream)
        if self._uploaded is None:
            self._uploaded = cupy.cuda.Event(disable_timing=True)
        self._uploaded.record(stream)
        return self._device[: 2 * count]
