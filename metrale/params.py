"""User-facing request types: :class:`SamplingParams` and :class:`RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

from metrale.errors import InvalidRequestError, UnknownOptionError
from metrale.validation import check_bool, check_float, check_int, check_seed

#: Temperatures below this are treated as greedy (0): dividing logits by a smaller value
#: overflows float32 and leaves no distribution to sample.
MIN_TEMPERATURE = 1e-5


def _check_stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    elif value is None:
        value = ()
    elif not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {value!r}")
    if any(not isinstance(s, str) or not s for s in value):
        raise InvalidRequestError(f"stop must hold non-empty strings, got {list(value)!r}")
    for text in value:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidRequestError(f"stop string {text!r} is not valid Unicode: {error.reason}") from None
    return tuple(value)


def _check_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {value!r}")
    return tuple(check_int("stop_token_ids[]", t, minimum=0) for t in value)


#: One check per field: it returns the canonical value or raises InvalidRequestError.
_FIELD_CHECKS: dict[str, Callable[[Any], Any]] = {
    "max_tokens": lambda v: check_int("max_tokens", v, minimum=1),
    "temperature": lambda v: check_float("temperature", v, minimum=0.0),
    "top_k": lambda v: check_int("top_k", v, minimum=-1),
    "top_p": lambda v: check_float("top_p", v, minimum=0.0, minimum_exclusive=True, maximum=1.0),
    "seed": lambda v: None if v is None else check_seed("seed", v),
    "stop": _check_stop,
    "stop_token_ids": _check_stop_token_ids,
    "ignore_eos": lambda v: check_bool("ignore_eos", v),
}


@dataclass(init=False)
class SamplingParams:
    """How to generate for one request.

    * ``max_tokens`` -- tokens to generate at most (an int >= 1);
    * ``temperature`` -- 0 means greedy; otherwise logits are divided by it (a finite number
      >= 0; below :data:`MIN_TEMPERATURE`, 1e-5, sampling is greedy);
    * ``top_k`` -- keep the k most likely tokens (0 or -1: all; above the vocabulary size: all);
    * ``top_p`` -- keep the smallest set of tokens whose probability reaches p (in (0, 1]; 1: all);
    * ``seed`` -- seeds this request's random stream: the same seed gives the same tokens (an int
      in ``[0, 2**64)``, or None to derive one from the engine's seed);
    * ``stop`` -- strings that end generation (the text is cut before them); a string or a list
      of non-empty strings, kept as a tuple;
    * ``stop_token_ids`` -- token ids that end generation (kept in ``token_ids``); a tuple of
      ints >= 0;
    * ``ignore_eos`` -- keep going past the checkpoint's end-of-sequence tokens (True or False).

    Every value is checked when it is set -- at construction and on every later assignment --
    so a ``SamplingParams`` never holds a bad value: unknown keywords raise
    :class:`~metrale.errors.UnknownOptionError`, bad values (a wrong type included)
    :class:`~metrale.errors.InvalidRequestError`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __init__(self, **options: Any) -> None:
        known = {f.name: f for f in fields(self)}
        for name in options:
            if name not in known:
                raise UnknownOptionError(
                    f"unknown sampling option {name!r}; known options: {', '.join(known)}"
                )
        # All values are checked before any is set.
        values = {
            name: _FIELD_CHECKS[name](options[name] if name in options else spec.default)
            for name, spec in known.items()
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise UnknownOptionError(
                f"unknown sampling option {name!r}; known options: {', '.join(_FIELD_CHECKS)}"
            )
        object.__setattr__(self, name, check(value))

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (temperature below :data:`MIN_TEMPERATURE`)."""
        return self.temperature < MIN_TEMPERATURE


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
