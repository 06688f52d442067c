"""The n-gram drafter (prompt lookup): drafts come from the sequence's own tokens, no model.

For a sequence ``t[0 .. L-1]`` it looks for the last ``n`` tokens earlier in the sequence, from
``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, and proposes the tokens that followed
the most recent earlier occurrence. Repetitive text (code, quoted passages, structured answers)
is where it pays; elsewhere it proposes nothing and the step decodes one token.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from metrale.model.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.speculative import SpeculativeConfig

METRALE_CONTRACT_VERSION = CONTRACT_VERSION


class NgramDrafter:
    """Prompt-lookup drafts (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, seqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        return [self.continuation(seq.tokens, limit) if limit > 0 else [] for seq, limit in zip(seqs, limits)]

    def continuation(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens following the most recent earlier occurrence of the longest
        matching suffix of ``tokens`` (empty when none matches)."""
        length = len(tokens)
        if limit <= 0 or length < self.min_n + 1:
            return []
        array = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = array[length - n:]
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, each followed by a token.
            windows = np.lib.stride_tricks.sliding_window_view(array[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return array[start : start + limit].tolist()
        return []


@hookimpl
def metrale_drafters() -> dict[str, Any]:
    return {"ngram": lambda config, model: NgramDrafter(config)}
