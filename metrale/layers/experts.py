"""Routed experts: stacked expert weights and the routed SwiGLU experts.

A public building block: any MoE family may build on it. Routing itself
differs between families (``backend.ops.moe_route`` covers softmax and sigmoid scoring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.layers.mlp import MlpWeights, swiglu_mlp
from metrale.loading.checkpoint import Checkpoint

#: Batches of up to this many tokens run their experts pair by pair (decode sizes); larger ones
#: group the pairs of each expert into one matrix product: on the CUDA backend inside
#: ``moe_experts`` (grouped tensor-core kernels, no host synchronisation), on the CPU backend in
#: :func:`routed_experts` (the CPU reference computes pair by pair).
MAX_PAIRWISE_TOKENS = 64


@dataclass
class StackedExperts:
    """Routed experts stacked (``gate_up [E 2I, H]``, gate rows of each expert first; ``down
    [E H, I]``) and the same weights as per-expert views. On a rank of a tensor-parallel group
    the rank's part: with expert parallelism its experts ``first .. first + E - 1`` whole, else
    every expert's part of the intermediate size ``I``."""

    gate_up: Any
    down: Any
    experts: list[MlpWeights]
    first: int = 0
    total: int | None = None


#: The names of an expert's gate, up and down projections (``{prefix}.{e}.{name}.weight``).
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
#: Mixtral's names for them.
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def load_stacked_experts(
    checkpoint: Checkpoint, backend: Any, prefix: str, count: int, hidden: int, width: int,
    names: tuple[str, str, str] = EXPERT_NAMES,
) -> StackedExperts:
    """Read ``{prefix}.{e}.{gate,up,down}_proj`` (or the gate, up and down ``names``) for ``e <
    count`` into stacked weights (a rank's part of them, :class:`StackedExperts`)."""
    gate_name, up_name, down_name = names
    shard = backend.shard
    if shard.sharded and shard.expert_parallel:
        held, part = shard.split(count, "n_routed_experts"), slice(None)
    else:
        held, part = slice(0, count), shard.split(width, "moe_intermediate_size")
    local = len(range(width)[part])
    gate_up = backend.load_weight(checkpoint, *[
        spec for e in range(held.start, held.stop) for spec in (
            (f"{prefix}.{e}.{gate_name}.weight", (width, hidden), part, None),
            (f"{prefix}.{e}.{up_name}.weight", (width, hidden), part, None))
    ])
    down = backend.load_weight(checkpoint, *[(f"{prefix}.{e}.{down_name}.weight", (hidden, width), None, part)
                                             for e in range(held.start, held.stop)])
    views = [MlpWeights(gate_up=gate_up[2 * local * e : 2 * local * (e + 1)], down=down[hidden * e : hidden * (e + 1)])
             for e in range(held.stop - held.start)]
    return StackedExperts(gate_up, down, views, first=held.start, total=count)


@dataclass
class SoftmaxMoe:
    """Softmax-routed experts, as Mixtral, Qwen2-MoE, Qwen3-MoE and Qwen3-Next have them: the
    router ``gate [E, H]`` scores every expert, the ``top_k`` best are kept (their softmax
    probabilities renormalised to sum to one when ``renormalise``), the chosen experts' SwiGLU
    outputs are summed with those weights; then, where there is one, a shared expert is added,
    through ``sigmoid(h . shared_gate)`` when it has a gate ``[1, H]`` (Qwen2-MoE, Qwen3-Next)."""

    gate: Any
    experts: StackedExperts
    top_k: int
    renormalise: bool
    shared: MlpWeights | None = None
    shared_gate: Any = None

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, *, num_experts: int, hidden: int, width: int,
             top_k: int, renormalise: bool, shared_width: int | None = None, shared_gate: bool = False,
             expert_names: tuple[str, str, str] = EXPERT_NAMES) -> "SoftmaxMoe":
        """The block at ``prefix``: ``gate``, ``experts.{e}`` (``expert_names``), and with
        ``shared_width`` ``shared_expert`` (and with ``shared_gate`` ``shared_expert_gate``)."""
        from metrale.layers.mlp import load_mlp_weights

        return cls(
            gate=backend.constant(checkpoint.tensor(f"{prefix}.gate.weight", (num_experts, hidden))),
            experts=load_stacked_experts(checkpoint, backend, f"{prefix}.experts", num_experts, hidden, width,
                                         names=expert_names),
            top_k=top_k,
            renormalise=renormalise,
            shared=(load_mlp_weights(checkpoint, backend, f"{prefix}.shared_expert", hidden, shared_width)
                    if shared_width else None),
            shared_gate=(backend.load_weight(checkpoint, (f"{prefix}.shared_expert_gate.weight", (1, hidden)))
                         if shared_width and shared_gate else None),
        )

    def route(self, backend: Any, h: Any) -> tuple[Any, Any]:
        """Top-k experts ``[N, k]`` and their weights: softmax over the router logits, renormalised
        as ``renormalise`` says, no scaling or group limit."""
        return backend.ops.moe_route(h, self.gate, None, "greedy", 1, 1, self.top_k, self.renormalise, 1.0)

    def forward(self, backend: Any, h: Any, chosen: Any, weights: Any, batch: Any = None) -> Any:
        """The chosen experts' weighted outputs plus the shared expert's (through its gate), with
        each row's adapter update of the shared expert when ``batch`` has adapter rows."""
        out = routed_experts(backend, self.experts, h, chosen, weights)
        if self.shared is None:
            return out
        shared = swiglu_mlp(backend, self.shared, h, batch)
        if self.shared_gate is None:
            return out + shared
        # routed + shared expert * sigmoid(h . shared_gate), one gate per row.
        return backend.ops.gated_add(out, shared, backend.ops.linear(h, self.shared_gate))


def routed_experts(backend: Any, experts: StackedExperts, h: Any, chosen: Any, weights: Any) -> Any:
    """``[N, H]`` float32: ``sum_s weights[n, s] * Expert_{chosen[n, s]}(h[n])``.

    ``backend.ops.moe_experts`` serves every batch, except CPU batches of more than
    :data:`MAX_PAIRWISE_TOKENS` tokens: the CPU reference runs pair by pair, so those sort their
    (token, expert) pairs by expert here instead (:func:`grouped_on_host`). On a rank of a
    tensor-parallel group each rank computes its part (its experts' pairs, the others weighted
    zero; or its part of every expert) and the parts are summed over the ranks."""
    held = len(experts.experts)
    if experts.total is not None and held != experts.total:
        xp = backend.xp
        local = chosen - experts.first
        mine = (local >= 0) & (local < held)
        chosen = xp.where(mine, local, 0).astype(chosen.dtype)
        weights = xp.where(mine, weights, 0).astype(xp.float32)
    if backend.name == "cpu" and h.shape[0] > MAX_PAIRWISE_TOKENS:
        out = grouped_on_host(backend, experts, h, chosen, weights)
    else:
        out = backend.ops.moe_experts(h, chosen, weights, experts.gate_up, experts.down)
    return backend.all_reduce(out)


def grouped_on_host(backend: Any, experts: StackedExperts, h: Any, chosen: Any, weights: Any) -> Any:
    """:func:`routed_experts` with the pairs sorted by expert on the host: one read of the choices,
    one gather of the rows, one matrix product chain per chosen expert over its contiguous rows,
    then each token's ``k`` weighted results gathered back and summed."""
    xp = backend.xp
    tokens, top_k = chosen.shape
    flat = backend.to_numpy(chosen).astype(np.int64).reshape(-1)
    order = np.argsort(flat, kind="stable")  # pair indices n * k + s, grouped by expert
    counts = np.bincount(flat, minlength=len(experts.experts))
    gathered = h[xp.asarray(order // top_k)]
    hidden = experts.down.shape[0] // len(experts.experts)
    results = xp.empty((tokens * top_k, hidden), dtype=xp.float32)
    start = 0
    for expert in np.flatnonzero(counts):
        stop = start + int(counts[expert])
        results[start:stop] = swiglu_mlp(backend, experts.experts[int(expert)], gathered[start:stop], reduce=False)
        start = stop
    results *= xp.asarray(weights, dtype=xp.float32).reshape(-1)[xp.asarray(order)][:, None]
    unsorted = results[xp.asarray(np.argsort(order))]  # back to pair order n * k + s
    return unsorted.reshape(tokens, top_k, hidden).sum(axis=1)
