"""Gated DeltaNet decode steps on the device, state in place in the slot pool (docs/families.rst,
"Gated DeltaNet layer" and "Per-sequence cache state").

* :func:`conv_update_kernel` -- the causal depthwise conv of one new token per row: its window is
  the slot's last ``K - 1`` inputs and the new one; the output goes through SiLU and the slot
  keeps the new last ``K - 1`` inputs.
* :func:`recurrent_step_kernel` -- one step of the gated delta rule per row and value head, on
  the float32 state ``[d_k, d_v]`` of the row's slot: ``S <- exp(g) S``, ``S <- S + k (beta (v -
  S^T k))^T``, ``o = S^T q``. A thread owns state columns (value dims); ``q`` and ``k`` go through
  shared memory.
* :func:`prompt_rule_kernel` -- the same rule over a prompt segment's tokens, for every segment of
  a batch at once. The state's columns evolve independently (column ``c`` needs only ``v[:, c]``
  besides the shared ``q``, ``k``, ``g``, ``beta``), so a block owns ``PROMPT_COLUMNS`` columns of
  one (segment, head) and keeps them in registers for the whole segment: ``PROMPT_PARTS`` threads
  share a column, each holding every ``PROMPT_PARTS``-th key dim, and sum their partial dot
  products by shuffles. The tokens go through shared memory ``PROMPT_TOKENS`` at a time, their
  loads all issued before the first is used. The state is read from its slot once and written
  back once. (On CUDA cores the chunked form saves no arithmetic: its advantage is tensor-core
  matrix products, which :mod:`metrale.kernels.gated_delta_chunked` uses for heads of 64 or 128
  dims; the CPU backend runs it, :func:`delta_rule_chunked`, and the tests check that both forms
  agree.)

Rows name their slot in ``slots [N]``; padding rows use the reserved dummy slot 0. The NumPy
references are :func:`conv_update_reference`, :func:`recurrent_step_reference` and
:func:`prompt_rule_reference`.

The layer's glue around the conv and the rule (steps 2, 3, 5 and 6 of "Gated DeltaNet layer"),
each with its reference:

* :func:`ungroup_kernel` (:func:`ungroup_reference`) -- the ``in_proj_qkvz`` rows, grouped by key
  head, into the conv input ``[q | k | v]`` and the output gate ``z``;
* :func:`gates_kernel` (:func:`gates_reference`) -- the ``in_proj_ba`` rows into the decay
  ``g`` and the rate ``beta`` per value head;
* :func:`conv_prompts_kernel` and :func:`conv_prompt_states_kernel`
  (:func:`conv_prompts_reference`) -- the causal conv and SiLU of every prompt segment of a
  batch from its slot's history, then the slots' new histories;
* :func:`split_heads_kernel` (:func:`split_heads_reference`) -- the conv outputs into
  L2-normalised ``q`` (scaled by ``d_k^-1/2``) and ``k``, repeated to the value heads, and ``v``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    block_sum,
    check_array,
    device_view,
    fast_exp,
    jit_kernel,
    numba_stream,
)
from metrale.kernels.activation import sigmoid_denominator
from metrale.kernels.attention_grouped import subgroup_sum

GDN_THREADS = 16 if SIMULATED else 128
MAX_KEY_DIM = 256
CONV_THREADS = 16 if SIMULATED else 256
MAX_CONV_KERNEL = 8
#: Tokens per chunk of the chunked form (docs/families.rst, "Chunked form").
CHUNK = 64

WARP = 8 if SIMULATED else 32
PROMPT_PARTS = 8  # threads sharing one state column
PROMPT_WARPS = 4
COLUMNS_PER_WARP = WARP // PROMPT_PARTS
PROMPT_COLUMNS = PROMPT_WARPS * COLUMNS_PER_WARP  # state columns a block owns
PROMPT_THREADS = PROMPT_WARPS * WARP
PROMPT_KEYS = MAX_KEY_DIM // PROMPT_PARTS  # state elements a thread holds at most
PROMPT_TOKENS = 4 if SIMULATED else 16  # tokens staged at a time
KEY_LOADS = -(-MAX_KEY_DIM // PROMPT_THREADS)  # words of one token's q (or k) a thread stages
STAGED_KEYS = PROMPT_TOKENS * KEY_LOADS
#: The fixed eps of the q / k L2 normalisation (transformers').
L2_NORM_EPS = 1e-6
GLUE_THREADS = 32 if SIMULATED else 256  # element-wise glue kernels
SPLIT_THREADS = 16 if SIMULATED else 128  # threads over one key head's dims (a multiple of 32 on the GPU)
CONV_ROWS = 3 if SIMULATED else 32  # prompt rows a conv thread walks


def delta_rule_recurrent(xp: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> tuple[Any, Any]:
    """Outputs ``[T, H, d_v]`` and the final state, one token at a time (docs/families.rst, "Gated DeltaNet layer", step 7).
    ``q, k [T, H, d_k]``, ``v [T, H, d_v]``, ``g, beta [T, H]``, ``state [H, d_k, d_v]`` float32."""
    out = xp.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=xp.float32)
    for t in range(q.shape[0]):
        state = state * xp.exp(g[t])[:, None, None]
        predicted = xp.einsum("hkv,hk->hv", state, k[t])
        state = state + xp.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        out[t] = xp.einsum("hkv,hk->hv", state, q[t])
    return out, state


def delta_rule_chunked(xp: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> tuple[Any, Any]:
    """The same function in chunks of ``CHUNK`` tokens (docs/families.rst, "Chunked form")."""
    out = xp.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=xp.float32)
    for start in range(0, q.shape[0], CHUNK):
        stop = min(start + CHUNK, q.shape[0])
        # [H, n, ...] per head.
        qc, kc, vc = (x[start:stop].transpose(1, 0, 2) for x in (q, k, v))
        gc, bc = g[start:stop].T, beta[start:stop].T
        n = stop - start
        gamma = xp.cumsum(gc, axis=1)  # [H, n]
        lower = xp.asarray(np.tril(np.ones((n, n), dtype=bool)))
        decay = xp.where(lower[None], xp.exp(xp.where(lower[None], gamma[:, :, None] - gamma[:, None, :], 0.0)), 0.0)
        strict = lower & ~xp.asarray(np.eye(n, dtype=bool))
        a = xp.where(strict[None], bc[:, :, None] * xp.einsum("hik,hjk->hij", kc, kc) * decay, 0.0)
        identity = xp.broadcast_to(xp.eye(n, dtype=xp.float32), a.shape)
        transform = xp.linalg.inv(identity + a)
        u = transform @ (bc[:, :, None] * vc)
        w = transform @ (bc[:, :, None] * xp.exp(gamma)[:, :, None] * kc)
        corrected = u - w @ state
        scores = xp.where(lower[None], xp.einsum("hik,hjk->hij", qc, kc) * decay, 0.0)
        out[start:stop] = ((xp.exp(gamma)[:, :, None] * qc) @ state + scores @ corrected).transpose(1, 0, 2)
        tail = xp.exp(gamma[:, -1:] - gamma)[:, :, None] * kc
        state = xp.exp(gamma[:, -1])[:, None, None] * state + tail.transpose(0, 2, 1) @ corrected
    return out, state


def prompt_rule_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                          state: np.ndarray, slots: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[T, H, d_v]``: segment ``s`` (rows ``starts[s]:starts[s + 1]``) runs the gated delta rule
    from ``state[slots[s]] [H, d_k, d_v]`` (updated in place): the chunked form, or one recurrent
    step for a one-token segment. ``q, k [T, H, d_k]``, ``v [T, H, d_v]``, ``g, beta [T, H]``."""
    out = np.empty(v.shape, dtype=np.float32)
    for index, slot in enumerate(slots):
        first, last = int(starts[index]), int(starts[index + 1])
        rule = delta_rule_recurrent if last - first == 1 else delta_rule_chunked
        out[first:last], state[slot] = rule(np, q[first:last], k[first:last], v[first:last], g[first:last],
                                            beta[first:last], state[slot].astype(np.float32))
    return out


def conv_update_reference(inputs: np.ndarray, weight: np.ndarray, conv_state: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``[N, C]``: SiLU of the causal conv of each row's new input ``inputs[n]`` after its slot's
    history ``conv_state[slots[n]] [C, K - 1]`` (updated in place); ``weight [C, K]``."""
    out = np.empty(inputs.shape, dtype=np.float32)
    for n, slot in enumerate(slots):
        window = np.concatenate([conv_state[slot], inputs[n][:, None]], axis=1).astype(np.float32)
        mixed = (window * weight).sum(axis=1)
        out[n] = mixed / sigmoid_denominator(mixed)
        conv_state[slot] = window[:, 1:]
    return out


def recurrent_step_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                             state: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``[N, H, d_v]``: one gated-delta step per row from ``state[slots[n]] [H, d_k, d_v]``
    (updated in place); ``q, k [N, H, d_k]``, ``v [N, H, d_v]``, ``g, beta [N, H]``."""
    out = np.empty(v.shape, dtype=np.float32)
    for n, slot in enumerate(slots):
        s = state[slot].astype(np.float32) * np.exp(g[n])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", s, k[n])
        s = s + np.einsum("hk,hv->hkv", k[n], beta[n][:, None] * (v[n] - predicted))
        out[n] = np.einsum("hkv,hk->hv", s, q[n])
        state[slot] = s
    return out


def ungroup_reference(qkvz: np.ndarray, key_heads: int, value_heads: int, key_dim: int,
                      value_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``in_proj_qkvz`` output ``[N, H_k (2 d_k + 2 G d_v)]`` (``G = H_v / H_k``), laid out
    per key head as ``[q (d_k) | k (d_k) | v (G d_v) | z (G d_v)]``, un-grouped: the conv input
    ``[N, 2 H_k d_k + H_v d_v]`` (every head's q, then k, then v) and ``z [N, H_v, d_v]``."""
    rows, ratio = qkvz.shape[0], value_heads // key_heads
    grouped = np.asarray(qkvz, dtype=np.float32).reshape(rows, key_heads, 2 * key_dim + 2 * ratio * value_dim)
    q = grouped[:, :, :key_dim].reshape(rows, key_heads * key_dim)
    k = grouped[:, :, key_dim : 2 * key_dim].reshape(rows, key_heads * key_dim)
    v = grouped[:, :, 2 * key_dim : 2 * key_dim + ratio * value_dim].reshape(rows, value_heads * value_dim)
    z = grouped[:, :, 2 * key_dim + ratio * value_dim :].reshape(rows, value_heads, value_dim)
    return np.concatenate([q, k, v], axis=1), np.ascontiguousarray(z)


def gates_reference(ba: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, key_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """``(g, beta)``, both ``[N, H_v]`` float32, from the ``in_proj_ba`` output ``[N, H_k 2G]``
    laid out per key head as ``[b (G) | a (G)]``: ``beta = sigmoid(b)``, ``g = -exp(A_log)
    softplus(a + dt_bias)``; ``a_log, dt_bias [H_v]`` float32."""
    rows, value_heads = ba.shape[0], a_log.shape[0]
    ratio = value_heads // key_heads
    grouped = np.asarray(ba, dtype=np.float32).reshape(rows, key_heads, 2 * ratio)
    b, a = grouped[:, :, :ratio].reshape(rows, value_heads), grouped[:, :, ratio:].reshape(rows, value_heads)
    beta = (1.0 / sigmoid_denominator(b)).astype(np.float32)
    softplus = np.logaddexp(0.0, a + dt_bias)
    g = (-np.exp(a_log) * softplus).astype(np.float32)
    return g, beta


def l2_normalised_reference(x: np.ndarray) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, the fixed :data:`L2_NORM_EPS`."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + np.float32(L2_NORM_EPS))


def split_heads_reference(mixed: np.ndarray, key_heads: int, value_heads: int, key_dim: int,
                          value_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Conv outputs ``[T, 2 H_k d_k + H_v d_v]`` -> ``q, k [T, H_v, d_k]``, ``v [T, H_v, d_v]``
    (float32, contiguous): q and k L2-normalised per key head (q then scaled by ``d_k^-1/2``) and
    repeated to the value heads (value head ``j`` takes key head ``j // G``)."""
    mixed = np.asarray(mixed, dtype=np.float32)
    ratio = value_heads // key_heads
    q = l2_normalised_reference(mixed[:, : key_heads * key_dim].reshape(-1, key_heads, key_dim)) * np.float32(key_dim**-0.5)
    k = l2_normalised_reference(mixed[:, key_heads * key_dim : 2 * key_heads * key_dim].reshape(-1, key_heads, key_dim))
    v = mixed[:, 2 * key_heads * key_dim :].reshape(-1, value_heads, value_dim)
    return np.repeat(q, ratio, axis=1), np.repeat(k, ratio, axis=1), np.ascontiguousarray(v)


def conv_prompts_reference(inputs: np.ndarray, weight: np.ndarray, conv_state: np.ndarray, slots: np.ndarray,
                           starts: np.ndarray) -> np.ndarray:
    """``[T, C]``: segment ``s`` (rows ``starts[s]:starts[s + 1]`` of ``inputs [T, C]``) through the
    causal depthwise conv (``weight [C, K]``) after its slot's history ``conv_state[slots[s]]
    [C, K - 1]``, then SiLU; the slot keeps the segment's last ``K - 1`` inputs (with the older
    history in front when the segment is shorter). Rows outside every segment are zero."""
    mixed = np.zeros(inputs.shape, dtype=np.float32)
    taps = weight.shape[1]
    for index, slot in enumerate(slots):
        first, last = int(starts[index]), int(starts[index + 1])
        count = last - first
        window = np.concatenate([conv_state[slot].T, inputs[first:last].astype(np.float32)], axis=0)  # [K - 1 + n, C]
        out = sum(window[j : j + count] * weight[:, j] for j in range(taps))
        conv_state[slot] = window[window.shape[0] - (taps - 1) :].T
        mixed[first:last] = out / sigmoid_denominator(out)
    return mixed


@jit_kernel
def conv_update_kernel(inputs, weight, conv_state, slots, out):
    # Grid: (N rows, ceil(C / CONV_THREADS)). inputs [N, C] f32; weight [C, K] f32; conv_state
    # [slots, C, K - 1] f32; slots [N] i32; out [N, C] f32.
    row = cuda.blockIdx.x
    channel = cuda.blockIdx.y * CONV_THREADS + cuda.threadIdx.x
    if channel >= inputs.shape[1]:
        return
    slot = slots[row]
    history = conv_state.shape[2]
    window = cuda.local.array(MAX_CONV_KERNEL, float32)
    for j in range(history):
        window[j] = conv_state[slot, channel, j]
    window[history] = inputs[row, channel]
    mixed = float32(0.0)
    for j in range(history + 1):
        mixed += weight[channel, j] * window[j]
    out[row, channel] = mixed / (float32(1.0) + math.exp(-mixed))
    for j in range(history):
        conv_state[slot, channel, j] = window[j + 1]


@jit_kernel
def recurrent_step_kernel(q, k, v, g, beta, state, slots, out):
    # Grid: (N rows, H value heads); GDN_THREADS threads over the value dims. q, k [N, H, dk]
    # f32; v [N, H, dv]; g, beta [N, H]; state [slots, H, dk, dv] f32 (in place); out [N, H, dv].
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    key_dim = q.shape[2]
    value_dim = v.shape[2]
    slot = slots[row]
    shared_q = cuda.shared.array(MAX_KEY_DIM, float32)
    shared_k = cuda.shared.array(MAX_KEY_DIM, float32)
    for i in range(tid, key_dim, GDN_THREADS):
        shared_q[i] = q[row, head, i]
        shared_k[i] = k[row, head, i]
    cuda.syncthreads()
    decay = math.exp(g[row, head])
    rate = beta[row, head]
    for column in range(tid, value_dim, GDN_THREADS):
        predicted = float32(0.0)
        for i in range(key_dim):
            predicted += state[slot, head, i, column] * shared_k[i]
        delta = rate * (v[row, head, column] - decay * predicted)
        result = float32(0.0)
        for i in range(key_dim):
            value = state[slot, head, i, column] * decay + shared_k[i] * delta
            state[slot, head, i, column] = value
            result += value * shared_q[i]
        out[row, head, column] = result


@jit_kernel
def prompt_rule_kernel(q, k, v, g, beta, state, slots, starts, out):
    # Grid: (S segments, H value heads, ceil(dv / PROMPT_COLUMNS)); PROMPT_THREADS threads.
    # q, k [T, H, dk] f32; v [T, H, dv]; g, beta [T, H]; state [slots, H, dk, dv] f32 (in
    # place); slots [S] i32; starts [S + 1] i32; out [T, H, dv] f32.
    segment = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = tid % WARP
    part = lane // COLUMNS_PER_WARP
    column = cuda.blockIdx.z * PROMPT_COLUMNS + warp * COLUMNS_PER_WARP + lane % COLUMNS_PER_WARP
    key_dim = q.shape[2]
    value_dim = v.shape[2]
    slot = slots[segment]
    live = column < value_dim
    shared_q = cuda.shared.array((PROMPT_TOKENS, MAX_KEY_DIM), float32)
    shared_k = cuda.shared.array((PROMPT_TOKENS, MAX_KEY_DIM), float32)
    shared_v = cuda.shared.array((PROMPT_TOKENS, PROMPT_COLUMNS), float32)
    shared_g = cuda.shared.array(PROMPT_TOKENS, float32)
    shared_beta = cuda.shared.array(PROMPT_TOKENS, float32)
    scratch = cuda.shared.array(PROMPT_THREADS, float32)
    held = cuda.local.array(PROMPT_KEYS, float32)  # state[part + PROMPT_PARTS * j, column]
    staged_q = cuda.local.array(STAGED_KEYS, float32)
    staged_k = cuda.local.array(STAGED_KEYS, float32)
    staged_v = cuda.local.array(PROMPT_TOKENS, float32)
    for j in range(PROMPT_KEYS):
        i = part + PROMPT_PARTS * j
        held[j] = float32(0.0)
        if live and i < key_dim:
            held[j] = state[slot, head, i, column]
    base = starts[segment]
    stop = starts[segment + 1]
    while base < stop:
        count = min(PROMPT_TOKENS, stop - base)
        # Stage the chunk's tokens: every load first, then the shared stores.
        for t in range(PROMPT_TOKENS):
            for r in range(KEY_LOADS):
                i = tid + r * PROMPT_THREADS
                staged_q[t * KEY_LOADS + r] = float32(0.0)
                staged_k[t * KEY_LOADS + r] = float32(0.0)
                if t < count and i < key_dim:
                    staged_q[t * KEY_LOADS + r] = q[base + t, head, i]
                    staged_k[t * KEY_LOADS + r] = k[base + t, head, i]
            staged_v[t] = float32(0.0)
            if t < count and live and part == 0:
                staged_v[t] = v[base + t, head, column]
        token_g = float32(0.0)
        token_beta = float32(0.0)
        if tid < count:
            token_g = g[base + tid, head]
            token_beta = beta[base + tid, head]
        cuda.syncthreads()  # the previous chunk's readers are done
        for t in range(PROMPT_TOKENS):
            for r in range(KEY_LOADS):
                i = tid + r * PROMPT_THREADS
                if i < key_dim:
                    shared_q[t, i] = staged_q[t * KEY_LOADS + r]
                    shared_k[t, i] = staged_k[t * KEY_LOADS + r]
            if part == 0:
                shared_v[t, column - cuda.blockIdx.z * PROMPT_COLUMNS] = staged_v[t]
        if tid < PROMPT_TOKENS:
            shared_g[tid] = token_g
            shared_beta[tid] = token_beta
        cuda.syncthreads()
        for t in range(count):
            decay = fast_exp(shared_g[t])
            partial = float32(0.0)
            for j in range(PROMPT_KEYS):
                i = part + PROMPT_PARTS * j
                if i < key_dim:
                    partial += held[j] * shared_k[t, i]
            predicted = decay * subgroup_sum(scratch, tid, lane, partial, COLUMNS_PER_WARP)
            delta = shared_beta[t] * (shared_v[t, column - cuda.blockIdx.z * PROMPT_COLUMNS] - predicted)
            partial = float32(0.0)
            for j in range(PROMPT_KEYS):
                i = part + PROMPT_PARTS * j
                if i < key_dim:
                    held[j] = held[j] * decay + shared_k[t, i] * delta
                    partial += held[j] * shared_q[t, i]
            result = subgroup_sum(scratch, tid, lane, partial, COLUMNS_PER_WARP)
            if live and part == 0:
                out[base + t, head, column] = result
        base += count
    for j in range(PROMPT_KEYS):
        i = part + PROMPT_PARTS * j
        if live and i < key_dim:
            state[slot, head, i, column] = held[j]


@jit_kernel
def ungroup_kernel(qkvz, key_dim, group_values, inputs_out, z_out):
    # Grid: (N rows, ceil(W / GLUE_THREADS)) over the grouped row of W = H_k (2 dk + 2 G dv).
    # qkvz [N, W] f32; group_values = G dv; inputs_out [N, 2 H_k dk + H_v dv] f32 (q, k, v);
    # z_out [N, H_v dv] f32.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column >= qkvz.shape[1]:
        return
    group_width = 2 * key_dim + 2 * group_values
    key_heads = qkvz.shape[1] // group_width
    head = column // group_width
    offset = column - head * group_width
    value = qkvz[row, column]
    if offset < key_dim:
        inputs_out[row, head * key_dim + offset] = value
    elif offset < 2 * key_dim:
        inputs_out[row, (key_heads + head) * key_dim + offset - key_dim] = value
    elif offset < 2 * key_dim + group_values:
        inputs_out[row, 2 * key_heads * key_dim + head * group_values + offset - 2 * key_dim] = value
    else:
        z_out[row, head * group_values + offset - 2 * key_dim - group_values] = value


@jit_kernel
def gates_kernel(ba, a_log, dt_bias, ratio, g_out, beta_out):
    # Grid: ceil(N H_v / GLUE_THREADS) over (row, value head). ba [N, H_k 2G] f32 (per key head
    # [b (G) | a (G)]); a_log, dt_bias [H_v] f32; ratio = G; g_out, beta_out [N, H_v] f32.
    index = cuda.grid(1)
    value_heads = g_out.shape[1]
    if index >= g_out.shape[0] * value_heads:
        return
    row = index // value_heads
    head = index - row * value_heads
    group = head // ratio
    b = ba[row, group * ratio + head]  # 2G group + (head - G group)
    a = ba[row, group * ratio + ratio + head]
    beta_out[row, head] = float32(1.0) / (float32(1.0) + math.exp(-b))
    x = a + dt_bias[head]
    # softplus as NumPy's logaddexp(0, x), without overflow for large x.
    if x > float32(0.0):
        softplus = x + math.log1p(math.exp(-x))
    else:
        softplus = math.log1p(math.exp(x))
    g_out[row, head] = -math.exp(a_log[head]) * softplus


@jit_kernel
def split_heads_kernel(mixed, scale, eps, q_out, k_out, v_out):
    # Grid: (T rows, H_k key heads); SPLIT_THREADS threads over the head's dims. mixed [T, 2 H_k
    # dk + H_v dv] f32; q_out, k_out [T, H_v, dk] f32 (key head h fills value heads hG .. hG + G
    # - 1); v_out [T, H_v dv] f32.
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    key_heads = cuda.gridDim.y
    key_dim = q_out.shape[2]
    ratio = q_out.shape[1] // key_heads
    partial = cuda.shared.array(SPLIT_THREADS, float32)
    q_base = head * key_dim
    k_base = (key_heads + head) * key_dim
    q_squares = float32(0.0)
    k_squares = float32(0.0)
    for i in range(tid, key_dim, SPLIT_THREADS):
        q_value = mixed[row, q_base + i]
        k_value = mixed[row, k_base + i]
        q_squares += q_value * q_value
        k_squares += k_value * k_value
    q_norm = math.sqrt(block_sum(partial, tid, q_squares, SPLIT_THREADS) + eps)
    k_norm = math.sqrt(block_sum(partial, tid, k_squares, SPLIT_THREADS) + eps)
    for i in range(tid, key_dim, SPLIT_THREADS):
        q_value = mixed[row, q_base + i] / q_norm * scale
        k_value = mixed[row, k_base + i] / k_norm
        for r in range(ratio):
            q_out[row, head * ratio + r, i] = q_value
            k_out[row, head * ratio + r, i] = k_value
    group_values = v_out.shape[1] // key_heads
    v_base = 2 * key_heads * key_dim + head * group_values
    for i in range(tid, group_values, SPLIT_THREADS):
        v_out[row, head * group_values + i] = mixed[row, v_base + i]


@jit_kernel
def conv_prompts_kernel(inputs, weight, conv_state, slots, starts, out):
    # Grid: (ceil(T / CONV_ROWS), ceil(C / CONV_THREADS)). A thread walks one channel over
    # CONV_ROWS consecutive rows, which may span several segments: each segment's first rows
    # take their window from the slot's history. inputs [T, C] f32; weight [C, K] f32;
    # conv_state [slots, C, K - 1] f32 (only read here); slots [S] i32; starts [S + 1] i32 (row
    # offsets, non-decreasing); out [T, C] f32.
    # The window and the taps are right-aligned in MAX_CONV_KERNEL entries (window[last] is the
    # current row, window[last - d] the input d rows before), so that every index is a constant
    # once the loops are unrolled and both stay in registers.
    channel = cuda.blockIdx.y * CONV_THREADS + cuda.threadIdx.x
    if channel >= inputs.shape[1]:
        return
    segments = slots.shape[0]
    row = cuda.blockIdx.x * CONV_ROWS
    stop = row + CONV_ROWS
    if stop > starts[segments]:
        stop = starts[segments]
    if row < starts[0]:
        row = starts[0]
    taps = weight.shape[1]
    unused = MAX_CONV_KERNEL - taps  # leading entries outside the window
    last = MAX_CONV_KERNEL - 1
    taps_weight = cuda.local.array(MAX_CONV_KERNEL, float32)
    window = cuda.local.array(MAX_CONV_KERNEL, float32)
    for m in range(MAX_CONV_KERNEL):
        taps_weight[m] = float32(0.0)
        window[m] = float32(0.0)
        if m >= unused:
            taps_weight[m] = weight[channel, m - unused]
    # The segment holding the first row: the last one starting at or before it.
    low = 0
    high = segments - 1
    while low < high:
        middle = (low + high + 1) // 2
        if starts[middle] <= row:
            low = middle
        else:
            high = middle - 1
    segment = low
    while row < stop:
        while starts[segment + 1] <= row:
            segment += 1
        first = starts[segment]
        slot = slots[segment]
        segment_stop = starts[segment + 1]
        if segment_stop > stop:
            segment_stop = stop
        # The K - 1 inputs before this row: from the segment, else from the slot's history.
        for m in range(MAX_CONV_KERNEL - 1):
            if m >= unused:
                position = row - (last - m)
                if position >= first:
                    window[m] = inputs[position, channel]
                else:
                    window[m] = conv_state[slot, channel, taps - 1 + position - first]
        while row < segment_stop:
            window[last] = inputs[row, channel]
            mixed = float32(0.0)
            for m in range(MAX_CONV_KERNEL):
                if m >= unused:
                    mixed += window[m] * taps_weight[m]
            out[row, channel] = mixed / (float32(1.0) + math.exp(-mixed))
            for m in range(MAX_CONV_KERNEL - 1):
                window[m] = window[m + 1]
            row += 1


@jit_kernel
def conv_prompt_states_kernel(inputs, conv_state, slots, starts):
    # Grid: (S segments, ceil(C / CONV_THREADS)). The slot of segment s keeps the last K - 1
    # values of [its history | the segment's inputs]; runs after conv_prompts_kernel, which reads
    # the old histories. inputs [T, C] f32; conv_state [slots, C, K - 1] f32 (in place).
    segment = cuda.blockIdx.x
    channel = cuda.blockIdx.y * CONV_THREADS + cuda.threadIdx.x
    if channel >= inputs.shape[1]:
        return
    slot = slots[segment]
    first = starts[segment]
    count = starts[segment + 1] - first
    history = conv_state.shape[2]
    kept = cuda.local.array(MAX_CONV_KERNEL, float32)
    for j in range(history):
        index = count + j  # into [history (K - 1) | inputs (count)]
        if index < history:
            kept[j] = conv_state[slot, channel, index]
        else:
            kept[j] = inputs[first + index - history, channel]
    for j in range(history):
        conv_state[slot, channel, j] = kept[j]


def conv_update(inputs: DeviceArray, weight: DeviceArray, conv_state: DeviceArray, slots: DeviceArray, out: DeviceArray,
                stream: object = None) -> DeviceArray:
    """Launch :func:`conv_update_kernel` (``conv_state`` float32, updated in place)."""
    op = "gdn_conv_update"
    check_array(op, "inputs", inputs, np.float32, ndim=2)
    rows, channels = inputs.shape
    check_array(op, "weight", weight, np.float32, (channels, None))
    check_array(op, "conv_state", conv_state, np.float32, (None, channels, weight.shape[1] - 1))
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "out", out, np.float32, (rows, channels))
    if weight.shape[1] > MAX_CONV_KERNEL:
        raise ValueError(f"conv kernels of up to {MAX_CONV_KERNEL} taps are supported, got {weight.shape[1]}")
    if rows:
        conv_update_kernel[(rows, -(-channels // CONV_THREADS)), CONV_THREADS, numba_stream(stream)](
            device_view(inputs), device_view(weight), device_view(conv_state), device_view(slots), device_view(out),
        )
    return out


def recurrent_step(q: DeviceArray, k: DeviceArray, v: DeviceArray, g: DeviceArray, beta: DeviceArray, state: DeviceArray,
                   slots: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`recurrent_step_kernel` (``state`` float32, updated in place)."""
    op = "gdn_recurrent_step"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, key_dim = q.shape
    check_array(op, "k", k, np.float32, (rows, heads, key_dim))
    check_array(op, "v", v, np.float32, (rows, heads, None))
    check_array(op, "g", g, np.float32, (rows, heads))
    check_array(op, "beta", beta, np.float32, (rows, heads))
    check_array(op, "state", state, np.float32, (None, heads, key_dim, v.shape[2]))
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "out", out, np.float32, tuple(v.shape))
    if key_dim > MAX_KEY_DIM:
        raise ValueError(f"key heads of up to {MAX_KEY_DIM} dims are supported, got {key_dim}")
    if rows:
        recurrent_step_kernel[(rows, heads), GDN_THREADS, numba_stream(stream)](
            device_view(q), device_view(k), device_view(v), device_view(g), device_view(beta), device_view(state),
            device_view(slots), device_view(out),
        )
    return out


def prompt_rule(q: DeviceArray, k: DeviceArray, v: DeviceArray, g: DeviceArray, beta: DeviceArray, state: DeviceArray,
                slots: DeviceArray, starts: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`prompt_rule_kernel`: every segment's tokens (``starts [S + 1]`` row offsets,
    state ``slots [S]``) through the gated delta rule, ``state`` float32 updated in place."""
    op = "gdn_prompt_rule"
    check_array(op, "q", q, np.float32, ndim=3)
    tokens, heads, key_dim = q.shape
    check_array(op, "k", k, np.float32, (tokens, heads, key_dim))
    check_array(op, "v", v, np.float32, (tokens, heads, None))
    check_array(op, "g", g, np.float32, (tokens, heads))
    check_array(op, "beta", beta, np.float32, (tokens, heads))
    check_array(op, "state", state, np.float32, (None, heads, key_dim, v.shape[2]))
    check_array(op, "slots", slots, np.int32, ndim=1)
    check_array(op, "starts", starts, np.int32, (slots.shape[0] + 1,))
    check_array(op, "out", out, np.float32, tuple(v.shape))
    if key_dim > MAX_KEY_DIM:
        raise ValueError(f"key heads of up to {MAX_KEY_DIM} dims are supported, got {key_dim}")
    if tokens and slots.shape[0]:
        grid = (slots.shape[0], heads, -(-v.shape[2] // PROMPT_COLUMNS))
        prompt_rule_kernel[grid, PROMPT_THREADS, numba_stream(stream)](
            device_view(q), device_view(k), device_view(v), device_view(g), device_view(beta), device_view(state),
            device_view(slots), device_view(starts), device_view(out),
        )
    return out


def ungroup(qkvz: DeviceArray, key_heads: int, value_heads: int, key_dim: int, value_dim: int, inputs_out: DeviceArray,
            z_out: DeviceArray, stream: object = None) -> tuple[DeviceArray, DeviceArray]:
    """Launch :func:`ungroup_kernel`: ``inputs_out [N, 2 H_k d_k + H_v d_v]`` and ``z_out [N, H_v,
    d_v]`` from ``qkvz [N, H_k (2 d_k + 2 G d_v)]``, all float32."""
    op = "gdn_ungroup"
    ratio = check_ratio(op, key_heads, value_heads)
    check_array(op, "qkvz", qkvz, np.float32, (None, key_heads * (2 * key_dim + 2 * ratio * value_dim)))
    rows = qkvz.shape[0]
    check_array(op, "inputs_out", inputs_out, np.float32, (rows, 2 * key_heads * key_dim + value_heads * value_dim))
    check_array(op, "z_out", z_out, np.float32, (rows, value_heads, value_dim))
    if rows and qkvz.shape[1]:
        grid = (rows, -(-qkvz.shape[1] // GLUE_THREADS))
        ungroup_kernel[grid, GLUE_THREADS, numba_stream(stream)](
            device_view(qkvz), np.int32(key_dim), np.int32(ratio * value_dim), device_view(inputs_out),
            device_view(z_out.reshape(rows, value_heads * value_dim)),
        )
    return inputs_out, z_out


def gates(ba: DeviceArray, a_log: DeviceArray, dt_bias: DeviceArray, key_heads: int, g_out: DeviceArray, beta_out: DeviceArray,
          stream: object = None) -> tuple[DeviceArray, DeviceArray]:
    """Launch :func:`gates_kernel`: ``g_out, beta_out [N, H_v]`` from ``ba [N, 2 H_v]`` (grouped by
    key head) and ``a_log, dt_bias [H_v]``, all float32."""
    op = "gdn_gates"
    check_array(op, "a_log", a_log, np.float32, ndim=1)
    value_heads = a_log.shape[0]
    ratio = check_ratio(op, key_heads, value_heads)
    check_array(op, "dt_bias", dt_bias, np.float32, (value_heads,))
    check_array(op, "ba", ba, np.float32, (None, 2 * value_heads))
    rows = ba.shape[0]
    check_array(op, "g_out", g_out, np.float32, (rows, value_heads))
    check_array(op, "beta_out", beta_out, np.float32, (rows, value_heads))
    count = rows * value_heads
    if count:
        gates_kernel[-(-count // GLUE_THREADS), GLUE_THREADS, numba_stream(stream)](
            device_view(ba), device_view(a_log), device_view(dt_bias), np.int32(ratio), device_view(g_out),
            device_view(beta_out),
        )
    return g_out, beta_out


def split_heads(mixed: DeviceArray, key_heads: int, value_heads: int, key_dim: int, value_dim: int, q_out: DeviceArray,
                k_out: DeviceArray, v_out: DeviceArray, stream: object = None) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
    """Launch :func:`split_heads_kernel`: ``q_out, k_out [T, H_v, d_k]`` and ``v_out [T, H_v, d_v]``
    from the conv outputs ``mixed [T, 2 H_k d_k + H_v d_v]``, all float32."""
    op = "gdn_split_heads"
    check_ratio(op, key_heads, value_heads)
    check_array(op, "mixed", mixed, np.float32, (None, 2 * key_heads * key_dim + value_heads * value_dim))
    rows = mixed.shape[0]
    check_array(op, "q_out", q_out, np.float32, (rows, value_heads, key_dim))
    check_array(op, "k_out", k_out, np.float32, (rows, value_heads, key_dim))
    check_array(op, "v_out", v_out, np.float32, (rows, value_heads, value_dim))
    if rows and key_heads:
        split_heads_kernel[(rows, key_heads), SPLIT_THREADS, numba_stream(stream)](
            device_view(mixed), np.float32(key_dim**-0.5), np.float32(L2_NORM_EPS), device_view(q_out),
            device_view(k_out), device_view(v_out.reshape(rows, value_heads * value_dim)),
        )
    return q_out, k_out, v_out


def conv_prompts(inputs: DeviceArray, weight: DeviceArray, conv_state: DeviceArray, slots: DeviceArray,
                 starts: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`conv_prompts_kernel`, then :func:`conv_prompt_states_kernel` on the same stream:
    every segment (``starts [S + 1]`` row offsets, distinct state ``slots [S]``) of ``inputs [T, C]``
    through the conv and SiLU into ``out [T, C]``, its slot of ``conv_state`` float32 updated in
    place."""
    op = "gdn_conv_prompts"
    check_array(op, "inputs", inputs, np.float32, ndim=2)
    rows, channels = inputs.shape
    check_array(op, "weight", weight, np.float32, (channels, None))
    taps = weight.shape[1]
    if not 1 <= taps <= MAX_CONV_KERNEL:
        raise KernelArgumentError(f"{op}: conv kernels of 1 to {MAX_CONV_KERNEL} taps are supported, got {taps}")
    check_array(op, "conv_state", conv_state, np.float32, (None, channels, taps - 1))
    check_array(op, "slots", slots, np.int32, ndim=1)
    segments = slots.shape[0]
    check_array(op, "starts", starts, np.int32, (segments + 1,))
    check_array(op, "out", out, np.float32, (rows, channels))
    if segments and channels:
        launch_stream = numba_stream(stream)
        channel_blocks = -(-channels // CONV_THREADS)
        if rows:
            conv_prompts_kernel[(-(-rows // CONV_ROWS), channel_blocks), CONV_THREADS, launch_stream](
                device_view(inputs), device_view(weight), device_view(conv_state), device_view(slots),
                device_view(starts), device_view(out),
            )
        if taps > 1:
            conv_prompt_states_kernel[(segments, channel_blocks), CONV_THREADS, launch_stream](
                device_view(inputs), device_view(conv_state), device_view(slots), device_view(starts),
            )
    return out


def check_ratio(op: str, key_heads: int, value_heads: int) -> int:
    """``H_v / H_k``, or :class:`KernelArgumentError` unless the key heads divide the value heads."""
    if key_heads <= 0 or value_heads % key_heads:
        raise KernelArgumentError(f"{op}: {value_heads} value heads are not a multiple of {key_heads} key heads")
    return value_heads // key_heads
