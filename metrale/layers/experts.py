"""Routed experts: stacked expert weights and the routed SwiGLU experts.

A public building block: any MoE family may build on it. Routing itself
differs between families (``backend.ops.moe_route`` covers softmax and sigmoid scoring).
GPT-OSS's kind -- a router with a bias whose top-k logits are softmaxed
(:class:`TopKRouter`), experts with biases and a clamped SwiGLU (:class:`ClampedExperts`), the
two as one block (:class:`ClampedSwigluMoe`) -- is here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    (token, expert) pairs by expert here instead (:func:`grouped_on_host`), except on a
    batch-invariant backend, where a token's result may not depend on how many share the step.
    On a rank of a tensor-parallel group each rank computes its part (its experts' pairs, the
    others weighted zero; or its part of every expert) and the parts are summed over the ranks."""
    held = len(experts.experts)
    if experts.total is not None and held != experts.total:
        xp = backend.xp
        local = chosen - experts.first
        mine = (local >= 0) & (local < held)
        chosen = xp.where(mine, local, 0).astype(chosen.dtype)
        weights = xp.where(mine, weights, 0).astype(xp.float32)
    if backend.name == "cpu" and h.shape[0] > MAX_PAIRWISE_TOKENS and not getattr(backend, "batch_invariant", False):
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


# ------------------------------------------------------------ experts with biases and a clamped SwiGLU


@dataclass
class TopKRouter:
    """A router whose logits ``h W^T + b`` (``weight [E, H]``, ``bias [E]`` or None) are computed
    apart, then each token's ``top_k`` largest logits chosen and weighted by their softmax over
    those ``k`` only (GPT-OSS's router; the ``moe_topk_softmax`` op)."""

    weight: Any
    bias: Any
    top_k: int

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, *, num_experts: int, hidden: int, top_k: int,
             bias: bool = True) -> "TopKRouter":
        """``{prefix}.weight`` and (with ``bias``) ``{prefix}.bias``, held at full precision on
        every rank whatever the checkpoint quantizes (the choice of experts is discontinuous)."""
        weight = backend.weight(checkpoint.tensor(f"{prefix}.weight", (num_experts, hidden)))
        offsets = backend.constant(checkpoint.tensor(f"{prefix}.bias", (num_experts,))) if bias else None
        return cls(weight, offsets, top_k)

    def route(self, backend: Any, h: Any) -> tuple[Any, Any]:
        """Top-k experts ``[N, k]`` (descending logits) and their weights ``[N, k]`` for ``h [N, H]``."""
        logits = backend.ops.linear(h, self.weight, self.bias)
        return backend.ops.moe_topk_softmax(logits, self.top_k)


@dataclass
class ClampedExperts:
    """Routed experts with biases and a clamped SwiGLU (GPT-OSS's), stacked as
    :class:`StackedExperts` are (``gate_up [E 2I, H]``, each expert's gate rows then its up rows;
    ``down [E H, I]``) with their biases stacked alike (``gate_up_bias [E 2I]``, ``down_bias [E H]``,
    constants); the ``moe_experts_clamped`` op computes them. ``alpha`` is the sigmoid's gain,
    ``limit`` the clamp of the gate (above) and of the up projection (both sides).

    On a rank of a tensor-parallel group the rank's part: with expert parallelism its experts
    ``first .. first + held - 1`` whole, else every expert's part of the intermediate size, the
    down projections' bias then held by rank 0 only (None on the others), so the sum over the
    ranks adds it once."""

    gate_up: Any
    down: Any
    gate_up_bias: Any
    down_bias: Any
    alpha: float
    limit: float
    held: int
    first: int = 0
    total: int | None = None

    def forward(self, backend: Any, h: Any, chosen: Any, weights: Any) -> Any:
        """``[N, H]`` float32: ``sum_s weights[n, s] * Expert_{chosen[n, s]}(h[n])``; on a rank of a
        tensor-parallel group the rank's part (its experts' pairs, the others weighted zero; or its
        part of every expert), summed over the ranks."""
        if self.total is not None and self.held != self.total:
            xp = backend.xp
            local = chosen - self.first
            mine = (local >= 0) & (local < self.held)
            chosen = xp.where(mine, local, 0).astype(chosen.dtype)
            weights = xp.where(mine, weights, 0).astype(xp.float32)
        out = backend.ops.moe_experts_clamped(h, chosen, weights, self.gate_up, self.down, self.alpha, self.limit,
                                              self.gate_up_bias, self.down_bias)
        return backend.all_reduce(out)


def interleaved_order(count: int, width: int) -> np.ndarray:
    """int64 ``[count * 2 width]``: the rows of ``count`` experts' gate/up projections stored
    interleaved (row ``2 j`` gate ``j``, row ``2 j + 1`` up ``j``) in the engine's order, each
    expert's gate rows then its up rows: ``stacked[order]`` reorders them."""
    one = np.concatenate([np.arange(0, 2 * width, 2), np.arange(1, 2 * width, 2)])
    return (np.arange(count)[:, None] * 2 * width + one[None, :]).reshape(-1)


def _rows_in_order(weight: Any, order: np.ndarray) -> Any:
    """The rows ``order`` of a host weight: a float32 matrix or a quantized one (its scales,
    and zero points, taken per row)."""
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[order])
    per_row = weight.per_row_scales()
    return replace(per_row, codes=np.ascontiguousarray(per_row.codes[order]),
                   scales=np.ascontiguousarray(per_row.scales[order]),
                   zeros=None if per_row.zeros is None else np.ascontiguousarray(per_row.zeros[order]))


def _placed(backend: Any, host: Any) -> Any:
    """A host weight (float32 or quantized) as ``backend`` holds weights."""
    if isinstance(host, np.ndarray):
        return backend.weight(host)
    upload = getattr(backend, "quantized_weight", None)  # the CPU backend computes with host arrays
    return upload(host) if upload is not None else host


def load_interleaved_experts(
    checkpoint: Checkpoint, backend: Any, prefix: str, count: int, hidden: int, width: int, *, alpha: float,
    limit: float,
) -> ClampedExperts:
    """GPT-OSS's stacked experts ``{prefix}.gate_up_proj`` / ``down_proj`` and their ``_bias``
    companions as :class:`ClampedExperts` (a rank's part of them).

    At full precision the stacks are stored as transformers computes with them, ``[E, in, out]``:
    ``gate_up_proj [E, H, 2I]`` (gate and up columns interleaved: column ``2 j`` gate ``j``,
    ``2 j + 1`` up ``j``) and ``down_proj [E, I, H]``. Stored MXFP4 they are ``[E, out, in]``
    (:mod:`metrale.loading.quantization.mxfp4`; the gate and up rows interleaved). The biases are
    ``gate_up_proj_bias [E, 2I]`` (interleaved) and ``down_proj_bias [E, H]``. The gate/up rows
    and biases are put in the engine's order here (:func:`interleaved_order`)."""
    shard = backend.shard
    if shard.sharded and shard.expert_parallel:
        held, part = shard.split(count, "num_local_experts"), slice(0, width)
    else:
        held, part = slice(0, count), shard.split(width, "intermediate_size")
    experts, local = held.stop - held.start, part.stop - part.start
    interleaved = slice(2 * part.start, 2 * part.stop)
    order = interleaved_order(experts, local)
    gate_up_name, down_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    xp = backend.xp
    if checkpoint.is_quantized(gate_up_name):
        stack = checkpoint.quantized(gate_up_name, (count, 2 * width, hidden), rows=interleaved)
        gate_up = _placed(backend, _rows_in_order(stack[held.start * 2 * local : held.stop * 2 * local], order))
    else:
        # Read as the backend holds weights, then transposed and put in order there (on the GPU:
        # the bf16 bits uploaded as stored, no host pass over gigabytes of experts).
        stored = backend.load_weight(checkpoint, (gate_up_name, (count, hidden, 2 * width), held))
        gate_up = xp.ascontiguousarray(stored[:, :, interleaved].transpose(0, 2, 1))
        gate_up = xp.ascontiguousarray(gate_up.reshape(experts * 2 * local, hidden)[xp.asarray(order)])
        del stored
    if checkpoint.is_quantized(down_name):
        stack = checkpoint.quantized(down_name, (count, hidden, width), columns=None if local == width else part)
        down = _placed(backend, stack[held.start * hidden : held.stop * hidden])
    else:
        stored = backend.load_weight(checkpoint, (down_name, (count, width, hidden), held))
        down = xp.ascontiguousarray(stored[:, part, :].transpose(0, 2, 1)).reshape(experts * hidden, local)
        del stored
    gate_up_bias = checkpoint.tensor(f"{gate_up_name}_bias", (count, 2 * width), rows=held)[:, interleaved]
    down_bias = checkpoint.tensor(f"{down_name}_bias", (count, hidden), rows=held)
    keeps_down_bias = shard.rank == 0 or shard.expert_parallel
    return ClampedExperts(
        gate_up=gate_up,
        down=down,
        gate_up_bias=backend.constant(gate_up_bias.reshape(-1)[order]),
        down_bias=backend.constant(down_bias.reshape(-1)) if keeps_down_bias else None,
        alpha=alpha, limit=limit, held=experts, first=held.start, total=count,
    )


@dataclass
class ClampedSwigluMoe:
    """GPT-OSS's MoE block: a :class:`TopKRouter` with a bias (``{prefix}.router``) choosing
    ``top_k`` of the :class:`ClampedExperts` (``{prefix}.experts``), whose outputs are summed with
    the router's weights."""

    router: TopKRouter
    experts: ClampedExperts

    @classmethod
    def load(cls, checkpoint: Checkpoint, backend: Any, prefix: str, *, num_experts: int, hidden: int, width: int,
             top_k: int, alpha: float, limit: float) -> "ClampedSwigluMoe":
        """The block at ``prefix`` (``model.layers.{i}.mlp`` in GPT-OSS)."""
        return cls(
            router=TopKRouter.load(checkpoint, backend, f"{prefix}.router", num_experts=num_experts, hidden=hidden,
                                   top_k=top_k),
            experts=load_interleaved_experts(checkpoint, backend, f"{prefix}.experts", num_experts, hidden, width,
                                             alpha=alpha, limit=limit),
        )

    def route(self, backend: Any, h: Any) -> tuple[Any, Any]:
        """The chosen experts ``[N, k]`` and their weights for ``h [N, H]``."""
        return self.router.route(backend, h)

    def forward(self, backend: Any, h: Any, chosen: Any, weights: Any) -> Any:
        """The chosen experts' weighted outputs ``[N, H]`` (no adapter reaches the experts)."""
        return self.experts.forward(backend, h, chosen, weights)
