"""Speculative decoding: the configuration, the drafter interface and the acceptance rule.

A decode step with speculation proposes up to ``K`` draft tokens per sequence (a *drafter*), runs
the target model over each sequence's last token plus its drafts in one forward call (the
``verify`` method of the forward contract, logits ``[sum(K_i + 1), vocab]``), samples one token
per row exactly as plain decoding would, and keeps the longest prefix of drafts equal to those
samples plus the sample at the first difference (or after the last draft). The ``verdict`` then
tells the model how many rows each sequence kept (:func:`accepted_count`). On the ``cuda``
backend a verify of a model without recurrent state replays the decode graphs, its rows as decode
rows of their own (:meth:`metrale.runner.graphs.CudaGraphRunner.run_verify`), so a verify of a
few rows costs little more than a decode step (timings: :doc:`/benchmarks`, "Speculative decoding").

Why this is exact: the drafters here propose one token per position (a point mass ``q``), and
row ``j``'s sample is drawn from the target's distribution ``p_j`` with the request's seed and
the index of the token it draws -- the draw plain decoding makes at that position. The draft is
kept with probability ``p_j(d_j)`` (the chance the sample equals it), and a sample that differs
is distributed as ``p_j`` without ``d_j``, renormalised: the standard speculative rejection rule
``min(1, p/q)`` with its residual for a point-mass ``q``. A request's tokens are therefore the
tokens it gets without speculation (greedy or seeded), whatever its batch companions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from metrale.errors import ConfigError

#: The most draft tokens a step may propose per sequence.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``speculative_config`` asks for (the keys vLLM uses).

    ``method`` names a drafter (``"ngram"``: prompt lookup in the sequence's own tokens;
    ``"mtp"``: a DeepSeek-V3 or Qwen3-Next checkpoint's multi-token-prediction module,
    :mod:`metrale.plugins.mtp`; others come from plugins,
    :func:`metrale.model.hookspecs.metrale_drafters`); ``num_speculative_tokens``
    is ``K``, the most drafts per sequence and step (1 to :data:`MAX_SPECULATIVE_TOKENS`);
    ``prompt_lookup_min`` / ``prompt_lookup_max`` bound the n-gram lengths the n-gram drafter
    matches (longest first). ``options`` keeps the keys a plugin's drafter reads.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    options: Mapping[str, Any] | None = None

    @classmethod
    def from_value(cls, value: Any) -> "SpeculativeConfig | None":
        """A config from a mapping (``{"method": "ngram", "num_speculative_tokens": 3}``), a
        :class:`SpeculativeConfig`, or None (no speculation). Raises
        :class:`~metrale.errors.ConfigError` naming a missing or bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative_config must be a mapping such as {{'method': 'ngram', "
                              f"'num_speculative_tokens': 3}}, got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        values = dict(value)
        method = values.pop("method", None)
        if not isinstance(method, str) or not method:
            raise ConfigError(f"speculative_config needs a 'method' (a drafter's name such as 'ngram'), got {method!r}")
        count = values.pop("num_speculative_tokens", None)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config's num_speculative_tokens must be an int from 1 to "
                              f"{MAX_SPECULATIVE_TOKENS}, got {count!r}")
        low, high = values.pop("prompt_lookup_min", 1), values.pop("prompt_lookup_max", 4)
        for name, number in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ConfigError(f"speculative_config's {name} must be a positive int, got {number!r}")
        if low > high:
            raise ConfigError(f"speculative_config's prompt_lookup_min ({low}) is above its prompt_lookup_max ({high})")
        if method == "ngram" and values:
            raise ConfigError(f"speculative_config has unknown keys {sorted(values)} for the n-gram drafter; "
                              f"it reads {sorted(known)}")
        return cls(method, count, low, high, values or None)


class Drafter(Protocol):
    """Proposes draft tokens for a decode step (what a ``metrale_drafters`` factory returns)."""

    def propose(self, seqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        """At most ``limits[i]`` draft tokens to follow ``seqs[i].tokens`` (its prompt and the
        tokens generated so far, all on the host), one list per sequence (empty: no proposal)."""
        ...  # pragma: no cover


def accepted_count(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of ``drafts`` a verify keeps: the longest prefix equal to the tokens sampled at
    the same rows (``sampled`` has one more entry than ``drafts``: the row after the last draft)."""
    count = 0
    for draft, token in zip(drafts, sampled):
        if int(draft) != int(token):
            break
        count += 1
    return count


def parse_config_argument(text: str) -> dict:
    """The ``--speculative-config`` command-line value: a JSON object (:class:`ValueError`
    saying what it is not, otherwise)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError('not a JSON object such as {"method": "ngram", "num_speculative_tokens": 3}')
    return value
