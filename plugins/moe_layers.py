"""Reusable routed-expert layers: stacked expert weights and the routed SwiGLU experts.

Public, like :mod:`metrale.plugins.dense.layers`: any MoE family may build on it. Routing itself
differs between families (``backend.ops.moe_route`` covers softmax and sigmoid scoring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.checkpoint import Checkpoint
from metrale.plugins.dense.layers import MlpWeights, swiglu_mlp

#: Batches of up to this many tokens run their experts pair by pair on the device (decode); larger
#: ones group the tokens of each expert into one matrix product.
MAX_PAIRWISE_TOKENS = 64


@dataclass
class StackedExperts:
    """Routed experts stacked (``gate_up [E 2I, H]``, gate rows of each expert first; ``down
    [E H, I]``) and the same weights as per-expert views."""

    gate_up: Any
    down: Any
    experts: list[MlpWeights]


def load_stacked_experts(
    checkpoint: Checkpoint, backend: Any, prefix: str, count: int, hidden: int, width: int
) -> StackedExperts:
    """Read ``{prefix}.{e}.{gate,up,down}_proj`` for ``e < count`` into stacked weights."""
    gate_up = backend.load_weight(checkpoint, *[
        part for e in range(count) for part in (
            (f"{prefix}.{e}.gate_proj.weight", (width, hidden)),
            (f"{prefix}.{e}.up_proj.weight", (width, hidden)))
    ])
    down = backend.load_weight(checkpoint, *[(f"{prefix}.{e}.down_proj.weight", (hidden, width)) for e in range(count)])
    views = [MlpWeights(gate_up=gate_up[2 * width * e : 2 * width * (e + 1)], down=down[hidden * e : hidden * (e + 1)])
             for e in range(count)]
    return StackedExperts(gate_up, down, views)


def routed_experts(backend: Any, experts: StackedExperts, h: Any, chosen: Any, weights: Any) -> Any:
    """``[N, H]`` float32: ``sum_s weights[n, s] * Expert_{chosen[n, s]}(h[n])``."""
    xp = backend.xp
    if h.shape[0] <= MAX_PAIRWISE_TOKENS:
        return backend.ops.moe_experts(h, chosen, weights, experts.gate_up, experts.down)
    out = xp.zeros((h.shape[0], experts.down.shape[0] // len(experts.experts)), dtype=xp.float32)
    chosen_host = backend.to_numpy(chosen).astype(np.int64)
    for expert in np.unique(chosen_host):
        token_rows, slots = np.nonzero(chosen_host == expert)
        token_index = xp.asarray(token_rows)
        y = swiglu_mlp(backend, experts.experts[int(expert)], h[token_index])
        out[token_index] += weights[token_index, xp.asarray(slots)][:, None] * y
    return out
