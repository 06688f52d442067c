"""LoRA on the GPU: every row's adapter update in one launch per step of the product, whatever
the mix of adapters in the batch (docs/lora.rst).

* a step of few rows (decode) shrinks in the projection's own product: the stack's extended
  weight holds every slot's ``A`` after the projection's rows, so one cuBLAS product gives each
  row's projection and its products with every slot's ``A``; :func:`lora_expand` (CUDA C++) then
  writes each row's output with its own slot's update (optionally SwiGLU's activation of it), in
  one launch whatever the mix of adapters;
* a step of many rows keeps the projection's product; one more cuBLAS product with every slot's
  ``A`` (or the step's one adapter's), :func:`lora_select_kernel` keeping each row's own slot's
  columns (in bf16), and one cuBLAS product accumulated into the output, ``y += shrunk b^T`` with
  the stack's block-diagonal ``b [out, S G R]`` (every slot's ``B`` read once a step);
* :func:`lora_token_rows_kernel` -- embedding rows an adapter replaces;
* :func:`lora_logit_rows_kernel` -- LM-head rows an adapter replaces, a dot product each.

Rows of slot 0 (the base model) return at once. Slots, the stacked weights and the row metadata
are device arrays that never move, so a CUDA graph replays any mix of adapters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, int32

from metrale.errors import KernelArgumentError
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

LORA_THREADS = 32 if SIMULATED else 128


@jit_kernel
def lora_select_kernel(products, width, slots, single_slot, shrunk):
    # Grid: (N rows, ceil(S W / LORA_THREADS)). products [N, S W] f32: each row's product with
    # every slot's A (one cuBLAS product), or [N, W] with single_slot > 0 (that slot's A only);
    # shrunk [N, S W] bf16 bits: the row's own slot's W columns kept, every other slot's zeroed
    # (everything for a base-model row), so one product with the stack's b adds each row's update.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column < shrunk.shape[1]:
        keep = column // width + 1 == slots[row]
        source = column
        if single_slot > 0:
            keep = keep and slots[row] == single_slot
            source = column - (single_slot - 1) * width
        shrunk[row, column] = float_to_bf16(products[row, source]) if keep else np.uint16(0)


@jit_kernel
def lora_token_rows_kernel(x, ids, slots, tokens, rows):
    # Grid: N blocks of LORA_THREADS. x [N, H] f32 (updated); ids, slots [N] int32; tokens [S, T]
    # int32 (-1 pads); rows [S, T, H] f32.
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    slot = slots[row]
    if slot == 0:
        return
    found = cuda.shared.array(1, int32)
    if tid == 0:
        found[0] = -1
    cuda.syncthreads()
    token = ids[row]
    for k in range(tid, tokens.shape[1], LORA_THREADS):
        if tokens[slot, k] == token:
            found[0] = k  # token ids of one slot are distinct: at most one thread writes
    cuda.syncthreads()
    k = found[0]
    if k >= 0:
        for column in range(tid, x.shape[1], LORA_THREADS):
            x[row, column] = rows[slot, k, column]


@jit_kernel
def lora_logit_rows_kernel(logits, h, h_bf16, slots, tokens, rows):
    # Grid: (N rows, T), LORA_THREADS threads. logits [N, V] f32 (updated); h [N, H] f32 or bf16
    # bits (h_bf16); slots [N] int32; tokens [S, T] int32 (-1 pads); rows [S, T, H] f32.
    row = cuda.blockIdx.x
    k = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    slot = slots[row]
    if slot == 0:
        return
    token = tokens[slot, k]
    if token < 0:
        return
    partial = cuda.shared.array(LORA_THREADS, float32)
    acc = float32(0.0)
    for column in range(tid, h.shape[1], LORA_THREADS):
        value = bf16_to_float(h[row, column]) if h_bf16 else float32(h[row, column])
        acc += value * rows[slot, k, column]
    total = block_sum(partial, tid, acc, LORA_THREADS)
    if tid == 0:
        logits[row, token] = total


def lora_select(products: DeviceArray, width: int, slots: DeviceArray, shrunk: DeviceArray,
                stream: object = None, single_slot: int = 0) -> DeviceArray:
    """Launch :func:`lora_select_kernel`: from ``products [N, S W]`` (float32; ``[N, W]``, the
    one slot's, with ``single_slot``) keep each row's slot's ``W`` columns, in bf16, in ``shrunk
    [N, S W]`` (the rest zero)."""
    op = "lora_linear"
    check_array(op, "products", products, np.float32, ndim=2)
    rows = products.shape[0]
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "shrunk", shrunk, np.uint16, (rows, None))
    columns = shrunk.shape[1]
    if width <= 0 or columns % width or products.shape[1] != (width if single_slot else columns):
        raise KernelArgumentError(f"{op}: products of {products.shape[1]} columns for {columns} shrunk columns, "
                                  f"slots of {width}" + (f" (slot {single_slot}'s only)" if single_slot else ""))
    if not 0 <= single_slot <= columns // width:
        raise KernelArgumentError(f"{op}: single_slot {single_slot} is not one of {columns // width} slots")
    if rows and columns:
        lora_select_kernel[(rows, -(-columns // LORA_THREADS)), LORA_THREADS, numba_stream(stream)](
            device_view(products), np.int32(width), device_view(slots), np.int32(single_slot), device_view(shrunk),
        )
    return shrunk


def lora_token_rows(x: DeviceArray, ids: DeviceArray, slots: DeviceArray, tokens: DeviceArray, rows: DeviceArray,
                    stream: object = None) -> DeviceArray:
    """Replace the embedding rows ``x [N, H]`` (float32, in place) adapters replace."""
    op = "lora_token_rows"
    check_array(op, "x", x, np.float32, ndim=2)
    count, hidden = x.shape
    check_array(op, "ids", ids, np.int32, (count,))
    check_array(op, "slots", slots, np.int32, (count,))
    check_array(op, "tokens", tokens, np.int32, ndim=2)
    check_array(op, "rows", rows, np.float32, (tokens.shape[0], tokens.shape[1], hidden))
    if count:
        lora_token_rows_kernel[count, LORA_THREADS, numba_stream(stream)](
            device_view(x), device_view(ids), device_view(slots), device_view(tokens), device_view(rows),
        )
    return x


def lora_logit_rows(logits: DeviceArray, h: DeviceArray, slots: DeviceArray, tokens: DeviceArray, rows: DeviceArray,
                    stream: object = None) -> DeviceArray:
    """Replace the logits ``[N, V]`` (float32, in place) of the LM-head rows adapters replace;
    ``h [N, H]`` is the LM head's input (float32 or bf16 bits)."""
    op = "lora_logit_rows"
    check_array(op, "logits", logits, np.float32, ndim=2)
    count = logits.shape[0]
    if h.dtype not in (np.float32, np.uint16):
        check_array(op, "h", h, np.float32)
    check_array(op, "h", h, h.dtype, (count, None))
    check_array(op, "slots", slots, np.int32, (count,))
    check_array(op, "tokens", tokens, np.int32, ndim=2)
    check_array(op, "rows", rows, np.float32, (tokens.shape[0], tokens.shape[1], h.shape[1]))
    if count and tokens.shape[1]:
        lora_logit_rows_kernel[(count, tokens.shape[1]), LORA_THREADS, numba_stream(stream)](
            device_view(logits), device_view(h), h.dtype == np.uint16, device_view(slots), device_view(tokens),
            device_view(rows),
        )
    return logits


# ------------------------------------------------------------------------- the CUDA C++ expand

from metrale.kernels._launch import DEPENDENT_LAUNCH, launch  # noqa: E402

#: Output columns (a thread each) of a block of :func:`lora_expand`, and the rows whose slots it
#: stages at a time.
EXPAND_COLUMNS = 128

EXPAND_KERNEL = r"""
#define LORA_COLUMNS 128

// The update of one row of adapter slot s: its shrunk products p (float32 in ext, the slot's
// `width` columns, the same for every thread of the block: one load a warp), each rounded to bf16
// as a product with B reads it, times the thread's output column's slot-s columns of b (bf16
// bits; the same for every row of the block: first read from memory, then from L1).
__device__ __forceinline__ float lora_update(const float* p, const unsigned short* b_row, int width, bool words) {
    float acc = 0.0f;
    if (words) {   // width a multiple of 8; b's rows and the products 16-byte aligned
        const uint4* w = reinterpret_cast<const uint4*>(b_row);
        const float4* q = reinterpret_cast<const float4*>(p);
        for (int k = 0; k < width / 8; ++k) {
            const uint4 v = __ldg(w + k);
            const float4 lo = __ldg(q + 2 * k), hi = __ldg(q + 2 * k + 1);
            acc += bf16_bits(to_bf16(lo.x)) * bf16_low(v.x) + bf16_bits(to_bf16(lo.y)) * bf16_high(v.x)
                 + bf16_bits(to_bf16(lo.z)) * bf16_low(v.y) + bf16_bits(to_bf16(lo.w)) * bf16_high(v.y)
                 + bf16_bits(to_bf16(hi.x)) * bf16_low(v.z) + bf16_bits(to_bf16(hi.y)) * bf16_high(v.z)
                 + bf16_bits(to_bf16(hi.z)) * bf16_low(v.w) + bf16_bits(to_bf16(hi.w)) * bf16_high(v.w);
        }
    } else {
        for (int k = 0; k < width; ++k) acc += bf16_bits(to_bf16(__ldg(p + k))) * bf16_bits(__ldg(b_row + k));
    }
    return acc;
}

// ext float32 [N, out + K]: a product with a LoRA stack's extended weight (the projection's own
// `out` rows, then every slot's A rows, K = slots_count * width), slots int32 [N], b bf16 bits
// [out, K] (block-diagonal per slot), bias float32 [out] or null. Each row i of slot s > 0 gets
// y[i, o] = ext[i, o] + bias[o] + sum_{k < width} ext[i, out + (s - 1) width + k] b[o, (s - 1) width + k]
// (the shrunk products rounded to bf16); a base-model row (s = 0) ext[i, o] + bias[o]. Written to
// y float32 [N, out]; or, with swiglu (out = 2 I: gate rows, then up rows), bf16(silu(y[i, o]) *
// y[i, I + o]) to act [N, I].
// Grid (ceil(columns / LORA_COLUMNS), slots_count + 1), LORA_COLUMNS threads: block (t, s) writes
// the rows of slot s, a thread an output column (of y, or of act), so each slot's columns of b are
// read from memory once a step. The block lists its rows in shared memory, LORA_COLUMNS rows of
// the batch at a time, and takes them two at a time (the loads of both in flight).
extern "C" __global__ void __launch_bounds__(LORA_COLUMNS) lora_expand(
    const float* __restrict__ ext, const int* __restrict__ slots, const unsigned short* __restrict__ b,
    const float* __restrict__ bias, float* __restrict__ y, unsigned short* __restrict__ act, int rows, int out,
    int width, int slots_count, int swiglu, int words) {
    __shared__ int listed[LORA_COLUMNS];
    __shared__ int count;
    const int K = width * slots_count, ld = out + K, slot = blockIdx.y;
    const int column = blockIdx.x * LORA_COLUMNS + threadIdx.x;
    const int columns = swiglu ? out / 2 : out;
    const bool active = column < columns, vector = words != 0;
    const int up = column + out / 2;
    const float bias_column = bias && active ? bias[column] : 0.0f;
    const float bias_up = bias && swiglu && active ? bias[up] : 0.0f;
    const int first = slot > 0 ? (slot - 1) * width : 0;
    const unsigned short* b_column = b + (size_t)(active ? column : 0) * K + first;
    const unsigned short* b_up = b + (size_t)(active && swiglu ? up : 0) * K + first;
    wait_for_producers();
    for (int base = 0; base < rows; base += LORA_COLUMNS) {
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        const int row = base + threadIdx.x;
        if (row < rows && slots[row] == slot) listed[atomicAdd(&count, 1)] = row;
        __syncthreads();
        const int listed_count = count;
        for (int i = 0; i < listed_count && active; i += 2) {
            float value[2], up_value[2];
            int taken[2];
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                taken[j] = i + j < listed_count ? listed[i + j] : -1;
                if (taken[j] < 0) continue;
                const float* x = ext + (size_t)taken[j] * ld;
                value[j] = x[column] + bias_column;
                up_value[j] = swiglu ? x[up] + bias_up : 0.0f;
                if (slot > 0) {
                    const float* p = x + out + first;
                    value[j] += lora_update(p, b_column, width, vector);
                    if (swiglu) up_value[j] += lora_update(p, b_up, width, vector);
                }
            }
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (taken[j] < 0) continue;
                if (swiglu) {
                    const float v = value[j];
                    act[(size_t)taken[j] * columns + column] = to_bf16(v / (1.0f + expf(-v)) * up_value[j]);
                } else {
                    y[(size_t)taken[j] * out + column] = value[j];
                }
            }
        }
        __syncthreads();
    }
    allow_dependents();
}
"""


#: The kernels of :func:`source`'s module.
KERNEL_NAMES = ("lora_expand",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    from metrale.kernels.decode_gemv import HELPERS, INSTRUCTIONS

    return INSTRUCTIONS + DEPENDENT_LAUNCH + HELPERS + EXPAND_KERNEL


_expand_kernels: list[Any] = []


def lora_expand(ext: DeviceArray, slots: DeviceArray, b: DeviceArray, width: int, out: DeviceArray,
                bias: DeviceArray | None = None, swiglu: bool = False, stream: object = None) -> DeviceArray:
    """Each row's LoRA update added to its product with a stack's extended weight, in CUDA C++
    (one launch whatever the mix of slots): ``ext [N, M + S W]`` float32 (the projection's ``M``
    columns, then every slot's shrunk products), ``slots [N]`` int32, ``b [M, S W]`` bf16 bits
    (:class:`~metrale.lora.LoraStack`), ``width`` = ``W``, ``bias [M]`` float32 or None. Writes
    ``out [N, M]`` float32; with ``swiglu`` (``M = 2 I``: gate columns, then up columns)
    ``silu(gate) * up`` to ``out [N, I]`` bf16 bits."""
    op = "lora_expand"
    check_array(op, "ext", ext, np.float32, ndim=2)
    rows, columns = ext.shape
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "b", b, np.uint16, ndim=2)
    m, k = b.shape
    if width <= 0 or k % width or columns != m + k:
        raise KernelArgumentError(f"{op}: ext of {columns} columns is not b's {m} rows and {k} columns, whole slots "
                                  f"of {width}")
    if swiglu and m % 2:
        raise KernelArgumentError(f"{op}: swiglu needs gate and up halves, got {m} columns")
    if swiglu:
        check_array(op, "out", out, np.uint16, (rows, m // 2))
    else:
        check_array(op, "out", out, np.float32, (rows, m))
    if bias is not None:
        check_array(op, "bias", bias, np.float32, (m,))
    if not _expand_kernels:
        import cupy

        _expand_kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",)).get_function("lora_expand"))
    # 16-byte loads of b's rows and of the products in ext's rows.
    words = (width % 8 == 0 and k % 8 == 0 and b.data.ptr % 16 == 0 and (m + k) % 4 == 0 and m % 4 == 0
             and ext.data.ptr % 16 == 0)
    if rows and m:
        null = np.uint64(0)
        launch(_expand_kernels[0], (-(-(m // 2 if swiglu else m) // EXPAND_COLUMNS), k // width + 1),
               (EXPAND_COLUMNS,),
               (ext, slots, b, null if bias is None else bias, null if swiglu else out, out if swiglu else null,
                np.int32(rows), np.int32(m), np.int32(width), np.int32(k // width), np.int32(swiglu),
                np.int32(words)),
               0, stream, dependent=False)
    return out
