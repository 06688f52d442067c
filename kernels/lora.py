"""LoRA on the GPU: every row's adapter update in one launch per step of the product, whatever
the mix of adapters in the batch (docs/lora.rst).

* a step of few rows (decode) shrinks in the projection's own product: the stack's extended
  weight holds every slot's ``A`` after the projection's rows, so one cuBLAS product gives each
  row's projection and its products with every slot's ``A``; :func:`lora_expand` (CUDA C++) then
  writes each row's output with its own slot's update (optionally SwiGLU's activation of it), in
  one launch whatever the mix of adapters, a block per tile of one slot's rows (the step's
  :func:`metrale.kernels.lora_tiles.adapter_tiles`, grouped on the host);
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
from metrale.kernels.lora_tiles import ADAPTER_TILE_ROWS

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

#: Output columns (a thread each) of a block of :func:`lora_expand`; the rows of a tile
#: (:data:`metrale.kernels.lora_tiles.ADAPTER_TILE_ROWS`), taken together; the shrunk products of a row it
#: stages in shared memory at a time.
EXPAND_COLUMNS = 128
EXPAND_ROWS = ADAPTER_TILE_ROWS
#: Whether the expand is launched as a programmatic dependent of the product before it (its
#: prologue -- reading its first tile, the bias and prefetching B, none of them another kernel's
#: output -- then overlaps that product's tail; all it reads of other kernels comes after
#: ``wait_for_producers()``). It shortens the adapted decode step (timings: docs/notes/lora-decode.rst).
EXPAND_DEPENDENT = True
EXPAND_SEGMENT = 256

EXPAND_KERNEL = r"""
#define LORA_COLUMNS 128
#ifndef LORA_ROWS
#define LORA_ROWS 8
#endif
#define LORA_SEGMENT 256

// Asks for the cache line at `address` ahead of its loads (nothing where there is no cache).
__device__ __forceinline__ void prefetch_line(const void* address) {
#if __CUDA_ARCH__ >= 700
    asm volatile("prefetch.global.L1 [%0];" :: "l"(address));
#endif
}

// ext float32 [N, out + K]: a product with a LoRA stack's extended weight (the projection's own
// `out` rows, then every slot's A rows, K = slots_count * width), tiles int32 [tile_count, 2 +
// LORA_ROWS] (metrale.kernels.lora_tiles.adapter_tiles: a slot, a row count, then that many rows of the slot;
// every row in one tile, the used tiles first, then tiles of no row), b bf16 bits [out, K]
// (block-diagonal per slot), bias float32 [out] or null. Each row i of slot s > 0 gets
// y[i, o] = ext[i, o] + bias[o] + sum_{k < width} ext[i, out + (s - 1) width + k] b[o, (s - 1) width + k]
// (the shrunk products rounded to bf16); a base-model row (s = 0) ext[i, o] + bias[o]. Written to
// y float32 [N, out]; or, with swiglu (out = 2 I: gate rows, then up rows), bf16(silu(y[i, o]) *
// y[i, I + o]) to act [N, I].
// Grid (ceil(columns / LORA_COLUMNS), P), LORA_COLUMNS threads: block (t, p) takes tiles p, p + P,
// ... for the output columns of tile t, a thread a column (of y, or of act): the tile's products
// staged in shared memory (LORA_SEGMENT of a row at a time), each 8 columns of the thread's slice
// of its slot's B loaded once (16 bytes) for all of its rows, the loads of several such steps in
// flight. The first tile, read before the wait (the tiles are no kernel's output), tells which
// B columns to ask for while the product ahead finishes; after the wait, one round trip to the
// products, then the arithmetic.
extern "C" __global__ void __launch_bounds__(LORA_COLUMNS) lora_expand(
    const float* __restrict__ ext, const int* __restrict__ tiles, int tile_count,
    const unsigned short* __restrict__ b, const float* __restrict__ bias, float* __restrict__ y,
    unsigned short* __restrict__ act, int out, int width, int slots_count, int swiglu, int words) {
    __shared__ float staged[LORA_ROWS * LORA_SEGMENT];
    const int K = width * slots_count, ld = out + K;
    const int column = blockIdx.x * LORA_COLUMNS + threadIdx.x;
    const int columns = swiglu ? out / 2 : out;
    const bool active = column < columns;
    const int up = column + out / 2;
    const float bias_column = bias && active ? bias[column] : 0.0f;
    const float bias_up = bias && swiglu && active ? bias[up] : 0.0f;
    bool waited = false;
    for (int t = blockIdx.y; t < tile_count; t += gridDim.y) {
        const int* tile = tiles + (size_t)t * (2 + LORA_ROWS);
        const int slot = tile[0], taken = min(tile[1], LORA_ROWS);
        if (taken <= 0) break;   // the same for the whole block: the used tiles come first
        const int first = slot > 0 ? (slot - 1) * width : 0;
        const unsigned short* b_column = b + (size_t)(active ? column : 0) * K + first;
        const unsigned short* b_up = b + (size_t)(active && swiglu ? up : 0) * K + first;
        if (!waited) {   // b is no kernel's output: its lines come while the product ahead ends
            if (slot > 0 && active) {
                for (int k = 0; k < width; k += 64) {
                    prefetch_line(b_column + k);
                    if (swiglu) prefetch_line(b_up + k);
                }
                prefetch_line(b_column + width - 1);
                if (swiglu) prefetch_line(b_up + width - 1);
            }
            wait_for_producers();
            waited = true;
        }
        float value[LORA_ROWS], up_value[LORA_ROWS];
        #pragma unroll
        for (int r = 0; r < LORA_ROWS; ++r) {
            const bool here = active && r < taken;
            const float* x = ext + (size_t)(here ? tile[2 + r] : 0) * ld;
            value[r] = here ? x[column] + bias_column : 0.0f;
            up_value[r] = here && swiglu ? x[up] + bias_up : 0.0f;
        }
        for (int segment = 0; slot > 0 && segment < width; segment += LORA_SEGMENT) {
            const int span = min(LORA_SEGMENT, width - segment);
            for (int i = threadIdx.x; i < taken * span; i += LORA_COLUMNS) {
                const int r = i / span, k = i - r * span;
                staged[r * LORA_SEGMENT + k] = bf16_bits(to_bf16(ext[(size_t)tile[2 + r] * ld + out + first + segment + k]));
            }
            __syncthreads();
            if (active && words) {   // width a multiple of 8; b's rows 16-byte aligned
                #pragma unroll 4
                for (int k = 0; k < span; k += 8) {
                    const uint4 w = __ldg(reinterpret_cast<const uint4*>(b_column + segment + k));
                    const uint4 u = swiglu ? __ldg(reinterpret_cast<const uint4*>(b_up + segment + k))
                                           : make_uint4(0, 0, 0, 0);
                    #pragma unroll
                    for (int r = 0; r < LORA_ROWS; ++r) {
                        if (r >= taken) break;
                        const float* p = staged + r * LORA_SEGMENT + k;
                        value[r] += p[0] * bf16_low(w.x) + p[1] * bf16_high(w.x) + p[2] * bf16_low(w.y)
                                  + p[3] * bf16_high(w.y) + p[4] * bf16_low(w.z) + p[5] * bf16_high(w.z)
                                  + p[6] * bf16_low(w.w) + p[7] * bf16_high(w.w);
                        up_value[r] += p[0] * bf16_low(u.x) + p[1] * bf16_high(u.x) + p[2] * bf16_low(u.y)
                                     + p[3] * bf16_high(u.y) + p[4] * bf16_low(u.z) + p[5] * bf16_high(u.z)
                                     + p[6] * bf16_low(u.w) + p[7] * bf16_high(u.w);
                    }
                }
            } else if (active) {
                for (int k = 0; k < span; ++k) {
                    const float w = bf16_bits(__ldg(b_column + segment + k));
                    const float u = swiglu ? bf16_bits(__ldg(b_up + segment + k)) : 0.0f;
                    #pragma unroll
                    for (int r = 0; r < LORA_ROWS; ++r) {
                        if (r >= taken) break;
                        value[r] += staged[r * LORA_SEGMENT + k] * w;
                        up_value[r] += staged[r * LORA_SEGMENT + k] * u;
                    }
                }
            }
            __syncthreads();
        }
        #pragma unroll
        for (int r = 0; r < LORA_ROWS; ++r) {
            if (!active || r >= taken) break;
            const size_t at = tile[2 + r];
            if (swiglu) {
                const float v = value[r];
                act[at * columns + column] = to_bf16(v / (1.0f + expf(-v)) * up_value[r]);
            } else {
                y[at * out + column] = value[r];
            }
        }
    }
    allow_dependents();
}
"""


#: The kernels of :func:`source`'s module.
KERNEL_NAMES = ("lora_expand",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    from metrale.kernels._words import HELPERS
    from metrale.kernels.decode_gemv import INSTRUCTIONS

    return INSTRUCTIONS + DEPENDENT_LAUNCH + HELPERS + EXPAND_KERNEL


#: The compiled expand.
_expand_kernels: dict[int, Any] = {}


def lora_expand(ext: DeviceArray, tiles: DeviceArray, b: DeviceArray, width: int, out: DeviceArray,
                bias: DeviceArray | None = None, swiglu: bool = False, stream: object = None) -> DeviceArray:
    """Each row's LoRA update added to its product with a stack's extended weight, in CUDA C++
    (one launch whatever the mix of slots): ``ext [N, M + S W]`` float32 (the projection's ``M``
    columns, then every slot's shrunk products), ``tiles [T, 2 + 8]`` int32 (the rows grouped
    by slot, :func:`metrale.kernels.lora_tiles.adapter_tiles`), ``b [M, S W]`` bf16 bits
    (:class:`~metrale.layers.lora_stacks.LoraStack`), ``width`` = ``W``, ``bias [M]`` float32 or None. Writes
    ``out [N, M]`` float32; with ``swiglu`` (``M = 2 I``: gate columns, then up columns)
    ``silu(gate) * up`` to ``out [N, I]`` bf16 bits."""
    op = "lora_expand"
    check_array(op, "ext", ext, np.float32, ndim=2)
    rows, columns = ext.shape
    check_array(op, "tiles", tiles, np.int32, (None, 2 + EXPAND_ROWS))
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
    if tiles.shape[0] < -(-rows // EXPAND_ROWS):
        raise KernelArgumentError(f"{op}: {tiles.shape[0]} tiles cannot hold {rows} rows")
    kernel = _expand_kernels.get(EXPAND_ROWS)
    if kernel is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17", f"-DLORA_ROWS={EXPAND_ROWS}"))
        kernel = _expand_kernels[EXPAND_ROWS] = module.get_function("lora_expand")
    # 16-byte loads of b's rows.
    words = width % 8 == 0 and k % 8 == 0 and b.data.ptr % 16 == 0
    if rows and m:
        null = np.uint64(0)
        launch(kernel, (-(-(m // 2 if swiglu else m) // EXPAND_COLUMNS), -(-rows // EXPAND_ROWS)), (EXPAND_COLUMNS,),
               (ext, tiles, np.int32(tiles.shape[0]), b, null if bias is None else bias, null if swiglu else out,
                out if swiglu else null, np.int32(m), np.int32(width), np.int32(k // width), np.int32(swiglu),
                np.int32(words)),
               0, stream, dependent=EXPAND_DEPENDENT)
    return out
