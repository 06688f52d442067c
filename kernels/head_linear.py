"""Per-head linear maps for MLA's absorbed form: ``out[n, h] = W[h] @ x[n, h]``.

The absorbed decode projects each query head into the latent space with the key half of
``kv_b_proj`` (``W_UK[h]^T``, ``[r, d_n]``) and maps each head's attention result back with the
value half (``W_UV[h]``, ``[d_v, r]``): one small matrix per head, the same for every row. Here
``W`` is stacked ``[heads * out, in]`` bf16; one warp computes one output value, streaming its
weight row as 64-bit words against the row's bf16 input.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from metrale.kernels._device import SIMULATED, DeviceArray, check_array, device_view, jit_kernel, numba_stream
from metrale.kernels.gemv import dot_words

HEAD_WARPS = 2 if SIMULATED else 8  # output values per block
WARP = 1 if SIMULATED else 32  # lanes per output value (the simulator has no shuffles)
FULL_MASK = 0xFFFFFFFF


def head_linear_reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``[N, heads, out]`` float32 for ``x [N, heads, in]`` and ``weight [heads * out, in]``."""
    heads = x.shape[1]
    w = np.asarray(weight, dtype=np.float32).reshape(heads, -1, x.shape[2])
    return np.einsum("nhi,hoi->nho", np.asarray(x, dtype=np.float32), w).astype(np.float32)


@jit_kernel
def head_linear_kernel(x_words, w_words, out):
    # Grid: (N rows, heads, ceil(out / HEAD_WARPS)); HEAD_WARPS * WARP threads. x_words
    # [N, heads * in / 4] u64 (bf16, heads contiguous); w_words [heads * out, in / 4]; out
    # [N, heads, out] f32.
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.z * HEAD_WARPS + tid // WARP
    width = out.shape[2]
    words = w_words.shape[1]
    if column >= width:
        return
    acc = float32(0.0)
    for index in range(lane, words, WARP):
        acc += dot_words(w_words[head * width + column, index], x_words[row, head * words + index])
    if WARP > 1:
        for k in range(5):
            acc += cuda.shfl_xor_sync(FULL_MASK, acc, 1 << k)
    if lane == 0:
        out[row, head, column] = acc


def head_linear(x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`head_linear_kernel`: bf16 ``x [N, heads, in]`` and ``weight [heads * out, in]``."""
    op = "head_linear"
    check_array(op, "x", x, np.uint16, ndim=3)
    rows, heads, width_in = x.shape
    check_array(op, "weight", weight, np.uint16, (None, width_in))
    width_out = weight.shape[0] // heads
    check_array(op, "out", out, np.float32, (rows, heads, width_out))
    if width_in % 4:
        raise ValueError(f"the input width {width_in} must be a multiple of 4")
    if rows:
        head_linear_kernel[(rows, heads, -(-width_out // HEAD_WARPS)), HEAD_WARPS * WARP, numba_stream(stream)](
            device_view(x.reshape(rows, heads * width_in).view(np.uint64)), device_view(weight.view(np.uint64)),
            device_view(out),
        )
    return out
