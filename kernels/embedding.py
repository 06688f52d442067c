"""Embedding gather: ``out[t] = weight[ids[t]]``."""

from __future__ import annotations

import numpy as np


def embedding_reference(weight: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``weight [V, H]``, ``ids [T]`` int -> ``[T, H]`` float32."""
    return np.asarray(weight[np.asarray(ids, dtype=np.int64)], dtype=np.float32)


# ------------------------------------------------------------------------------ CUDA kernel

from numba import cuda  # noqa: E402

from metrale.kernels._device import SIMULATED, DeviceArray, bf16_to_float, check_array, device_view, jit_kernel, numba_stream  # noqa: E402

EMBEDDING_THREADS = 16 if SIMULATED else 128


@jit_kernel
def embedding_kernel(weight, ids, out):
    # Grid: (N rows, ceil(H / threads)); one thread per output element.
    # weight [V, H] bf16 bits (uint16), ids [N] int32, out [N, H] float32.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column < out.shape[1]:
        out[row, column] = bf16_to_float(weight[ids[row], column])


def embedding(weight: DeviceArray, ids: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Gather rows of a bf16 ``weight [V, H]`` into float32 ``out [N, H]``."""
    check_array("embedding", "weight", weight, np.uint16, ndim=2)
    rows, hidden = ids.shape[0], weight.shape[1]
    check_array("embedding", "ids", ids, np.int32, (rows,))
    check_array("embedding", "out", out, np.float32, (rows, hidden))
    if rows:
        grid = (rows, -(-hidden // EMBEDDING_THREADS))
        embedding_kernel[grid, EMBEDDING_THREADS, numba_stream(stream)](
            device_view(weight), device_view(ids), device_view(out)
        )
    return out
