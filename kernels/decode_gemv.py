"""Matrix-vector products for decode batches (up to :data:`MAX_ROWS` rows) with the op before them
fused in: ``y = prologue(x) W^T``, bf16 weights streamed through the tensor cores (CUDA C++,
compiled by NVRTC through CuPy).

A decode step of a 1B model is launch-bound: every kernel costs a few microseconds in the CUDA
graph whatever it does, and the norm before a projection, or the SwiGLU gate before the down
projection, is a kernel of its own. Here the projection's kernel computes its input itself:

* :data:`PLAIN` -- ``x`` bf16 ``[rows, K]`` as it is; :data:`PLAIN_F32` -- ``x`` float32
  ``[rows, K]`` rounded to bf16 (what the ``to_bf16`` kernel before it would write);
* :data:`RMSNORM` -- ``x`` float32 ``[rows, K]`` plus the float32 residual (when given):
  ``s = x + residual`` (written to ``summed`` by block 0, the next residual), then
  ``bf16(s / sqrt(mean(s^2) + eps) * (offset + norm_weight))``, as
  :func:`metrale.kernels.rmsnorm.rmsnorm_residual` computes it;
* :data:`SILU` -- ``x`` bf16 ``[rows, 2K]`` (gate columns first): ``bf16(silu(gate) * up)``, as
  :func:`metrale.kernels.activation.silu_and_mul` computes it.

:data:`RMSNORM_SWIGLU` moves the gate to the other end of the MLP: the RMSNORM prologue, a
gate-and-up weight ``[2N, K]``, and an epilogue that writes ``bf16(silu(bf16(g)) * bf16(u))``
per unit (the values :data:`SILU` would stage), ``[rows, N]``: a tile then holds 8 units, its gate
rows and its up rows as the two halves of the product's 16 rows (the op registry offers it for
``rmsnorm_mlp``, :func:`metrale.ops.selection.decode_gemv_kernels` with ``swiglu_epilogue``).
:data:`PLAIN_SWIGLU` is the same epilogue after the :data:`PLAIN` prologue: ``linear_silu`` (a
shared expert's gate and up projections with their gate) in one kernel.

Each block first issues its first weight loads, then writes the prologue's ``[rows, K]`` bf16 input
into shared memory (every block computes it: the input is a few kilobytes, read from L2). The
product runs on ``mma.sync.m16n8k16``: 16 output columns are the M side, a tile of (at most) 8 rows
the N side, so one instruction takes 512 bytes of weights and the arithmetic never limits the
weight stream, whatever the row count. Past 8 rows (up to :data:`MAX_ROWS`) each weight fragment
multiplies every tile of 8 rows in turn (``ROW_TILES``), the weights still read once. The K order
inside an instruction is free (a dot product), so each lane feeds the A fragment straight from two
16-byte weight loads (columns g and g + 8, the same 8 K values) and the B fragment from the
matching 16 bytes of staged input: no shuffles, no shared memory for the weights. ``SPLIT`` warps
share a tile of 16 columns, each taking a slice of K, and add their partial sums through shared
memory; with ``SPLIT == 1`` every warp owns whole tiles and the grid loops over them. The launcher
picks ``SPLIT`` so that the tiles times the split give every multiprocessor a block's worth of
warps (narrow projections split K, wide ones do not). Each warp keeps the next batch of weight
words in flight while it multiplies the current one.

Launched dependently (:mod:`metrale.kernels._launch`), a block issues its first weight loads
before it waits for the kernel ahead to finish: they do not depend on it.

The output is float32 (plus ``bias``) or, with ``bf16_out``, bf16 bits (a gate-and-up projection
feeding :data:`SILU`). ``summed`` must not share memory with ``x`` or ``residual``: every block
reads them while block 0 writes it. ``K`` must be a multiple of 32 and every array 16-byte aligned.

:func:`decode_gemv_reference` is the NumPy reference; ``tests/kernels`` runs the kernels on the
host against it through the CUDA emulation header, ``tests/kernels``' GPU tests (``-m gpu``) on the GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._tensor_cores import MMA_BF16
from metrale.kernels._words import HELPERS, aligned
from metrale.kernels.activation import silu_and_mul_reference
from metrale.kernels.linear import linear_reference
from metrale.kernels.rmsnorm import rmsnorm_residual_reference

PLAIN, RMSNORM, SILU, RMSNORM_SWIGLU, PLAIN_SWIGLU, PLAIN_F32 = 0, 1, 2, 3, 4, 5
MODES = {PLAIN: "plain", RMSNORM: "rmsnorm", SILU: "silu", RMSNORM_SWIGLU: "rmsnorm, swiglu out",
         PLAIN_SWIGLU: "plain, swiglu out", PLAIN_F32: "plain, float32 in"}
#: The modes whose epilogue applies the SwiGLU gate (weight ``[2N, K]``, bf16 output ``[rows, N]``).
SWIGLU_MODES = (RMSNORM_SWIGLU, PLAIN_SWIGLU)

#: Rows a launch takes: up to 8 per tile of the tensor-core product's N side, up to
#: :data:`ROW_TILES`\[-1] such tiles (each weight fragment multiplies every tile).
MAX_ROWS = 32
ROW_TILES = (1, 2, 4)
WARPS = 8
THREADS = 32 * WARPS
#: 16-byte weight words per lane and column in one batch (32 K values each): the launcher's default
#: and the other choice :func:`decode_gemv` takes (twice the loads in flight, one block a
#: multiprocessor for the registers).
UNROLLS = (4, 8)
SPLITS = (1, 2, 4, 8)  # warps sharing a tile of 16 columns
TILE = 16  # output columns of one product
#: Largest dynamic shared memory a block takes (the staged rows, the norm's partial sums and the
#: split's partial products): what compute capability 9.0 allows a block.
MAX_SHARED_BYTES = 227 * 1024
REDUCE_BYTES = WARPS * 32 * 16  # a float4 per lane of every warp, per row tile
NORM_BYTES = WARPS * MAX_ROWS * 4 + MAX_ROWS * 4  # partial sums of squares per warp and row, then the scales

#: The CUDA side only: the dynamic shared memory (the emulation header has its own).
INSTRUCTIONS = r"""
#define DYNAMIC_SHARED extern __shared__ __align__(16) unsigned char dynamic_shared[]
"""

CONSTANTS = f"""
#define WARPS {WARPS}
#define THREADS {THREADS}
#define NORM_ROWS {MAX_ROWS}
#define MODE_PLAIN {PLAIN}
#define MODE_RMSNORM {RMSNORM}
#define MODE_SILU {SILU}
#define MODE_RMSNORM_SWIGLU {RMSNORM_SWIGLU}
#define MODE_PLAIN_SWIGLU {PLAIN_SWIGLU}
#define MODE_PLAIN_F32 {PLAIN_F32}
"""

KERNELS = r"""
// Where chunk `chunk` (16 bytes) of staged row `row` lies: rows of `stride` chunks (a multiple of
// 8, 128 bytes), rows r and r ^ 1 putting theirs in opposite halves of each 128-byte line, so the 8
// lanes of a quarter-warp (2 rows x 4 chunks) hit 8 different bank groups.
__device__ __forceinline__ int staged_chunk(int row, int chunk, int stride) {
    return row * stride + (chunk ^ ((row & 1) << 2));
}

// y[r, n] = dot(prologue(x)[r, :], weight[n, :]) (+ bias[n]) for r < rows <= 8 * ROW_TILES, n < N:
// row tile t (rows 8t to 8t + 7) is the N side of its own products, with the same weight fragments.
// MODE_RMSNORM_SWIGLU: the RMSNORM prologue, weight [2N, K] (N gate rows, then N up rows), and
// y[r, n] = silu(g) * u of the bf16-rounded g = dot(., gate row n), u = dot(., up row n), as bf16
// (BF16_OUT, no bias): a tile is 8 units, its gate rows as the product's rows 0-7 and its up rows
// as rows 8-15, so each lane holds a unit's gate and up for its two rows. MODE_PLAIN_SWIGLU: the
// same after the PLAIN prologue.
// Grid: blocks of THREADS threads; warp w works on column tile blockIdx.x * WARPS / SPLIT + w / SPLIT
// (16 columns; then + gridDim.x * WARPS / SPLIT, round after round) over K slice w % SPLIT.
// Dynamic shared memory: rows * ceil(K / 64) * 128 bytes of staged input, then (RMSNORM) the norm's sums, then
// (SPLIT > 1) WARPS * ROW_TILES * 32 float4 of partial products. x: bf16 bits [rows, K] (PLAIN), float32
// [rows, K] (RMSNORM, with residual float32 [rows, K] or null), bf16 bits [rows, 2K] (SILU);
// weight: bf16 bits [N, K] as 16-byte words, K a multiple of 32; out: float32 [rows, N], or bf16
// bits with BF16_OUT. Every array 16-byte aligned.
template <int MODE, bool BF16_OUT, int SPLIT, int UNROLL, int ROW_TILES>
__global__ void __launch_bounds__(THREADS, UNROLL > 4 || ROW_TILES > 1 ? 1 : 2) decode_gemv(
    const void* __restrict__ x, const float* __restrict__ residual, const unsigned short* __restrict__ norm_weight,
    float eps, float norm_offset, float* __restrict__ summed, const uint4* __restrict__ weight,
    const float* __restrict__ bias, void* __restrict__ out, int rows, int K, int N) {
    DYNAMIC_SHARED;
    allow_dependents();
    constexpr int GROUPS = WARPS / SPLIT;   // tiles a block works on at once
    uint4* stage = reinterpret_cast<uint4*>(dynamic_shared);   // [rows][stride], swizzled
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int chunks = K / 8, stride = (chunks + 7) / 8 * 8;
    constexpr bool SWIGLU = MODE == MODE_RMSNORM_SWIGLU || MODE == MODE_PLAIN_SWIGLU;
    const int tiles = SWIGLU ? (N + 7) / 8 : (N + 15) / 16;
    const int slice = (chunks / 4 + SPLIT - 1) / SPLIT * 4;   // chunks of a warp's K slice
    const int part = warp % SPLIT;
    const int first_chunk = part * slice, end_chunk = min(chunks, first_chunk + slice);
    const int batches = (slice + 4 * UNROLL - 1) / (4 * UNROLL);   // per tile, the same for every warp
    const int tile_stride = gridDim.x * GROUPS;
    const int first_tile = blockIdx.x * GROUPS + warp / SPLIT;
    const int rounds = (tiles - (int)blockIdx.x * GROUPS + tile_stride - 1) / tile_stride;   // block-uniform
    const int steps = rounds * batches;
    const uint4 zero = {0u, 0u, 0u, 0u};

    // Batch `step` of this warp: tile first_tile + (step / batches) * tile_stride, chunks
    // first_chunk + (step % batches) * 4 * UNROLL + q + 4u; columns g and g + 8 of the tile.
    auto load = [&](int step, uint4* upper, uint4* lower) {
        const int round = step / batches, batch = step - round * batches;
        const int tile = first_tile + round * tile_stride;
        const size_t column = SWIGLU ? (size_t)min(tile * 8 + g, N - 1) : (size_t)min(tile * 16 + g, N - 1);
        const size_t below = SWIGLU ? column + N : (size_t)min(tile * 16 + g + 8, N - 1);
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int chunk = first_chunk + batch * 4 * UNROLL + 4 * u + q;
            const bool valid = tile < tiles && chunk < end_chunk;
            upper[u] = valid ? __ldg(weight + column * chunks + chunk) : zero;
            lower[u] = valid ? __ldg(weight + below * chunks + chunk) : zero;
        }
    };

    uint4 upper[UNROLL], lower[UNROLL];
    if (steps > 0) load(0, upper, lower);   // in flight while the kernel ahead ends and the prologue runs
    wait_for_producers();   // everything below reads or writes what other kernels touch

    // 1. The prologue's rows, as bf16, into shared memory.
    if (MODE == MODE_PLAIN || MODE == MODE_PLAIN_SWIGLU) {
        const uint4* in = static_cast<const uint4*>(x);
        for (int i = tid; i < rows * chunks; i += THREADS) {
            const int r = i / chunks, c = i - r * chunks;
            stage[staged_chunk(r, c, stride)] = __ldg(in + i);
        }
    } else if (MODE == MODE_PLAIN_F32) {
        const float4* in = static_cast<const float4*>(x);   // [rows][K / 4]
        for (int i = tid; i < rows * chunks; i += THREADS) {
            const int r = i / chunks, c = i - r * chunks;
            const float4 a = in[(size_t)i * 2], b = in[(size_t)i * 2 + 1];
            uint4 value;
            value.x = (unsigned)to_bf16(a.x) | ((unsigned)to_bf16(a.y) << 16);
            value.y = (unsigned)to_bf16(a.z) | ((unsigned)to_bf16(a.w) << 16);
            value.z = (unsigned)to_bf16(b.x) | ((unsigned)to_bf16(b.y) << 16);
            value.w = (unsigned)to_bf16(b.z) | ((unsigned)to_bf16(b.w) << 16);
            stage[staged_chunk(r, c, stride)] = value;
        }
    } else if (MODE == MODE_SILU) {
        const uint4* in = static_cast<const uint4*>(x);   // [rows][2 * chunks]
        for (int i = tid; i < rows * chunks; i += THREADS) {
            const int r = i / chunks, c = i - r * chunks;
            const uint4 gate = __ldg(in + (size_t)r * 2 * chunks + c), up = __ldg(in + (size_t)r * 2 * chunks + chunks + c);
            uint4 value;
            value.x = silu_mul_pair(gate.x, up.x);
            value.y = silu_mul_pair(gate.y, up.y);
            value.z = silu_mul_pair(gate.z, up.z);
            value.w = silu_mul_pair(gate.w, up.w);
            stage[staged_chunk(r, c, stride)] = value;
        }
    } else {
        const float4* in = static_cast<const float4*>(x);   // [rows][K / 4]
        const float4* add = reinterpret_cast<const float4*>(residual);
        float* partial = reinterpret_cast<float*>(stage + rows * stride);   // [WARPS][NORM_ROWS]
        float* scale = partial + WARPS * NORM_ROWS;   // [NORM_ROWS]
        const int quads = K / 4;
        for (int r = 0; r < rows; ++r) {
            float squares = 0.0f;
            for (int k = tid; k < quads; k += THREADS) {
                float4 v = in[(size_t)r * quads + k];
                if (add != nullptr) {
                    const float4 w = add[(size_t)r * quads + k];
                    v.x += w.x; v.y += w.y; v.z += w.z; v.w += w.w;
                }
                squares += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
            squares = warp_sum(squares);
            if (lane == 0) partial[warp * NORM_ROWS + r] = squares;
        }
        __syncthreads();
        if (tid < rows) {
            float total = 0.0f;
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) total += partial[w * NORM_ROWS + tid];
            scale[tid] = 1.0f / sqrtf(total / (float)K + eps);
        }
        __syncthreads();
        const uint4* gains = reinterpret_cast<const uint4*>(norm_weight);
        for (int i = tid; i < rows * chunks; i += THREADS) {
            const int r = i / chunks, c = i - r * chunks;
            float4 a = in[(size_t)i * 2], b = in[(size_t)i * 2 + 1];
            if (add != nullptr) {
                const float4 ra = add[(size_t)i * 2], rb = add[(size_t)i * 2 + 1];
                a.x += ra.x; a.y += ra.y; a.z += ra.z; a.w += ra.w;
                b.x += rb.x; b.y += rb.y; b.z += rb.z; b.w += rb.w;
            }
            if (blockIdx.x == 0) {
                reinterpret_cast<float4*>(summed)[(size_t)i * 2] = a;
                reinterpret_cast<float4*>(summed)[(size_t)i * 2 + 1] = b;
            }
            const uint4 gain = __ldg(gains + c);
            const float s = scale[r];
            uint4 value;
            value.x = (unsigned)to_bf16(a.x * s * (norm_offset + bf16_low(gain.x)))
                      | ((unsigned)to_bf16(a.y * s * (norm_offset + bf16_high(gain.x))) << 16);
            value.y = (unsigned)to_bf16(a.z * s * (norm_offset + bf16_low(gain.y)))
                      | ((unsigned)to_bf16(a.w * s * (norm_offset + bf16_high(gain.y))) << 16);
            value.z = (unsigned)to_bf16(b.x * s * (norm_offset + bf16_low(gain.z)))
                      | ((unsigned)to_bf16(b.y * s * (norm_offset + bf16_high(gain.z))) << 16);
            value.w = (unsigned)to_bf16(b.z * s * (norm_offset + bf16_low(gain.w)))
                      | ((unsigned)to_bf16(b.w * s * (norm_offset + bf16_high(gain.w))) << 16);
            stage[staged_chunk(r, c, stride)] = value;
        }
    }
    __syncthreads();

    // 2. The products, batch after batch, the next batch's loads in flight during each.
    constexpr int NORM_SUMS = MODE == MODE_RMSNORM || MODE == MODE_RMSNORM_SWIGLU ? (WARPS * NORM_ROWS + NORM_ROWS) * 4 : 0;
    // [WARPS][ROW_TILES][32]
    float4* reduce = reinterpret_cast<float4*>(dynamic_shared + (size_t)rows * stride * 16 + NORM_SUMS);
    float acc[ROW_TILES][4];
    #pragma unroll
    for (int t = 0; t < ROW_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    for (int step = 0; step < steps; ++step) {
        uint4 next_upper[UNROLL], next_lower[UNROLL];
        if (step + 1 < steps) load(step + 1, next_upper, next_lower);
        const int batch = step % batches;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (first_chunk + batch * 4 * UNROLL + 4 * u < end_chunk) {   // warp-uniform
                const int chunk = first_chunk + batch * 4 * UNROLL + 4 * u + q;
                const unsigned a0[4] = {upper[u].x, lower[u].x, upper[u].y, lower[u].y};
                const unsigned a1[4] = {upper[u].z, lower[u].z, upper[u].w, lower[u].w};
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) {
                    const int row = 8 * t + g;
                    const uint4 in = row < rows && chunk < end_chunk ? stage[staged_chunk(row, chunk, stride)] : zero;
                    const unsigned b0[2] = {in.x, in.y};
                    mma_16x8x16(acc[t], a0, b0);
                    const unsigned b1[2] = {in.z, in.w};
                    mma_16x8x16(acc[t], a1, b1);
                }
            }
        }
        if (batch == batches - 1) {   // the tile's last batch: its columns are done
            const int tile = first_tile + (step / batches) * tile_stride;
            if (SPLIT > 1) {
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) {
                    const float4 mine = {acc[t][0], acc[t][1], acc[t][2], acc[t][3]};
                    reduce[(warp * ROW_TILES + t) * 32 + lane] = mine;
                }
                __syncthreads();
                if (part == 0) {
                    #pragma unroll
                    for (int p = 1; p < SPLIT; ++p) {
                        #pragma unroll
                        for (int t = 0; t < ROW_TILES; ++t) {
                            const float4 other = reduce[((warp + p) * ROW_TILES + t) * 32 + lane];
                            acc[t][0] += other.x; acc[t][1] += other.y; acc[t][2] += other.z; acc[t][3] += other.w;
                        }
                    }
                }
                __syncthreads();
            }
            #pragma unroll
            for (int t = 0; t < ROW_TILES; ++t) {
                if (SWIGLU && part == 0 && tile < tiles) {
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int r = 8 * t + 2 * q + i, unit = tile * 8 + g;
                        if (r < rows && unit < N) {
                            const float gate = bf16_bits(to_bf16(acc[t][i])), up = bf16_bits(to_bf16(acc[t][i + 2]));
                            static_cast<unsigned short*>(out)[(size_t)r * N + unit] =
                                to_bf16(gate / (1.0f + expf(-gate)) * up);
                        }
                    }
                } else if (part == 0 && tile < tiles) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = 8 * t + 2 * q + (i & 1), column = tile * 16 + g + (i >= 2 ? 8 : 0);
                        if (r < rows && column < N) {
                            const float value = bias != nullptr ? acc[t][i] + bias[column] : acc[t][i];
                            if (BF16_OUT) static_cast<unsigned short*>(out)[(size_t)r * N + column] = to_bf16(value);
                            else static_cast<float*>(out)[(size_t)r * N + column] = value;
                        }
                    }
                }
                acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            upper[u] = next_upper[u];
            lower[u] = next_lower[u];
        }
    }
}
"""


def kernel_name(mode: int, bf16_out: bool, split: int, unroll: int = UNROLLS[0], row_tiles: int = 1) -> str:
    """The C++ name of one instantiation of ``decode_gemv``."""
    return f"decode_gemv<{mode}, {'true' if bf16_out else 'false'}, {split}, {unroll}, {row_tiles}>"


def row_tiles(rows: int) -> int:
    """The :data:`ROW_TILES` choice of a launch of ``rows`` rows: the fewest tiles of 8 that hold them."""
    return next(t for t in ROW_TILES if 8 * t >= rows) if rows <= MAX_ROWS else ROW_TILES[-1]


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return INSTRUCTIONS + DEPENDENT_LAUNCH + MMA_BF16 + CONSTANTS + HELPERS + KERNELS


def shared_bytes(rows: int, inner: int, mode: int, split: int) -> int:
    """Dynamic shared memory of a launch: the staged rows, the norm's sums, the split's partial
    products."""
    staged = rows * -(-inner // 64) * 128  # rows padded to 128 bytes
    reduce = REDUCE_BYTES * row_tiles(rows) if split > 1 else 0
    return staged + (NORM_BYTES if mode in (RMSNORM, RMSNORM_SWIGLU) else 0) + reduce


def supports(rows: int, inner: int, mode: int = PLAIN) -> bool:
    """Whether a launch of ``rows`` rows and inner size ``inner`` is served (with the largest
    split, which needs the most shared memory)."""
    return (0 < rows <= MAX_ROWS and inner > 0 and inner % 32 == 0
            and shared_bytes(rows, inner, mode, SPLITS[-1]) <= MAX_SHARED_BYTES)


def plan(rows: int, inner: int, columns: int, mode: int, multiprocessors: int, split: int | None = None,
         unroll: int = UNROLLS[0]) -> tuple[int, int]:
    """``(split, blocks)`` of a launch: the smallest split whose tiles give every multiprocessor a
    block's worth of warps (unless ``split`` is given), and the blocks that cover the tiles once
    (split > 1) or, without a split, as many as the GPU holds at once (the warps loop over the
    tiles: two blocks a multiprocessor where the shared memory allows, one with ``unroll`` 8, whose
    registers allow no more)."""
    tiles = -(-columns // (TILE // 2 if mode in SWIGLU_MODES else TILE))
    if split is None:
        split = next((s for s in SPLITS if tiles * s >= multiprocessors * WARPS), SPLITS[-1])
    groups = WARPS // split
    blocks = -(-tiles // groups)
    if split == 1:
        per_multiprocessor = (2 if 2 * shared_bytes(rows, inner, mode, split) <= 228 * 1024 and unroll == UNROLLS[0]
                              and rows <= 8 else 1)
        blocks = min(blocks, multiprocessors * per_multiprocessor)
    return split, blocks


def choose_unroll(rows: int, inner: int, columns: int, mode: int, multiprocessors: int,
                  split: int | None = None) -> int:
    """The launcher's :data:`UNROLLS` choice: 8 (twice the weight words in flight, one block a
    multiprocessor for the registers) where the split grid fits one wave at one block a
    multiprocessor and there are at most 8 rows (more rows hold more accumulators), 4 otherwise:
    a second wave costs more than the loads in flight gain (timings: :doc:`/notes/decode-kernels`)."""
    chosen, blocks = plan(rows, inner, columns, mode, multiprocessors, split)
    return UNROLLS[1] if chosen > 1 and blocks <= multiprocessors and rows <= 8 else UNROLLS[0]


# ------------------------------------------------------------------------------ reference


def decode_gemv_reference(
    mode: int, x: np.ndarray, weight: np.ndarray, *, residual: np.ndarray | None = None,
    norm_weight: np.ndarray | None = None, eps: float = 1e-6, norm_offset: float = 0.0, bias: np.ndarray | None = None,
    bf16_out: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(out, summed)``: what a launch computes, from float32 arrays (``x``, ``weight`` and
    ``norm_weight`` holding bf16 values). The prologue's input is rounded to bf16 as the unfused
    ops round it; ``out`` is float32 (bf16 values with ``bf16_out``); ``summed`` is the RMSNORM
    prologue's ``x + residual`` (None for the other modes)."""
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    def round_bf16(values: np.ndarray) -> np.ndarray:
        return bf16_to_float32(float32_to_bf16(np.asarray(values, dtype=np.float32)))

    summed = None
    x = np.asarray(x, dtype=np.float32)
    if mode in (PLAIN, PLAIN_SWIGLU):
        staged = x
    elif mode == PLAIN_F32:
        staged = round_bf16(x)
    elif mode == SILU:
        inner = x.shape[1] // 2
        staged = round_bf16(silu_and_mul_reference(x[:, :inner], x[:, inner:]))
    elif mode in (RMSNORM, RMSNORM_SWIGLU):
        assert norm_weight is not None
        normed, summed = rmsnorm_residual_reference(x, residual, norm_weight, eps, norm_offset)
        staged = round_bf16(normed)
    else:
        raise KernelArgumentError(f"decode_gemv: unknown mode {mode!r}")
    out = linear_reference(staged, weight, bias)
    if mode in SWIGLU_MODES:
        units = weight.shape[0] // 2
        return round_bf16(silu_and_mul_reference(round_bf16(out[:, :units]), round_bf16(out[:, units:]))), summed
    return (round_bf16(out) if bf16_out else out.astype(np.float32)), summed


# ------------------------------------------------------------------------------- launcher

_kernels: dict[tuple[int, bool, int, int, int], Any] = {}
_multiprocessors: dict[int, int] = {}


def _kernel(mode: int, bf16_out: bool, split: int, unroll: int, tiles: int) -> Any:
    key = (mode, bf16_out, split, unroll, tiles)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy

        name = kernel_name(mode, bf16_out, split, unroll, tiles)
        module = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=(name,))
        kernel = module.get_function(name)
        _kernels[key] = kernel
    return kernel


def multiprocessor_count() -> int:
    """Multiprocessors of the current CUDA device (asked once per device)."""
    import cupy

    device = cupy.cuda.Device().id
    if device not in _multiprocessors:
        _multiprocessors[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return _multiprocessors[device]


def decode_gemv(
    mode: int, x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: Any, *, residual: DeviceArray | None = None,
    norm_weight: DeviceArray | None = None, eps: float = 1e-6, norm_offset: float = 0.0,
    summed: DeviceArray | None = None, bias: DeviceArray | None = None, split: int | None = None,
    unroll: int | None = None,
) -> DeviceArray:
    """``out <- prologue(x) weight^T (+ bias)`` (see the module docstring) on ``stream``; with
    :data:`RMSNORM`, ``summed <- x (+ residual)``. ``out`` float32 ``[rows, N]``, or uint16 for a
    bf16 output. ``split`` overrides the launcher's choice of warps per tile (:func:`plan`),
    ``unroll`` the weight words a lane loads per column and batch (one of :data:`UNROLLS`; None:
    :func:`choose_unroll`).
    Raises :class:`~metrale.errors.KernelArgumentError` for shapes it does not serve
    (:func:`supports`) and arrays not 16-byte aligned."""
    name = f"decode_gemv ({MODES.get(mode, mode)})"
    check_array(name, "weight", weight, np.uint16, ndim=2)
    columns, inner = weight.shape
    if mode in SWIGLU_MODES:  # the gate and up rows: half as many outputs
        if columns % 16 or bias is not None:
            raise KernelArgumentError(f"{name}: {columns} gate and up rows (a multiple of 16 needed), or a bias")
        columns //= 2
    rows = x.shape[0] if getattr(x, "ndim", 0) == 2 else -1
    width = 2 * inner if mode == SILU else inner
    norm = mode in (RMSNORM, RMSNORM_SWIGLU)
    check_array(name, "x", x, np.float32 if norm or mode == PLAIN_F32 else np.uint16, (rows, width))
    if not supports(rows, inner, mode):
        raise KernelArgumentError(f"{name}: {rows} rows of inner size {inner} are not served "
                                  f"(at most {MAX_ROWS} rows; the inner size a multiple of 32, staged in "
                                  f"{MAX_SHARED_BYTES} bytes)")
    bf16_out = out.dtype == np.uint16
    if mode in SWIGLU_MODES and not bf16_out:
        raise KernelArgumentError(f"{name}: the SwiGLU output is bf16 bits")
    check_array(name, "out", out, np.uint16 if bf16_out else np.float32, (rows, columns))
    if bias is not None:
        check_array(name, "bias", bias, np.float32, (columns,))
    if norm:
        if norm_weight is None or summed is None:
            raise KernelArgumentError(f"{name}: the norm needs norm_weight and summed")
        check_array(name, "norm_weight", norm_weight, np.uint16, (inner,))
        check_array(name, "summed", summed, np.float32, (rows, inner))
        if residual is not None:
            check_array(name, "residual", residual, np.float32, (rows, inner))
    for label, array in (("x", x), ("weight", weight), ("residual", residual), ("norm_weight", norm_weight),
                         ("summed", summed)):
        if array is not None and not aligned(array):
            raise KernelArgumentError(f"{name}: {label} does not start at a 16-byte boundary")
    if split is not None and split not in SPLITS:
        raise KernelArgumentError(f"{name}: split {split} is not one of {SPLITS}")
    if unroll is None:
        unroll = choose_unroll(rows, inner, columns, mode, multiprocessor_count(), split)
    if unroll not in UNROLLS:
        raise KernelArgumentError(f"{name}: unroll {unroll} is not one of {UNROLLS}")
    chosen, blocks = plan(rows, inner, columns, mode, multiprocessor_count(), split, unroll)
    kernel = _kernel(mode, bf16_out, chosen, unroll, row_tiles(rows))
    stage = shared_bytes(rows, inner, mode, chosen)
    if stage > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = stage
    null = np.uint64(0)  # a null pointer for the arguments left out
    launch(kernel, (blocks,), (THREADS,), (
        x, residual if residual is not None else null, norm_weight if norm_weight is not None else null,
        np.float32(eps), np.float32(norm_offset), summed if summed is not None else null, weight,
        bias if bias is not None else null, out, np.int32(rows), np.int32(inner), np.int32(columns),
    ), stage, stream, dependent=True)
    return out
