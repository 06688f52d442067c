"""A bf16 matrix product whose every output element is computed the same way whatever the number
of rows: the linear layers' product under ``batch_invariant=True`` on the GPU (CUDA C++ with
``mma.sync``, compiled by NVRTC through CuPy).

``y [M, N] = x [M, K] @ W [N, K]^T (+ bias)``, bf16 in, float32 sums and out. Under the mode,
rows the decode kernel takes (:func:`metrale.kernels.decode_gemv.supports`) go through
:func:`metrale.kernels.decode_gemv.decode_gemv` as it is (its plain prologue, at the speed the
default mode decodes with; :func:`metrale.ops.selection.cuda_batch_invariant_kernels` binds both);
more rows go through this module's tiled kernel, which sums every element in exactly the decode
kernel's order, so a row's bits never depend on which of the two took it nor on the rows beside
it:

* the same ``m16n8k16`` products with the same operands: sixteen weight columns as the product's
  rows (A), eight of ``x``'s rows as its columns (B), each element of a product computed by the
  tensor cores from that element's row and column alone;
* the same sixteen k a product: ``K`` in steps of 32, each step two products, the first over
  ``k0 + 8q + {0..3}`` for ``q = 0..3`` and the second over ``k0 + 8q + {4..7}``
  (:func:`step_groups`), placed at the same positions of the fragments (lane ``(g, q)`` holds the
  16 bytes ``k0 + 8q .. k0 + 8q + 7`` of a column and of a row);
* the same split of ``K``: the decode kernel's :func:`~metrale.kernels.decode_gemv.plan` for the
  weight's column count and the device (never the rows) cuts ``K`` into :func:`split_steps` steps
  a slice; each slice's products accumulate from zero in increasing order, and the slices' sums
  are added in order (the decode kernel adds its warps' slices so) before the bias.

The tiled kernel: blocks of 128 weight columns by 128 rows, 8 warps of 64 columns by 32 rows,
stages of 64 k copied into shared memory with ``cp.async`` (three in flight), each 32-k step of a
column or row kept as 64 contiguous bytes so that a quarter-warp's fragment loads read 128
contiguous bytes.

:func:`invariant_linear_reference` is the NumPy model of that order (float32 sums of 16-term
products, the slices added in order); the emulated tests compare the tiled kernel with it and
with the decode kernel bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels import decode_gemv
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import launch
from metrale.kernels._tensor_cores import MMA_BF16, STAGED_COPIES
from metrale.kernels._words import aligned

#: Weight columns and rows of ``x`` a block computes; k a stage holds; stages in flight.
BLOCK_COLUMNS = 128
BLOCK_ROWS = 128
STAGE_K = 64
STAGES = 3
THREADS = 256
#: Dynamic shared memory of a block: every stage's weight and row tiles.
SHARED_BYTES = STAGES * (BLOCK_COLUMNS + BLOCK_ROWS) * STAGE_K * 2


KERNEL = r"""
#define TILED_COLUMNS 128
#define TILED_ROWS 128
#define TILED_STAGE_STEPS 2      // 32-k steps a stage
#define TILED_STAGES 3
#define TILED_THREADS 256

// Shared memory of a stage: the weight tile [TILED_STAGE_STEPS][TILED_COLUMNS][4 chunks], then the row
// tile [TILED_STAGE_STEPS][TILED_ROWS][4 chunks]; a chunk is 16 bytes, 8 k.
#define TILED_STAGE_CHUNKS (TILED_STAGE_STEPS * (TILED_COLUMNS + TILED_ROWS) * 4)

// Copy stage `stage_k` (k stage_k .. stage_k + 63) of the block's weight columns and rows into
// shared stage `slot`: thread i copies chunks i, i + TILED_THREADS, ... of each tile, chunk c being
// step c / (4 * lines), line (c / 4) % lines, chunk c % 4 of that line's step; lines past N or M
// and steps past K are zeros.
__device__ __forceinline__ void tiled_copy_stage(uint4* shared, int slot, const unsigned short* __restrict__ w,
                                           const unsigned short* __restrict__ x, int column_base, int row_base,
                                           int stage_k, int M, int N, int K) {
    uint4* weights = shared + slot * TILED_STAGE_CHUNKS;
    uint4* rows = weights + TILED_STAGE_STEPS * TILED_COLUMNS * 4;
#pragma unroll
    for (int i = threadIdx.x; i < TILED_STAGE_STEPS * TILED_COLUMNS * 4; i += TILED_THREADS) {
        const int step = i / (4 * TILED_COLUMNS), line = (i / 4) % TILED_COLUMNS, chunk = i % 4;
        const int column = column_base + line, k = stage_k + 32 * step + 8 * chunk;
        const bool valid = column < N && k < K;
        copy_16(shared_address(weights + i), w + (valid ? (size_t)column * K + k : 0), valid);
    }
#pragma unroll
    for (int i = threadIdx.x; i < TILED_STAGE_STEPS * TILED_ROWS * 4; i += TILED_THREADS) {
        const int step = i / (4 * TILED_ROWS), line = (i / 4) % TILED_ROWS, chunk = i % 4;
        const int row = row_base + line, k = stage_k + 32 * step + 8 * chunk;
        const bool valid = row < M && k < K;
        copy_16(shared_address(rows + i), x + (valid ? (size_t)row * K + k : 0), valid);
    }
}

// out[m, n] = sum over the slices of K in order of (the slice's products from zero, in order)
// (+ bias[n]), float32. x: bf16 bits [M, K]; w: bf16 bits [N, K]; K a multiple of 32; slices of
// `slice_steps` steps of 32 k. Grid (ceil(N / 128), ceil(M / 128)), TILED_THREADS threads; warp w takes
// columns 64 (w % 2) .. + 63 and rows 32 (w / 2) .. + 31 of the block. FOLD: more than one slice.
template <bool FOLD>
__global__ void __launch_bounds__(TILED_THREADS, 1) invariant_linear_tiled(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, const float* __restrict__ bias,
    float* __restrict__ out, int M, int N, int K, int slice_steps) {
    DYNAMIC_SHARED;
    uint4* shared = reinterpret_cast<uint4*>(dynamic_shared);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const int column_base = blockIdx.x * TILED_COLUMNS, row_base = blockIdx.y * TILED_ROWS;
    const int warp_columns = 64 * (warp % 2), warp_rows = 32 * (warp / 2);
    const int steps = K / 32, stages = (steps + TILED_STAGE_STEPS - 1) / TILED_STAGE_STEPS;

    // acc[n tile][row tile]: c0, c1 (column g, rows 2q, 2q + 1), c2, c3 (column g + 8).
    float acc[4][4][4];
    float total[FOLD ? 4 : 1][FOLD ? 4 : 1][4];
    bool folded = false;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < TILED_STAGES - 1; ++s) {
        if (s < stages) tiled_copy_stage(shared, s, w, x, column_base, row_base, s * 32 * TILED_STAGE_STEPS, M, N, K);
        commit_copies();
    }
    for (int stage = 0; stage < stages; ++stage) {
        wait_copies<TILED_STAGES - 2>();
        __syncthreads();   // the stage has landed for every thread; the slot refilled next is read by none
        const int next = stage + TILED_STAGES - 1;
        if (next < stages)
            tiled_copy_stage(shared, next % TILED_STAGES, w, x, column_base, row_base, next * 32 * TILED_STAGE_STEPS, M, N, K);
        commit_copies();
        const uint4* weights = shared + (stage % TILED_STAGES) * TILED_STAGE_CHUNKS;
        const uint4* rows = weights + TILED_STAGE_STEPS * TILED_COLUMNS * 4;
#pragma unroll
        for (int j = 0; j < TILED_STAGE_STEPS; ++j) {
            const int step = stage * TILED_STAGE_STEPS + j;
            if (step >= steps) break;   // block-uniform
            if (FOLD && step > 0 && step % slice_steps == 0) {   // a slice ends: add its sums in order
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            float& sum = total[FOLD ? a : 0][FOLD ? b : 0][i];
                            sum = folded ? sum + acc[a][b][i] : acc[a][b][i];
                            acc[a][b][i] = 0.0f;
                        }
                folded = true;
            }
            uint4 upper[4], lower[4], in[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                upper[a] = weights[(j * TILED_COLUMNS + warp_columns + 16 * a + g) * 4 + q];
                lower[a] = weights[(j * TILED_COLUMNS + warp_columns + 16 * a + g + 8) * 4 + q];
            }
#pragma unroll
            for (int b = 0; b < 4; ++b) in[b] = rows[(j * TILED_ROWS + warp_rows + 8 * b + g) * 4 + q];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const unsigned a0[4] = {upper[a].x, lower[a].x, upper[a].y, lower[a].y};
                const unsigned a1[4] = {upper[a].z, lower[a].z, upper[a].w, lower[a].w};
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const unsigned b0[2] = {in[b].x, in[b].y};
                    mma_16x8x16(acc[a][b], a0, b0);
                    const unsigned b1[2] = {in[b].z, in[b].w};
                    mma_16x8x16(acc[a][b], a1, b1);
                }
            }
        }
    }
    wait_copies<0>();

#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int column = column_base + warp_columns + 16 * a + g + (i >= 2 ? 8 : 0);
                const int row = row_base + warp_rows + 8 * b + 2 * q + (i & 1);
                if (row < M && column < N) {
                    float value = acc[a][b][i];
                    if (FOLD && folded) value = total[FOLD ? a : 0][FOLD ? b : 0][i] + value;
                    if (bias != nullptr) value += bias[column];
                    out[(size_t)row * N + column] = value;
                }
            }
        }
    }
}
"""


def split_of(columns: int, multiprocessors: int) -> int:
    """The decode kernel's split of ``K`` (warps sharing a tile of 16 columns) for a weight of
    ``columns`` columns on a device of ``multiprocessors``: from the weight and the device alone."""
    return decode_gemv.plan(1, 32, columns, decode_gemv.PLAIN, multiprocessors)[0]


def split_steps(inner: int, split: int) -> int:
    """Steps of 32 k a slice of ``K`` holds (the decode kernel's slice of ``4 * ceil(chunks / 4 /
    split)`` chunks of 8 k); the last slice may be shorter, later ones empty."""
    return -(-(inner // 32) // split)


def step_groups(start: int, stop: int) -> list[np.ndarray]:
    """The k of each product of ``[start, stop)`` (both multiples of 32), in the order the kernels
    add them: per step of 32 (``k0``), ``k0 + 8q + {0..3}`` then ``k0 + 8q + {4..7}`` over
    ``q = 0..3``."""
    quads = 8 * np.arange(4)[:, None]
    groups = []
    for k in range(start, stop, 32):
        groups += [(k + quads + np.arange(4)).ravel(), (k + quads + 4 + np.arange(4)).ravel()]
    return groups


def invariant_linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, *,
                               split: int = 1) -> np.ndarray:
    """float32 ``[M, N]``: the kernels' order of sums for a split of ``K`` in ``split`` slices --
    each product's sixteen terms (:func:`step_groups`) summed in float64 and rounded to float32
    (the tensor cores' exact products, one rounding a product; the hardware rounds within a product
    in its own way, so this is the order, not the bits), the products added in order in float32
    per slice, the slices in order, then the bias."""
    x = np.asarray(x, dtype=np.float32)
    weight = np.asarray(weight, dtype=np.float32)
    m, k = x.shape
    n = weight.shape[0]
    length = 32 * split_steps(k, split)
    total = np.zeros((m, n), dtype=np.float32)
    for start in range(0, k, length):
        partial = np.zeros((m, n), dtype=np.float32)
        for group in step_groups(start, min(k, start + length)):
            products = x[:, group].astype(np.float64) @ weight[:, group].astype(np.float64).T
            partial = (partial + products.astype(np.float32)).astype(np.float32)
        total = partial if start == 0 else (total + partial).astype(np.float32)
    if bias is not None:
        total = (total + np.asarray(bias, dtype=np.float32)).astype(np.float32)
    return total


def supports(k: int) -> bool:
    """Inner sizes the kernels take: a positive multiple of 32 (the decode kernel's words)."""
    return k > 0 and k % 32 == 0


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return MMA_BF16 + STAGED_COPIES + KERNEL


_module: list[Any] = []


def _function(fold: bool) -> Any:
    if not _module:
        import cupy

        _module.append(cupy.RawModule(code=source(), options=("--std=c++17",),
                                      name_expressions=[f"invariant_linear_tiled<{b}>" for b in ("true", "false")]))
    function = _module[0].get_function(f"invariant_linear_tiled<{'true' if fold else 'false'}>")
    if function.max_dynamic_shared_size_bytes < SHARED_BYTES:
        function.max_dynamic_shared_size_bytes = SHARED_BYTES
    return function


def invariant_linear(x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: Any,
                     bias: DeviceArray | None = None, *, multiprocessors: int | None = None) -> DeviceArray:
    """``out [M, N] <- x [M, K] @ weight [N, K]^T (+ bias)`` through the tiled kernel: x and weight
    bf16 bits (uint16), out and bias float32; every element summed in the order of
    :func:`metrale.kernels.decode_gemv.decode_gemv`'s plain product with the split
    :func:`split_of` gives for ``multiprocessors`` (the device's, by default), whatever ``M``."""
    op = "invariant_linear"
    check_array(op, "x", x, np.uint16, ndim=2)
    m, k = x.shape
    check_array(op, "weight", weight, np.uint16, ndim=2)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise KernelArgumentError(f"{op}: weight has shape {list(weight.shape)}, not [N, {k}]")
    if not supports(k):
        raise KernelArgumentError(f"{op}: the inner size must be a positive multiple of 32, got {k}")
    check_array(op, "out", out, np.float32, (m, n))
    if bias is not None:
        check_array(op, "bias", bias, np.float32, (n,))
    for name, array in (("x", x), ("weight", weight), ("out", out)):
        if not array.flags.c_contiguous or not aligned(array):
            raise KernelArgumentError(f"{op}: {name} must be contiguous and start at a 16-byte boundary")
    if m == 0 or n == 0:
        return out
    split = split_of(n, decode_gemv.multiprocessor_count() if multiprocessors is None else multiprocessors)
    launch(_function(split > 1), (-(-n // BLOCK_COLUMNS), -(-m // BLOCK_ROWS)), (THREADS,),
           (x, weight, bias if bias is not None else np.uint64(0), out, np.int32(m), np.int32(n), np.int32(k),
            np.int32(split_steps(k, split))), SHARED_BYTES, stream, dependent=False)
    return out
