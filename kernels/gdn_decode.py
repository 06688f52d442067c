"""A Gated DeltaNet layer's decode step between its input projections and ``out_proj`` in two
kernels (CUDA C++, compiled by NVRTC through CuPy), where the unfused ops take six.

From the ``in_proj_qkvz`` output (grouped by key head, as the checkpoint lays it out) and the
``in_proj_ba`` output of one token per sequence:

1. **conv** -- grid ``(N, ceil(C / THREADS))``, one thread per conv channel: the channel's input
   read from its place in the grouped projection (the un-grouping of ``gdn_ungroup`` as index
   arithmetic), the causal depthwise conv over the slot's history and the new input, SiLU, and
   the history moved on in place (every channel is its own: no two threads share a state);
2. **rule** -- grid ``(N, H_v)``, one block per sequence and value head: the key head's q and k
   L2-normalised (q scaled by ``d_k^-1/2``), the gates ``g = -exp(A_log) softplus(a + dt_bias)``
   and ``beta = sigmoid(b)``, one step of the gated delta rule on the slot's ``[d_k, d_v]``
   state, then the gated RMSNorm with the head's ``z``, written as bf16 -- the input of
   ``out_proj``. A thread owns one value column of every ``R``-th state row
   (:func:`rule_row_groups`, ``R`` row groups of ``d_v`` threads): it reads its rows once into
   registers, the row groups' partial sums of ``S^T k`` and of ``S^T q`` meet in shared memory,
   and it writes the rows back, so the state is read and written once with all its loads in
   flight (a thread per column walking all ``d_k`` rows left one warp a multiprocessor).

The same function as ``gdn_ungroup``, ``gdn_gates``, ``gdn_conv_update``, ``gdn_split_heads``,
``gdn_recurrent_step`` and ``gated_rmsnorm`` one after another (:func:`decode_reference`), up to
the order of float32 sums. ``tests/kernels`` runs the kernels on the host through the CUDA
emulation header; ``tests/kernels``' GPU tests (``-m gpu``) on the GPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._words import HELPERS
from metrale.kernels.decode_gemv import INSTRUCTIONS as DYNAMIC_SHARED_MEMORY

CONV_THREADS = 256
MAX_HEAD_DIM = 1024  # d_v rounded up to a warp fits a rule block (MAX_RULE_THREADS)

KERNELS = r"""
// Sum of value over the block (blockDim.x a multiple of 32); scratch holds 32 floats.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    __syncthreads();   // scratch is free (a previous sum has read it)
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

// mixed[n, c] = silu(sum_t window[t] * weight[c, t]), window = [conv_state[slot, c, :], input], the
// history moved on. qkvz [N, Hk * W], W = 2 dk + 2 G dv, per key head [q | k | v (G dv) | z (G dv)];
// channels: every head's q, then k, then v (C = 2 Hk dk + Hv dv). Grid (N, ceil(C / blockDim.x)).
extern "C" __global__ void gdn_decode_conv(const float* __restrict__ qkvz, const float* __restrict__ weight,
                                float* __restrict__ conv_state, const int* __restrict__ slots,
                                float* __restrict__ mixed, int key_heads, int value_heads, int key_dim,
                                int value_dim, int kernel) {
    allow_dependents();
    wait_for_producers();   // the projections come from the kernels ahead
    const int n = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    const int group = value_heads / key_heads;
    const int width = 2 * key_dim + 2 * group * value_dim;
    const int channels = 2 * key_heads * key_dim + value_heads * value_dim;
    if (c >= channels) return;
    int column;
    if (c < key_heads * key_dim) {
        column = (c / key_dim) * width + c % key_dim;
    } else if (c < 2 * key_heads * key_dim) {
        const int local = c - key_heads * key_dim;
        column = (local / key_dim) * width + key_dim + local % key_dim;
    } else {
        const int local = c - 2 * key_heads * key_dim, head = local / value_dim;
        column = (head / group) * width + 2 * key_dim + (head % group) * value_dim + local % value_dim;
    }
    const float input = qkvz[(size_t)n * key_heads * width + column];
    float* history = conv_state + ((size_t)slots[n] * channels + c) * (kernel - 1);
    float sum = 0.0f;
    for (int t = 0; t < kernel - 1; ++t) sum += history[t] * weight[c * kernel + t];
    sum += input * weight[c * kernel + kernel - 1];
    for (int t = 0; t + 1 < kernel - 1; ++t) history[t] = history[t + 1];
    if (kernel > 1) history[kernel - 2] = input;
    mixed[(size_t)n * channels + c] = sum / (1.0f + expf(-sum));
}

// One gated-delta step and the gated RMSNorm of value head j of row n. Grid (N, Hv); blockDim.x =
// DVP * R threads, DVP = dv rounded up to a warp: thread (g, c) = (tid / DVP, tid % DVP) owns value
// column c of the state rows g, g + R, g + 2R, ... (coalesced across a warp's columns), the first
// CACHED_ROWS of them held in registers between the read and the write, so the slot's [dk, dv]
// state is read once and written once by R * DVP threads with all their loads in flight. Dynamic
// shared memory (2 dk + 32 + R * DVP) floats: q, k, the sums' scratch, the row groups' partials.
#define CACHED_ROWS 16
extern "C" __global__ void gdn_decode_rule(const float* __restrict__ mixed, const float* __restrict__ qkvz,
                                const float* __restrict__ ba, const float* __restrict__ a_log,
                                const float* __restrict__ dt_bias, float* __restrict__ state,
                                const int* __restrict__ slots, const float* __restrict__ norm_weight, float eps,
                                float l2_eps, unsigned short* __restrict__ out, int key_heads, int value_heads,
                                int key_dim, int value_dim) {
    DYNAMIC_SHARED;
    allow_dependents();
    wait_for_producers();   // the convolution's output comes from the kernel ahead
    const int padded = (value_dim + 31) / 32 * 32, groups = blockDim.x / padded;
    float* q = reinterpret_cast<float*>(dynamic_shared);
    float* k = q + key_dim;
    float* scratch = k + key_dim;
    float* partial = scratch + 32;   // [groups][padded]
    const int n = blockIdx.x, j = blockIdx.y, tid = threadIdx.x;
    const int c = tid % padded, g = tid / padded;
    const int group = value_heads / key_heads, i = j / group, local = j % group;
    const int width = 2 * key_dim + 2 * group * value_dim;
    const int channels = 2 * key_heads * key_dim + value_heads * value_dim;
    const float* row = mixed + (size_t)n * channels;
    float q_squares = 0.0f, k_squares = 0.0f;
    for (int d = tid; d < key_dim; d += blockDim.x) {
        const float q_value = row[i * key_dim + d], k_value = row[key_heads * key_dim + i * key_dim + d];
        q[d] = q_value;
        k[d] = k_value;
        q_squares += q_value * q_value;
        k_squares += k_value * k_value;
    }
    const float q_norm = block_sum(q_squares, scratch);
    const float k_norm = block_sum(k_squares, scratch);
    const float q_scale = 1.0f / sqrtf(q_norm + l2_eps) * (1.0f / sqrtf((float)key_dim));
    const float k_scale = 1.0f / sqrtf(k_norm + l2_eps);
    for (int d = tid; d < key_dim; d += blockDim.x) {
        q[d] *= q_scale;
        k[d] *= k_scale;
    }
    __syncthreads();
    const float b = ba[(size_t)n * key_heads * 2 * group + i * 2 * group + local];
    const float a = ba[(size_t)n * key_heads * 2 * group + i * 2 * group + group + local] + dt_bias[j];
    const float beta = 1.0f / (1.0f + expf(-b));
    const float softplus = fmaxf(a, 0.0f) + log1pf(expf(-fabsf(a)));
    const float decay = expf(-expf(a_log[j]) * softplus);
    const bool owns = c < value_dim;
    float* column = state + ((size_t)slots[n] * value_heads + j) * key_dim * value_dim + c;
    float cached[CACHED_ROWS];
    float predicted = 0.0f;
    if (owns) {
#pragma unroll
        for (int t = 0; t < CACHED_ROWS; ++t) {
            const int r = g + t * groups;
            cached[t] = r < key_dim ? column[(size_t)r * value_dim] : 0.0f;
        }
#pragma unroll
        for (int t = 0; t < CACHED_ROWS; ++t) {
            const int r = g + t * groups;
            if (r < key_dim) predicted += cached[t] * decay * k[r];
        }
        for (int r = g + CACHED_ROWS * groups; r < key_dim; r += groups)
            predicted += column[(size_t)r * value_dim] * decay * k[r];
    }
    partial[g * padded + c] = predicted;
    __syncthreads();
    float total = 0.0f;
    for (int h = 0; h < groups; ++h) total += partial[h * padded + c];
    const float delta = owns ? beta * (row[2 * key_heads * key_dim + j * value_dim + c] - total) : 0.0f;
    float result = 0.0f;
    if (owns) {
#pragma unroll
        for (int t = 0; t < CACHED_ROWS; ++t) {
            const int r = g + t * groups;
            if (r < key_dim) {
                const float updated = cached[t] * decay + k[r] * delta;
                column[(size_t)r * value_dim] = updated;
                result += updated * q[r];
            }
        }
        for (int r = g + CACHED_ROWS * groups; r < key_dim; r += groups) {
            const float updated = column[(size_t)r * value_dim] * decay + k[r] * delta;
            column[(size_t)r * value_dim] = updated;
            result += updated * q[r];
        }
    }
    __syncthreads();   // every column's total is read
    partial[g * padded + c] = result;
    __syncthreads();
    result = 0.0f;
    for (int h = 0; h < groups; ++h) result += partial[h * padded + c];
    const float squares = block_sum(g == 0 && owns ? result * result : 0.0f, scratch);
    if (g == 0 && owns) {
        const float z = qkvz[(size_t)n * key_heads * width + i * width + 2 * key_dim + group * value_dim
                             + local * value_dim + c];
        const float normed = result / sqrtf(squares / (float)value_dim + eps);
        out[((size_t)n * value_heads + j) * value_dim + c] = to_bf16(normed * norm_weight[c] * (z / (1.0f + expf(-z))));
    }
}
"""

KERNEL_NAMES = ("gdn_decode_conv", "gdn_decode_rule")


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DYNAMIC_SHARED_MEMORY + DEPENDENT_LAUNCH + HELPERS + KERNELS


#: Threads of a rule block at most (its row groups times ``d_v`` rounded up to a warp).
MAX_RULE_THREADS = 1024
#: State rows a rule thread aims for (CACHED_ROWS of the kernel: held in registers).
CACHED_ROWS = 16


def rule_row_groups(key_dim: int, value_dim: int) -> int:
    """Row groups ``R`` of a rule block: enough that a thread owns at most :data:`CACHED_ROWS` of
    the ``d_k`` state rows where the block allows, as many as fit :data:`MAX_RULE_THREADS`."""
    padded = -(-value_dim // 32) * 32
    return max(1, min(MAX_RULE_THREADS // padded, -(-key_dim // CACHED_ROWS)))


def rule_threads(key_dim: int, value_dim: int) -> int:
    """Threads of a rule block: :func:`rule_row_groups` times ``d_v`` rounded up to a warp."""
    return rule_row_groups(key_dim, value_dim) * (-(-value_dim // 32) * 32)


def rule_shared_bytes(key_dim: int, value_dim: int) -> int:
    """Dynamic shared memory of a rule block: q, k, 32 floats of scratch, the row groups' partials."""
    return (2 * key_dim + 32 + rule_threads(key_dim, value_dim)) * 4


def supports(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> bool:
    """Whether a layer of this geometry is served."""
    return (key_heads > 0 and value_heads > 0 and value_heads % key_heads == 0 and 0 < key_dim <= MAX_HEAD_DIM
            and 0 < value_dim <= MAX_HEAD_DIM)


def decode_reference(qkvz: np.ndarray, ba: np.ndarray, conv_weight: np.ndarray, conv_state: np.ndarray,
                     a_log: np.ndarray, dt_bias: np.ndarray, state: np.ndarray, slots: np.ndarray,
                     norm_weight: np.ndarray, eps: float, key_heads: int, value_heads: int, key_dim: int,
                     value_dim: int) -> np.ndarray:
    """``[N, H_v, d_v]`` float32: the unfused ops' references one after another (``conv_state``
    and ``state`` updated in place)."""
    from metrale.kernels import gated, gated_delta

    inputs, z = gated_delta.ungroup_reference(qkvz, key_heads, value_heads, key_dim, value_dim)
    g, beta = gated_delta.gates_reference(ba, a_log, dt_bias, key_heads)
    mixed = gated_delta.conv_update_reference(inputs, conv_weight, conv_state, slots)
    q, k, v = gated_delta.split_heads_reference(mixed, key_heads, value_heads, key_dim, value_dim)
    out = gated_delta.recurrent_step_reference(q, k, v, g, beta, state, slots)
    return gated.gated_rmsnorm_reference(out, z, norm_weight, eps)


_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    if name not in _kernels:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",))
        for each in KERNEL_NAMES:
            _kernels[each] = module.get_function(each)
    return _kernels[name]


def decode_step(
    qkvz: DeviceArray, ba: DeviceArray, conv_weight: DeviceArray, conv_state: DeviceArray, a_log: DeviceArray,
    dt_bias: DeviceArray, state: DeviceArray, slots: DeviceArray, norm_weight: DeviceArray, eps: float,
    key_heads: int, value_heads: int, key_dim: int, value_dim: int, mixed: DeviceArray, out: DeviceArray,
    stream: Any = None,
) -> DeviceArray:
    """Launch the two kernels (see the module docstring): ``out [N, H_v, d_v]`` bf16 bits;
    ``mixed [N, C]`` float32 scratch; ``conv_state`` and ``state`` move on in place. Every array
    float32 but ``slots`` (int32) and ``out``."""
    op = "gdn_decode"
    if not supports(key_heads, value_heads, key_dim, value_dim):
        raise KernelArgumentError(f"{op}: {key_heads} key heads of {key_dim} and {value_heads} value heads of "
                                  f"{value_dim} are not served")
    group = value_heads // key_heads
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    check_array(op, "qkvz", qkvz, np.float32, (None, key_heads * (2 * key_dim + 2 * group * value_dim)))
    rows = qkvz.shape[0]
    check_array(op, "ba", ba, np.float32, (rows, 2 * value_heads))
    check_array(op, "conv_weight", conv_weight, np.float32, (channels, None))
    kernel = conv_weight.shape[1]
    check_array(op, "conv_state", conv_state, np.float32, (None, channels, kernel - 1))
    check_array(op, "a_log", a_log, np.float32, (value_heads,))
    check_array(op, "dt_bias", dt_bias, np.float32, (value_heads,))
    check_array(op, "state", state, np.float32, (None, value_heads, key_dim, value_dim))
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "norm_weight", norm_weight, np.float32, (value_dim,))
    check_array(op, "mixed", mixed, np.float32, (rows, channels))
    check_array(op, "out", out, np.uint16, (rows, value_heads, value_dim))
    if not rows:
        return out
    from metrale.kernels.gated_delta import L2_NORM_EPS

    threads = rule_threads(key_dim, value_dim)
    launch(_kernel("gdn_decode_conv"), (rows, math.ceil(channels / CONV_THREADS)), (CONV_THREADS,), (
        qkvz, conv_weight, conv_state, slots, mixed, np.int32(key_heads), np.int32(value_heads),
        np.int32(key_dim), np.int32(value_dim), np.int32(kernel)), 0, stream, dependent=True)
    launch(_kernel("gdn_decode_rule"), (rows, value_heads), (threads,), (
        mixed, qkvz, ba, a_log, dt_bias, state, slots, norm_weight, np.float32(eps), np.float32(L2_NORM_EPS), out,
        np.int32(key_heads), np.int32(value_heads), np.int32(key_dim), np.int32(value_dim),
    ), rule_shared_bytes(key_dim, value_dim), stream, dependent=True)
    return out
