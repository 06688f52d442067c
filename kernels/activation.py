"""SiLU-and-mul: the SwiGLU gate, ``silu(gate) * up``."""

from __future__ import annotations

import numpy as np


def silu_and_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate * sigmoid(gate) * up``, float32, same shape as the inputs."""
    gate = np.asarray(gate, dtype=np.float32)
    return (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(np.float32)


# ------------------------------------------------------------------------------ CUDA kernels

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

from metrale.errors import KernelArgumentError  # noqa: E402
from metrale.kernels._device import SIMULATED, DeviceArray, check_array, device_view, float_to_bf16, numba_stream  # noqa: E402

ELEMENTWISE_THREADS = 32 if SIMULATED else 256


@cuda.jit(cache=True)
def silu_and_mul_kernel(gate_up, out):
    # Grid: (N rows, ceil(I / threads)). gate_up [N, 2I] f32 (gate first), out [N, I] bf16 bits.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if column < width:
        gate = gate_up[row, column]
        silu = gate / (float32(1.0) + math.exp(-gate))
        out[row, column] = float_to_bf16(silu * gate_up[row, width + column])


@cuda.jit(cache=True)
def to_bf16_kernel(source, out):
    # Grid: ceil(n / threads) over the flattened arrays. source f32 [n], out bf16 bits [n].
    index = cuda.grid(1)
    if index < out.shape[0]:
        out[index] = float_to_bf16(source[index])


def silu_and_mul(gate_up: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out <- bf16(silu(gate) * up)`` for ``gate_up [N, 2I]`` float32."""
    check_array("silu_and_mul", "gate_up", gate_up, np.float32, ndim=2)
    rows, double = gate_up.shape
    if double % 2:
        raise KernelArgumentError(f"silu_and_mul: gate_up has shape {[rows, double]}, whose last extent is odd")
    check_array("silu_and_mul", "out", out, np.uint16, (rows, double // 2))
    if rows:
        grid = (rows, -(-(double // 2) // ELEMENTWISE_THREADS))
        silu_and_mul_kernel[grid, ELEMENTWISE_THREADS, numba_stream(stream)](device_view(gate_up), device_view(out))
    return out


def to_bf16(source: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Round float32 ``source`` to bf16 bits in ``out`` (same shape)."""
    check_array("to_bf16", "source", source, np.float32)
    check_array("to_bf16", "out", out, np.uint16, tuple(source.shape))
    count = int(np.prod(source.shape))
    if count:
        blocks = -(-count // ELEMENTWISE_THREADS)
        to_bf16_kernel[blocks, ELEMENTWISE_THREADS, numba_stream(stream)](
            device_view(source.reshape(count)), device_view(out.reshape(count))
        )
    return out
