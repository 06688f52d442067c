"""DeepSeek MoE on the device without host synchronisation (docs/families.rst, "DeepSeek MoE routing").

* **routing** -- :func:`route_reference` / :func:`route_kernel`: per token, from the float32
  router logits, the top-k experts and their weights: softmax scores with greedy or
  group-limited selection (DeepSeek-V2), or sigmoid scores with the correction bias and top-2-sum
  group limits (DeepSeek-V3); optional renormalisation; times ``routed_scaling_factor``.
* **experts** -- :func:`experts_reference` / :func:`moe_gate_up_kernel` +
  :func:`moe_down_kernel`: every (token, chosen expert) pair runs that expert's SwiGLU straight
  from the stacked expert weights (``gate_up [E * 2I, H]``, gate rows of expert e at
  ``[2 I e, 2 I e + I)``, up rows after them; ``down [E * H, I]``), the expert ids read on the
  device. One warp per output value streams its weight row as 64-bit words. Meant for decode
  batches, where each expert serves a few tokens; prompt-sized batches run as grouped
  tensor-core products (:mod:`metrale.kernels.moe_grouped`).

Ties in the top-k go to the smaller expert index.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bits_to_float,
    check_array,
    device_view,
    dot_words,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)
from metrale.kernels.activation import sigmoid_denominator

#: Routing methods: DeepSeek-V2's two, and DeepSeek-V3's (sigmoid scores with a bias).
ROUTE_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
ROUTE_THREADS = 32 if SIMULATED else 256  # >= experts
MAX_EXPERTS = ROUTE_THREADS
MAX_TOP_K = 16
MAX_GROUPS = 32
MOE_WARPS = 2 if SIMULATED else 8  # output values per block
WARP = 1 if SIMULATED else 32  # lanes per output value (the simulator has no shuffles)
FULL_MASK = 0xFFFFFFFF


def route_reference(
    logits: np.ndarray, bias: np.ndarray | None, method: str, n_group: int, topk_group: int, top_k: int,
    renormalise: bool, scaling: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(experts ``[N, k]`` int32, weights ``[N, k]`` float32) for router ``logits [N, E]`` float32."""
    logits = np.asarray(logits, dtype=np.float32)
    tokens, experts = logits.shape
    per_group = experts // n_group
    if method == "noaux_tc":
        if bias is None:
            raise KernelArgumentError("route_reference: method 'noaux_tc' needs the correction bias")
        scores = (1.0 / sigmoid_denominator(logits)).astype(np.float32)
        choice = scores + bias[None, :]
        grouped = choice.reshape(tokens, n_group, per_group)
        group_score = -np.sort(-grouped, axis=2)[:, :, : min(2, per_group)].sum(axis=2)
    else:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
        choice = scores
        group_score = scores.reshape(tokens, n_group, per_group).max(axis=2)
    if method != "greedy" and topk_group < n_group:
        kept = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_group]
        allowed = np.zeros((tokens, n_group), dtype=bool)
        allowed[np.arange(tokens)[:, None], kept] = True
        choice = np.where(np.repeat(allowed, per_group, axis=1), choice, -np.inf if method == "noaux_tc" else 0.0)
    chosen = np.argsort(-choice, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    weights = np.take_along_axis(scores, chosen, axis=1)
    if renormalise:
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return chosen, (weights * scaling).astype(np.float32)


def experts_reference(
    x: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate_up: np.ndarray, down: np.ndarray
) -> np.ndarray:
    """``[N, H]`` float32: ``sum_s weights[n, s] * SwiGLU_{experts[n, s]}(x[n])`` from the stacked weights."""
    hidden = x.shape[1]
    inter = down.shape[1]
    out = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for n in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[n, s])
            gu = gate_up[2 * inter * e : 2 * inter * (e + 1)] @ x[n]
            gate, up = gu[:inter], gu[inter:]
            act = gate / sigmoid_denominator(gate) * up
            out[n] += weights[n, s] * (down[hidden * e : hidden * (e + 1)] @ act)
    return out


@cuda.jit(device=True)
def _block_pick_max(values, index_scratch, value_scratch, tid, count):
    # Index of the largest of values[0:count] (smallest index on ties), for every thread.
    best = float32(-math.inf)
    best_index = int32(count)
    if tid < count:
        best = values[tid]
        best_index = tid
    value_scratch[tid] = best
    index_scratch[tid] = best_index
    cuda.syncthreads()
    stride = ROUTE_THREADS // 2
    while stride > 0:
        if tid < stride:
            other = value_scratch[tid + stride]
            other_index = index_scratch[tid + stride]
            if other > value_scratch[tid] or (other == value_scratch[tid] and other_index < index_scratch[tid]):
                value_scratch[tid] = other
                index_scratch[tid] = other_index
        cuda.syncthreads()
        stride //= 2
    chosen = index_scratch[0]
    cuda.syncthreads()
    return chosen


@jit_kernel
def route_kernel(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling, out_experts, out_weights):
    # Grid: one block of ROUTE_THREADS threads per token; thread e owns expert e. logits [N, E]
    # f32; bias [E] f32 (read for noaux_tc); out_experts [N, k] i32; out_weights [N, k] f32.
    token = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    experts = logits.shape[1]
    per_group = experts // n_group
    scores = cuda.shared.array(MAX_EXPERTS, float32)
    choice = cuda.shared.array(MAX_EXPERTS, float32)
    group_scores = cuda.shared.array(MAX_GROUPS, float32)
    value_scratch = cuda.shared.array(ROUTE_THREADS, float32)
    index_scratch = cuda.shared.array(ROUTE_THREADS, int32)
    picked = cuda.shared.array(MAX_TOP_K, int32)
    logit = float32(-math.inf)
    if tid < experts:
        logit = logits[token, tid]
    if method == 2:
        if tid < experts:
            score = float32(1.0) / (float32(1.0) + math.exp(-logit))
            scores[tid] = score
            choice[tid] = score + bias[tid]
        cuda.syncthreads()
    else:
        value_scratch[tid] = logit
        cuda.syncthreads()
        largest = float32(-math.inf)
        for e in range(experts):
            largest = max(largest, value_scratch[e])
        total = float32(0.0)
        for e in range(experts):
            total += math.exp(value_scratch[e] - largest)
        cuda.syncthreads()
        if tid < experts:
            score = math.exp(logit - largest) / total
            scores[tid] = score
            choice[tid] = score
        cuda.syncthreads()
    if method != 0 and topk_group < n_group:
        if tid < n_group:
            first = float32(-math.inf)
            second = float32(-math.inf)
            for e in range(tid * per_group, (tid + 1) * per_group):
                value = choice[e]
                if value > first:
                    second = first
                    first = value
                elif value > second:
                    second = value
            group_scores[tid] = first + second if (method == 2 and per_group > 1) else first
        cuda.syncthreads()
        # Keep the topk_group best groups: a group is dropped when topk_group others beat it.
        if tid < experts:
            group = tid // per_group
            mine = group_scores[group]
            better = 0
            for g in range(n_group):
                other = group_scores[g]
                if other > mine or (other == mine and g < group):
                    better += 1
            if better >= topk_group:
                choice[tid] = float32(-math.inf) if method == 2 else float32(0.0)
        cuda.syncthreads()
    for slot in range(top_k):
        chosen = _block_pick_max(choice, index_scratch, value_scratch, tid, experts)
        if tid == 0:
            picked[slot] = chosen
            choice[chosen] = float32(-math.inf)
        cuda.syncthreads()
    if tid == 0:
        total = float32(0.0)
        for slot in range(top_k):
            total += scores[picked[slot]]
        for slot in range(top_k):
            weight = scores[picked[slot]]
            if renormalise:
                weight = weight / (total + float32(1e-20))
            out_experts[token, slot] = picked[slot]
            out_weights[token, slot] = weight * scaling


@cuda.jit(device=True)
def _lane_sum(value):
    if WARP > 1:
        for k in range(5):
            value += cuda.shfl_xor_sync(FULL_MASK, value, 1 << k)
    return value


@cuda.jit(device=True)
def _row_dot(x_words, x_row, w_words, w_row, lane):
    acc = float32(0.0)
    for index in range(lane, w_words.shape[1], WARP):
        acc += dot_words(w_words[w_row, index], x_words[x_row, index])
    return _lane_sum(acc)


@jit_kernel
def moe_gate_up_kernel(x_words, gate_up_words, experts, act):
    # Grid: (N * k pairs, ceil(I / MOE_WARPS)); MOE_WARPS * WARP threads, a warp per output value.
    # x_words [N, H / 4] u64 (bf16); gate_up_words [E * 2I, H / 4]; experts [N, k] i32;
    # act [N * k, I] bf16 bits: silu(gate) * up of pair (n, s) = row n * k + s.
    pair = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    top_k = experts.shape[1]
    inter = act.shape[1]
    token = pair // top_k
    if column >= inter:
        return
    expert = experts[token, pair % top_k]
    base = 2 * inter * expert
    gate = _row_dot(x_words, token, gate_up_words, base + column, lane)
    up = _row_dot(x_words, token, gate_up_words, base + inter + column, lane)
    if lane == 0:
        act[pair, column] = float_to_bf16(gate / (float32(1.0) + math.exp(-gate)) * up)


@jit_kernel
def moe_down_kernel(act_words, down_words, experts, weights, out):
    # Grid: (N tokens, ceil(H / MOE_WARPS)); a warp per output value. act_words [N * k, I / 4] u64;
    # down_words [E * H, I / 4]; weights [N, k] f32; out [N, H] f32 (written, not added to).
    token = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    hidden = out.shape[1]
    top_k = experts.shape[1]
    if column >= hidden:
        return
    total = float32(0.0)
    for slot in range(top_k):
        expert = experts[token, slot]
        total += weights[token, slot] * _row_dot(act_words, token * top_k + slot, down_words,
                                                 expert * hidden + column, lane)
    if lane == 0:
        out[token, column] = total


@jit_kernel
def router_logits_kernel(x_words, gate, out):
    # Grid: (N tokens, ceil(E / MOE_WARPS)); a warp per (token, expert). x_words [N, H / 4] u64
    # (bf16 activations); gate [E, H] f32 (transformers keeps the router in float32); out [N, E] f32.
    token = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    expert = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    if expert >= gate.shape[0]:
        return
    acc = float32(0.0)
    for index in range(lane, x_words.shape[1], WARP):
        word = x_words[token, index]
        low = uint32(word & uint64(0xFFFFFFFF))
        high = uint32(word >> uint64(32))
        column = 4 * index
        acc += (bits_to_float(low << uint32(16)) * gate[expert, column]
                + bits_to_float(low & uint32(0xFFFF0000)) * gate[expert, column + 1]
                + bits_to_float(high << uint32(16)) * gate[expert, column + 2]
                + bits_to_float(high & uint32(0xFFFF0000)) * gate[expert, column + 3])
    acc = _lane_sum(acc)
    if lane == 0:
        out[token, expert] = acc


def router_logits(x: DeviceArray, gate: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`router_logits_kernel`: float32 ``out [N, E]`` for bf16 ``x [N, H]``."""
    op = "router_logits"
    check_array(op, "x", x, np.uint16, ndim=2)
    tokens, hidden = x.shape
    check_array(op, "gate", gate, np.float32, (None, hidden))
    check_array(op, "out", out, np.float32, (tokens, gate.shape[0]))
    if hidden % 4:
        raise ValueError(f"hidden size {hidden} must be a multiple of 4")
    if tokens:
        router_logits_kernel[(tokens, -(-gate.shape[0] // MOE_WARPS)), MOE_WARPS * WARP, numba_stream(stream)](
            device_view(x.view(np.uint64)), device_view(gate), device_view(out),
        )
    return out


def route(logits: DeviceArray, bias: DeviceArray | None, method: str, n_group: int, topk_group: int, top_k: int,
          renormalise: bool, scaling: float, out_experts: DeviceArray, out_weights: DeviceArray,
          stream: object = None) -> tuple[DeviceArray, DeviceArray]:
    """Launch :func:`route_kernel` (``bias`` may be None unless ``method`` is ``"noaux_tc"``)."""
    op = "moe_route"
    check_array(op, "logits", logits, np.float32, ndim=2)
    tokens, experts = logits.shape
    if experts > MAX_EXPERTS or top_k > MAX_TOP_K or n_group > MAX_GROUPS or experts % n_group:
        raise ValueError(f"routing supports up to {MAX_EXPERTS} experts in up to {MAX_GROUPS} equal groups and "
                         f"top-{MAX_TOP_K}; got {experts} experts, {n_group} groups, top-{top_k}")
    check_array(op, "out_experts", out_experts, np.int32, (tokens, top_k))
    check_array(op, "out_weights", out_weights, np.float32, (tokens, top_k))
    if bias is None:
        bias = logits[0]  # never read
    if tokens:
        route_kernel[tokens, ROUTE_THREADS, numba_stream(stream)](
            device_view(logits), device_view(bias), np.int32(ROUTE_METHODS[method]), np.int32(n_group),
            np.int32(topk_group), np.int32(top_k), bool(renormalise), np.float32(scaling), device_view(out_experts),
            device_view(out_weights),
        )
    return out_experts, out_weights


def experts(x: DeviceArray, expert_ids: DeviceArray, weights: DeviceArray, gate_up: DeviceArray, down: DeviceArray,
            act: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch the two expert kernels: ``out [N, H]`` float32 from bf16 ``x [N, H]`` (``act``:
    ``[N * k, I]`` bf16 scratch)."""
    op = "moe_experts"
    check_array(op, "x", x, np.uint16, ndim=2)
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    inter = down.shape[1]
    check_array(op, "gate_up", gate_up, np.uint16, (None, hidden))
    check_array(op, "act", act, np.uint16, (tokens * top_k, inter))
    check_array(op, "out", out, np.float32, (tokens, hidden))
    if hidden % 4 or inter % 4:
        raise ValueError(f"hidden size {hidden} and expert width {inter} must be multiples of 4")
    if tokens:
        launch = numba_stream(stream)
        moe_gate_up_kernel[(tokens * top_k, -(-inter // MOE_WARPS)), MOE_WARPS * WARP, launch](
            device_view(x.view(np.uint64)), device_view(gate_up.view(np.uint64)), device_view(expert_ids),
            device_view(act),
        )
        moe_down_kernel[(tokens, -(-hidden // MOE_WARPS)), MOE_WARPS * WARP, launch](
            device_view(act.view(np.uint64)), device_view(down.view(np.uint64)), device_view(expert_ids),
            device_view(weights), device_view(out),
        )
    return out
