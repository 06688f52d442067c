"""Requests and their stopping rules: what the engine (:mod:`metrale.engine.engine`) generates for.
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
    #: Order of arrival in the engine (the scheduler's FCFS key and preemption order).
    arrival: int = 0
    #: True once the request's tokens so far are computed and it decodes one token a step.
    prefilled: bool = False
    #: Prompt tokens the prefix cache supplied at the first admission (None before it).
    cached_tokens: int | None = None
    #: Prefix-cache digests of the request's full blocks (grown as tokens are added).
    block_digests: list[bytes] = field(default_factory=list)
    #: Full blocks already published to the prefix cache (since the last release).
    published_blocks: int = 0
    num_preemptions: int = 0
    #: Why the request failed (it then finishes with ``finish_reason == "error"``).
    error: str | None = None
    #: Generated tokens already handed out by a streaming call.
    streamed: int = 0
    #: Generated tokens ``text`` reflects (it is decoded only when needed).
    text_tokens: int = 0

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
        if self.decode_text is not None and params.stop:
            # Stop strings are looked for in the text after every token; otherwise the text is
            # decoded only when an output is made (decoding it every token costs O(n^2)).
            self._decode(request)
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

    def _decode(self, request: Request) -> None:
        request.text = self.decode_text(request.generated)
        request.text_tokens = len(request.generated)

    def output(self, request: Request, finished: bool = True) -> RequestOutput:
        """The request's output so far (``finished``: its final output)."""
        if self.decode_text is not None and request.text_tokens != len(request.generated):
            self._decode(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(request.generated),
            text=request.text,
            finish_reason=(request.finish_reason or "length") if finished else None,
            stop_reason=request.stop_reason,
            cached_tokens=request.cached_tokens or 0,
            error=request.error,
            finished=finished,
            num_preemptions=request.num_preemptions,
        )


def make_request(index: int, prompt: str | None, token_ids: list[int], params: SamplingParams, engine_seed: int) -> Request:
    return Request(
        request_id=str(index),
        prompt=prompt,
        prompt_token_ids=token_ids,
        params=params,
        seed=request_seed(params.seed, engine_seed, index),
    )
