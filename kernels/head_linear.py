"""Per-head linear maps for MLA's absorbed form: ``out[n, h] = W[h] @ x[n, h]``.

The absorbed decode projects each query head into the latent space with the key half of
``kv_b_proj`` (``W_UK[h]^T``, ``[r, d_n]``) and maps each head's attention result back with the
value half (``W_UV[h]``, ``[d_v, r]``): one small matrix per head, the same for every row. Here
``W`` is stacked ``[heads * out, in]`` bf16; one warp computes one output value, streaming its
weight row as 64-bit words against the row's bf16 input (:func:`head_linear_kernel`, numba).

:func:`head_linear_words` is the CUDA C++ kernel the CUDA backend runs where it serves the input:
a warp per output value holds its weight row's 16-byte words in registers while every row goes by,
reads a float32 input directly (rounding it to bf16 as it reads it, so a strided float32 view of
the queries needs neither a copy nor a conversion kernel first) and launches dependently.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32

from metrale.errors import KernelArgumentError
from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    check_array,
    device_view,
    dot_words,
    jit_kernel,
    numba_stream,
)

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


# ------------------------------------------------------------------------------ CUDA C++ kernel

from metrale.kernels._launch import DEPENDENT_LAUNCH, launch  # noqa: E402
from metrale.kernels._words import HELPERS  # noqa: E402

#: Warps of a block of :func:`head_linear_words`; each computes one output value of every row.
WORD_WARPS = 8
#: 16-byte weight words a lane holds (the input width at most 32 lanes * 8 words * 8 values).
MAX_LANE_WORDS = 8

KERNEL = r"""
#define HEAD_WARPS_CC 8
#define MAX_LANE_WORDS 8

// out[n, h, o] = dot(weight[h * out_width + o, :], x[n, h, :]) for every row n. Grid
// ceil(heads * out_width / HEAD_WARPS_CC) blocks of 32 * HEAD_WARPS_CC threads: a warp per output
// value, its lanes across the input's 16-byte words, the weight words held in registers while the
// rows go by (the weights are read once whatever the rows). x is bf16 bits (x_float 0) or float32
// (x_float 1, rounded to bf16 as the to_bf16 kernel rounds it), at x + n * row_stride + h *
// head_stride (elements; the input's values contiguous, 16-byte aligned); weight [heads *
// out_width, in_width] bf16 bits; out [N, heads, out_width] float32; in_width a multiple of 8.
extern "C" __global__ void __launch_bounds__(32 * HEAD_WARPS_CC) head_linear_words(
    const void* __restrict__ x, int x_float, long row_stride, long head_stride, const uint4* __restrict__ weight,
    float* __restrict__ out, int rows, int heads, int in_width, int out_width) {
    const int lane = threadIdx.x % 32;
    const int output = blockIdx.x * HEAD_WARPS_CC + threadIdx.x / 32;
    const bool valid = output < heads * out_width;
    const int words = in_width / 8, head = output / out_width;
    const uint4 zero = {0u, 0u, 0u, 0u};
    uint4 w[MAX_LANE_WORDS];
#pragma unroll
    for (int i = 0; i < MAX_LANE_WORDS; ++i) {
        const int word = lane + 32 * i;
        w[i] = valid && word < words ? __ldg(weight + (size_t)output * words + word) : zero;
    }
    allow_dependents();
    wait_for_producers();   // the weights above are constant; x comes from the kernels ahead
    if (!valid) return;
    for (int n = 0; n < rows; ++n) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_LANE_WORDS; ++i) {
            const int word = lane + 32 * i;
            if (word >= words) continue;
            uint4 value;
            if (x_float) {
                const float4* source = reinterpret_cast<const float4*>(
                    static_cast<const float*>(x) + n * row_stride + head * head_stride) + 2 * word;
                const float4 a = source[0], b = source[1];
                value.x = (unsigned)to_bf16(a.x) | ((unsigned)to_bf16(a.y) << 16);
                value.y = (unsigned)to_bf16(a.z) | ((unsigned)to_bf16(a.w) << 16);
                value.z = (unsigned)to_bf16(b.x) | ((unsigned)to_bf16(b.y) << 16);
                value.w = (unsigned)to_bf16(b.z) | ((unsigned)to_bf16(b.w) << 16);
            } else {
                value = reinterpret_cast<const uint4*>(
                    static_cast<const unsigned short*>(x) + n * row_stride + head * head_stride)[word];
            }
            acc += dot8(w[i], value);
        }
        acc = warp_sum(acc);
        if (lane == 0) out[((size_t)n * heads + head) * out_width + output % out_width] = acc;
    }
}
"""

KERNEL_NAMES = ("head_linear_words",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DEPENDENT_LAUNCH + HELPERS + KERNEL


_word_kernels: list[Any] = []


def words_supported(x: DeviceArray, weight: DeviceArray) -> bool:
    """Whether :func:`head_linear_words` serves ``x`` (bf16 bits or float32 ``[N, heads, in]``,
    its last axis contiguous, every head's input 16-byte aligned) and ``weight`` (``in`` a multiple
    of 8 and at most 32 lanes times :data:`MAX_LANE_WORDS` words of 8)."""
    if getattr(x, "ndim", 0) != 3 or x.dtype not in (np.uint16, np.float32) or weight.dtype != np.uint16:
        return False
    in_width = x.shape[2]
    item = x.dtype.itemsize
    pointer = getattr(getattr(x, "data", None), "ptr", 0) or 0
    aligned = pointer % 16 == 0 and all(stride % 16 == 0 for stride in x.strides[:2]) and x.strides[2] == item
    return aligned and in_width % 8 == 0 and in_width <= 32 * MAX_LANE_WORDS * 8 and weight.shape[1] == in_width


def head_linear_words(x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: Any = None) -> DeviceArray:
    """The CUDA C++ head_linear (dependently launched): ``out [N, heads, out]`` float32 from ``x``
    bf16 bits or float32 ``[N, heads, in]`` (a strided view allowed, :func:`words_supported`) and
    bf16 ``weight [heads * out, in]``; a float32 input is rounded to bf16 as it is read."""
    op = "head_linear"
    if not words_supported(x, weight):
        raise KernelArgumentError(f"{op}: x {x.dtype} {list(x.shape)} (strides {list(x.strides)}) with weight "
                                  f"{list(weight.shape)} is not served by the CUDA C++ kernel")
    rows, heads, in_width = x.shape
    out_width = weight.shape[0] // heads
    check_array(op, "weight", weight, np.uint16, (heads * out_width, in_width))
    check_array(op, "out", out, np.float32, (rows, heads, out_width))
    if not _word_kernels:
        import cupy

        _word_kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",)).get_function("head_linear_words"))
    if rows and heads * out_width:
        item = x.dtype.itemsize
        launch(_word_kernels[0], (-(-heads * out_width // WORD_WARPS),), (32 * WORD_WARPS,),
               (x, np.int32(x.dtype == np.float32), np.int64(x.strides[0] // item), np.int64(x.strides[1] // item),
                weight, out, np.int32(rows), np.int32(heads), np.int32(in_width), np.int32(out_width)),
               0, stream, dependent=True)
    return out
