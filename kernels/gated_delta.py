"""Gated DeltaNet decode steps on the device (FAMILIES.md §3.4 and §3.6), state in place in the slot pool.

* :func:`conv_update_kernel` -- the causal depthwise conv of one new token per row: its window is
  the slot's last ``K - 1`` inputs and the new one; the output goes through SiLU and the slot
  keeps the new last ``K - 1`` inputs.
* :func:`recurrent_step_kernel` -- one step of the gated delta rule per row and value head, on
  the float32 state ``[d_k, d_v]`` of the row's slot: ``S <- exp(g) S``, ``S <- S + k (beta (v -
  S^T k))^T``, ``o = S^T q``. A thread owns state columns (value dims); ``q`` and ``k`` go through
  shared memory.

Rows name their slot in ``slots [N]``; padding rows use the reserved dummy slot 0. The NumPy
references are :func:`conv_update_reference` and :func:`recurrent_step_reference`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from metrale.kernels._device import SIMULATED, check_array, device_view, numba_stream

GDN_THREADS = 16 if SIMULATED else 128
MAX_KEY_DIM = 256
CONV_THREADS = 16 if SIMULATED else 256
MAX_CONV_KERNEL = 8


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
            value = state[slot, head, i, column] * decay
            state[slot, head, i, column] = value
            predicted += value * shared_k[i]
        delta = rate * (v[row, head, column] - predicted)
        result = float32(0.0)
        for i in range(key_dim):
            value = state[slot, head, i, column] + shared_k[i] * delta
            state[slot, head, i, column] = value
            result += value * shared_q[i]
        out[row, head, column] = result


def conv_update(inputs: object, weight: object, conv_state: object, slots: object, out: object,
                stream: object = None) -> object:
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


def recurrent_step(q: object, k: object, v: object, g: object, beta: object, state: object, slots: object,
                   out: object, stream: object = None) -> object:
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
