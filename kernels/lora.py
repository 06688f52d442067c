"""LoRA on the GPU: every row's adapter update in one launch per step of the product, whatever
the mix of adapters in the batch (docs/lora.rst).

* the shrink is one cuBLAS product of the rows with every slot's ``A`` at once (``[N, S G R]``,
  slot 0's zeros left out), then :func:`lora_select_kernel` keeps each row's own slot's columns
  (in bf16) and zeroes the others';
* the expand is then one cuBLAS product accumulated into the projection's output:
  ``y += shrunk b^T`` with the stack's block-diagonal ``b [out, S G R]``, every slot's ``B`` read
  once a step (what a per-row gather reads once a row); or, where its staging fits,
  :func:`lora_expand_words` (CUDA C++) in one launch straight from the products, each row reading
  only its own slot's columns (no selection kernel before it);
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
def lora_select_kernel(products, width, slots, shrunk):
    # Grid: (N rows, ceil(S W / LORA_THREADS)). products [N, S W] f32: each row's product with
    # every slot's A (one cuBLAS product); shrunk [N, S W] bf16 bits: the row's own slot's W
    # columns kept, every other slot's zeroed (everything for a base-model row), so one product
    # with the stack's b adds each row's update.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column < shrunk.shape[1]:
        keep = column // width + 1 == slots[row]
        shrunk[row, column] = float_to_bf16(products[row, column]) if keep else np.uint16(0)


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
                stream: object = None) -> DeviceArray:
    """Launch :func:`lora_select_kernel`: from ``products [N, S W]`` (float32) keep each row's
    slot's ``W`` columns, in bf16, in ``shrunk`` (the rest zero)."""
    op = "lora_linear"
    check_array(op, "products", products, np.float32, ndim=2)
    rows, columns = products.shape
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "shrunk", shrunk, np.uint16, (rows, columns))
    if rows and columns:
        lora_select_kernel[(rows, -(-columns // LORA_THREADS)), LORA_THREADS, numba_stream(stream)](
            device_view(products), np.int32(width), device_view(slots), device_view(shrunk),
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

#: Output columns, rows and threads of a block of :func:`lora_expand_words`.
EXPAND_COLUMNS = 32
EXPAND_ROWS = 16
EXPAND_THREADS = 256
#: The most shared memory a block of :func:`lora_expand_words` takes (the default limit).
EXPAND_SHARED_BYTES = 48 * 1024

EXPAND_KERNEL = r"""
#define LORA_COLUMNS 32
#define LORA_ROWS 16
#define LORA_THREADS 256
#define LORA_STRIDE (LORA_COLUMNS + 1)   // b's staged rows padded: a warp's 32 columns in 32 banks

// y[i, o] += sum_{k < W} products[i, (s - 1) W + k] * b[o, (s - 1) W + k] for each row i of adapter
// slot s = slots[i] > 0: the expand of a LoRA update from the shrunk products (one cuBLAS product),
// each row reading only its own slot's W columns. slots int32 [N], b bf16 bits [out, slots_count W],
// y float32 [N, out]. products float32: [N, slots_count W] (every slot's), or, with single_slot > 0
// (every adapter row of that slot), [N, W] (that slot's only; only its B is staged). Grid
// (ceil(out / LORA_COLUMNS), ceil(N / LORA_ROWS)) blocks of LORA_THREADS: a block stages its rows'
// products and its columns' b (transposed) in shared memory, then a warp takes 32 columns of one
// row at a time.
extern "C" __global__ void __launch_bounds__(LORA_THREADS) lora_expand_words(
    const float* __restrict__ products, const int* __restrict__ slots, const unsigned short* __restrict__ b,
    float* __restrict__ y, int rows, int out, int width, int slots_count, int single_slot) {
    DYNAMIC_SHARED;
    float* staged = reinterpret_cast<float*>(dynamic_shared);
    const int K = width * slots_count;                 // b's row
    const int P = single_slot > 0 ? width : K;         // products' row, and what is staged of b's
    const int first = single_slot > 0 ? (single_slot - 1) * width : 0;
    float* p = staged;                       // [LORA_ROWS][P]
    float* bt = staged + LORA_ROWS * P;      // [P][LORA_STRIDE]
    const int column0 = blockIdx.x * LORA_COLUMNS, row0 = blockIdx.y * LORA_ROWS;
    wait_for_producers();
    for (int index = threadIdx.x; index < LORA_ROWS * P; index += LORA_THREADS) {
        const int r = index / P, k = index - r * P;
        p[index] = row0 + r < rows ? products[(size_t)(row0 + r) * P + k] : 0.0f;
    }
    for (int index = threadIdx.x; index < LORA_COLUMNS * P; index += LORA_THREADS) {
        const int c = index / P, k = index - c * P;
        bt[k * LORA_STRIDE + c] = column0 + c < out ? bf16_bits(b[(size_t)(column0 + c) * K + first + k]) : 0.0f;
    }
    __syncthreads();
    allow_dependents();
    const int c = threadIdx.x % LORA_COLUMNS, column = column0 + c;
    for (int r = threadIdx.x / LORA_COLUMNS; r < LORA_ROWS; r += LORA_THREADS / LORA_COLUMNS) {
        const int row = row0 + r;
        if (row >= rows || column >= out) continue;
        const int slot = slots[row];
        if (slot <= 0 || (single_slot > 0 && slot != single_slot)) continue;
        const int offset = single_slot > 0 ? 0 : (slot - 1) * width;
        const float* pr = p + r * P + offset;
        const float* bc = bt + offset * LORA_STRIDE + c;
        float acc = 0.0f;
        for (int k = 0; k < width; ++k) acc += pr[k] * bc[k * LORA_STRIDE];
        y[(size_t)row * out + column] += acc;
    }
}
"""


def expand_shared_bytes(slots: int, width: int) -> int:
    """Shared memory of a block of :func:`lora_expand_words` for ``slots`` slots of ``width``
    (``G R``) columns each."""
    k = slots * width
    return 4 * k * (EXPAND_ROWS + EXPAND_COLUMNS + 1)


def expand_words_supported(slots: int, width: int) -> bool:
    """Whether :func:`lora_expand_words` serves ``slots`` slots of ``width`` columns (its staging
    fits a block's default shared memory)."""
    return expand_shared_bytes(slots, width) <= EXPAND_SHARED_BYTES


#: The kernels of :func:`source`'s module.
KERNEL_NAMES = ("lora_expand_words",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    from metrale.kernels.decode_gemv import HELPERS, INSTRUCTIONS

    return INSTRUCTIONS + DEPENDENT_LAUNCH + HELPERS + EXPAND_KERNEL


_expand_kernels: list[Any] = []


def lora_expand_words(products: DeviceArray, slots: DeviceArray, b: DeviceArray, y: DeviceArray, width: int,
                      stream: object = None, single_slot: int = 0) -> DeviceArray:
    """Add each row's LoRA update to ``y [N, out]`` (float32, in place) in CUDA C++: ``products [N,
    S W]`` float32 (every slot's shrunk products), ``slots [N]`` int32, ``b [out, S W]`` bf16 bits
    (:class:`~metrale.lora.LoraStack`), ``width`` = ``W``. One launch whatever the mix of slots.
    With ``single_slot`` (every adapter row of that slot: the step's route) ``products`` are
    ``[N, W]``, that slot's only, and only its ``B`` is read. :func:`expand_words_supported` says
    which sizes it takes."""
    op = "lora_linear"
    check_array(op, "products", products, np.float32, ndim=2)
    rows, k = products.shape
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "b", b, np.uint16, ndim=2)
    out = b.shape[0]
    check_array(op, "y", y, np.float32, (rows, out))
    if width <= 0 or b.shape[1] % width or k != (width if single_slot else b.shape[1]):
        raise KernelArgumentError(f"{op}: products of {k} columns and b of {b.shape[1]} are not whole slots of {width}"
                                  + (f" (one slot's: {width} columns)" if single_slot else ""))
    if not 0 <= single_slot <= b.shape[1] // width:
        raise KernelArgumentError(f"{op}: single_slot {single_slot} is not a slot of b")
    if not expand_words_supported(k // width, width):
        raise KernelArgumentError(f"{op}: {k // width} slots of {width} columns take more shared memory than a "
                                  "block has (expand_words_supported)")
    if not _expand_kernels:
        import cupy

        _expand_kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",))
                               .get_function("lora_expand_words"))
    if rows and out:
        launch(_expand_kernels[0], (-(-out // EXPAND_COLUMNS), -(-rows // EXPAND_ROWS)), (EXPAND_THREADS,),
               (products, slots, b, y, np.int32(rows), np.int32(out), np.int32(width), np.int32(b.shape[1] // width),
                np.int32(single_slot)),
               expand_shared_bytes(k // width, width), stream, dependent=False)
    return y
