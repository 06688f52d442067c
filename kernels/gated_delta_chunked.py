"""The gated delta rule over prompt segments in its chunked form on tensor cores (CUDA C++ with
``mma.sync``, compiled by NVRTC through CuPy; docs/families.rst, "Chunked form").

It computes what :func:`metrale.kernels.gated_delta.prompt_rule_reference` computes (and
:func:`metrale.kernels.gated_delta.prompt_rule_kernel` on CUDA cores): segment ``s`` (rows
``starts[s]:starts[s + 1]``) runs the rule from ``state[slots[s]]``, updated in place. A block of
eight warps owns one (segment, head) and 32 or 64 of the state's columns (value dims, which
evolve independently; :func:`block_columns` picks the width) and walks the segment's chunks of
:data:`CHUNK` tokens in order, the float32 state ``S [d_k, columns]`` in registers as the
accumulators of its own update product. Per chunk, with ``gamma`` the in-chunk cumulative decays
and ``D_ij = exp(gamma_i - gamma_j)`` for ``j <= i``:

* ``K K^T`` and ``Q K^T`` on tensor cores (warps 0-3 and 4-7, 16 token rows each), masked and
  decayed into ``A = strict_lower(diag(beta) K K^T * D)`` (float32, shared) and ``P = lower(Q K^T
  * D)`` (bf16, kept in registers as the operand of the last product);
* ``K S`` and ``Q S`` on tensor cores: ``R = diag(beta) (V - diag(exp(gamma)) K S)`` and the
  output's first term ``diag(exp(gamma)) Q S``;
* ``T = (I + A)^-1`` by forward substitution on CUDA cores, in float32 shared memory, 16 rows
  at a time;
* ``V' = T R`` on tensor cores: the WY form's ``U - W S`` with ``U = T diag(beta) V`` and ``W =
  T diag(beta exp(gamma)) K``, evaluated without forming ``U`` and ``W``;
* ``O = diag(exp(gamma)) Q S + P V'`` and ``S <- exp(gamma_n) S + K^T diag(exp(gamma_n - gamma))
  V'`` on tensor cores.

Matrix-product operands are bf16 (``Q``, ``K``, ``S``, ``T``, ``R``, ``P``, ``V'``) with float32
accumulation; the state stays float32 from chunk to chunk and is written back to its slot once.
A last chunk shorter than :data:`CHUNK` is padded with zero rows (``g = beta = 0``, a no-op).
:func:`chunked_prompt_rule_reference` is the NumPy model of these steps, bf16 roundings
included. numba's CUDA simulator cannot run the kernel; its tests run it on the GPU, and its
source on the CPU through an emulation of the CUDA pieces it uses
(tests/kernels/test_gated_delta_chunked_emulated.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._tensor_cores import MMA_BF16

#: Tokens per chunk (docs/families.rst, "Chunked form").
CHUNK = 64
THREADS = 256
#: Key and value head sizes served.
HEAD_DIMS = (64, 128)
#: State columns one block may own: 32 spreads a few prompts over more multiprocessors, 64 does
#: less repeated per-chunk work when blocks are plentiful.
COLUMNS_CHOICES = (32, 64)

SOURCE = MMA_BF16 + r"""

#define KEY_DIM __KEY_DIM__
#define VALUE_DIM __VALUE_DIM__
#define COLUMNS __COLUMNS__              // state columns (value dims) of one block
#define SHARED_BYTES __SHARED_BYTES__    // the dynamic shared memory the launcher provides
#define CHUNK 64
#define THREADS 256
#define WARPS 8
#define FULL_MASK 0xffffffffu
#define KEY_STRIDE (KEY_DIM + 8)         // padded bf16 row of Q, K and S^T: fragment reads are bank-conflict free
#define TOKEN_STRIDE (CHUNK + 8)         // padded bf16 row of R^T, V'^T and the decayed V'^T
#define SOLVE_STRIDE (CHUNK + 4)         // padded float row of A and T
#define COLUMN_TILES (COLUMNS / 8)
#define HALF_TILES (COLUMNS / 16)        // column tiles of V' = T R per warp (two warps per row tile)
#define STATE_ROW_TILES (KEY_DIM / 16)
#define WARPS_PER_STATE_ROW (WARPS / STATE_ROW_TILES)
#define STATE_TILES (COLUMN_TILES / WARPS_PER_STATE_ROW)   // column tiles of the state per warp
#define QK_LOADS (CHUNK * KEY_DIM / 4 / THREADS)           // float4 loads of q (and of k) per thread and chunk

static_assert(STATE_ROW_TILES * WARPS_PER_STATE_ROW == WARPS, "state rows spread over the warps");
static_assert(STATE_TILES * WARPS_PER_STATE_ROW == COLUMN_TILES, "state columns spread over the warps");
static_assert(QK_LOADS * THREADS * 4 == CHUNK * KEY_DIM, "q and k tiles spread over the threads");
static_assert(VALUE_DIM % COLUMNS == 0, "whole column blocks");

typedef unsigned short bf16_bits;

// The shared memory, in this order (float arrays first, every size a multiple of 16 bytes).
#define LOWER_OFFSET 0                                                  // A [CHUNK][SOLVE_STRIDE] f32
#define INVERSE_OFFSET (LOWER_OFFSET + CHUNK * SOLVE_STRIDE * 4)        // T [CHUNK][SOLVE_STRIDE] f32
#define GAMMA_OFFSET (INVERSE_OFFSET + CHUNK * SOLVE_STRIDE * 4)        // gamma [CHUNK] f32
#define RATE_OFFSET (GAMMA_OFFSET + CHUNK * 4)                          // beta [CHUNK] f32
#define QUERIES_OFFSET (RATE_OFFSET + CHUNK * 4)                        // Q [CHUNK][KEY_STRIDE] bf16
#define KEYS_OFFSET (QUERIES_OFFSET + CHUNK * KEY_STRIDE * 2)           // K [CHUNK][KEY_STRIDE] bf16
#define STATE_T_OFFSET (KEYS_OFFSET + CHUNK * KEY_STRIDE * 2)           // S^T [COLUMNS][KEY_STRIDE] bf16
#define RESIDUAL_T_OFFSET (STATE_T_OFFSET + COLUMNS * KEY_STRIDE * 2)   // R^T [COLUMNS][TOKEN_STRIDE] bf16
#define CORRECTED_T_OFFSET (RESIDUAL_T_OFFSET + COLUMNS * TOKEN_STRIDE * 2)  // V'^T
#define DECAYED_T_OFFSET (CORRECTED_T_OFFSET + COLUMNS * TOKEN_STRIDE * 2)   // (diag(exp(gamma_n - gamma)) V')^T
#define SHARED_END (DECAYED_T_OFFSET + COLUMNS * TOKEN_STRIDE * 2)
static_assert(SHARED_END == SHARED_BYTES, "the launcher's shared memory size matches the layout");

__device__ __forceinline__ unsigned pack_bf16(float low, float high) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<unsigned*>(&pair);
}

__device__ __forceinline__ bf16_bits to_bf16(float value) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

__device__ __forceinline__ unsigned shared_pair(const bf16_bits* at) {
    return *reinterpret_cast<const unsigned*>(at);
}

// Two bf16 values of one column of a row-major tile, rows ``at`` and ``at + stride``, as a pair.
__device__ __forceinline__ unsigned column_pair(const bf16_bits* at, int stride) {
    return (unsigned)at[0] | ((unsigned)at[stride] << 16);
}

// The A operand of rows row0 and row0 + 8 (row0 = 16-row tile + lane / 4), k columns k0.. k0 + 15,
// from a row-major bf16 tile.
__device__ __forceinline__ void row_operand(unsigned* a, const bf16_bits* tile, int stride, int row0, int k0, int quad) {
    const bf16_bits* top = tile + row0 * stride + k0 + quad * 2;
    const bf16_bits* bottom = top + 8 * stride;
    a[0] = shared_pair(top);
    a[1] = shared_pair(bottom);
    a[2] = shared_pair(top + 8);
    a[3] = shared_pair(bottom + 8);
}

// The B operand of k rows k0 .. k0 + 15 and column n (= 8-column tile + lane / 4) of a matrix
// stored transposed (row n of ``tile`` holds its column n).
__device__ __forceinline__ void column_operand(unsigned* b, const bf16_bits* tile, int stride, int n, int k0, int quad) {
    const bf16_bits* at = tile + n * stride + k0 + quad * 2;
    b[0] = shared_pair(at);
    b[1] = shared_pair(at + 8);
}

// Grid: (S segments, H heads, VALUE_DIM / COLUMNS); THREADS threads; SHARED_BYTES dynamic shared
// memory. q, k [T, H, KEY_DIM] f32; v [T, H, VALUE_DIM] f32; g, beta [T, H] f32; state [slots, H,
// KEY_DIM, VALUE_DIM] f32 (in place); slots [S] int32; starts [S + 1] int32 (row offsets); out
// [T, H, VALUE_DIM] f32. Every float array 16-byte aligned.
extern "C" __global__ void __launch_bounds__(THREADS) gated_delta_chunked(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,
    const float* __restrict__ beta, float* __restrict__ state, const int* __restrict__ slots,
    const int* __restrict__ starts, int heads, float* __restrict__ out)
{
    extern __shared__ __align__(16) unsigned char shared[];
    float* lower = reinterpret_cast<float*>(shared + LOWER_OFFSET);
    float* inverse = reinterpret_cast<float*>(shared + INVERSE_OFFSET);
    float* gamma = reinterpret_cast<float*>(shared + GAMMA_OFFSET);
    float* rate = reinterpret_cast<float*>(shared + RATE_OFFSET);
    bf16_bits* queries = reinterpret_cast<bf16_bits*>(shared + QUERIES_OFFSET);
    bf16_bits* keys = reinterpret_cast<bf16_bits*>(shared + KEYS_OFFSET);
    bf16_bits* state_t = reinterpret_cast<bf16_bits*>(shared + STATE_T_OFFSET);
    bf16_bits* residual_t = reinterpret_cast<bf16_bits*>(shared + RESIDUAL_T_OFFSET);
    bf16_bits* corrected_t = reinterpret_cast<bf16_bits*>(shared + CORRECTED_T_OFFSET);
    bf16_bits* decayed_t = reinterpret_cast<bf16_bits*>(shared + DECAYED_T_OFFSET);

    const int segment = blockIdx.x, head = blockIdx.y, column0 = blockIdx.z * COLUMNS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;
    const int first = starts[segment], stop = starts[segment + 1];
    float* slot_state = state + ((long)slots[segment] * heads + head) * KEY_DIM * VALUE_DIM + column0;

    // This thread's state: rows (key dims) state_row0 and state_row0 + 8, columns
    // (state_tile0 + i) * 8 + 2 quad (+1) for i < STATE_TILES, in the accumulator layout.
    const int state_row0 = (warp % STATE_ROW_TILES) * 16 + group;
    const int state_tile0 = (warp / STATE_ROW_TILES) * STATE_TILES;
    float held[STATE_TILES][4];
#pragma unroll
    for (int i = 0; i < STATE_TILES; ++i) {
        const int column = (state_tile0 + i) * 8 + quad * 2;
        const float2 top = *reinterpret_cast<const float2*>(slot_state + (long)state_row0 * VALUE_DIM + column);
        const float2 bottom = *reinterpret_cast<const float2*>(slot_state + (long)(state_row0 + 8) * VALUE_DIM + column);
        held[i][0] = top.x; held[i][1] = top.y; held[i][2] = bottom.x; held[i][3] = bottom.y;
    }
    // S^T as bf16, the operand of K S and Q S.
#pragma unroll
    for (int i = 0; i < STATE_TILES; ++i) {
        const int column = (state_tile0 + i) * 8 + quad * 2;
        state_t[column * KEY_STRIDE + state_row0] = to_bf16(held[i][0]);
        state_t[(column + 1) * KEY_STRIDE + state_row0] = to_bf16(held[i][1]);
        state_t[column * KEY_STRIDE + state_row0 + 8] = to_bf16(held[i][2]);
        state_t[(column + 1) * KEY_STRIDE + state_row0 + 8] = to_bf16(held[i][3]);
    }

    // The chunk products: warps 0-3 the keys' side (A, R), warps 4-7 the queries' side (P, O),
    // each on token rows row0 and row1 of a 16-row tile.
    const bool keys_side = warp < 4;
    const int row0 = (warp % 4) * 16 + group, row1 = row0 + 8;
    const long head_stride = (long)heads;

    for (int base = first; base < stop; base += CHUNK) {
        const int count = min(CHUNK, stop - base);
        __syncthreads();   // every reader of the previous chunk's buffers is done

        // Stage the chunk: q and k as bf16 (zero rows past count), gamma (inclusive scan of g
        // by warp 0) and beta (zero past count).
        float g_low = 0.f, g_high = 0.f, beta_low = 0.f, beta_high = 0.f;
        if (warp == 0) {
            if (lane < count) {
                g_low = g[(base + lane) * head_stride + head];
                beta_low = beta[(base + lane) * head_stride + head];
            }
            if (lane + 32 < count) {
                g_high = g[(base + lane + 32) * head_stride + head];
                beta_high = beta[(base + lane + 32) * head_stride + head];
            }
        }
        float4 staged_q[QK_LOADS], staged_k[QK_LOADS];
#pragma unroll
        for (int i = 0; i < QK_LOADS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            const int r = e / (KEY_DIM / 4), c = (e % (KEY_DIM / 4)) * 4;
            staged_q[i] = staged_k[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < count) {
                const long at = ((base + r) * head_stride + head) * KEY_DIM + c;
                staged_q[i] = *reinterpret_cast<const float4*>(q + at);
                staged_k[i] = *reinterpret_cast<const float4*>(k + at);
            }
        }
#pragma unroll
        for (int i = 0; i < QK_LOADS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            const int r = e / (KEY_DIM / 4), c = (e % (KEY_DIM / 4)) * 4;
            *reinterpret_cast<uint2*>(&queries[r * KEY_STRIDE + c]) =
                make_uint2(pack_bf16(staged_q[i].x, staged_q[i].y), pack_bf16(staged_q[i].z, staged_q[i].w));
            *reinterpret_cast<uint2*>(&keys[r * KEY_STRIDE + c]) =
                make_uint2(pack_bf16(staged_k[i].x, staged_k[i].y), pack_bf16(staged_k[i].z, staged_k[i].w));
        }
        if (warp == 0) {
#pragma unroll
            for (int offset = 1; offset < 32; offset *= 2) {
                const float low = __shfl_up_sync(FULL_MASK, g_low, offset);
                const float high = __shfl_up_sync(FULL_MASK, g_high, offset);
                if (lane >= offset) {
                    g_low += low;
                    g_high += high;
                }
            }
            g_high += __shfl_sync(FULL_MASK, g_low, 31);
            gamma[lane] = g_low;
            gamma[lane + 32] = g_high;
            rate[lane] = beta_low;
            rate[lane + 32] = beta_high;
        }
        __syncthreads();

        const float last = gamma[count - 1];
        const float gamma0 = gamma[row0], gamma1 = gamma[row1];
        const float scale0 = expf(gamma0), scale1 = expf(gamma1);
        unsigned probabilities[CHUNK / 16][4];   // P as the A operand of P V' (queries' side)
        float result[COLUMN_TILES][4];           // O (queries' side)
        if (keys_side) {
            const float rate0 = rate[row0], rate1 = rate[row1];
            // v at this thread's places of R (float32, from global memory; zero past count).
            float value[COLUMN_TILES][4];
#pragma unroll
            for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                const int column = column0 + nt * 8 + quad * 2;
                const float* top_row = v + ((base + row0) * head_stride + head) * VALUE_DIM + column;
                const float* bottom_row = v + ((base + row1) * head_stride + head) * VALUE_DIM + column;
                float2 top = make_float2(0.f, 0.f), bottom = make_float2(0.f, 0.f);
                if (row0 < count) top = *reinterpret_cast<const float2*>(top_row);
                if (row1 < count) bottom = *reinterpret_cast<const float2*>(bottom_row);
                value[nt][0] = top.x; value[nt][1] = top.y; value[nt][2] = bottom.x; value[nt][3] = bottom.y;
            }
            // A = strict_lower(diag(beta) K K^T * D), float32 into shared memory.
            float products[CHUNK / 8][4];
#pragma unroll
            for (int nt = 0; nt < CHUNK / 8; ++nt) products[nt][0] = products[nt][1] = products[nt][2] = products[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
                unsigned a[4];
                row_operand(a, keys, KEY_STRIDE, row0, kk * 16, quad);
#pragma unroll
                for (int nt = 0; nt < CHUNK / 8; ++nt) {
                    unsigned b[2];
                    column_operand(b, keys, KEY_STRIDE, nt * 8 + group, kk * 16, quad);
                    mma_16x8x16(products[nt], a, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < CHUNK / 8; ++nt) {
                const int j = nt * 8 + quad * 2;
                const float gamma_j0 = gamma[j], gamma_j1 = gamma[j + 1];
                float2 top, bottom;
                top.x = j < row0 ? rate0 * products[nt][0] * expf(gamma0 - gamma_j0) : 0.f;
                top.y = j + 1 < row0 ? rate0 * products[nt][1] * expf(gamma0 - gamma_j1) : 0.f;
                bottom.x = j < row1 ? rate1 * products[nt][2] * expf(gamma1 - gamma_j0) : 0.f;
                bottom.y = j + 1 < row1 ? rate1 * products[nt][3] * expf(gamma1 - gamma_j1) : 0.f;
                *reinterpret_cast<float2*>(&lower[row0 * SOLVE_STRIDE + j]) = top;
                *reinterpret_cast<float2*>(&lower[row1 * SOLVE_STRIDE + j]) = bottom;
            }
            // R = diag(beta) (V - diag(exp(gamma)) K S), as bf16 R^T.
            float predicted[COLUMN_TILES][4];
#pragma unroll
            for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                predicted[nt][0] = predicted[nt][1] = predicted[nt][2] = predicted[nt][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
                unsigned a[4];
                row_operand(a, keys, KEY_STRIDE, row0, kk * 16, quad);
#pragma unroll
                for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                    unsigned b[2];
                    column_operand(b, state_t, KEY_STRIDE, nt * 8 + group, kk * 16, quad);
                    mma_16x8x16(predicted[nt], a, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                const int column = nt * 8 + quad * 2;
                residual_t[column * TOKEN_STRIDE + row0] = to_bf16(rate0 * (value[nt][0] - scale0 * predicted[nt][0]));
                residual_t[(column + 1) * TOKEN_STRIDE + row0] = to_bf16(rate0 * (value[nt][1] - scale0 * predicted[nt][1]));
                residual_t[column * TOKEN_STRIDE + row1] = to_bf16(rate1 * (value[nt][2] - scale1 * predicted[nt][2]));
                residual_t[(column + 1) * TOKEN_STRIDE + row1] = to_bf16(rate1 * (value[nt][3] - scale1 * predicted[nt][3]));
            }
        } else {
            // P = lower(Q K^T * D), bf16 in registers.
            float scores[CHUNK / 8][4];
#pragma unroll
            for (int nt = 0; nt < CHUNK / 8; ++nt) scores[nt][0] = scores[nt][1] = scores[nt][2] = scores[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
                unsigned a[4];
                row_operand(a, queries, KEY_STRIDE, row0, kk * 16, quad);
#pragma unroll
                for (int nt = 0; nt < CHUNK / 8; ++nt) {
                    unsigned b[2];
                    column_operand(b, keys, KEY_STRIDE, nt * 8 + group, kk * 16, quad);
                    mma_16x8x16(scores[nt], a, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < CHUNK / 8; ++nt) {
                const int j = nt * 8 + quad * 2;
                const float gamma_j0 = gamma[j], gamma_j1 = gamma[j + 1];
                scores[nt][0] = j <= row0 ? scores[nt][0] * expf(gamma0 - gamma_j0) : 0.f;
                scores[nt][1] = j + 1 <= row0 ? scores[nt][1] * expf(gamma0 - gamma_j1) : 0.f;
                scores[nt][2] = j <= row1 ? scores[nt][2] * expf(gamma1 - gamma_j0) : 0.f;
                scores[nt][3] = j + 1 <= row1 ? scores[nt][3] * expf(gamma1 - gamma_j1) : 0.f;
            }
#pragma unroll
            for (int kt = 0; kt < CHUNK / 16; ++kt) {
                // The accumulators of column tiles 2kt and 2kt + 1 are the A operand of tokens 16kt .. 16kt + 15.
                probabilities[kt][0] = pack_bf16(scores[2 * kt][0], scores[2 * kt][1]);
                probabilities[kt][1] = pack_bf16(scores[2 * kt][2], scores[2 * kt][3]);
                probabilities[kt][2] = pack_bf16(scores[2 * kt + 1][0], scores[2 * kt + 1][1]);
                probabilities[kt][3] = pack_bf16(scores[2 * kt + 1][2], scores[2 * kt + 1][3]);
            }
            // O = diag(exp(gamma)) Q S.
#pragma unroll
            for (int nt = 0; nt < COLUMN_TILES; ++nt) result[nt][0] = result[nt][1] = result[nt][2] = result[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
                unsigned a[4];
                row_operand(a, queries, KEY_STRIDE, row0, kk * 16, quad);
#pragma unroll
                for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                    unsigned b[2];
                    column_operand(b, state_t, KEY_STRIDE, nt * 8 + group, kk * 16, quad);
                    mma_16x8x16(result[nt], a, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                result[nt][0] *= scale0; result[nt][1] *= scale0;
                result[nt][2] *= scale1; result[nt][3] *= scale1;
            }
        }
        __syncthreads();

        // T = (I + A)^-1 (unit lower-triangular) in float32, 16 rows at a time: row i of T is
        // e_i - sum_{j < i} A_ij T_j. First every row of the panel gets the terms of the earlier
        // panels (final already), then one thread per column runs the panel's own 16 rows.
#pragma unroll 1
        for (int top = 0; top < CHUNK; top += 16) {
            for (int e = threadIdx.x; e < 16 * CHUNK; e += THREADS) {
                const int i = top + e / CHUNK, c = e % CHUNK;
                float x = c == i ? 1.f : 0.f;
                for (int j = c; j < top; ++j) x -= lower[i * SOLVE_STRIDE + j] * inverse[j * SOLVE_STRIDE + c];
                inverse[i * SOLVE_STRIDE + c] = x;
            }
            __syncthreads();
            if (threadIdx.x < top + 16) {
                const int c = threadIdx.x;
                float column[16];
#pragma unroll
                for (int r = 0; r < 16; ++r) column[r] = inverse[(top + r) * SOLVE_STRIDE + c];
#pragma unroll
                for (int r = 1; r < 16; ++r) {
#pragma unroll
                    for (int s = 0; s < r; ++s) column[r] -= lower[(top + r) * SOLVE_STRIDE + top + s] * column[s];
                }
#pragma unroll
                for (int r = 1; r < 16; ++r) inverse[(top + r) * SOLVE_STRIDE + c] = column[r];
            }
            __syncthreads();
        }

        // V' = T R: warp w takes token rows of tile w % 4 and half w / 4 of the columns; V'^T
        // and its decayed copy as bf16.
        {
            const int tile0 = (warp / 4) * HALF_TILES;
            float corrected[HALF_TILES][4];
#pragma unroll
            for (int nt = 0; nt < HALF_TILES; ++nt) {
                corrected[nt][0] = corrected[nt][1] = corrected[nt][2] = corrected[nt][3] = 0.f;
            }
#pragma unroll
            for (int kt = 0; kt < CHUNK / 16; ++kt) {
                const int k0 = kt * 16 + quad * 2;
                const float2 t00 = *reinterpret_cast<const float2*>(&inverse[row0 * SOLVE_STRIDE + k0]);
                const float2 t10 = *reinterpret_cast<const float2*>(&inverse[row1 * SOLVE_STRIDE + k0]);
                const float2 t01 = *reinterpret_cast<const float2*>(&inverse[row0 * SOLVE_STRIDE + k0 + 8]);
                const float2 t11 = *reinterpret_cast<const float2*>(&inverse[row1 * SOLVE_STRIDE + k0 + 8]);
                const unsigned a[4] = {pack_bf16(t00.x, t00.y), pack_bf16(t10.x, t10.y), pack_bf16(t01.x, t01.y),
                                       pack_bf16(t11.x, t11.y)};
#pragma unroll
                for (int nt = 0; nt < HALF_TILES; ++nt) {
                    unsigned b[2];
                    column_operand(b, residual_t, TOKEN_STRIDE, (tile0 + nt) * 8 + group, kt * 16, quad);
                    mma_16x8x16(corrected[nt], a, b);
                }
            }
            const float decay0 = expf(last - gamma0), decay1 = expf(last - gamma1);
#pragma unroll
            for (int nt = 0; nt < HALF_TILES; ++nt) {
                const int column = (tile0 + nt) * 8 + quad * 2;
                corrected_t[column * TOKEN_STRIDE + row0] = to_bf16(corrected[nt][0]);
                corrected_t[(column + 1) * TOKEN_STRIDE + row0] = to_bf16(corrected[nt][1]);
                corrected_t[column * TOKEN_STRIDE + row1] = to_bf16(corrected[nt][2]);
                corrected_t[(column + 1) * TOKEN_STRIDE + row1] = to_bf16(corrected[nt][3]);
                decayed_t[column * TOKEN_STRIDE + row0] = to_bf16(corrected[nt][0] * decay0);
                decayed_t[(column + 1) * TOKEN_STRIDE + row0] = to_bf16(corrected[nt][1] * decay0);
                decayed_t[column * TOKEN_STRIDE + row1] = to_bf16(corrected[nt][2] * decay1);
                decayed_t[(column + 1) * TOKEN_STRIDE + row1] = to_bf16(corrected[nt][3] * decay1);
            }
        }
        __syncthreads();

        // O += P V' and the chunk's output rows (queries' side).
        if (!keys_side) {
#pragma unroll
            for (int kt = 0; kt < CHUNK / 16; ++kt) {
#pragma unroll
                for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                    unsigned b[2];
                    column_operand(b, corrected_t, TOKEN_STRIDE, nt * 8 + group, kt * 16, quad);
                    mma_16x8x16(result[nt], probabilities[kt], b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < COLUMN_TILES; ++nt) {
                const int column = column0 + nt * 8 + quad * 2;
                if (row0 < count)
                    *reinterpret_cast<float2*>(out + ((base + row0) * head_stride + head) * VALUE_DIM + column) =
                        make_float2(result[nt][0], result[nt][1]);
                if (row1 < count)
                    *reinterpret_cast<float2*>(out + ((base + row1) * head_stride + head) * VALUE_DIM + column) =
                        make_float2(result[nt][2], result[nt][3]);
            }
        }

        // S <- exp(gamma_n) S + K^T (diag(exp(gamma_n - gamma)) V'); the A operand K^T pairs
        // two tokens of one key dim.
        const float decay = expf(last);
#pragma unroll
        for (int i = 0; i < STATE_TILES; ++i) {
            held[i][0] *= decay; held[i][1] *= decay; held[i][2] *= decay; held[i][3] *= decay;
        }
#pragma unroll
        for (int kt = 0; kt < CHUNK / 16; ++kt) {
            const bf16_bits* top = keys + (kt * 16 + quad * 2) * KEY_STRIDE + state_row0;
            const unsigned a[4] = {column_pair(top, KEY_STRIDE), column_pair(top + 8, KEY_STRIDE),
                                   column_pair(top + 8 * KEY_STRIDE, KEY_STRIDE),
                                   column_pair(top + 8 * KEY_STRIDE + 8, KEY_STRIDE)};
#pragma unroll
            for (int i = 0; i < STATE_TILES; ++i) {
                unsigned b[2];
                column_operand(b, decayed_t, TOKEN_STRIDE, (state_tile0 + i) * 8 + group, kt * 16, quad);
                mma_16x8x16(held[i], a, b);
            }
        }
#pragma unroll
        for (int i = 0; i < STATE_TILES; ++i) {
            const int column = (state_tile0 + i) * 8 + quad * 2;
            state_t[column * KEY_STRIDE + state_row0] = to_bf16(held[i][0]);
            state_t[(column + 1) * KEY_STRIDE + state_row0] = to_bf16(held[i][1]);
            state_t[column * KEY_STRIDE + state_row0 + 8] = to_bf16(held[i][2]);
            state_t[(column + 1) * KEY_STRIDE + state_row0 + 8] = to_bf16(held[i][3]);
        }
    }

#pragma unroll
    for (int i = 0; i < STATE_TILES; ++i) {
        const int column = (state_tile0 + i) * 8 + quad * 2;
        *reinterpret_cast<float2*>(slot_state + (long)state_row0 * VALUE_DIM + column) = make_float2(held[i][0], held[i][1]);
        *reinterpret_cast<float2*>(slot_state + (long)(state_row0 + 8) * VALUE_DIM + column) =
            make_float2(held[i][2], held[i][3]);
    }
}
"""


def _bf16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bf16 (nearest, ties to even) and widened back: an mma operand."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + ((bits >> 16) & 1) + np.uint32(0x7FFF)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def chunked_rule_model(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Outputs ``[n, H, d_v]`` and the final state ``[H, d_k, d_v]`` of one segment, step by step
    as the kernel computes them: float32 arithmetic, every matrix-product operand rounded to
    bf16. ``q, k [n, H, d_k]``, ``v [n, H, d_v]``, ``g, beta [n, H]``, ``state [H, d_k, d_v]``."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=np.float32)
    state = np.asarray(state, dtype=np.float32)
    for start in range(0, q.shape[0], CHUNK):
        stop = min(start + CHUNK, q.shape[0])
        n = stop - start
        # [H, n, ...] per head.
        queries = _bf16_rounded(q[start:stop].transpose(1, 0, 2))
        keys = _bf16_rounded(k[start:stop].transpose(1, 0, 2))
        values = np.asarray(v[start:stop], dtype=np.float32).transpose(1, 0, 2)
        rate = np.asarray(beta[start:stop], dtype=np.float32).T[:, :, None]
        gamma = np.cumsum(np.asarray(g[start:stop], dtype=np.float32).T, axis=1, dtype=np.float32)  # [H, n]
        lower = np.tril(np.ones((n, n), dtype=bool))
        strict = np.tril(np.ones((n, n), dtype=bool), -1)
        decay = np.exp(np.where(lower, gamma[:, :, None] - gamma[:, None, :], np.float32(0.0)))
        a = np.where(strict, rate * (keys @ keys.transpose(0, 2, 1)) * decay, np.float32(0.0))
        scores = _bf16_rounded(np.where(lower, (queries @ keys.transpose(0, 2, 1)) * decay, np.float32(0.0)))
        held = _bf16_rounded(state)
        scale = np.exp(gamma)[:, :, None]
        residual = _bf16_rounded(rate * (values - scale * (keys @ held)))
        result = scale * (queries @ held)
        inverse = np.zeros((q.shape[1], n, n), dtype=np.float32)
        for i in range(n):  # forward substitution: T_i = e_i - sum_{j < i} A_ij T_j
            inverse[:, i, i] = 1.0
            inverse[:, i, :i] = -np.einsum("hj,hjc->hc", a[:, i, :i], inverse[:, :i, :i])
        corrected = _bf16_rounded(inverse) @ residual
        last = gamma[:, -1:]
        result = result + scores @ _bf16_rounded(corrected)
        decayed = _bf16_rounded(np.exp(last - gamma)[:, :, None] * corrected)
        state = np.exp(last)[:, :, None] * state + keys.transpose(0, 2, 1) @ decayed
        out[start:stop] = result.transpose(1, 0, 2)
    return out, state


def chunked_prompt_rule_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                                  state: np.ndarray, slots: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """:func:`~metrale.kernels.gated_delta.prompt_rule_reference` as the kernel computes it
    (:func:`chunked_rule_model` per segment, a one-token segment included): ``[T, H, d_v]``, the
    segments' states updated in place."""
    out = np.zeros(v.shape, dtype=np.float32)
    for index, slot in enumerate(slots):
        first, last = int(starts[index]), int(starts[index + 1])
        out[first:last], state[slot] = chunked_rule_model(q[first:last], k[first:last], v[first:last], g[first:last],
                                                          beta[first:last], state[slot])
    return out


def supports(key_dim: int, value_dim: int) -> bool:
    """Whether this kernel serves the head sizes: ``d_k`` and ``d_v`` each 64 or 128."""
    return key_dim in HEAD_DIMS and value_dim in HEAD_DIMS


def shared_bytes(key_dim: int, columns: int) -> int:
    """Dynamic shared memory of one block: ``A`` and ``T`` (float32), ``gamma`` and ``beta``, ``Q``,
    ``K`` and ``S^T`` (bf16, rows padded by 8), ``R^T``, ``V'^T`` and its decayed copy (bf16)."""
    return (2 * CHUNK * (CHUNK + 4) * 4 + 2 * CHUNK * 4 + 2 * CHUNK * (key_dim + 8) * 2 + columns * (key_dim + 8) * 2
            + 3 * columns * (CHUNK + 8) * 2)


def block_columns(blocks_per_column: int, value_dim: int, multiprocessors: int) -> int:
    """State columns per block for ``blocks_per_column`` (segments x heads) blocks of each column
    range: 64 when that many blocks already cover the multiprocessors, else 32 (twice the blocks,
    each with half the per-column work)."""
    wide = min(COLUMNS_CHOICES[-1], value_dim)
    return wide if blocks_per_column * (value_dim // wide) >= multiprocessors else COLUMNS_CHOICES[0]


_kernels: dict[tuple[int, int, int], Any] = {}
_multiprocessors: dict[int, int] = {}


def _kernel(key_dim: int, value_dim: int, columns: int) -> Any:
    """The compiled kernel for the head sizes and block columns (NVRTC, once per process and
    variant), its dynamic shared memory limit raised to what it uses."""
    kernel = _kernels.get((key_dim, value_dim, columns))
    if kernel is None:
        import cupy

        source = (SOURCE.replace("__KEY_DIM__", str(key_dim)).replace("__VALUE_DIM__", str(value_dim))
                  .replace("__COLUMNS__", str(columns)).replace("__SHARED_BYTES__", str(shared_bytes(key_dim, columns))))
        module = cupy.RawModule(code=source, options=("--std=c++17",))
        kernel = module.get_function("gated_delta_chunked")
        kernel.max_dynamic_shared_size_bytes = shared_bytes(key_dim, columns)
        _kernels[(key_dim, value_dim, columns)] = kernel
    return kernel


def _multiprocessor_count() -> int:
    import cupy

    device = cupy.cuda.Device().id
    count = _multiprocessors.get(device)
    if count is None:
        count = _multiprocessors[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return count


def _address(array: Any) -> int | None:
    interface = getattr(array, "__cuda_array_interface__", None) or getattr(array, "__array_interface__", None)
    return None if interface is None else int(interface["data"][0])


def prompt_rule(q: DeviceArray, k: DeviceArray, v: DeviceArray, g: DeviceArray, beta: DeviceArray, state: DeviceArray,
                slots: DeviceArray, starts: DeviceArray, out: DeviceArray, stream: Any = None,
                columns: int | None = None) -> DeviceArray:
    """Every segment's tokens (``starts [S + 1]`` row offsets, distinct state ``slots [S]``) through
    the gated delta rule in chunks on tensor cores: ``out [T, H, d_v]`` float32, ``state [slots, H,
    d_k, d_v]`` float32 updated in place; ``q, k [T, H, d_k]``, ``v [T, H, d_v]``, ``g, beta [T,
    H]`` float32, every float array 16-byte aligned. ``columns`` (32 or 64, at most ``d_v``) fixes
    the state columns per block; by default :func:`block_columns` picks them."""
    op = "gdn_prompt_rule_chunked"
    check_array(op, "q", q, np.float32, ndim=3)
    tokens, heads, key_dim = q.shape
    check_array(op, "k", k, np.float32, (tokens, heads, key_dim))
    check_array(op, "v", v, np.float32, (tokens, heads, None))
    value_dim = v.shape[2]
    if not supports(key_dim, value_dim):
        raise KernelArgumentError(f"{op}: key and value heads of {key_dim} and {value_dim} dims are unsupported")
    check_array(op, "g", g, np.float32, (tokens, heads))
    check_array(op, "beta", beta, np.float32, (tokens, heads))
    check_array(op, "state", state, np.float32, (None, heads, key_dim, value_dim))
    check_array(op, "slots", slots, np.int32, ndim=1)
    check_array(op, "starts", starts, np.int32, (slots.shape[0] + 1,))
    check_array(op, "out", out, np.float32, tuple(v.shape))
    for name, array in (("q", q), ("k", k), ("v", v), ("state", state), ("out", out)):
        address = _address(array)
        if address is not None and address % 16:
            raise KernelArgumentError(f"{op}: {name} is not 16-byte aligned")
    if columns is not None and (columns not in COLUMNS_CHOICES or columns > value_dim):
        raise KernelArgumentError(f"{op}: {columns} state columns per block are unsupported for {value_dim} value dims")
    segments = slots.shape[0]
    if not (tokens and segments and heads):
        return out
    if columns is None:
        columns = block_columns(segments * heads, value_dim, _multiprocessor_count())
    arguments = (q, k, v, g, beta, state, slots, starts, np.int32(heads), out)
    kernel = _kernel(key_dim, value_dim, columns)
    with stream if stream is not None else contextlib.nullcontext():
        kernel((segments, heads, value_dim // columns), (THREADS,), arguments, shared_mem=shared_bytes(key_dim, columns))
    return out
