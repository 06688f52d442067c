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
  matrix products; the CPU backend runs it, :func:`delta_rule_chunked`, and the tests check that
  both forms agree.)

Rows name their slot in ``slots [N]``; padding rows use the reserved dummy slot 0. The NumPy
references are :func:`conv_update_reference`, :func:`recurrent_step_reference` and
:func:`prompt_rule_reference`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32

from metrale.kernels._device import SIMULATED, DeviceArray, check_array, device_view, fast_exp, numba_stream
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
        out[n] = mixed / (1.0 + np.exp(-mixed))
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


@cuda.jit(cache=True)
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


@cuda.jit(cache=True)
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


@cuda.jit(cache=True)
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
