"""What :meth:`metrale.LLM.generate` accepts as prompts, parsed into text or token ids.

A prompt is a ``str``, a list (or tuple, or 1-D integer NumPy array) of token ids, or a dict as
vLLM takes them: ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}``. With both keys the
token ids run and the text is the output's ``prompt``: the ids must be the text's encoding, with
the tokenizer's special tokens or without them (:func:`check_prompt_agreement`; a
:class:`TokenizedPrompt` is taken as it is). ``generate`` takes one prompt or a list of prompts.
Anything else -- ``None``, ``bytes``, a number, a dict with other keys, a token id that is not an
int -- raises :class:`~metrale.errors.InvalidRequestError` naming the offending value, before any
prompt runs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypedDict, Union

import numpy as np

from metrale.errors import EmptyPromptError, InvalidRequestError

#: One prompt, in any accepted form.
Prompt = Union[str, Sequence[int], Mapping[str, Any]]


class TextPrompt(TypedDict):
    """A prompt as text, as vLLM's ``TextPrompt``: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt as token ids, as vLLM's ``TokensPrompt``: ``{"prompt_token_ids": [...]}``, with the
    text they encode under ``prompt`` when the caller has it (the ids run; the text is the output's
    ``prompt``)."""

    prompt_token_ids: list[int]
    prompt: str

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class TokenizedPrompt(dict):
    """A prompt dict whose ``prompt_token_ids`` its caller encoded from its ``prompt`` (with the
    front end's :meth:`~metrale.entrypoints.frontend.PromptFrontend.encode`): taken without tokenizing the
    text again to check that the two agree, which a long prompt would pay for twice. For callers
    that encode the text themselves (the server's handlers, :meth:`~metrale.LLM.chat`), through
    :meth:`~metrale.entrypoints.frontend.PromptFrontend.tokenized_prompt`; a plain dict with both keys is
    checked."""


@dataclass(frozen=True)
class ParsedPrompt:
    """A prompt as text (to be tokenized: ``token_ids`` None) or as token ids (with the text they
    came from, or None); ``check_agreement``: the text and the ids were given together by a
    caller that did not encode one from the other, and must still be checked against each other
    (:func:`check_prompt_agreement`)."""

    text: str | None
    token_ids: list[int] | None
    check_agreement: bool = False


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:80]}..." if len(text) > 80 else text


def parse_token_ids(value: Any, label: str) -> list[int]:
    """Token ids given as a list or tuple of ints or a 1-D integer array, as a list of ints."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise InvalidRequestError(f"{label}: token ids must be a 1-D integer array, got {value.dtype} {value.shape}")
        return [int(t) for t in value]
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{label}: token ids must be a list of ints, got {_describe(value)}")
    bad = [t for t in value if not _is_token(t)]
    if bad:
        raise InvalidRequestError(f"{label}: token ids must be ints, got {_describe(bad[0])} ({type(bad[0]).__name__})")
    return [int(t) for t in value]


def check_text(text: str, label: str) -> str:
    """``text`` if it is a non-empty string that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{label} must be a string, got {_describe(text)} ({type(text).__name__})")
    if not text:
        raise EmptyPromptError(f"{label} is the empty string ''")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"{label} is not valid Unicode: {error.reason} at index {error.start} ({text[error.start]!r})"
        ) from None
    return text


def parse_prompt(prompt: Any, label: str) -> ParsedPrompt:
    """One prompt in any accepted form (see the module docstring)."""
    if isinstance(prompt, str):
        return ParsedPrompt(check_text(prompt, label), None)
    if isinstance(prompt, Mapping):
        keys = [k for k in _PROMPT_KEYS if k in prompt]
        unknown = [k for k in prompt if k not in _PROMPT_KEYS]
        if unknown or not keys:
            raise InvalidRequestError(
                f"{label}: a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (or both), got keys "
                f"{sorted(map(str, prompt))}"
            )
        text = check_text(prompt["prompt"], f"{label}['prompt']") if "prompt" in prompt else None
        if "prompt_token_ids" not in prompt:
            return ParsedPrompt(text, None)
        return ParsedPrompt(text, parse_token_ids(prompt["prompt_token_ids"], f"{label}['prompt_token_ids']"),
                            check_agreement=text is not None and not isinstance(prompt, TokenizedPrompt))
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return ParsedPrompt(None, parse_token_ids(prompt, label))
    raise InvalidRequestError(
        f"{label} must be a string, a list of token ids or a prompt dict, got {_describe(prompt)} "
        f"({type(prompt).__name__})"
    )


def check_prompt_agreement(text: str, token_ids: list[int], encode: Callable[[str, bool], list[int]],
                           label: str) -> None:
    """Refuse ``token_ids`` given with ``text`` that are not ``text``'s encoding (``encode(text,
    add_special_tokens)``) with the special tokens or without them: the chat path encodes a
    template's text, which writes its own special tokens, without them; a plain text gets them.
    Otherwise the ids would run while the output reported another prompt."""
    with_special = encode(text, True)
    if token_ids == with_special or token_ids == encode(text, False):
        return
    first = next((i for i, (a, b) in enumerate(zip(token_ids, with_special)) if a != b),
                 min(len(token_ids), len(with_special)))
    raise InvalidRequestError(
        f"{label}: 'prompt' and 'prompt_token_ids' disagree: the text {_describe(text)} encodes to "
        f"{len(with_special)} ids {_describe(with_special)} (with or without special tokens), but "
        f"'prompt_token_ids' holds {len(token_ids)} ids {_describe(token_ids)}, which differ from index {first}; "
        "give one of them"
    )


def split_prompts(prompts: Any) -> list[Any]:
    """``prompts`` as a list of single prompts: one prompt (a string, a dict, a list of ints)
    becomes a list of one."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim not in (1, 2):
            raise InvalidRequestError(f"prompts as an array must be 1-D (one prompt) or 2-D, got shape {prompts.shape}")
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, (list, tuple)):
        if prompts and all(_is_token(p) for p in prompts):
            return [prompts]
        return list(prompts)
    raise InvalidRequestError(
        f"prompts must be a prompt or a list of prompts, got {_describe(prompts)} ({type(prompts).__name__})"
    )
