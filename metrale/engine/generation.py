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
from typing import Any, Iterable, Sequence

from metrale.params import CompletionOutput, Logprob, LogprobsDict, RequestOutput, SamplingParams
from metrale.runner.sampling import TokenLogprobs, completion_seed, request_seed
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
    """One completion being generated (a request with ``n`` completions runs as ``n`` of these,
    gathered by a :class:`RequestGroup`)."""

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
    #: This completion's place among its request's ``n``.
    index: int = 0
    #: The sampled tokens' log probabilities (when ``params.logprobs`` asks for them).
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: The structured output's matcher (:class:`metrale.structured.GrammarMatcher`), or None.
    grammar: Any = None
    #: Draft tokens proposed for this completion, and how many of them its verifies kept
    #: (speculative decoding, :mod:`metrale.speculative`).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: ``time.monotonic()`` when the engine received the completion and first scheduled it, and
    #: when its first and latest generated tokens were handed out (:mod:`metrale.engine.timings`).
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    #: The LoRA adapter this completion runs with (:class:`~metrale.loading.lora.LoRARequest`), or None.
    lora: Any = None
    #: A pooling request's :class:`~metrale.params.PoolingParams` (resolved: no field None), None
    #: for a generation request. A pooling request samples nothing: its prompt's last chunk
    #: yields its :attr:`embedding` and finishes it (:mod:`metrale.engine.pooling`).
    pooling: Any = None
    #: A pooling request's pooled states so far: the float64 sum of its computed rows' final
    #: states (mean pooling), or its last row's (last pooling); None before its first chunk.
    pooled: Any = None
    #: A finished pooling request's vector (float32 ``[hidden_size]``), None until then.
    embedding: Any = None
    #: ``token_logprobs`` as :data:`~metrale.params.LogprobsDict`\\ s, made once per token.
    _logprob_dicts: list[LogprobsDict] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.seq = SequenceState.from_prompt(self.prompt_token_ids)

    @property
    def generated(self) -> list[int]:
        return self.seq.tokens[self.seq.prompt_len :]

    @property
    def tokenizer(self) -> Any:
        return self.detokenizer._tokenizer if self.detokenizer is not None else None

    def banned_tokens(self, eos_token_ids: Iterable[int], pending: bool) -> tuple[int, ...]:
        """The tokens this completion may not draw next: while it has fewer than ``min_tokens``,
        its stop tokens and (unless ``ignore_eos``) the end-of-sequence tokens. ``pending``: a
        token sampled before is not read back yet."""
        params = self.params
        if len(self.generated) + pending >= params.min_tokens:
            return ()
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_token_ids))

    def logprob_dicts(self) -> list[LogprobsDict]:
        """One :data:`~metrale.params.LogprobsDict` per generated token (the chosen token with
        its rank, and the most likely alternatives)."""
        tokenizer = self.tokenizer
        for entry in self.token_logprobs[len(self._logprob_dicts) :]:
            self._logprob_dicts.append(logprobs_dict(entry, tokenizer))
        return self._logprob_dicts[: len(self.generated)]

    @property
    def text(self) -> str | None:
        """The text so far (cut before a stop string that ended the request)."""
        if self.detokenizer is None:
            return None
        self.detokenizer.advance(self.generated)
        return self.detokenizer.text[: self.text_end]


def visible_text(request: Request, finished: bool) -> str | None:
    """The text an output of ``request`` shows (``finished``: its final one): while it runs, a
    tail that may still become a stop string is left out."""
    text = request.text
    if text is not None and not finished and request.params.stop:
        text = text[: len(text) - held_back(text, request.params.stop)]
    return text


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


def logprobs_dict(entry: TokenLogprobs, tokenizer: Any) -> LogprobsDict:
    """``{token id: Logprob}`` of one position: the alternatives ranked 1..k, then the chosen
    token (with its own rank) when it is not among them."""

    def text(token: int) -> str | None:
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else None

    out: LogprobsDict = {}
    for rank, (token, value) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
        out[token] = Logprob(value, rank, text(token))
    if entry.token not in out:
        out[entry.token] = Logprob(entry.logprob, entry.rank, text(entry.token))
    return out


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
        early = len(request.generated) < params.min_tokens
        if request.finish_reason is None and params.stop and request.detokenizer is not None and not early:
            self._find_stop(request, request.detokenizer, params.stop)
        if request.finish_reason is None and request.grammar is not None and request.grammar.is_finished:
            request.finish_reason = "stop"
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
    def completion(request: Request, finished: bool = True) -> CompletionOutput:
        """The completion so far (``finished``: its final state). The text of an unfinished
        completion leaves out a tail that may still become a stop string."""
        text = visible_text(request, finished)
        logprobs = cumulative = None
        if request.params.logprobs is not None:
            logprobs = list(request.logprob_dicts())
            cumulative = float(sum(entry.logprob for entry in request.token_logprobs[: len(request.generated)]))
        return CompletionOutput(
            index=request.index,
            text=text,
            token_ids=list(request.generated),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=(request.finish_reason or "length") if finished else None,
            stop_reason=request.stop_reason,
        )

    @staticmethod
    def output(request: Request, finished: bool = True) -> RequestOutput:
        """The :class:`RequestOutput` of a lone completion (see :meth:`RequestGroup.output`)."""
        return RequestGroup(request.request_id, [request]).output(finished)


@dataclass
class RequestGroup:
    """A request's ``n`` completions (:class:`Request`\\ s sharing a prompt), and its prompt's
    log probabilities when asked for."""

    request_id: str
    completions: list[Request]
    prompt_logprobs: list[LogprobsDict | None] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def output(self, finished: bool | None = None) -> RequestOutput:
        """The request's output so far; ``finished`` (default: whether every completion is)
        makes the final one."""
        done = self.finished if finished is None else finished
        first = self.completions[0]
        errors = [c.error for c in self.completions if c.error is not None]
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,  # never changed: shared, not copied per output
            outputs=[StopChecker.completion(c, finished=done or c.finish_reason is not None) for c in self.completions],
            finished=done,
            prompt_logprobs=self.prompt_logprobs,
            cached_tokens=first.cached_tokens or 0,
            error=self.error or (errors[0] if errors else None),
            num_preemptions=sum(c.num_preemptions for c in self.completions),
            num_draft_tokens=sum(c.num_draft_tokens for c in self.completions),
            num_accepted_tokens=sum(c.num_accepted_tokens for c in self.completions),
            lora_request=first.lora,
        )


def prompt_logprob_dicts(entries: Sequence[TokenLogprobs | None], tokenizer: Any) -> list[LogprobsDict | None]:
    """The ``prompt_logprobs`` of an output: None for the first prompt token, then one dict per
    later token."""
    return [None] + [logprobs_dict(entry, tokenizer) if entry is not None else None for entry in entries]


def make_group(
    index: int, prompt: str | None, token_ids: list[int], params: SamplingParams, engine_seed: int, tokenizer: Any = None,
    request_id: str | None = None, grammar: Any = None,
) -> RequestGroup:
    """The ``params.n`` completions of one request (``index``: its number in the engine, which
    seeds it when ``params.seed`` is None). ``grammar`` (a compiled structured output) gives
    each completion its own matcher."""
    seed = request_seed(params.seed, engine_seed, index)
    name = str(index) if request_id is None else request_id
    completions = [
        Request(
            request_id=name,
            prompt=prompt,
            prompt_token_ids=token_ids,
            params=params,
            seed=completion_seed(seed, i),
            detokenizer=IncrementalText(tokenizer, token_ids) if tokenizer is not None else None,
            index=i,
            grammar=grammar.matcher() if grammar is not None else None,
        )
        for i in range(params.n)
    ]
    return RequestGroup(name, completions)


def make_request(
    index: int, prompt: str | None, token_ids: list[int], params: SamplingParams, engine_seed: int, tokenizer: Any = None
) -> Request:
    """A lone completion (tests and tools; ``params.n`` is not looked at)."""
    return Request(
        request_id=str(index),
        prompt=prompt,
        prompt_token_ids=token_ids,
        params=params,
        seed=request_seed(params.seed, engine_seed, index),
        detokenizer=IncrementalText(tokenizer, token_ids) if tokenizer is not None else None,
    )
