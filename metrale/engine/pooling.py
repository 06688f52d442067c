"""Pooling requests: one prompt in, one vector out (embeddings).

A pooling request is a :class:`~metrale.engine.generation.Request` whose ``pooling`` holds its
:class:`~metrale.params.PoolingParams` (resolved: no field None). The scheduler admits it as any
prompt -- the same token budget, chunked prefill, ``max_num_seqs`` -- and puts its chunks in
the plan's ``pool`` list (:class:`~metrale.engine.scheduler.StepPlan`). The engine runs a step's
pooling chunks in one forward call of their own, ``final_states``
(:meth:`metrale.model.forward.ModelForward.final_states`), which returns the final normed states
(after the model's last norm, before the LM head) of the rows the chunks ask for
(:func:`pooling_segments`); :func:`apply_states` pools them. A request's last chunk yields its
vector and finishes it, so it never becomes a decode row and its cache is released in the step
that computed it.

**Exactness.** Mean pooling adds each chunk's rows up in float64 and divides by the prompt's
length at its last chunk: the mean of the rows, however the scheduler cut the prompt (a
preempted request starts its sum again with its recomputation). Last pooling keeps the last
row alone. Each row's state depends only on its sequence's tokens, so a prompt's vector does
not depend on the requests that share its steps beyond the rounding of the batched products.

**Prefix cache.** A pooling request skips the lookup: every row of its prompt is computed in
its own steps, so its vector never depends on what earlier requests left in the cache (the same
prompts embedded again give the same vectors, bit for bit) and mean pooling has every row's
state to pool. The blocks it computes are published for later requests all the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from metrale.engine.generation import Request
from metrale.params import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, SamplingParams
from metrale.sequence import Segment

#: The sampling params a pooling request carries for the engine's bookkeeping (it samples nothing).
_NO_SAMPLING = SamplingParams(max_tokens=1)

#: Norms below this are not divided by (a zero vector stays zero).
_MIN_NORM = 1e-12


def reuses_prefix(request: Request) -> bool:
    """Whether admitting ``request`` may look its prompt up in the prefix cache: a generation
    request's only (module docstring)."""
    return request.pooling is None


def pooling_segments(chunks: Sequence[Any]) -> list[Segment]:
    """The rows of a ``final_states`` call for ``chunks`` (the plan's
    :class:`~metrale.engine.scheduler.PrefillChunk`\\ s of pooling requests): each chunk's tokens,
    with every row's state for mean pooling, the last row's for a last-pooled prompt's last
    chunk, none for its other chunks."""
    segments = []
    for chunk in chunks:
        seq = chunk.request.seq
        if chunk.request.pooling.pooling == "mean":
            rows = "all"
        else:
            rows = "last" if chunk.is_last else "none"
        segments.append(Segment(seq, seq.tokens[chunk.start : chunk.start + chunk.length], chunk.start, rows))
    return segments


def apply_states(chunks: Sequence[Any], segments: Sequence[Segment], states: Any, backend: Any) -> list[Request]:
    """Pool ``states`` (the ``final_states`` call's ``[rows, H]`` float32 for ``segments``, in
    order) into the chunks' requests; returns the requests whose last chunk this was, each with
    its :attr:`~metrale.engine.generation.Request.embedding` set and ``finish_reason`` ``"stop"``
    -- or ``"error"`` when its vector is not finite. One transfer to the host per call: each
    chunk's rows are summed on the backend first."""
    xp = backend.xp
    parts, owners, row = [], [], 0
    for index, segment in enumerate(segments):
        count = {"all": len(segment.token_ids), "last": 1}.get(segment.logits, 0)
        if count:
            parts.append(states[row : row + count].astype(xp.float64).sum(axis=0))
            owners.append(index)
            row += count
    if row != int(states.shape[0]):
        raise ValueError(f"final_states returned {int(states.shape[0])} rows for {row} asked")
    host = backend.to_numpy(xp.stack(parts)) if parts else np.zeros((0, 0))
    summed = dict(zip(owners, host))
    finished = []
    for index, chunk in enumerate(chunks):
        request = chunk.request
        part = summed.get(index)
        if part is not None:
            mean = request.pooling.pooling == "mean"
            # (A mean-pooled prompt is computed from its first token on: a chunk at 0 starts it.)
            request.pooled = request.pooled + part if mean and chunk.start and request.pooled is not None else part
        if chunk.is_last:
            finish(request)
            finished.append(request)
    return finished


def finish(request: Request) -> None:
    """Make ``request``'s vector from what its chunks pooled and finish it."""
    params = request.pooling
    pooled = request.pooled
    if pooled is None:
        request.error = f"pooling request {request.request_id} ended with no state pooled"
        request.finish_reason = "error"
        return
    vector = pooled / len(request.prompt_token_ids) if params.pooling == "mean" else pooled
    if params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), _MIN_NORM)
    request.pooled = None
    if not np.isfinite(vector).all():
        request.error = f"the final states of pooling request {request.request_id} are not finite (NaN or infinity)"
        request.finish_reason = "error"
        return
    request.embedding = vector.astype(np.float32)
    request.finish_reason = "stop"


@dataclass
class PoolingGroup:
    """One pooling request as the drivers handle requests (a
    :class:`~metrale.engine.generation.RequestGroup`'s shape, with one member): ``output()``
    makes its :class:`~metrale.params.EmbeddingRequestOutput`."""

    request_id: str
    completions: list[Request]
    prompt_logprobs: None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.completions[0].finish_reason is not None

    @property
    def request(self) -> Request:
        return self.completions[0]

    def output(self, finished: bool | None = None) -> EmbeddingRequestOutput:
        """The request's output: its vector once it finished well, else an empty one (with
        ``error`` when it failed)."""
        request = self.request
        done = self.finished if finished is None else finished
        vector = request.embedding
        return EmbeddingRequestOutput(
            request_id=self.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=EmbeddingOutput([] if vector is None else vector.tolist()),
            finished=done,
            error=self.error or request.error,
        )


def make_pooling_group(request_id: str, prompt: str | None, token_ids: list[int], params: PoolingParams) -> PoolingGroup:
    """The pooling request of one checked prompt, pooled as ``params`` (resolved) says."""
    if params.pooling is None or params.normalize is None:
        raise ValueError(f"a pooling request needs resolved params, got {params!r}")
    request = Request(request_id=request_id, prompt=prompt, prompt_token_ids=token_ids, params=_NO_SAMPLING, seed=0,
                      pooling=params)
    return PoolingGroup(request_id, [request])
