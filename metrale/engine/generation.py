"""Requests, their text and their stopping rules: what the engine (:mod:`metrale.engine.engine`)
generates for.

A request's text is decoded incrementally (``tokenizers``' ``DecodeStream``): each generated
token is decoded once, with a few prompt tokens as context so the first word keeps its leading
space, and a token that ends inside a multi-byte character yields nothing until the character
is complete. The text is decoded after every token when stop strings must be looked for (only
the last ``len(stop) - 1`` characters before the new piece are searched again), otherwise only
when an output is made. Outputs of unfinished requests hold back the text that may still turn
into a stop string, so the text a stream hands out only ever grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metrale.params import RequestOutput, SamplingParams
from metrale.runner.sampling import request_seed
from metrale.sequence import SequenceState

#: Prompt tokens given to the incremental decoder as context for the first generated token.
PROMPT_CONTEXT_TOKENS = 6


class IncrementalText:
    """The text of a request's generated tokens, decoded one token at a time."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=True)
        #: The decoded text: complete characters only.
        self.text = ""
        #: Generated tokens decoded so far.
        self.num_tokens = 0

    def advance(self, generated: list[int]) -> int:
        """Decode the tokens of ``generated`` not decoded yet; returns the text length before."""
        before = len(self.text)
        pieces = []
        for token in generated[self.num_tokens :]:
            piece = self._stream.step(self._tokenizer, token)
            if piece:
                pieces.append(piece)
        self.num_tokens = len(generated)
        if pieces:
            self.text += "".join(pieces)
        return before


@dataclass
class Request:
    """One prompt being generated."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    seq: SequenceState = field(init=False)
    #: The generated text (None without a tokenizer); see :class:`IncrementalText`.
    detokenizer: IncrementalText | None = None
    #: Where a stop string cut the text (None: not cut).
    text_end: int | None = None
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

    def __post_init__(self) -> None:
        self.seq = SequenceState.from_prompt(self.prompt_token_ids)

    @property
    def generated(self) -> list[int]:
        return self.seq.tokens[self.seq.prompt_len :]

    @property
    def text(self) -> str | None:
        """The text so far (cut before a stop string that ended the request)."""
        if self.detokenizer is None:
            return None
        self.detokenizer.advance(self.generated)
        return self.detokenizer.text[: self.text_end]


def finishing(request: Request, max_model_len: int) -> bool:
    """Whether ``request`` finishes once its pending token (sampled by a step in flight) is read,
    whatever that token is: it then has ``max_tokens`` tokens, or fills the model's context."""
    if request.seq.pending_token is None:
        return False
    return len(request.generated) + 1 >= request.params.max_tokens or len(request.seq.tokens) + 1 > max_model_len


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string: text
    that a later token may still turn into a stop."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StopChecker:
    """Decides after each token whether a request is finished."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def update(self, request: Request, token: int) -> None:
        params = request.params
        if token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            request.finish_reason, request.stop_reason = "stop", token
        if request.finish_reason is None and params.stop and request.detokenizer is not None:
            self._find_stop(request, request.detokenizer, params.stop)
        if request.finish_reason is None:
            full = len(request.generated) >= params.max_tokens
            # The next decode would place the newest token at position len(tokens) - 1.
            out_of_context = len(request.seq.tokens) > self.max_model_len
            if full or out_of_context:
                request.finish_reason = "length"


    @staticmethod
    def _find_stop(request: Request, detokenizer: IncrementalText, stops: tuple[str, ...]) -> None:
        before = detokenizer.advance(request.generated)
        text = detokenizer.text
        # A stop string not found before ends at or after the new text's first character.
        hits = []
        for stop in stops:
            position = text.find(stop, max(0, before - len(stop) + 1))
            if position >= 0:
                hits.append((position, stop))
        if hits:
            position, stop = min(hits)
            request.text_end = position
            request.finish_reason, request.stop_reason = "stop", stop

    @staticmethod
    def output(request: Request, finished: bool = True) -> RequestOutput:
        """The request's output so far (``finished``: its final output). The text of an
        unfinished request leaves out a tail that may still become a stop string."""
        text = request.text
        if text is not None and not finished and request.params.stop:
            text = text[: len(text) - held_back(text, request.params.stop)]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(request.generated),
            text=text,
            finish_reason=(request.finish_reason or "length") if finished else None,
            stop_reason=request.stop_reason,
            cached_tokens=request.cached_tokens or 0,
            error=request.error,
            finished=finished,
            num_preemptions=request.num_preemptions,
        )


def make_request(
    index: int, prompt: str | None, token_ids: list[int], params: SamplingParams, engine_seed: int, tokenizer: Any = None
) -> Request:
    return Request(
        request_id=str(index),
        prompt=prompt,
        prompt_token_ids=token_ids,
        params=params,
        seed=request_seed(params.seed, engine_seed, index),
        detokenizer=IncrementalText(tokenizer, token_ids) if tokenizer is not None else None,
    )
