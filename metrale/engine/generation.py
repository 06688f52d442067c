"""The generation loop: prefill each request, then decode the running ones together.

Requests run in groups of at most ``max_num_seqs``: every member is prefilled, then one
``decode_batch`` per step advances all members that are still running. Cache blocks of a finished
request are returned at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from metrale.engine.sampler import request_seed
from metrale.params import RequestOutput, SamplingParams
from metrale.sequence import SequenceState


@dataclass
class Request:
    """One prompt being generated."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    seq: SequenceState = field(init=False)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        self.seq = SequenceState.from_prompt(self.prompt_token_ids)

    @property
    def generated(self) -> list[int]:
        return self.seq.tokens[self.seq.prompt_len :]


class StopChecker:
    """Decides after each token whether a request is finished, and keeps its text."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int, decode_text: Callable[[list[int]], str] | None):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.decode_text = decode_text

    def update(self, request: Request, token: int) -> None:
        params = request.params
        if self.decode_text is not None:
            request.text = self.decode_text(request.generated)
        if token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            request.finish_reason, request.stop_reason = "stop", token
        if request.finish_reason is None and params.stop and request.text is not None:
            hits = [(request.text.find(s), s) for s in params.stop if s in request.text]
            if hits:
                position, stop = min(hits)
                request.text = request.text[:position]
                request.finish_reason, request.stop_reason = "stop", stop
        if request.finish_reason is None:
            full = len(request.generated) >= params.max_tokens
            # The next decode would place the newest token at position seq_len.
            out_of_context = request.seq.seq_len + 1 > self.max_model_len
            if full or out_of_context:
                request.finish_reason = "length"

    @staticmethod
    def output(request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(request.generated),
            text=request.text,
            finish_reason=request.finish_reason or "length",
            stop_reason=request.stop_reason,
        )


def run_group(forward: Any, cache: Any, backend: Any, requests: list[Request], stopper: StopChecker,
              on_finish: Callable[[Request], None]) -> None:
    """Generate every request of ``requests`` to completion; their cache is always released."""
    try:
        running: list[Request] = []
        for request in requests:
            logits = forward.prefill(request.prompt_token_ids, request.seq)
            _append([request], logits, backend, stopper)
            if request.finish_reason is None:
                running.append(request)
            else:
                cache.release(request.seq)
                on_finish(request)
        while running:
            tokens = [r.seq.tokens[-1] for r in running]
            logits = forward.decode_batch(tokens, [r.seq for r in running])
            _append(running, logits, backend, stopper)
            still: list[Request] = []
            for request in running:
                if request.finish_reason is None:
                    still.append(request)
                else:
                    cache.release(request.seq)
                    on_finish(request)
            running = still
    finally:
        for request in requests:
            if request.seq.block_table or request.seq.state_slot is not None:
                cache.release(request.seq)


def _append(requests: list[Request], logits: Any, backend: Any, stopper: StopChecker) -> None:
    """Sample one token per request from the rows of ``logits`` (on the backend's device)."""
    tokens = backend.sample_tokens(
        logits, [r.params for r in requests], [r.seed for r in requests], [len(r.generated) for r in requests]
    )
    for request, token in zip(requests, tokens):
        request.seq.tokens.append(int(token))
        stopper.update(request, int(token))


def make_request(index: int, prompt: str | None, token_ids: list[int], params: SamplingParams, engine_seed: int) -> Request:
    return Request(
        request_id=str(index),
        prompt=prompt,
        prompt_token_ids=token_ids,
        params=params,
        seed=request_seed(params.seed, engine_seed, index),
    )
