"""User-facing request types: :class:`SamplingParams` and :class:`RequestOutput`."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from metrale.errors import InvalidRequestError, UnknownOptionError


@dataclass(init=False)
class SamplingParams:
    """How to generate for one request.

    * ``max_tokens`` -- tokens to generate at most (>= 1);
    * ``temperature`` -- 0 means greedy; otherwise logits are divided by it;
    * ``top_k`` -- keep the k most likely tokens (0 or -1: all);
    * ``top_p`` -- keep the smallest set of tokens whose probability reaches p (1.0: all);
    * ``seed`` -- seeds this request's random stream: the same seed gives the same tokens;
    * ``stop`` -- strings that end generation (the text is cut before them);
    * ``stop_token_ids`` -- token ids that end generation (kept in ``token_ids``);
    * ``ignore_eos`` -- keep going past the checkpoint's end-of-sequence tokens.

    Unknown keywords raise :class:`~metrale.errors.UnknownOptionError`; bad values raise
    :class:`~metrale.errors.InvalidRequestError`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __init__(self, **options: Any) -> None:
        known = {f.name: f for f in fields(self)}
        for name in options:
            if name not in known:
                raise UnknownOptionError(
                    f"unknown sampling option {name!r}; known options: {', '.join(known)}"
                )
        for name, spec in known.items():
            if name in options:
                value = options[name]
            elif spec.default_factory is not MISSING:
                value = spec.default_factory()
            else:
                value = spec.default
            setattr(self, name, value)
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(f"stop must hold non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must hold non-negative ints, got {self.stop_token_ids!r}")
        self.ignore_eos = bool(self.ignore_eos)


@dataclass
class RequestOutput:
    """The result of one request (or, from :meth:`metrale.LLM.generate_stream`, its state so far).

    ``token_ids`` are the generated tokens (a stop token included), ``text`` their decoded text
    (cut before a stop string; None without a tokenizer). ``finish_reason`` is ``"stop"`` (an
    end-of-sequence token, a stop token or a stop string), ``"length"`` (``max_tokens`` or the
    model's context reached) or ``"error"`` (the request could not run: ``error`` says why; the
    other requests go on), and None while the request is unfinished (``finished`` False).
    ``stop_reason`` is the stop string or token id that ended it. ``cached_tokens`` counts the
    prompt tokens the prefix cache supplied when the request was first admitted;
    ``num_preemptions`` how often it was preempted (its cache freed and recomputed later).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    error: str | None = None
    finished: bool = True
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)
