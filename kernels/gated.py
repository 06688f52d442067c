"""The output gates of Qwen3-Next (docs/families.rst, "Gated attention" and "Gated DeltaNet layer").

* :func:`gated_rmsnorm_kernel` -- the Gated DeltaNet output norm, per value head:
  ``rms(x; w, eps) * silu(z)`` (a plain weight, not zero-centred);
* :func:`sigmoid_gate_kernel` -- the gated attention's ``o * sigmoid(gate)``;
* :func:`gated_add_kernel` -- the MoE's ``routed + shared * sigmoid(gate)``, the shared expert's
  output added through its scalar gate per row.

The first two write bf16 bits: their outputs feed a matrix product. The third writes float32 (the
layer's output, added to the residual).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    block_sum,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)
from metrale.kernels.activation import sigmoid_denominator

GATED_NORM_THREADS = 16 if SIMULATED else 128
GATE_THREADS = 64 if SIMULATED else 256


def gated_rmsnorm_reference(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``[..., d]`` float32: ``x / sqrt(mean(x^2) + eps) * weight * silu(z)`` over the last axis."""
    x = np.asarray(x, dtype=np.float32)
    z = np.asarray(z, dtype=np.float32)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return (normed * weight * (z / sigmoid_denominator(z))).astype(np.float32)


def sigmoid_gate_reference(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x * sigmoid(gate)``, float32."""
    gate = np.asarray(gate, dtype=np.float32)
    return (np.asarray(x, dtype=np.float32) / sigmoid_denominator(gate)).astype(np.float32)


def gated_add_reference(x: np.ndarray, y: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x + y * sigmoid(gate)`` float32 for ``x, y [N, H]`` and ``gate [N, 1]`` (computed as
    ``y / (1 + exp(-gate))``)."""
    gate = np.asarray(gate, dtype=np.float32)
    return (np.asarray(x, dtype=np.float32) + np.asarray(y, dtype=np.float32) / sigmoid_denominator(gate)).astype(np.float32)


@jit_kernel
def gated_rmsnorm_kernel(x, z, weight, eps, out):
    # Grid: one block of GATED_NORM_THREADS per (row, head) vector. x, z [V, d] f32; weight [d]
    # f32; out [V, d] bf16 bits.
    vector = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    width = x.shape[1]
    partial = cuda.shared.array(GATED_NORM_THREADS, float32)
    acc = float32(0.0)
    for i in range(tid, width, GATED_NORM_THREADS):
        value = x[vector, i]
        acc += value * value
    total = block_sum(partial, tid, acc, GATED_NORM_THREADS)
    scale = float32(1.0) / math.sqrt(total / float32(width) + eps)
    for i in range(tid, width, GATED_NORM_THREADS):
        gate = z[vector, i]
        out[vector, i] = float_to_bf16(x[vector, i] * scale * weight[i] * gate / (float32(1.0) + math.exp(-gate)))


@jit_kernel
def sigmoid_gate_kernel(x, gate, out):
    # Grid: ceil(n / GATE_THREADS) over flattened arrays. x [n] bf16 bits; gate [n] f32; out [n] bf16.
    index = cuda.grid(1)
    if index < out.shape[0]:
        out[index] = float_to_bf16(bf16_to_float(x[index]) / (float32(1.0) + math.exp(-gate[index])))


@jit_kernel
def gated_add_kernel(x, y, gate, out):
    # Grid: (N rows, ceil(H / GATE_THREADS)). x, y [N, H] f32; gate [N, 1] f32; out [N, H] f32
    # (may be x itself).
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column < out.shape[1]:
        out[row, column] = x[row, column] + y[row, column] / (float32(1.0) + math.exp(-gate[row, 0]))


def gated_rmsnorm(
    x: DeviceArray, z: DeviceArray, weight: DeviceArray, eps: float, out: DeviceArray, stream: object = None,
) -> DeviceArray:
    """Launch :func:`gated_rmsnorm_kernel` on ``x, z [V, d]`` float32 into bf16 ``out [V, d]``."""
    op = "gated_rmsnorm"
    check_array(op, "x", x, np.float32, ndim=2)
    check_array(op, "z", z, np.float32, tuple(x.shape))
    check_array(op, "weight", weight, np.float32, (x.shape[1],))
    check_array(op, "out", out, np.uint16, tuple(x.shape))
    if x.shape[0]:
        gated_rmsnorm_kernel[x.shape[0], GATED_NORM_THREADS, numba_stream(stream)](
            device_view(x), device_view(z), device_view(weight), np.float32(eps), device_view(out),
        )
    return out


def sigmoid_gate(x: DeviceArray, gate: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`sigmoid_gate_kernel`: bf16 ``out = x * sigmoid(gate)`` (same shapes)."""
    op = "sigmoid_gate"
    check_array(op, "x", x, np.uint16)
    check_array(op, "gate", gate, np.float32, tuple(x.shape))
    check_array(op, "out", out, np.uint16, tuple(x.shape))
    count = int(np.prod(x.shape))
    if count:
        sigmoid_gate_kernel[-(-count // GATE_THREADS), GATE_THREADS, numba_stream(stream)](
            device_view(x.reshape(count)), device_view(gate.reshape(count)), device_view(out.reshape(count)),
        )
    return out


def gated_add(x: DeviceArray, y: DeviceArray, gate: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`gated_add_kernel`: float32 ``out = x + y * sigmoid(gate)`` for ``x, y, out [N, H]``
    and ``gate [N, 1]``."""
    op = "gated_add"
    check_array(op, "x", x, np.float32, ndim=2)
    rows, width = x.shape
    check_array(op, "y", y, np.float32, (rows, width))
    check_array(op, "gate", gate, np.float32, (rows, 1))
    check_array(op, "out", out, np.float32, (rows, width))
    if rows and width:
        gated_add_kernel[(rows, -(-width // GATE_THREADS)), GATE_THREADS, numba_stream(stream)](
            device_view(x), device_view(y), device_view(gate), device_view(out),
        )
    return out
