"""Routed experts of a prompt as grouped matrix products on tensor cores (CUDA C++ with
``mma.sync``, compiled by NVRTC through CuPy).

The same sum as :func:`metrale.kernels.moe.experts_reference`; the NumPy reference here,
:func:`grouped_experts_reference`, computes it one expert at a time. Every (token, chosen expert)
pair is a row; the rows of one expert share that expert's weights, so they are gathered into
tiles of :data:`BLOCK_M` rows and multiplied as one product. A fixed number of launches per
layer, grids sized from the shapes alone, no host synchronisation (CUDA-graph safe):

1. **align** (one block): the pairs ``n * k + s`` sorted by expert, each expert's run padded with
   ``-1`` to a multiple of :data:`BLOCK_M`, and the expert of every tile (``-1`` for the tiles
   past the last one used). :func:`max_tiles` bounds the tile count from ``N * k`` and ``E``;
   the order of an expert's pairs is arbitrary, and each row's result does not depend on it.
2. **gate_up**: a block multiplies one tile's rows of ``x`` (gathered through ``pair // k``) by
   :data:`BLOCK_N` / 2 gate rows of the tile's expert and the matching up rows (interleaved by
   eight, so one thread holds a column's gate and up sums) and writes ``silu(gate) * up`` as bf16
   into ``act [tiles * BLOCK_M, I]`` (padding rows get zeros); for GPT-OSS's experts the sums
   take the expert's biases first and the activation is its clamped SwiGLU.
3. **down**: a tile's ``act`` rows times :data:`BLOCK_N` rows of the expert's ``down [H, I]``;
   the epilogue adds the expert's bias (GPT-OSS), scales by the pair's routing weight and writes
   float32 into ``pair_out [N * k, H]`` at the pair's row.
4. **sum**: ``out[n] = sum_s pair_out[n * k + s]``, in slot order.

The products stream ``block_k``-deep slices of both operands (K-contiguous rows: ``x`` / ``act``
rows and weight rows) through a ``cp.async`` pipeline of :data:`STAGES` padded shared buffers
and read their ``m16n8k16`` fragments with ``ldmatrix``; bf16 in, float32 accumulate. ``H`` and
``I`` must be multiples of 8 (16-byte copies); partial tiles in any dimension are guarded.

numba exposes no tensor-core instruction, so these kernels are CUDA C++; numba's CUDA simulator
cannot run them (their tests run on the GPU only; :func:`align_reference` models the alignment
on the host).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._tensor_cores import MMA_BF16, STAGED_COPIES
from metrale.kernels.activation import sigmoid_denominator


class Tiling(NamedTuple):
    """Tile shape of the two products: ``block_m`` pair rows by ``block_n`` weight rows per
    block, ``warps_m`` x ``warps_n`` warps, ``stages`` shared buffers in flight, each a
    ``block_k``-deep slice of both operands."""

    block_m: int = 64
    block_n: int = 128
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3
    block_k: int = 32

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of a product block: ``stages`` buffers of padded bf16 rows."""
        return self.stages * (self.block_m + self.block_n) * (self.block_k + 8) * 2

    def valid(self) -> bool:
        warp_m, warp_n = self.block_m // max(self.warps_m, 1), self.block_n // max(self.warps_n, 1)
        chunks = self.block_k // 8
        return (
            self.block_k in (32, 64) and self.warps_m > 0 and self.warps_n > 0 and self.stages >= 2
            and self.block_m % self.warps_m == 0
            and self.block_n % self.warps_n == 0 and warp_m % 16 == 0 and warp_n % 16 == 0
            and (self.block_m * chunks) % self.threads == 0 and (self.block_n * chunks) % self.threads == 0
            and self.shared_bytes <= MAX_SHARED_BYTES
        )


#: The default tiling: 64 pair rows by 128 weight rows (for gate_up: 64 gate and 64 up rows),
#: four warps of 32 x 64, three buffers (46 KiB of shared memory).
TILING = Tiling()
#: Tiles of 128 pair rows for batches whose experts get many pairs each: four warps of 64 x 64,
#: slices 64 deep (108 KiB of shared memory), the fastest of twelve tilings timed at 2,048 tokens
#: of DeepSeek-V2-Lite's and Qwen3-Next's experts (``tools/moe_sweep.py``).
LARGE_TILING = Tiling(128, 128, 2, 2, 3, 64)
LARGE_TILING_ROWS = 128
BLOCK_M = TILING.block_m
BLOCK_N = TILING.block_n
STAGES = TILING.stages
#: Shared memory a block may opt into on an H100 / H200 (227 KiB).
MAX_SHARED_BYTES = 227 * 1024
#: The alignment kernel: one block, one thread per expert for its scan.
ALIGN_THREADS = 1024
MAX_EXPERTS = ALIGN_THREADS
SUM_THREADS = 256
#: Tiles run along the grid's y dimension.
MAX_GRID_Y = 65535

#: The tile constants, filled in per :class:`Tiling` by :func:`constants`.
CONSTANTS = r"""
#define BLOCK_M __BLOCK_M__
#define BLOCK_N __BLOCK_N__        // weight rows of a tile (gate_up: BLOCK_N / 2 gate rows and as many up rows)
#define WARPS_M __WARPS_M__
#define WARPS_N __WARPS_N__
#define STAGES __STAGES__
#define BLOCK_K __BLOCK_K__        // depth of a staged K slice (two or four m16n8k16 steps)
#define THREADS (32 * WARPS_M * WARPS_N)
#define STRIDE (BLOCK_K + 8)       // padded shared row (bf16): ldmatrix's eight rows start 4 banks apart
#define WARP_M (BLOCK_M / WARPS_M)
#define WARP_N (BLOCK_N / WARPS_N)
#define M_FRAGS (WARP_M / 16)
#define N_FRAGS (WARP_N / 8)
#define ROW_CHUNKS (BLOCK_K / 8)   // 16-byte copies per staged row
#define A_COPIES (BLOCK_M * ROW_CHUNKS / THREADS)
#define B_COPIES (BLOCK_N * ROW_CHUNKS / THREADS)
#define ROWS_PER_PASS (THREADS / ROW_CHUNKS)
#define STAGE_ELEMENTS ((BLOCK_M + BLOCK_N) * STRIDE)
#define ALIGN_THREADS 1024
#define MAX_EXPERTS ALIGN_THREADS

static_assert(WARP_M % 16 == 0 && WARP_N % 16 == 0, "a warp owns whole 16-row and 16-column fragments");
static_assert(A_COPIES * THREADS == BLOCK_M * ROW_CHUNKS && B_COPIES * THREADS == BLOCK_N * ROW_CHUNKS,
              "every thread stages the same number of 16-byte chunks");
static_assert(STAGES >= 2, "the pipeline needs two buffers");
"""

#: The PTX instructions the kernels use (``cp.async``, ``ldmatrix``, ``mma.sync``), the bf16
#: packing and the dynamic shared memory, each behind a small function or macro.
INSTRUCTIONS = MMA_BF16 + STAGED_COPIES

#: The kernels, written against :data:`CONSTANTS` and :data:`INSTRUCTIONS`.
KERNELS = r"""
typedef unsigned short bf16_bits;

// Stage the K slice [k0, k0 + BLOCK_K) of the tile's rows: A rows (pairs) at the start of
// `stage`, B rows (weights) after them. a_rows / b_rows: this thread's source rows (nullptr: a
// padding row or a weight row past the end, staged as zeros); chunks past `depth` are zeros too.
__device__ __forceinline__ void stage_slice(bf16_bits* stage, const bf16_bits* const* a_rows,
                                            const bf16_bits* const* b_rows, int k0, int depth,
                                            const bf16_bits* any_address) {
    const int chunk = threadIdx.x % ROW_CHUNKS;
    const int column = k0 + chunk * 8;
    const bool inside = column < depth;
#pragma unroll
    for (int i = 0; i < A_COPIES; ++i) {
        const int row = threadIdx.x / ROW_CHUNKS + i * ROWS_PER_PASS;
        const bool valid = inside && a_rows[i] != nullptr;
        copy_16(shared_address(stage + row * STRIDE + chunk * 8), valid ? a_rows[i] + column : any_address, valid);
    }
    bf16_bits* b_stage = stage + BLOCK_M * STRIDE;
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i) {
        const int row = threadIdx.x / ROW_CHUNKS + i * ROWS_PER_PASS;
        const bool valid = inside && b_rows[i] != nullptr;
        copy_16(shared_address(b_stage + row * STRIDE + chunk * 8), valid ? b_rows[i] + column : any_address, valid);
    }
}

// acc += A[BLOCK_M, depth] * B[BLOCK_N, depth]^T over the rows given per thread (stage_slice).
// Warp (warp_m, warp_n) owns rows warp_m * WARP_M.. and B rows warp_n * WARP_N..; acc[mf][nf] is
// the m16n8 accumulator of its rows mf * 16.. and B rows nf * 8.. (c0, c1: row lane / 4, columns
// 2 (lane % 4) + {0, 1}; c2, c3: row lane / 4 + 8).
__device__ __forceinline__ void multiply_tile(float (&acc)[M_FRAGS][N_FRAGS][4], bf16_bits* shared,
                                              const bf16_bits* const* a_rows, const bf16_bits* const* b_rows,
                                              int depth, const bf16_bits* any_address) {
    const int slices = (depth + BLOCK_K - 1) / BLOCK_K;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    // A fragment (16 rows x 16 k): matrices 0..3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7),
    // (rows 0-7, k 8-15), (rows 8-15, k 8-15) = registers a0..a3 of mma's row-major A.
    const int a_row = warp_m * WARP_M + lane % 16;
    const int a_column = (lane / 16) * 8;
    // Two B fragments (n 0-7 and n 8-15, each 16 k): matrices 0..3 = (n 0-7, k 0-7), (n 0-7,
    // k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = b0, b1 of the first and b0, b1 of the second
    // (B column-major is a weight row per n, K-contiguous, as staged).
    const int b_row = warp_n * WARP_N + (lane / 16) * 8 + lane % 8;
    const int b_column = ((lane / 8) % 2) * 8;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < slices) stage_slice(shared + s * STAGE_ELEMENTS, a_rows, b_rows, s * BLOCK_K, depth, any_address);
        commit_copies();   // one group per slice, empty ones included, so the wait count below holds
    }
    for (int slice = 0; slice < slices; ++slice) {
        wait_copies<STAGES - 2>();   // this slice's group (STAGES - 2 later ones may still fly)
        __syncthreads();             // its copies are visible; every warp is done with slice - 1's buffer
        const int next = slice + STAGES - 1;
        if (next < slices) {
            stage_slice(shared + (next % STAGES) * STAGE_ELEMENTS, a_rows, b_rows, next * BLOCK_K, depth, any_address);
        }
        commit_copies();
        const bf16_bits* a_stage = shared + (slice % STAGES) * STAGE_ELEMENTS;
        const bf16_bits* b_stage = a_stage + BLOCK_M * STRIDE;
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
            unsigned a[M_FRAGS][4], b[N_FRAGS][2];
#pragma unroll
            for (int mf = 0; mf < M_FRAGS; ++mf) {
                load_matrices(a[mf], shared_address(a_stage + (a_row + mf * 16) * STRIDE + kk * 16 + a_column));
            }
#pragma unroll
            for (int pair = 0; pair < N_FRAGS / 2; ++pair) {
                unsigned r[4];
                load_matrices(r, shared_address(b_stage + (b_row + pair * 16) * STRIDE + kk * 16 + b_column));
                b[2 * pair][0] = r[0];
                b[2 * pair][1] = r[1];
                b[2 * pair + 1][0] = r[2];
                b[2 * pair + 1][1] = r[3];
            }
#pragma unroll
            for (int mf = 0; mf < M_FRAGS; ++mf) {
#pragma unroll
                for (int nf = 0; nf < N_FRAGS; ++nf) mma_16x8x16(acc[mf][nf], a[mf], b[nf]);
            }
        }
    }
    wait_copies<0>();
}

// Grid: (1); ALIGN_THREADS threads. chosen [pairs] int32 (the router's [N, k], flat);
// sorted_pairs [max_tiles * block_m] and tile_expert [max_tiles] int32, both written whole.
// Expert ids outside [0, num_experts) are skipped (their rows of the result are undefined).
extern "C" __global__ void __launch_bounds__(ALIGN_THREADS) moe_align(
    const int* __restrict__ chosen, int pairs, int num_experts, int block_m, int max_tiles,
    int* __restrict__ sorted_pairs, int* __restrict__ tile_expert)
{
    __shared__ int counts[MAX_EXPERTS];        // pairs per expert, then the scatter cursors
    __shared__ int tile_start[MAX_EXPERTS + 1];
    __shared__ int scan[ALIGN_THREADS];
    const int tid = threadIdx.x;
    if (tid < num_experts) counts[tid] = 0;
    for (int i = tid; i < max_tiles * block_m; i += ALIGN_THREADS) sorted_pairs[i] = -1;
    __syncthreads();
    for (int p = tid; p < pairs; p += ALIGN_THREADS) {
        const int expert = chosen[p];
        if (expert >= 0 && expert < num_experts) atomicAdd(&counts[expert], 1);
    }
    __syncthreads();
    // Inclusive scan of the tiles per expert (one expert per thread).
    scan[tid] = tid < num_experts ? (counts[tid] + block_m - 1) / block_m : 0;
    __syncthreads();
    for (int offset = 1; offset < ALIGN_THREADS; offset *= 2) {
        const int before = tid >= offset ? scan[tid - offset] : 0;
        __syncthreads();
        scan[tid] += before;
        __syncthreads();
    }
    if (tid < num_experts) {
        tile_start[tid + 1] = scan[tid];
        counts[tid] = 0;
    }
    if (tid == 0) tile_start[0] = 0;
    __syncthreads();
    const int used = tile_start[num_experts];
    for (int t = tid; t < max_tiles; t += ALIGN_THREADS) {
        int expert = -1;
        if (t < used) {   // the last expert whose first tile is at or before t (it owns t)
            int low = 0, high = num_experts - 1;
            while (low < high) {
                const int middle = (low + high + 1) / 2;
                if (tile_start[middle] <= t) low = middle; else high = middle - 1;
            }
            expert = low;
        }
        tile_expert[t] = expert;
    }
    for (int p = tid; p < pairs; p += ALIGN_THREADS) {
        const int expert = chosen[p];
        if (expert >= 0 && expert < num_experts) {
            const int slot = atomicAdd(&counts[expert], 1);
            sorted_pairs[tile_start[expert] * block_m + slot] = p;
        }
    }
}

// Grid: (ceil(I / (BLOCK_N / 2)), max_tiles); THREADS threads; STAGES * STAGE_ELEMENTS bf16 of
// dynamic shared memory. x [N, H], gate_up [E * 2I, H] bf16 bits (expert e: I gate rows, then I
// up rows); act [max_tiles * BLOCK_M, I] bf16 bits, row = the pair's padded slot.
// GPT-OSS's activation of a gate and an up sum (metrale.kernels.moe_clamped's clamped_swiglu_reference).
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float alpha, float limit) {
    gate = fminf(gate, limit);
    up = fminf(fmaxf(up, -limit), limit);
    return (up + 1.f) * gate / (1.f + expf(-alpha * gate));
}

// gate_up_bias [E * 2I] float32 or null: added to the sums. clamped: GPT-OSS's activation
// (up clamped to +-limit, gate to at most limit, (up + 1) * gate * sigmoid(alpha * gate)) instead
// of silu(gate) * up.
extern "C" __global__ void __launch_bounds__(THREADS) moe_grouped_gate_up(
    const bf16_bits* __restrict__ x, const bf16_bits* __restrict__ gate_up, const int* __restrict__ sorted_pairs,
    const int* __restrict__ tile_expert, int top_k, int hidden, int inter, bf16_bits* __restrict__ act,
    const float* __restrict__ gate_up_bias, int clamped, float alpha, float limit)
{
    DYNAMIC_SHARED;
    const int tile = blockIdx.y;
    const int expert = tile_expert[tile];
    if (expert < 0) return;
    bf16_bits* shared = reinterpret_cast<bf16_bits*>(dynamic_shared);
    const int column0 = blockIdx.x * (BLOCK_N / 2);   // first gate (and up) column of the block

    const bf16_bits* a_rows[A_COPIES];
    const bf16_bits* b_rows[B_COPIES];
#pragma unroll
    for (int i = 0; i < A_COPIES; ++i) {
        const int pair = sorted_pairs[tile * BLOCK_M + threadIdx.x / ROW_CHUNKS + i * ROWS_PER_PASS];
        a_rows[i] = pair >= 0 ? x + (long long)(pair / top_k) * hidden : nullptr;
    }
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i) {
        // Staged B rows in groups of eight: even groups gate rows, odd groups the up rows of
        // the same columns.
        const int row = threadIdx.x / ROW_CHUNKS + i * ROWS_PER_PASS;
        const int group = row / 8;
        const int column = column0 + (group / 2) * 8 + row % 8;
        b_rows[i] = column < inter
            ? gate_up + ((long long)expert * 2 * inter + (group % 2) * inter + column) * hidden : nullptr;
    }
    float acc[M_FRAGS][N_FRAGS][4];
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf) {
#pragma unroll
        for (int nf = 0; nf < N_FRAGS; ++nf) acc[mf][nf][0] = acc[mf][nf][1] = acc[mf][nf][2] = acc[mf][nf][3] = 0.f;
    }
    multiply_tile(acc, shared, a_rows, b_rows, hidden, x);

    // Fragment nf of a warp is staged group warp_n * N_FRAGS + nf: nf = 2j holds gate and
    // nf = 2j + 1 up sums of columns column0 + (warp_n * N_FRAGS / 2 + j) * 8 + 2 (lane % 4) + {0, 1}.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_m * WARP_M + mf * 16 + lane / 4 + half * 8;
            bf16_bits* target = act + ((long long)tile * BLOCK_M + row) * inter;
#pragma unroll
            for (int j = 0; j < N_FRAGS / 2; ++j) {
                const int column = column0 + (warp_n * (N_FRAGS / 2) + j) * 8 + (lane % 4) * 2;
                if (column >= inter) continue;
                float gate0 = acc[mf][2 * j][2 * half], gate1 = acc[mf][2 * j][2 * half + 1];
                float up0 = acc[mf][2 * j + 1][2 * half], up1 = acc[mf][2 * j + 1][2 * half + 1];
                if (gate_up_bias != nullptr) {
                    const float* bias = gate_up_bias + (long long)expert * 2 * inter + column;
                    gate0 += bias[0];
                    gate1 += bias[1];
                    up0 += bias[inter];
                    up1 += bias[inter + 1];
                }
                *reinterpret_cast<unsigned*>(target + column) =
                    clamped ? pack_bf16(clamped_swiglu(gate0, up0, alpha, limit), clamped_swiglu(gate1, up1, alpha, limit))
                            : pack_bf16(gate0 / (1.f + expf(-gate0)) * up0, gate1 / (1.f + expf(-gate1)) * up1);
            }
        }
    }
}

// Grid: (ceil(H / BLOCK_N), max_tiles); THREADS threads; dynamic shared memory as gate_up.
// act [max_tiles * BLOCK_M, I], down [E * H, I] bf16 bits; weights [N * k] float32;
// pair_out [N * k, H] float32: row n * k + s = weights[n, s] * down_e act (padding rows skipped).
// down_bias [E * H] float32 or null: added to the products before the routing weight scales them.
extern "C" __global__ void __launch_bounds__(THREADS) moe_grouped_down(
    const bf16_bits* __restrict__ act, const bf16_bits* __restrict__ down, const int* __restrict__ sorted_pairs,
    const int* __restrict__ tile_expert, const float* __restrict__ weights, int hidden, int inter,
    float* __restrict__ pair_out, const float* __restrict__ down_bias)
{
    DYNAMIC_SHARED;
    const int tile = blockIdx.y;
    const int expert = tile_expert[tile];
    if (expert < 0) return;
    bf16_bits* shared = reinterpret_cast<bf16_bits*>(dynamic_shared);
    const int column0 = blockIdx.x * BLOCK_N;

    const bf16_bits* a_rows[A_COPIES];
    const bf16_bits* b_rows[B_COPIES];
#pragma unroll
    for (int i = 0; i < A_COPIES; ++i) {   // padding rows of act hold zeros (gate_up wrote them)
        a_rows[i] = act + ((long long)tile * BLOCK_M + threadIdx.x / ROW_CHUNKS + i * ROWS_PER_PASS) * inter;
    }
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i) {
        const int column = column0 + threadIdx.x / ROW_CHUNKS + i * ROWS_PER_PASS;
        b_rows[i] = column < hidden ? down + ((long long)expert * hidden + column) * inter : nullptr;
    }
    float acc[M_FRAGS][N_FRAGS][4];
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf) {
#pragma unroll
        for (int nf = 0; nf < N_FRAGS; ++nf) acc[mf][nf][0] = acc[mf][nf][1] = acc[mf][nf][2] = acc[mf][nf][3] = 0.f;
    }
    multiply_tile(acc, shared, a_rows, b_rows, inter, act);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_m * WARP_M + mf * 16 + lane / 4 + half * 8;
            const int pair = sorted_pairs[tile * BLOCK_M + row];
            if (pair < 0) continue;
            const float weight = weights[pair];
            float* target = pair_out + (long long)pair * hidden;
#pragma unroll
            for (int nf = 0; nf < N_FRAGS; ++nf) {
                const int column = column0 + warp_n * WARP_N + nf * 8 + (lane % 4) * 2;
                if (column >= hidden) continue;
                float low = acc[mf][nf][2 * half], high = acc[mf][nf][2 * half + 1];
                if (down_bias != nullptr) {
                    low += down_bias[(long long)expert * hidden + column];
                    high += down_bias[(long long)expert * hidden + column + 1];
                }
                *reinterpret_cast<float2*>(target + column) = make_float2(low * weight, high * weight);
            }
        }
    }
}

// Grid: (any); any block size. pair_out [N * k, H] float32; out [N, H] float32; H % 4 == 0.
extern "C" __global__ void moe_sum_pairs(const float* __restrict__ pair_out, int tokens, int top_k, int hidden,
                                         float* __restrict__ out)
{
    const int quads = hidden / 4;
    const long long total = (long long)tokens * quads;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long token = i / quads;
        const int quad = (int)(i % quads);
        const float4* source = reinterpret_cast<const float4*>(pair_out + token * top_k * hidden) + quad;
        float4 sum = source[0];
        for (int s = 1; s < top_k; ++s) {
            const float4 value = source[(long long)s * quads];
            sum.x += value.x;
            sum.y += value.y;
            sum.z += value.z;
            sum.w += value.w;
        }
        reinterpret_cast<float4*>(out)[i] = sum;
    }
}
"""

#: The whole module, tile constants as placeholders.
SOURCE = INSTRUCTIONS + CONSTANTS + KERNELS

_kernels: dict[Tiling, dict[str, Any]] = {}
KERNEL_NAMES = ("moe_align", "moe_grouped_gate_up", "moe_grouped_down", "moe_sum_pairs")


def constants(tiling: Tiling = TILING) -> str:
    """:data:`CONSTANTS` for ``tiling``."""
    return (CONSTANTS.replace("__BLOCK_M__", str(tiling.block_m)).replace("__BLOCK_N__", str(tiling.block_n))
            .replace("__WARPS_M__", str(tiling.warps_m)).replace("__WARPS_N__", str(tiling.warps_n))
            .replace("__STAGES__", str(tiling.stages)).replace("__BLOCK_K__", str(tiling.block_k)))


def source(tiling: Tiling = TILING) -> str:
    """:data:`SOURCE` specialised to ``tiling``."""
    return INSTRUCTIONS + constants(tiling) + KERNELS


def _kernel(tiling: Tiling, name: str) -> Any:
    """The compiled kernel ``name`` for ``tiling`` (NVRTC, once per process and tiling)."""
    kernels = _kernels.get(tiling)
    if kernels is None:
        import cupy

        module = cupy.RawModule(code=source(tiling), options=("--std=c++17",))
        kernels = {kernel: module.get_function(kernel) for kernel in KERNEL_NAMES}
        if tiling.shared_bytes > 48 * 1024:  # the products' buffers: beyond the default, opted into
            for product in ("moe_grouped_gate_up", "moe_grouped_down"):
                kernels[product].max_dynamic_shared_size_bytes = tiling.shared_bytes
        _kernels[tiling] = kernels
    return kernels[name]


def tiling_for(tokens: int, top_k: int, num_experts: int) -> Tiling:
    """The tiling the engine runs ``tokens`` tokens' routed experts with: :data:`TILING`, or
    :data:`LARGE_TILING` once an expert gets :data:`LARGE_TILING_ROWS` pairs on average (its
    larger tiles then waste few padding rows)."""
    return LARGE_TILING if tokens * top_k >= LARGE_TILING_ROWS * num_experts else TILING


# ------------------------------------------------------------------------------ references


def grouped_experts_reference(
    x: np.ndarray, chosen: np.ndarray, weights: np.ndarray, gate_up: np.ndarray, down: np.ndarray
) -> np.ndarray:
    """``[N, H]`` float32: ``sum_s weights[n, s] * down_e(silu(gate_e x[n]) * up_e x[n])`` with
    ``e = chosen[n, s]``, from ``gate_up [E * 2I, H]`` and ``down [E * H, I]``.

    :func:`metrale.kernels.moe.experts_reference`'s sum (float32 throughout, the slots added in
    order ``s = 0 .. k - 1``), computed one expert at a time: each expert's pairs as one matrix."""
    x = np.asarray(x, dtype=np.float32)
    gate_up = np.asarray(gate_up, dtype=np.float32)
    down = np.asarray(down, dtype=np.float32)
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    inter = down.shape[1]
    flat = np.asarray(chosen, dtype=np.int64).reshape(-1)
    scale = np.asarray(weights, dtype=np.float32).reshape(-1)
    pair_out = np.zeros((tokens * top_k, hidden), dtype=np.float32)
    for expert in np.unique(flat):
        pairs = np.flatnonzero(flat == expert)
        e = int(expert)
        gu = x[pairs // top_k] @ gate_up[2 * inter * e : 2 * inter * (e + 1)].T
        gate, up = gu[:, :inter], gu[:, inter:]
        act = gate / sigmoid_denominator(gate) * up
        pair_out[pairs] = scale[pairs, None] * (act @ down[hidden * e : hidden * (e + 1)].T)
    out = np.zeros((tokens, hidden), dtype=np.float32)
    by_slot = pair_out.reshape(tokens, top_k, hidden)
    for s in range(top_k):
        out += by_slot[:, s]
    return out


def max_tiles(pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Tiles of ``block_m`` rows enough for ``pairs`` pairs over ``num_experts`` experts, each
    expert's run padded to whole tiles: ``ceil(pairs / block_m)`` plus at most one partial tile
    per expert that has pairs. From the shapes alone, so a grid never depends on the routing."""
    return -(-pairs // block_m) + min(num_experts, pairs)


def align_reference(chosen: np.ndarray, num_experts: int, block_m: int = BLOCK_M) -> tuple[np.ndarray, np.ndarray]:
    """What the alignment kernel writes, with each expert's pairs in increasing order (the kernel
    leaves their order arbitrary): ``sorted_pairs [max_tiles * block_m]`` int32, the pairs
    ``n * k + s`` grouped by expert, each expert's run starting at a tile boundary and padded with
    -1; ``tile_expert [max_tiles]`` int32, each tile's expert, -1 past the last used tile."""
    flat = np.asarray(chosen, dtype=np.int64).reshape(-1)
    tiles = max_tiles(flat.size, num_experts, block_m)
    sorted_pairs = np.full(tiles * block_m, -1, dtype=np.int32)
    tile_expert = np.full(tiles, -1, dtype=np.int32)
    tile = 0
    for expert in range(num_experts):
        pairs = np.flatnonzero(flat == expert)
        if not pairs.size:
            continue
        sorted_pairs[tile * block_m : tile * block_m + pairs.size] = pairs
        count = -(-pairs.size // block_m)
        tile_expert[tile : tile + count] = expert
        tile += count
    return sorted_pairs, tile_expert


# ------------------------------------------------------------------------------- launchers


def supports(hidden: int, inter: int, num_experts: int) -> bool:
    """Whether the grouped kernels serve the shape: ``H`` and ``I`` multiples of 8 (16-byte rows
    of bf16 values), at most :data:`MAX_EXPERTS` experts."""
    return hidden > 0 and inter > 0 and hidden % 8 == 0 and inter % 8 == 0 and 0 < num_experts <= MAX_EXPERTS


def _check_aligned(op: str, name: str, array: Any) -> None:
    data = getattr(array, "data", None)
    pointer = getattr(data, "ptr", None)
    if pointer is not None and pointer % 16:
        raise KernelArgumentError(f"{op}: {name} does not start at a 16-byte boundary")


def align(chosen: DeviceArray, num_experts: int, sorted_pairs: DeviceArray, tile_expert: DeviceArray,
          block_m: int = BLOCK_M, stream: Any = None) -> tuple[DeviceArray, DeviceArray]:
    """Launch the alignment kernel: from ``chosen [N, k]`` int32, ``sorted_pairs [T * block_m]``
    and ``tile_expert [T]`` int32 (``T = max_tiles(N * k, num_experts, block_m)``) as
    :func:`align_reference` describes, each expert's pairs in an arbitrary order."""
    op = "moe_align"
    check_array(op, "chosen", chosen, np.int32, ndim=2)
    pairs = chosen.shape[0] * chosen.shape[1]
    if not 0 < num_experts <= MAX_EXPERTS:
        raise KernelArgumentError(f"{op}: {num_experts} experts are unsupported (at most {MAX_EXPERTS})")
    if block_m <= 0:
        raise KernelArgumentError(f"{op}: block_m must be positive, got {block_m}")
    tiles = max_tiles(pairs, num_experts, block_m)
    check_array(op, "sorted_pairs", sorted_pairs, np.int32, (tiles * block_m,))
    check_array(op, "tile_expert", tile_expert, np.int32, (tiles,))
    if tiles:
        import contextlib

        arguments = (chosen, np.int32(pairs), np.int32(num_experts), np.int32(block_m), np.int32(tiles), sorted_pairs,
                     tile_expert)
        with stream if stream is not None else contextlib.nullcontext():
            _kernel(TILING, "moe_align")((1,), (ALIGN_THREADS,), arguments)
    return sorted_pairs, tile_expert


def grouped_experts(
    x: DeviceArray, chosen: DeviceArray, weights: DeviceArray, gate_up: DeviceArray, down: DeviceArray,
    sorted_pairs: DeviceArray, tile_expert: DeviceArray, act: DeviceArray, pair_out: DeviceArray, out: DeviceArray,
    stream: Any = None, tiling: Tiling = TILING, *, gate_up_bias: DeviceArray | None = None,
    down_bias: DeviceArray | None = None, clamp: tuple[float, float] | None = None,
) -> DeviceArray:
    """The routed experts of ``x [N, H]`` (bf16 bits) as grouped products: ``out [N, H]`` float32,
    as :func:`grouped_experts_reference` (with ``act`` rounded to bf16). ``chosen [N, k]`` int32,
    ``weights [N, k]`` float32; ``gate_up [E * 2I, H]``, ``down [E * H, I]`` bf16 bits. Scratch,
    with ``T = max_tiles(N * k, E, tiling.block_m)``: ``sorted_pairs [T * block_m]`` and
    ``tile_expert [T]`` int32, ``act [T * block_m, I]`` bf16 bits, ``pair_out [N * k, H]``
    float32. Four launches, no host synchronisation.

    GPT-OSS's experts (:func:`metrale.kernels.moe_clamped.clamped_experts_reference`) take the
    same launches: ``gate_up_bias [E * 2I]`` and ``down_bias [E * H]`` float32 added to the
    products, and ``clamp=(alpha, limit)`` for its clamped SwiGLU in place of ``silu(gate) * up``."""
    op = "moe_grouped_experts"
    check_array(op, "x", x, np.uint16, ndim=2)
    tokens, hidden = x.shape
    check_array(op, "chosen", chosen, np.int32, (tokens, None))
    top_k = chosen.shape[1]
    check_array(op, "weights", weights, np.float32, (tokens, top_k))
    check_array(op, "down", down, np.uint16, ndim=2)
    inter = down.shape[1]
    num_experts = down.shape[0] // hidden if hidden else 0
    check_array(op, "down", down, np.uint16, (num_experts * hidden, inter))
    check_array(op, "gate_up", gate_up, np.uint16, (num_experts * 2 * inter, hidden))
    if not supports(hidden, inter, num_experts):
        raise KernelArgumentError(f"{op}: hidden size {hidden}, expert width {inter} and {num_experts} experts are "
                                  f"unsupported (multiples of 8, at most {MAX_EXPERTS} experts)")
    if not tiling.valid():
        raise KernelArgumentError(f"{op}: tiling {tiling} is not valid")
    pairs = tokens * top_k
    tiles = max_tiles(pairs, num_experts, tiling.block_m)
    if tiles > MAX_GRID_Y:
        raise KernelArgumentError(f"{op}: {pairs} pairs need {tiles} tiles, more than a grid holds ({MAX_GRID_Y})")
    check_array(op, "act", act, np.uint16, (tiles * tiling.block_m, inter))
    check_array(op, "pair_out", pair_out, np.float32, (pairs, hidden))
    check_array(op, "out", out, np.float32, (tokens, hidden))
    for name, array in (("x", x), ("gate_up", gate_up), ("down", down), ("act", act), ("pair_out", pair_out),
                        ("out", out)):
        _check_aligned(op, name, array)
    if gate_up_bias is not None:
        check_array(op, "gate_up_bias", gate_up_bias, np.float32, (num_experts * 2 * inter,))
    if down_bias is not None:
        check_array(op, "down_bias", down_bias, np.float32, (num_experts * hidden,))
    if not pairs:
        return out
    import contextlib

    align(chosen, num_experts, sorted_pairs, tile_expert, tiling.block_m, stream)
    threads, shared = (tiling.threads,), tiling.shared_bytes
    with stream if stream is not None else contextlib.nullcontext():
        null = np.uint64(0)
        alpha, limit = clamp if clamp is not None else (0.0, 0.0)
        _kernel(tiling, "moe_grouped_gate_up")(
            (-(-inter // (tiling.block_n // 2)), tiles), threads,
            (x, gate_up, sorted_pairs, tile_expert, np.int32(top_k), np.int32(hidden), np.int32(inter), act,
             gate_up_bias if gate_up_bias is not None else null, np.int32(clamp is not None), np.float32(alpha),
             np.float32(limit)),
            shared_mem=shared,
        )
        _kernel(tiling, "moe_grouped_down")(
            (-(-hidden // tiling.block_n), tiles), threads,
            (act, down, sorted_pairs, tile_expert, weights, np.int32(hidden), np.int32(inter), pair_out,
             down_bias if down_bias is not None else null),
            shared_mem=shared,
        )
        quads = tokens * hidden // 4
        _kernel(tiling, "moe_sum_pairs")(
            (min(-(-quads // SUM_THREADS), 8192),), (SUM_THREADS,),
            (pair_out, np.int32(tokens), np.int32(top_k), np.int32(hidden), out),
        )
    return out
