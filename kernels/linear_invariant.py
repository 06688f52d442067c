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

The tiled kernel: blocks of warps, each warp a few tiles of 16 weight columns by 8 rows, stages
of 64 k copied into shared memory with ``cp.async``, each 32-k step of a column or row kept as 64
contiguous bytes so that a quarter-warp's fragment loads read 128 contiguous bytes. Three tilings
(:data:`NARROW`, :data:`WIDE`, :data:`FOLDED`): few rows take blocks of one slice of ``K`` each, their sums added
in order by a second kernel (:func:`partial_shape`'s workspace), so that a decode batch still
spreads over the GPU -- a ``K`` of one slice (wide weights) straight into the output, with no
workspace and no second kernel; prompts take larger blocks that sum every slice themselves (the
wide tiling for a ``K`` of one slice, the folded one for several).

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

#: The two tilings of the kernel: ``(warps along the columns, warps along the rows, 16-column
#: tiles a warp, 8-row tiles a warp, stages in shared memory)``. NARROW (64 columns by 32 rows a
#: block) is for few rows: each block sums one slice of K (the grid's third dimension), its
#: float32 partial sums written apart and added in the slices' order by a second kernel, so that a
#: decode batch's blocks cover the GPU (a ``K`` of one slice goes straight to the output); WIDE
#: (128 columns by 64 rows) is for prompts: a block sums every slice itself, adding each to the
#: total as it ends.
NARROW = (4, 1, 1, 4, 3)
WIDE = (4, 2, 2, 4, 3)
#: The tiling of prompts whose ``K`` has several slices (128 columns by 64 rows, four warps of 64
#: columns by 32 rows): a block keeps a total beside each slice's sums, and fewer, larger warp
#: tiles read fewer fragments from shared memory a product than :data:`WIDE`'s.
FOLDED = (2, 2, 4, 4, 3)
#: The most rows the narrow tiling takes (two blocks of rows).
NARROW_ROWS = 64
STAGE_K = 64
SUM_THREADS = 256


def tile_shape(tiling: tuple[int, ...]) -> tuple[int, int, int]:
    """``(columns, rows, threads)`` of a block of ``tiling``."""
    warps_n, warps_m, column_tiles, row_tiles, _ = tiling
    return warps_n * 16 * column_tiles, warps_m * 8 * row_tiles, 32 * warps_n * warps_m


def shared_bytes(tiling: tuple[int, ...]) -> int:
    """Dynamic shared memory of a block of ``tiling``: every stage's weight and row tiles."""
    columns, rows, _ = tile_shape(tiling)
    return tiling[4] * (columns + rows) * STAGE_K * 2


KERNEL = r"""
#define INVARIANT_STAGE_STEPS 2      // 32-k steps a stage

// Copy stage `stage` of the block's steps (k of steps first_step + 2 stage and the next) into
// shared slot `slot`: the weight tile [2 steps][COLUMNS lines][4 chunks], then the row tile
// [2 steps][ROWS lines][4 chunks], a chunk 16 bytes (8 k); chunk c of a tile is step c / (4 lines),
// line (c / 4) % lines, chunk c % 4 (consecutive threads: 64 contiguous bytes of a line). Lines
// past N or M and steps from end_step on are zeros.
template <int COLUMNS, int ROWS, int BLOCK_THREADS>
__device__ __forceinline__ void invariant_copy_stage(uint4* shared, int slot, const unsigned short* __restrict__ w,
                                                     const unsigned short* __restrict__ x, int column_base,
                                                     int row_base, int first_step, int end_step, int M, int N, int K) {
    uint4* weights = shared + slot * INVARIANT_STAGE_STEPS * (COLUMNS + ROWS) * 4;
    uint4* rows = weights + INVARIANT_STAGE_STEPS * COLUMNS * 4;
#pragma unroll
    for (int i = threadIdx.x; i < INVARIANT_STAGE_STEPS * COLUMNS * 4; i += BLOCK_THREADS) {
        const int step = first_step + i / (4 * COLUMNS), line = (i / 4) % COLUMNS, chunk = i % 4;
        const int column = column_base + line;
        const bool valid = column < N && step < end_step;
        copy_16(shared_address(weights + i), w + (valid ? (size_t)column * K + 32 * step + 8 * chunk : 0), valid);
    }
#pragma unroll
    for (int i = threadIdx.x; i < INVARIANT_STAGE_STEPS * ROWS * 4; i += BLOCK_THREADS) {
        const int step = first_step + i / (4 * ROWS), line = (i / 4) % ROWS, chunk = i % 4;
        const int row = row_base + line;
        const bool valid = row < M && step < end_step;
        copy_16(shared_address(rows + i), x + (valid ? (size_t)row * K + 32 * step + 8 * chunk : 0), valid);
    }
}

// The products of x [M, K] and w [N, K] (bf16 bits, K a multiple of 32) in the decode GEMV's
// order: per element, each slice of `slice_steps` steps of 32 k summed from zero in increasing
// order, two m16n8k16 products a step (16 weight columns the product's rows, 8 of x's rows its
// columns; lane (g, q) holds k0 + 8q .. k0 + 8q + 7 of its column or row: the first product its
// words .x .y, the second .z .w). Warp w takes column tiles (w % WARPS_N) * COLUMN_TILES .. and row
// tiles (w / WARPS_N) * ROW_TILES .. of the block; STAGES stages of 64 k in flight.
// SLICED: grid (ceil(N / COLUMNS), ceil(M / ROWS), slices); block z sums slice z alone and writes
// its sums to out + z * M * N (float32 [slices, M, N], no bias). Otherwise grid (ceil(N / COLUMNS),
// ceil(M / ROWS)); the block sums every slice, adds each to the total as it ends (FOLD: more than
// one slice) and writes out [M, N] float32 = total (+ bias[n]).
template <int WARPS_N, int WARPS_M, int COLUMN_TILES, int ROW_TILES, int STAGES, bool SLICED, bool FOLD>
__global__ void __launch_bounds__(32 * WARPS_N * WARPS_M) invariant_linear_tiled(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, const float* __restrict__ bias,
    float* __restrict__ out, int M, int N, int K, int slice_steps) {
    constexpr int BLOCK_THREADS = 32 * WARPS_N * WARPS_M;
    constexpr int COLUMNS = WARPS_N * 16 * COLUMN_TILES, ROWS = WARPS_M * 8 * ROW_TILES;
    constexpr int STAGE_CHUNKS = INVARIANT_STAGE_STEPS * (COLUMNS + ROWS) * 4;
    DYNAMIC_SHARED;
    uint4* shared = reinterpret_cast<uint4*>(dynamic_shared);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const int column_base = blockIdx.x * COLUMNS, row_base = blockIdx.y * ROWS;
    const int warp_columns = 16 * COLUMN_TILES * (warp % WARPS_N), warp_rows = 8 * ROW_TILES * (warp / WARPS_N);
    const int steps = K / 32;
    const int first_step = SLICED ? min(steps, (int)blockIdx.z * slice_steps) : 0;
    const int end_step = SLICED ? min(steps, first_step + slice_steps) : steps;
    const int stages = (end_step - first_step + INVARIANT_STAGE_STEPS - 1) / INVARIANT_STAGE_STEPS;

    // acc[column tile][row tile]: c0, c1 (column g, rows 2q, 2q + 1), c2, c3 (column g + 8).
    float acc[COLUMN_TILES][ROW_TILES][4];
    float total[FOLD ? COLUMN_TILES : 1][FOLD ? ROW_TILES : 1][4];
    bool folded = false;
#pragma unroll
    for (int a = 0; a < COLUMN_TILES; ++a)
#pragma unroll
        for (int b = 0; b < ROW_TILES; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < stages)
            invariant_copy_stage<COLUMNS, ROWS, BLOCK_THREADS>(shared, s, w, x, column_base, row_base,
                                                         first_step + s * INVARIANT_STAGE_STEPS, end_step, M, N, K);
        commit_copies();
    }
    for (int stage = 0; stage < stages; ++stage) {
        wait_copies<STAGES - 2>();
        __syncthreads();   // the stage has landed for every thread; the slot refilled next is read by none
        const int next = stage + STAGES - 1;
        if (next < stages)
            invariant_copy_stage<COLUMNS, ROWS, BLOCK_THREADS>(shared, next % STAGES, w, x, column_base, row_base,
                                                         first_step + next * INVARIANT_STAGE_STEPS, end_step, M, N, K);
        commit_copies();
        const uint4* weights = shared + (stage % STAGES) * STAGE_CHUNKS;
        const uint4* rows = weights + INVARIANT_STAGE_STEPS * COLUMNS * 4;
#pragma unroll
        for (int j = 0; j < INVARIANT_STAGE_STEPS; ++j) {
            const int step = first_step + stage * INVARIANT_STAGE_STEPS + j;
            if (step >= end_step) break;   // block-uniform
            if (FOLD && step > 0 && step % slice_steps == 0) {   // a slice ends: add its sums in order
#pragma unroll
                for (int a = 0; a < COLUMN_TILES; ++a)
#pragma unroll
                    for (int b = 0; b < ROW_TILES; ++b)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            float& sum = total[FOLD ? a : 0][FOLD ? b : 0][i];
                            sum = folded ? sum + acc[a][b][i] : acc[a][b][i];
                            acc[a][b][i] = 0.0f;
                        }
                folded = true;
            }
            uint4 upper[COLUMN_TILES], lower[COLUMN_TILES], in[ROW_TILES];
#pragma unroll
            for (int a = 0; a < COLUMN_TILES; ++a) {
                upper[a] = weights[(j * COLUMNS + warp_columns + 16 * a + g) * 4 + q];
                lower[a] = weights[(j * COLUMNS + warp_columns + 16 * a + g + 8) * 4 + q];
            }
#pragma unroll
            for (int b = 0; b < ROW_TILES; ++b) in[b] = rows[(j * ROWS + warp_rows + 8 * b + g) * 4 + q];
#pragma unroll
            for (int a = 0; a < COLUMN_TILES; ++a) {
                const unsigned a0[4] = {upper[a].x, lower[a].x, upper[a].y, lower[a].y};
                const unsigned a1[4] = {upper[a].z, lower[a].z, upper[a].w, lower[a].w};
#pragma unroll
                for (int b = 0; b < ROW_TILES; ++b) {
                    const unsigned b0[2] = {in[b].x, in[b].y};
                    mma_16x8x16(acc[a][b], a0, b0);
                    const unsigned b1[2] = {in[b].z, in[b].w};
                    mma_16x8x16(acc[a][b], a1, b1);
                }
            }
        }
    }
    wait_copies<0>();

    float* target = SLICED ? out + (size_t)blockIdx.z * M * N : out;
#pragma unroll
    for (int a = 0; a < COLUMN_TILES; ++a) {
#pragma unroll
        for (int b = 0; b < ROW_TILES; ++b) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int column = column_base + warp_columns + 16 * a + g + (i >= 2 ? 8 : 0);
                const int row = row_base + warp_rows + 8 * b + 2 * q + (i & 1);
                if (row < M && column < N) {
                    float value = acc[a][b][i];
                    if (FOLD && folded) value = total[FOLD ? a : 0][FOLD ? b : 0][i] + value;
                    if (!SLICED && bias != nullptr) value += bias[column];
                    target[(size_t)row * N + column] = value;
                }
            }
        }
    }
}

// out[m, n] = partial[0, m, n] + partial[1, m, n] + ... in order (+ bias[n]): the decode GEMV's
// sum of its warps' slices. A thread an element.
__global__ void invariant_linear_sum(const float* __restrict__ partial, const float* __restrict__ bias,
                                     float* __restrict__ out, int M, int N, int slices) {
    const size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= (size_t)M * N) return;
    float sum = partial[index];
    for (int s = 1; s < slices; ++s) sum += partial[(size_t)s * M * N + index];
    if (bias != nullptr) sum += bias[index % N];
    out[index] = sum;
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


def kernel_name(tiling: tuple[int, ...], sliced: bool, fold: bool) -> str:
    """The C++ name of one instantiation of ``invariant_linear_tiled``."""
    flags = ", ".join("true" if flag else "false" for flag in (sliced, fold))
    return f"invariant_linear_tiled<{', '.join(map(str, tiling))}, {flags}>"


#: The instantiations the launcher takes: the narrow tiling sliced and whole (a ``K`` of one slice,
#: written straight to the output), the folded one and the wide one (a ``K`` of one slice).
INSTANTIATIONS = (kernel_name(NARROW, True, False), kernel_name(NARROW, False, False),
                  kernel_name(FOLDED, False, True), kernel_name(WIDE, False, False))

_modules: dict[str, Any] = {}


def _function(name: str) -> Any:
    """The compiled function ``name``: the launcher's instantiations and the sum in one module,
    another tiling's in a module of its own."""
    key = name if name not in (*INSTANTIATIONS, "invariant_linear_sum") else ""
    if key not in _modules:
        import cupy

        names = [name] if key else [*INSTANTIATIONS, "invariant_linear_sum"]
        _modules[key] = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=names)
    return _modules[key].get_function(name)


def check_tiling(tiling: tuple[int, ...]) -> None:
    """Raise :class:`~metrale.errors.KernelArgumentError` for a tiling the kernel cannot take: five
    positive integers, at most 1,024 threads a block, at least two stages, the stages within the
    227 KiB of shared memory a block may have."""
    if (len(tiling) != 5 or not all(isinstance(value, int) and value > 0 for value in tiling) or tiling[4] < 2
            or tile_shape(tiling)[2] > 1024 or shared_bytes(tiling) > 227 * 1024):
        raise KernelArgumentError(f"invariant_linear: tiling {tiling!r} is not (warps along the columns, warps along "
                                  "the rows, column tiles, row tiles, stages >= 2) within 1,024 threads and 227 KiB")


def partial_shape(rows: int, columns: int, multiprocessors: int) -> tuple[int, int, int] | None:
    """The float32 workspace ``[slices, rows, columns]`` a product of ``rows`` rows needs (the
    narrow tiling's slices' sums), None where it needs none (more rows than the narrow tiling takes,
    or a ``K`` of one slice, whose sums go straight to the output)."""
    split = split_of(columns, multiprocessors)
    return (split, rows, columns) if 0 < rows <= NARROW_ROWS and split > 1 else None


def invariant_linear(x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: Any,
                     bias: DeviceArray | None = None, *, partial: DeviceArray | None = None,
                     multiprocessors: int | None = None, tiling: tuple[int, ...] | None = None) -> DeviceArray:
    """``out [M, N] <- x [M, K] @ weight [N, K]^T (+ bias)`` through the tiled kernel: x and weight
    bf16 bits (uint16), out and bias float32; every element summed in the order of
    :func:`metrale.kernels.decode_gemv.decode_gemv`'s plain product with the split
    :func:`split_of` gives for ``multiprocessors`` (the device's, by default), whatever ``M``.
    ``partial``: float32 of :func:`partial_shape` where that is not None. ``tiling`` replaces
    :data:`NARROW`, :data:`WIDE` or :data:`FOLDED` (for sweeps: every tiling sums in the same order)."""
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
    multiprocessors = decode_gemv.multiprocessor_count() if multiprocessors is None else multiprocessors
    workspace = partial_shape(m, n, multiprocessors)
    if workspace is not None and (partial is None or tuple(partial.shape) != workspace):
        raise KernelArgumentError(f"{op}: {m} rows need a float32 partial workspace of shape {list(workspace)}")
    if m == 0 or n == 0:
        return out
    split = split_of(n, multiprocessors)
    sliced = workspace is not None
    tiling = tiling if tiling is not None else NARROW if m <= NARROW_ROWS else FOLDED if split > 1 else WIDE
    check_tiling(tiling)
    columns, rows, threads = tile_shape(tiling)
    function = _function(kernel_name(tiling, sliced, not sliced and split > 1))
    if function.max_dynamic_shared_size_bytes < shared_bytes(tiling):
        function.max_dynamic_shared_size_bytes = shared_bytes(tiling)
    null = np.uint64(0)
    launch(function, (-(-n // columns), -(-m // rows), split if sliced else 1), (threads,),
           (x, weight, null if sliced or bias is None else bias, partial if sliced else out, np.int32(m), np.int32(n),
            np.int32(k), np.int32(split_steps(k, split))), shared_bytes(tiling), stream, dependent=False)
    if sliced:
        launch(_function("invariant_linear_sum"), (-(-(m * n) // SUM_THREADS),), (SUM_THREADS,),
               (partial, null if bias is None else bias, out, np.int32(m), np.int32(n), np.int32(split)), 0, stream,
               dependent=False)
    return out
