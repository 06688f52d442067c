"""User-facing request types: :class:`SamplingParams` and :class:`PoolingParams`, and the results
:class:`RequestOutput`, :class:`CompletionOutput`, :class:`Logprob`, :class:`EmbeddingRequestOutput`
and :class:`EmbeddingOutput` (shaped as vLLM's)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
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


#: The largest temperature (far past any that still changes the distribution: dividing float32
#: logits by more leaves them all 0).
MAX_TEMPERATURE = 1e6

#: The most completions one request may ask for (``n``).
MAX_N = 128

#: The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for per token.
MAX_LOGPROBS = 20


def _check_logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    bias: dict[int, float] = {}
    for token, amount in value.items():
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():  # JSON object keys are strings
            token = int(token)
        token = check_int("logit_bias token id", token, minimum=0)
        bias[token] = check_float(f"logit_bias[{token}]", amount, minimum=-100.0, maximum=100.0)
    return bias


def _check_structured(value: Any) -> Any:
    if value is None:
        return None
    from metrale.structured import StructuredOutputParams

    if not isinstance(value, StructuredOutputParams):
        raise InvalidRequestError(
            f"structured_output must be a metrale.structured.StructuredOutputParams or None, got {value!r}")
    return value


#: One check per field: it returns the canonical value or raises InvalidRequestError.
_FIELD_CHECKS: dict[str, Callable[[Any], Any]] = {
    "max_tokens": lambda v: check_int("max_tokens", v, minimum=1),
    "temperature": lambda v: check_float("temperature", v, minimum=0.0, maximum=MAX_TEMPERATURE),
    "top_k": lambda v: check_int("top_k", v, minimum=-1),
    "top_p": lambda v: check_float("top_p", v, minimum=0.0, minimum_exclusive=True, maximum=1.0),
    "seed": lambda v: None if v is None else check_seed("seed", v),
    "stop": _check_stop,
    "stop_token_ids": _check_stop_token_ids,
    "ignore_eos": lambda v: check_bool("ignore_eos", v),
    "n": lambda v: check_int("n", v, minimum=1, maximum=MAX_N),
    "presence_penalty": lambda v: check_float("presence_penalty", v, minimum=-2.0, maximum=2.0),
    "frequency_penalty": lambda v: check_float("frequency_penalty", v, minimum=-2.0, maximum=2.0),
    "repetition_penalty": lambda v: check_float("repetition_penalty", v, minimum=0.0, minimum_exclusive=True, maximum=100.0),
    "min_p": lambda v: check_float("min_p", v, minimum=0.0, maximum=1.0),
    "logit_bias": _check_logit_bias,
    "min_tokens": lambda v: check_int("min_tokens", v, minimum=0),
    "logprobs": lambda v: None if v is None else check_int("logprobs", v, minimum=0, maximum=MAX_LOGPROBS),
    "prompt_logprobs": lambda v: None if v is None else check_int("prompt_logprobs", v, minimum=0, maximum=MAX_LOGPROBS),
    "structured_output": _check_structured,
}


@dataclass(init=False)
class SamplingParams:
    """How to generate for one request.

    * ``max_tokens`` -- tokens to generate at most (an int >= 1);
    * ``temperature`` -- 0 means greedy; otherwise logits are divided by it (a number in
      ``[0, 1e6]``, :data:`MAX_TEMPERATURE`; below :data:`MIN_TEMPERATURE`, 1e-5, sampling is
      greedy);
    * ``top_k`` -- keep the k most likely tokens (0 or -1: all; above the vocabulary size: all);
    * ``top_p`` -- keep the smallest set of tokens whose probability reaches p (in (0, 1]; 1: all);
    * ``min_p`` -- keep the tokens whose probability is at least ``min_p`` times the most likely
      one's (in [0, 1]; 0: all);
    * ``seed`` -- seeds this request's random stream: the same seed gives the same tokens (an int
      in ``[0, 2**64)``, or None to derive one from the engine's seed);
    * ``n`` -- completions to generate for the prompt (1 to :data:`MAX_N`); each has its own
      random stream (the first that of ``seed``), so with ``temperature`` 0 they are equal;
    * ``stop`` -- strings that end generation (the text is cut before them); a string or a list
      of non-empty strings, kept as a tuple;
    * ``stop_token_ids`` -- token ids that end generation (kept in ``token_ids``); a tuple of
      ints >= 0;
    * ``ignore_eos`` -- keep going past the checkpoint's end-of-sequence tokens (True or False);
    * ``min_tokens`` -- tokens to generate before an end-of-sequence token, a stop token or a stop
      string may end the request (those tokens cannot be drawn before; an int >= 0, at most
      ``max_tokens``);
    * ``presence_penalty`` / ``frequency_penalty`` -- subtracted from the logit of every token
      already generated: once, and once per occurrence (in [-2, 2], as OpenAI's);
    * ``repetition_penalty`` -- the logit of every token in the prompt or generated so far is
      divided by it when positive and multiplied by it when negative (> 0; 1: off; as
      transformers' ``repetition_penalty``);
    * ``logit_bias`` -- ``{token id: bias}`` added to those logits before sampling (biases in
      [-100, 100]; -100 all but bans a token);
    * ``logprobs`` -- with an int k (0 to :data:`MAX_LOGPROBS`), each generated token's log
      probability and the k most likely tokens' (:class:`Logprob`) are returned;
    * ``prompt_logprobs`` -- the same for every prompt token after the first (computed by one
      teacher-forced pass over the prompt before the request joins the batch);
    * ``structured_output`` -- a :class:`~metrale.structured.StructuredOutputParams`: the output
      must match a JSON schema, any JSON object, a regular expression, a grammar or a choice.

    Penalties, ``logit_bias``, ``min_tokens`` and ``structured_output`` change the logits before
    temperature, ``top_k``, ``top_p`` and ``min_p`` pick the token; ``logprobs`` are those of the
    model's own distribution (its logits before any of them).

    Every value is checked when it is set -- at construction and on every later assignment --
    so a ``SamplingParams`` never holds a bad value: unknown keywords raise
    :class:`~metrale.errors.UnknownOptionError`, bad values (a wrong type included)
    :class:`~metrale.errors.InvalidRequestError`. The fields given explicitly are remembered
    (:attr:`explicit`): a checkpoint's ``generation_config.json`` supplies the defaults of the
    others (:meth:`with_defaults`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: Any = None
    _explicit: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __init__(self, **options: Any) -> None:
        known = {f.name: f for f in fields(self) if f.name != "_explicit"}
        for name in options:
            if name not in known:
                raise UnknownOptionError(
                    f"unknown sampling option {name!r}; known options: {', '.join(known)}"
                )
        # All values are checked before any is set.
        values = {name: _FIELD_CHECKS[name](options[name] if name in options else _default(spec))
                  for name, spec in known.items()}
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_explicit", frozenset(options))

    def __setattr__(self, name: str, value: Any) -> None:
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise UnknownOptionError(
                f"unknown sampling option {name!r}; known options: {', '.join(_FIELD_CHECKS)}"
            )
        object.__setattr__(self, name, check(value))
        object.__setattr__(self, "_explicit", self._explicit | {name})

    def __copy__(self) -> "SamplingParams":
        own = SamplingParams.__new__(SamplingParams)
        for name in _FIELD_CHECKS:
            value = getattr(self, name)
            object.__setattr__(own, name, dict(value) if isinstance(value, dict) else value)
        object.__setattr__(own, "_explicit", self._explicit)
        return own

    @property
    def explicit(self) -> frozenset[str]:
        """The names of the fields given at construction or assigned since."""
        return self._explicit

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (temperature below :data:`MIN_TEMPERATURE`)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether presence, frequency or repetition penalties change the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy whose fields not given explicitly take ``defaults``' values (such as
        :func:`generation_defaults` of a checkpoint); ``self`` when nothing changes."""
        missing = {name: value for name, value in defaults.items() if name not in self._explicit}
        if not missing:
            return self
        own = self.__copy__()
        for name, value in missing.items():
            object.__setattr__(own, name, _FIELD_CHECKS[name](value))
        return own

    def check_for_model(self, vocab_size: int) -> None:
        """The checks that need the model or several fields together: ``min_tokens`` at most
        ``max_tokens``, ``logit_bias`` and ``stop_token_ids`` within the vocabulary."""
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name, tokens in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in tokens if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} holds token id {bad[0]}, outside [0, {vocab_size})")


def _default(spec: Any) -> Any:
    return spec.default_factory() if spec.default is _MISSING else spec.default


_MISSING = dataclasses.MISSING

#: The ``generation_config.json`` keys a checkpoint's sampling defaults come from, and the
#: :class:`SamplingParams` field of each.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults ``generation_config.json`` gives (``{field: value}``): its
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
    ``max_new_tokens`` (as ``max_tokens``), and ``do_sample: false`` as temperature 0 (greedy,
    as transformers generates). Values that would not pass :class:`SamplingParams`' checks are
    left out (a checkpoint's file must not make every request fail)."""
    defaults: dict[str, Any] = {}
    for key, name in GENERATION_CONFIG_FIELDS.items():
        if key in generation_config and generation_config[key] is not None:
            try:
                defaults[name] = _FIELD_CHECKS[name](generation_config[key])
            except InvalidRequestError:
                continue
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


@dataclass
class Logprob:
    """The log probability of one token (``logprob``), its ``rank`` in the distribution (1: the
    most likely) and its text (``decoded_token``; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per position: ``{token id: Logprob}`` -- the chosen token and the most likely alternatives.
LogprobsDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request.

    ``index`` is its place among the request's ``n`` completions. ``token_ids`` are the
    generated tokens (a stop token included), ``text`` their decoded text (cut before a stop
    string; None without a tokenizer). ``finish_reason`` is ``"stop"`` (an end-of-sequence
    token, a stop token, a stop string, or a finished structured output), ``"length"``
    (``max_tokens`` or the model's context reached) or ``"error"`` (the request could not run:
    the request's ``error`` says why), and None while unfinished. ``stop_reason`` is the stop
    string or token id that ended it. ``logprobs`` (when asked for) holds one
    :data:`LogprobsDict` per generated token, ``cumulative_logprob`` the sum of the chosen tokens'
    log probabilities.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request (or, from a stream, its state so far), shaped as vLLM's.

    ``outputs`` holds its ``n`` :class:`CompletionOutput`\\ s, in index order.
    ``prompt_logprobs`` (when asked for) holds None for the first prompt token and one
    :data:`LogprobsDict` for each later one. ``finished`` is False while any completion runs.
    ``cached_tokens`` counts the prompt tokens the prefix cache supplied when the request was
    first admitted (vLLM's ``num_cached_tokens``); ``num_preemptions`` how often its completions
    were preempted (their cache freed and recomputed later); ``error`` says why a request that
    finished with ``finish_reason == "error"`` could not run (the other requests go on).
    ``num_draft_tokens`` counts the draft tokens speculative decoding proposed for its
    completions and ``num_accepted_tokens`` those the target model's verifies kept (both 0
    without ``speculative_config``). ``lora_request`` is the LoRA adapter it ran with
    (:class:`~metrale.loading.lora.LoRARequest`), None for the base model.

    ``token_ids``, ``text``, ``finish_reason`` and ``stop_reason`` are those of the first
    completion (``outputs[0]``), for the common ``n == 1``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[LogprobsDict | None] | None = None
    cached_tokens: int = 0
    error: str | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    lora_request: Any = None

    @property
    def num_cached_tokens(self) -> int:
        return self.cached_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over every completion."""
        return sum(len(output.token_ids) for output in self.outputs)


#: How a pooling request pools its prompt's final states into one vector: ``"last"`` the last
#: token's, ``"mean"`` their mean.
POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How to pool one prompt into an embedding (:meth:`metrale.LLM.embed`, the server's
    ``/v1/embeddings``).

    * ``pooling`` -- ``"last"`` (the last token's final normed state, as Qwen3-Embedding and
      other decoder embedders pool) or ``"mean"`` (the mean over the prompt's tokens); None: the
      model's default (:attr:`metrale.entrypoints.frontend.PromptFrontend.default_pooling`);
    * ``normalize`` -- scale the vector to unit length; None: the model's default.

    Bad values raise :class:`~metrale.errors.InvalidRequestError`. :meth:`resolved` fills the
    fields left None.
    """

    pooling: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and (not isinstance(self.pooling, str) or self.pooling not in POOLING_METHODS):
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")
        if self.normalize is not None:
            object.__setattr__(self, "normalize", check_bool("normalize", self.normalize))

    def resolved(self, default: "PoolingParams") -> "PoolingParams":
        """These params with each field left None taken from ``default`` (``"last"`` and
        normalized where ``default`` leaves it None too)."""
        pooling = self.pooling if self.pooling is not None else default.pooling
        normalize = self.normalize if self.normalize is not None else default.normalize
        return PoolingParams(pooling or "last", True if normalize is None else normalize)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding: ``embedding`` the pooled vector (``hidden_size`` floats; empty
    when its request failed or was aborted)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The result of one pooling request (:meth:`metrale.LLM.embed`,
    :meth:`metrale.AsyncLLM.embed`), shaped as vLLM's: ``outputs.embedding`` holds the vector.
    ``finished`` is True once it is final; ``error`` says why a request failed (its embedding
    is then empty, as it is for an aborted one)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    error: str | None = None
