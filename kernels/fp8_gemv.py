"""The decode GEMV of FP8 weights whose scales factor out of the sums (CUDA C++, compiled by NVRTC
through CuPy): ``y[r, n] = s_x[r] s_w[n] sum_k q_x[r, k] q_w[n, k] (+ bias[n])``.

``W`` is a :class:`~metrale.kernels.quantized.QuantizedWeight` of FP8 E4M3 codes with one scale per
output channel or per tensor, its inputs quantized to FP8 per token (``fp8_token``: ``s_x[r] =
max|x[r]| / 448``) or with a static scale (``fp8_tensor``): what compressed-tensors' FP8 schemes and
online FP8 quantization (``quantization="fp8"``) give. Both scales are constant along the inner
size, so the products take the codes themselves and the scales apply once, to each output.

The loop is lean because nothing else happens in it: each lane loads 16 consecutive codes of each
of its two weight rows (one 16-byte load apiece), converts them to 8 f16 pairs each (one
instruction a pair: every E4M3 value is an f16 value) and feeds four ``mma.sync.m16n8k16`` f16
products with float32 sums; the input's 16 codes at the same inner positions, staged as f16 in
natural order, are its B fragments (two 16-byte shared-memory loads a row tile). With 16 output
columns as the M side and 8 input rows as the N side, a lane's A fragment takes inner positions
``16q + 4j .. 16q + 4j + 3`` for product ``j`` (``q`` the lane's quad position): the sum is over all
positions whichever order the products take them in, and the weights and inputs agree on it.
No scale, zero point or bound is read per step; a warp's steps continue from one column tile to the
next without draining its loads. Launched dependently (:mod:`metrale.kernels._launch`), a block
issues its first weight loads before it waits for the kernel ahead.

The prologue quantizes the input rows (up to :data:`SHARED_STAGE_MAX_ROWS`) into shared memory:
each block reads them with 16-byte loads, reduces each row's maximum, and writes the f16 values of
their E4M3 codes (bf16 rows read once, kept in shared memory between the two); more rows are
staged once into a global workspace by :mod:`metrale.kernels.quantized_gemv`'s ``stage_rows`` (the
same layout), which the product reads through the L1 cache. The prologue can take
``rmsnorm_residual`` in too: the sums of squares, then the norm's bf16 values into the codes' slots
with their maximum, then the codes.

The routed-expert form (:func:`fp8_decode_experts`) serves a MoE layer's decode rows over FP8
stacks of experts: a grid row per routed pair (token, slot), whose blocks find the pair's expert on
the device and run the one-row GEMV over that expert's rows of the stack -- the gated form for
gate and up into a bf16 scratch row, then the down product into a float32 one -- and a last kernel
weighs each token's pairs and sums them. Only the chosen experts' codes are read, at the GEMV's
rate.

:func:`fp8_gemv_reference` is the NumPy reference of a launch (:func:`fp8_decode_experts_reference`
of the routed form); ``tests/kernels`` runs the kernels on the host through the CUDA emulation
header against them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels import quantized_gemv as qg
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._tensor_cores import MMA_BF16
from metrale.kernels._words import HELPERS, aligned
from metrale.kernels.activation import silu_and_mul_reference
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import QuantizedWeight, dequantize, quantize_activations

#: Input schemes (template ``ACT``), numbered as :data:`metrale.kernels.quantized_gemv.ACTIVATIONS`.
ACTIVATIONS = {name: qg.ACTIVATIONS[name] for name in ("fp8_token", "fp8_tensor", "fp8_group")}
#: The scale blocks' size along the inner size of block-wise FP8 (``fp8_group`` inputs): weights'
#: columns and inputs' groups alike.
SCALE_BLOCK = 128
MAX_ROWS = 32
#: The most rows the prologue stages in shared memory; more are staged once by ``stage_rows``.
SHARED_STAGE_MAX_ROWS = 4
#: Pieces of 64 inner positions a warp loads per step (its loads for the next step in flight
#: during each): 4 KB of codes a warp.
UNROLL = 4
THREADS = qg.THREADS
WARPS = qg.WARPS


KERNELS = r"""
// 8 bf16 values (16 bytes) as floats, value i from half i.
__device__ __forceinline__ void bf16_eight(uint4 w, float* v) {
    v[0] = bf16_low(w.x); v[1] = bf16_high(w.x); v[2] = bf16_low(w.y); v[3] = bf16_high(w.y);
    v[4] = bf16_low(w.z); v[5] = bf16_high(w.z); v[6] = bf16_low(w.w); v[7] = bf16_high(w.w);
}

// 16 E4M3 codes (a 16-byte load) as 8 f16 pairs, pair i the codes 2i and 2i + 1.
__device__ __forceinline__ void fp8_pairs(uint4 codes, unsigned* pairs) {
    pairs[0] = e4m3x2_to_f16x2(codes.x); pairs[1] = e4m3x2_to_f16x2(codes.x >> 16);
    pairs[2] = e4m3x2_to_f16x2(codes.y); pairs[3] = e4m3x2_to_f16x2(codes.y >> 16);
    pairs[4] = e4m3x2_to_f16x2(codes.z); pairs[5] = e4m3x2_to_f16x2(codes.z >> 16);
    pairs[6] = e4m3x2_to_f16x2(codes.w); pairs[7] = e4m3x2_to_f16x2(codes.w >> 16);
}

// y[r, n] = s_x[r] s_w[n] dot(q_x[r, :], q_w[n, :]) (+ bias[n]) for r < rows <= 8 * ROW_TILES, n < N.
// x: INPUT [rows, K] (float32, or unsigned short: bf16 bits), rows 16-byte aligned; codes [N, K]
// E4M3, K a multiple of 16; s_w[n] = scales[n / block_rows]; s_x[r] = max|x[r]| / 448 (at least
// MIN_SCALE; ACT_FP8_TOKEN) or input_scale (ACT_FP8_TENSOR); q_x = the E4M3 codes of x / s_x.
// out: float32 [rows, N]; SWIGLU: codes [2N, K] (N gate rows, then N up rows), out bf16 bits [rows, N]
// = silu(g) * u of the scaled gate and up sums, a column tile holding 8 gate rows (as the MMA's
// rows 0-7) and their 8 up rows (rows 8-15), so a lane holds a unit's gate and up for its two rows.
// Grid: WARPS / SPLIT column tiles of 16 a block, round after round; SPLIT
// warps share a tile, each over a slice of whole 64-position pieces of the inner size.
// SHARED_STAGE: the prologue stages the rows in dynamic shared memory (rows * ceil(K / 64) * 128
// bytes of f16 codes, 64-position pieces zero-padded, then rows floats of scales, 16-byte aligned);
// otherwise staged_rows / staged_scales hold them (stage_rows, the same layout, the padding unread).
// Then (SPLIT > 1) the split's partial sums.
// EXPERTS: one routed pair a grid row (blockIdx.y), rows == 1: the pair's input row is x's row
// pair / pairs_per_row, its weight expert experts[pair]'s rows of a stack of experts' weights
// ([E * N, K], or [E * 2N, K] gate and up rows per expert; their scales stacked the same way), its
// output row out's row pair.
template <int ACT, int SPLIT, int ROW_TILES, bool SHARED_STAGE, int UNROLL, typename INPUT, bool SWIGLU, bool NORM,
          bool EXPERTS>
__global__ void __launch_bounds__(THREADS, ROW_TILES > 1 ? 1 : 2) fp8_gemv(
    const INPUT* __restrict__ x, float input_scale, const uint4* __restrict__ staged_rows,
    const float* __restrict__ staged_scales, const unsigned char* __restrict__ codes,
    const float* __restrict__ scales, int block_rows, const float* __restrict__ bias, float* __restrict__ out,
    int rows, int K, int N, const float* __restrict__ residual, const unsigned short* __restrict__ norm_weight,
    float eps, float norm_offset, float* __restrict__ summed, const int* __restrict__ experts, int pairs_per_row) {
    DYNAMIC_SHARED;
    __shared__ float partial_max[4 * WARPS];
    __shared__ float norm_scales[4];
    allow_dependents();
    if constexpr (EXPERTS) {
        // The chosen expert comes from the kernel ahead: nothing is loaded before it is known.
        wait_for_producers();
        const int pair = blockIdx.y, expert = experts[pair];
        const size_t weight_rows = SWIGLU ? 2 * (size_t)N : (size_t)N;
        x += (size_t)(pair / pairs_per_row) * K;
        codes += (size_t)expert * weight_rows * K;
        scales += (size_t)expert * (weight_rows / block_rows) * (ACT == ACT_FP8_GROUP ? (K + 127) / 128 : 1);
        out = reinterpret_cast<float*>(reinterpret_cast<char*>(out) + (size_t)pair * N * (SWIGLU ? 2 : 4));
    }
    constexpr int GROUPS = WARPS / SPLIT;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int pieces = (K + 63) / 64, stride = pieces * 8;   // stride: 16-byte chunks of a staged row
    // ACT_FP8_GROUP: slices of whole 128-position scale blocks (an even count of pieces).
    const int slice = ACT == ACT_FP8_GROUP ? (pieces + 2 * SPLIT - 1) / (2 * SPLIT) * 2 : (pieces + SPLIT - 1) / SPLIT;
    const int part = warp % SPLIT;
    const int groups = (K + 127) / 128;   // ACT_FP8_GROUP: scale blocks along K (weights and inputs)
    const int first_piece = part * slice;
    const int own = max(0, min(pieces, first_piece + slice) - first_piece);   // this warp's pieces
    // Byte offsets (from the lane's first code of the slice) below `limit` hold codes of this slice.
    const int limit = min(64 * own, K - 64 * first_piece - 16 * q);
    const int batches = (slice + UNROLL - 1) / UNROLL;   // the same for every warp of the block
    const int tiles = SWIGLU ? (N + 7) / 8 : (N + 15) / 16;
    const int tile_stride = gridDim.x * GROUPS;
    const int first_tile = blockIdx.x * GROUPS + warp / SPLIT;
    const int rounds = (tiles - (int)blockIdx.x * GROUPS + tile_stride - 1) / tile_stride;
    const int steps = rounds * batches;
    const uint4 zero = {0u, 0u, 0u, 0u};

    // Where a step is: batch `batch` of the warp's tile `tile`, the lane's two weight rows' codes
    // of the slice from `upper` and `lower`.
    struct Position {
        int tile, batch;
        int upper_row, lower_row;   // the lane's two weight rows
        const unsigned char* upper;
        const unsigned char* lower;
    };
    auto enter_tile = [&](Position& p, int tile) {
        p.tile = tile;
        p.batch = 0;
        const size_t offset = (size_t)(64 * first_piece + 16 * q);
        const int upper = SWIGLU ? min(tile * 8 + g, N - 1) : min(tile * 16 + g, N - 1);
        const int lower = SWIGLU ? upper + N : min(tile * 16 + g + 8, N - 1);
        p.upper_row = upper;
        p.lower_row = lower;
        p.upper = codes + (size_t)upper * (size_t)K + offset;
        p.lower = codes + (size_t)lower * (size_t)K + offset;
    };
    auto advance = [&](Position& p) {
        if (++p.batch == batches) enter_tile(p, p.tile + tile_stride);
    };
    auto load = [&](const Position& p, uint4* upper, uint4* lower) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int offset = (p.batch * UNROLL + u) * 64;
            const bool valid = p.tile < tiles && offset < limit;
            upper[u] = valid ? __ldg(reinterpret_cast<const uint4*>(p.upper + offset)) : zero;
            lower[u] = valid ? __ldg(reinterpret_cast<const uint4*>(p.lower + offset)) : zero;
        }
    };

    Position now, next;
    enter_tile(now, first_tile);
    next = now;
    advance(next);
    uint4 upper[UNROLL], lower[UNROLL], other_upper[UNROLL], other_lower[UNROLL];
    // The first two steps' codes in flight while the prologue runs; from then on two steps are
    // always in flight, a buffer reloaded as soon as its step is done.
    if (steps > 0) load(now, upper, lower);
    if (steps > 1) load(next, other_upper, other_lower);
    wait_for_producers();   // everything below reads or writes what other kernels touch

    const uint4* stage = staged_rows;
    const float* row_scales = staged_scales;
    if (SHARED_STAGE) {
        uint4* shared_stage = reinterpret_cast<uint4*>(dynamic_shared);
        float* shared_scales = reinterpret_cast<float*>(shared_stage + rows * stride);
        const int chunks = K / 8;
        // bf16 rows with per-token scales are read once: the first pass keeps each chunk (8 values,
        // 16 bytes) in the slot its codes take, the second quantizes it in place (the same thread).
        constexpr bool ONE_PASS = NORM || ((ACT == ACT_FP8_TOKEN || ACT == ACT_FP8_GROUP) && sizeof(INPUT) == 2);
        if constexpr (NORM) {
            // s = x (+ residual), float32; the bf16 values of s / rms(s) * (norm_offset + gain) into
            // the codes' slots (block 0 writes s out), their maximum on the way.
            const float4* in = reinterpret_cast<const float4*>(x);
            const float4* add = reinterpret_cast<const float4*>(residual);
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
                if (lane == 0) partial_max[r * WARPS + warp] = squares;
            }
            __syncthreads();
            if (tid < rows) {
                float total = 0.0f;
                #pragma unroll
                for (int w = 0; w < WARPS; ++w) total += partial_max[tid * WARPS + w];
                norm_scales[tid] = 1.0f / sqrtf(total / (float)K + eps);
            }
            __syncthreads();
            const uint4* gains = reinterpret_cast<const uint4*>(norm_weight);
            // Chunk c (8 values) of row r normed into its codes' slot; returns their largest magnitude.
            auto stage_normed = [&](int r, int c, float n) -> float {
                const size_t i = (size_t)r * chunks + c;
                float4 a = in[i * 2], b = in[i * 2 + 1];
                if (add != nullptr) {
                    const float4 ra = add[i * 2], rb = add[i * 2 + 1];
                    a.x += ra.x; a.y += ra.y; a.z += ra.z; a.w += ra.w;
                    b.x += rb.x; b.y += rb.y; b.z += rb.z; b.w += rb.w;
                }
                if (blockIdx.x == 0 && blockIdx.y == 0) {
                    reinterpret_cast<float4*>(summed)[i * 2] = a;
                    reinterpret_cast<float4*>(summed)[i * 2 + 1] = b;
                }
                const uint4 gain = __ldg(gains + c);
                uint4 normed;
                normed.x = (unsigned)to_bf16(a.x * n * (norm_offset + bf16_low(gain.x)))
                           | ((unsigned)to_bf16(a.y * n * (norm_offset + bf16_high(gain.x))) << 16);
                normed.y = (unsigned)to_bf16(a.z * n * (norm_offset + bf16_low(gain.y)))
                           | ((unsigned)to_bf16(a.w * n * (norm_offset + bf16_high(gain.y))) << 16);
                normed.z = (unsigned)to_bf16(b.x * n * (norm_offset + bf16_low(gain.z)))
                           | ((unsigned)to_bf16(b.y * n * (norm_offset + bf16_high(gain.z))) << 16);
                normed.w = (unsigned)to_bf16(b.z * n * (norm_offset + bf16_low(gain.w)))
                           | ((unsigned)to_bf16(b.w * n * (norm_offset + bf16_high(gain.w))) << 16);
                shared_stage[r * stride + c] = normed;
                float v[8];
                bf16_eight(normed, v);
                float amax = 0.0f;
                #pragma unroll
                for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
                return amax;
            };
            for (int r = 0; r < rows; ++r) {
                const float n = norm_scales[r];
                if constexpr (ACT == ACT_FP8_GROUP) {
                    // A scale per 128 positions, as for unnormed rows below: every lane runs each
                    // round, and a group's 16 chunks are 16 neighbouring lanes'.
                    for (int base = 0; base < chunks; base += THREADS) {
                        const int c = base + tid;
                        float amax = c < chunks ? stage_normed(r, c, n) : 0.0f;
                        #pragma unroll
                        for (int offset = 8; offset > 0; offset /= 2)
                            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
                        if (c < chunks && c % 16 == 0) shared_scales[r * groups + c / 16] = fmaxf(amax / FP8_MAX, MIN_SCALE);
                    }
                } else {
                    float amax = 0.0f;
                    for (int c = tid; c < chunks; c += THREADS) amax = fmaxf(amax, stage_normed(r, c, n));
                    if (ACT == ACT_FP8_TOKEN) {
                        amax = warp_max(amax);
                        if (lane == 0) partial_max[r * WARPS + warp] = amax;
                    }
                }
            }
            __syncthreads();   // (the sums of squares were read before the last barrier)
            if (ACT != ACT_FP8_GROUP && tid < rows) {
                float amax = 0.0f;
                #pragma unroll
                for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, partial_max[tid * WARPS + w]);
                shared_scales[tid] = ACT == ACT_FP8_TOKEN ? fmaxf(amax / FP8_MAX, MIN_SCALE) : input_scale;
            }
            __syncthreads();
        } else if (ACT == ACT_FP8_GROUP) {
            // A scale per 128 positions: the 16 chunks of a group are 16 neighbouring lanes' (a
            // loop round covers whole groups, every lane of a warp in it).
            for (int r = 0; r < rows; ++r) {
                for (int base = 0; base < chunks; base += THREADS) {
                    const int c = base + tid;
                    float amax = 0.0f;
                    if (c < chunks) {
                        float v[8];
                        if constexpr (sizeof(INPUT) == 2) {
                            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K) + c);
                            shared_stage[r * stride + c] = raw;
                            bf16_eight(raw, v);
                        } else {
                            load_eight(x + (size_t)r * K, c, v);
                        }
                        #pragma unroll
                        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
                    }
                    #pragma unroll
                    for (int offset = 8; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
                    if (c < chunks && c % 16 == 0) shared_scales[r * groups + c / 16] = fmaxf(amax / FP8_MAX, MIN_SCALE);
                }
            }
            __syncthreads();
        } else if (ACT == ACT_FP8_TOKEN) {
            for (int r = 0; r < rows; ++r) {
                float amax = 0.0f;
                #pragma unroll 4
                for (int c = tid; c < chunks; c += THREADS) {
                    float v[8];
                    if constexpr (ONE_PASS) {
                        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K) + c);
                        shared_stage[r * stride + c] = raw;
                        bf16_eight(raw, v);
                    } else {
                        load_eight(x + (size_t)r * K, c, v);
                    }
                    #pragma unroll
                    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
                }
                amax = warp_max(amax);
                if (lane == 0) partial_max[r * WARPS + warp] = amax;
            }
            __syncthreads();
            if (tid < rows) {
                float amax = 0.0f;
                #pragma unroll
                for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, partial_max[tid * WARPS + w]);
                shared_scales[tid] = fmaxf(amax / FP8_MAX, MIN_SCALE);
            }
            __syncthreads();
        } else if (tid < rows) {
            shared_scales[tid] = input_scale;
        }
        for (int r = 0; r < rows; ++r) {
            const float row_scale = ACT == ACT_FP8_TOKEN ? shared_scales[r] : input_scale;
            #pragma unroll 2
            for (int c = tid; c < stride; c += THREADS) {
                uint4 staged = zero;
                if (c < chunks) {
                    const float s = ACT == ACT_FP8_GROUP ? shared_scales[r * groups + c / 16] : row_scale;
                    float v[8];
                    if constexpr (ONE_PASS) bf16_eight(shared_stage[r * stride + c], v);
                    else load_eight(x + (size_t)r * K, c, v);
                    // Two instructions a pair: the E4M3 codes, then their f16 values.
                    staged = make_uint4(e4m3x2_to_f16x2(e4m3x2_of(v[0] / s, v[1] / s)),
                                        e4m3x2_to_f16x2(e4m3x2_of(v[2] / s, v[3] / s)),
                                        e4m3x2_to_f16x2(e4m3x2_of(v[4] / s, v[5] / s)),
                                        e4m3x2_to_f16x2(e4m3x2_of(v[6] / s, v[7] / s)));
                }
                shared_stage[r * stride + c] = staged;
            }
        }
        __syncthreads();
        stage = shared_stage;
        row_scales = shared_scales;
    }
    const int scale_count = ACT == ACT_FP8_GROUP ? rows * groups : rows;
    const int reduce_at = SHARED_STAGE ? rows * stride * 16 + (scale_count * 4 + 15) / 16 * 16 : 0;
    float4* reduce = reinterpret_cast<float4*>(dynamic_shared + reduce_at);   // [WARPS][ROW_TILES][32]

    float acc[ROW_TILES][4];
    #pragma unroll
    for (int t = 0; t < ROW_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    // ACT_FP8_GROUP: the scaled sums of the tile's finished 128-position blocks (acc holds the
    // current block's, unscaled).
    float total[ACT == ACT_FP8_GROUP ? ROW_TILES : 1][4];
    #pragma unroll
    for (int t = 0; t < (ACT == ACT_FP8_GROUP ? ROW_TILES : 1); ++t) total[t][0] = total[t][1] = total[t][2] = total[t][3] = 0.0f;

    // One step: the batch's pieces (none past the warp's slice: a warp-uniform test), four products
    // a piece and row tile; after the tile's last batch its sums, scaled, go out.
    auto run_step = [&](const uint4* upper, const uint4* lower) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int index = now.batch * UNROLL + u;
            if (index < own) {
                unsigned a_upper[8], a_lower[8];
                fp8_pairs(upper[u], a_upper);
                fp8_pairs(lower[u], a_lower);
                const bool valid = 64 * index < limit;   // the lane's inputs lie inside K
                const int chunk = (first_piece + index) * 8 + 2 * q;
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) {
                    const int row = 8 * t + g;
                    uint4 in0 = zero, in1 = zero;
                    if (valid && row < rows) {
                        const uint4* in = stage + row * stride + chunk;
                        in0 = in[0];
                        in1 = in[1];
                    }
                    const unsigned a0[4] = {a_upper[0], a_lower[0], a_upper[1], a_lower[1]};
                    const unsigned a1[4] = {a_upper[2], a_lower[2], a_upper[3], a_lower[3]};
                    const unsigned a2[4] = {a_upper[4], a_lower[4], a_upper[5], a_lower[5]};
                    const unsigned a3[4] = {a_upper[6], a_lower[6], a_upper[7], a_lower[7]};
                    const unsigned b0[2] = {in0.x, in0.y}, b1[2] = {in0.z, in0.w};
                    const unsigned b2[2] = {in1.x, in1.y}, b3[2] = {in1.z, in1.w};
                    mma_16x8x16_f16(acc[t], a0, b0);
                    mma_16x8x16_f16(acc[t], a1, b1);
                    mma_16x8x16_f16(acc[t], a2, b2);
                    mma_16x8x16_f16(acc[t], a3, b3);
                }
                if constexpr (ACT == ACT_FP8_GROUP) {
                    // A block's last piece: its sums times its weight and input scales join the total.
                    const int piece = first_piece + index;
                    if ((piece & 1) || index == own - 1) {
                        const int block = piece / 2;
                        const float upper_scale = __ldg(scales + (size_t)(now.upper_row / block_rows) * groups + block);
                        const float lower_scale = __ldg(scales + (size_t)(now.lower_row / block_rows) * groups + block);
                        #pragma unroll
                        for (int t = 0; t < ROW_TILES; ++t) {
                            #pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int r = 8 * t + 2 * q + (i & 1);
                                const float input = r < rows ? row_scales[r * groups + block] : 0.0f;
                                total[t][i] += acc[t][i] * ((i < 2 ? upper_scale : lower_scale) * input);
                                acc[t][i] = 0.0f;
                            }
                        }
                    }
                }
            }
        }
        if (now.batch == batches - 1) {
            if constexpr (ACT == ACT_FP8_GROUP) {
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[t][i] = total[t][i];
                        total[t][i] = 0.0f;
                    }
                }
            }
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
            if (SWIGLU && part == 0 && now.tile < tiles) {
                const int unit = now.tile * 8 + g;
                if (unit < N) {
                    const float gate_scale = ACT == ACT_FP8_GROUP ? 1.0f : __ldg(scales + unit / block_rows);
                    const float up_scale = ACT == ACT_FP8_GROUP ? 1.0f : __ldg(scales + (unit + N) / block_rows);
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        #pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            const int r = 8 * t + 2 * q + i;
                            if (r < rows) {
                                const float input = ACT == ACT_FP8_TENSOR ? input_scale
                                                    : ACT == ACT_FP8_GROUP ? 1.0f : row_scales[r];
                                const float gate = acc[t][i] * input * gate_scale;
                                const float up = acc[t][i + 2] * input * up_scale;
                                reinterpret_cast<unsigned short*>(out)[(size_t)r * N + unit] =
                                    to_bf16(gate / (1.0f + expf(-gate)) * up);
                            }
                        }
                    }
                }
            } else if (part == 0 && now.tile < tiles) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int n = now.tile * 16 + g + (i >= 2 ? 8 : 0);
                    if (n < N) {
                        const float weight_scale = ACT == ACT_FP8_GROUP ? 1.0f : __ldg(scales + n / block_rows);
                        const float add = bias != nullptr ? __ldg(bias + n) : 0.0f;
                        #pragma unroll
                        for (int t = 0; t < ROW_TILES; ++t) {
                            const int r = 8 * t + 2 * q + (i & 1);
                            if (r < rows) {
                                const float input = ACT == ACT_FP8_TENSOR ? input_scale
                                                    : ACT == ACT_FP8_GROUP ? 1.0f : row_scales[r];
                                out[(size_t)r * N + n] = acc[t][i] * input * weight_scale + add;
                            }
                        }
                    }
                }
            }
            #pragma unroll
            for (int t = 0; t < ROW_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
        }
        now = next;
        advance(next);
    };
    // Two steps an iteration, the buffers swapping roles: no register copies between steps. After a
    // step `next` is two steps ahead of the one just done: its buffer's next load.
    for (int step = 0; step < steps; step += 2) {
        run_step(upper, lower);
        if (step + 2 < steps) load(next, upper, lower);
        if (step + 1 < steps) {
            run_step(other_upper, other_lower);
            if (step + 3 < steps) load(next, other_upper, other_lower);
        }
    }
}

// out[t, n] = sum_s weights[t, s] * partial[t * top_k + s, n]: the routed pairs' products of a
// token weighed and summed. Grid (ceil(H / THREADS), tokens).
extern "C" __global__ void __launch_bounds__(THREADS) expert_slot_sum(
    const float* __restrict__ partial, const float* __restrict__ weights, float* __restrict__ out, int top_k, int H) {
    allow_dependents();
    wait_for_producers();
    const int token = blockIdx.y, n = blockIdx.x * THREADS + threadIdx.x;
    if (n >= H) return;
    float total = 0.0f;
    for (int slot = 0; slot < top_k; ++slot)
        total += weights[token * top_k + slot] * partial[(size_t)(token * top_k + slot) * H + n];
    out[(size_t)token * H + n] = total;
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return (qg.INSTRUCTIONS + DEPENDENT_LAUNCH + MMA_BF16 + qg.F16_PRIMITIVES + qg.CONSTANTS + HELPERS + qg.DEVICE_FUNCTIONS
            + KERNELS)


def serves(rows: int, weight: QuantizedWeight) -> bool:
    """Whether the GEMV serves ``rows`` rows of a product with ``weight``: 1 to :data:`MAX_ROWS`
    rows, FP8 codes with one scale per output channel (or per tensor) and inputs quantized per
    token or with a static scale, or block-wise FP8 (weight scales per :data:`SCALE_BLOCK` columns
    and any count of rows, inputs per group of :data:`SCALE_BLOCK`, as DeepSeek-V3 and Qwen3-FP8
    store them); no act-order or zero points, the inner size a multiple of 16."""
    out, inner = weight.shape
    if weight.activations == "fp8_group":
        scales_fit = weight.block[1] == SCALE_BLOCK and weight.activation_group == SCALE_BLOCK
    else:
        scales_fit = weight.scales.shape[1] == 1
    return (0 < rows <= MAX_ROWS and out > 0 and weight.codes_format == "fp8" and weight.activations in ACTIVATIONS
            and scales_fit and weight.input_order is None and weight.zeros is None and inner % 16 == 0)


def shared_stage(rows: int, weight: QuantizedWeight) -> bool:
    """Whether the prologue stages the rows in shared memory (up to :data:`SHARED_STAGE_MAX_ROWS`
    that fit beside the split's partial sums); otherwise ``stage_rows`` stages them first."""
    return rows <= SHARED_STAGE_MAX_ROWS and shared_bytes(rows, weight, qg.SPLITS[-1], True) <= qg.MAX_SHARED_BYTES


def shared_bytes(rows: int, weight: QuantizedWeight, split: int, staged: bool) -> int:
    """Dynamic shared memory of a launch: the staged rows and their scales (``staged``), the
    split's partial sums."""
    pieces = -(-weight.shape[1] // 64)
    scale_count = rows * qg.activation_groups(weight)
    stage = rows * pieces * 128 + -(-scale_count * 4 // 16) * 16 if staged else 0
    return stage + (qg.REDUCE_BYTES * qg.row_tiles(rows) if split > 1 else 0)


def workspace_shapes(rows: int, weight: QuantizedWeight) -> tuple[tuple[int, int], tuple[int, int]]:
    """The global workspace of rows the prologue does not stage: f16 codes (uint32 ``[rows,
    ceil(K / 64) * 32]``) and the rows' scales (float32 ``[rows, 1]``)."""
    return qg.workspace_shapes(rows, weight)


def input_type(bf16_input: bool) -> str:
    return qg.input_type(bf16_input)


def kernel_name(activations: str, split: int, tiles: int, shared: bool = True, unroll: int = UNROLL,
                bf16_input: bool = False, swiglu: bool = False, norm: bool = False, experts: bool = False) -> str:
    return (f"fp8_gemv<{ACTIVATIONS[activations]}, {split}, {tiles}, {'true' if shared else 'false'}, {unroll}, "
            f"{input_type(bf16_input)}, {'true' if swiglu else 'false'}, {'true' if norm else 'false'}, "
            f"{'true' if experts else 'false'}>")


# ------------------------------------------------------------------------------ reference


def fp8_gemv_reference(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray | None = None,
                       swiglu: bool = False) -> np.ndarray:
    """float32 ``[rows, N]``: what a launch computes, from host arrays: the input quantized as
    :func:`~metrale.kernels.quantized.quantize_activations` does, times the dequantized weight,
    the sums exact (float64) and rounded once; with ``swiglu`` (a ``[2N, K]`` gate-and-up weight)
    the bf16 values of ``silu_and_mul`` of those sums, as float32 ``[rows, N]``. (The norm
    prologue's input is :func:`norm_reference` of its rows.)"""
    staged = quantize_activations(np.asarray(x, dtype=np.float32), weight).astype(np.float64)
    y = staged @ dequantize(weight).astype(np.float64).T
    y = (y + bias if bias is not None else y).astype(np.float32)
    if not swiglu:
        return y
    units = y.shape[1] // 2
    return bf16_to_float32(float32_to_bf16(silu_and_mul_reference(y[:, :units], y[:, units:])))


def norm_reference(x: np.ndarray, residual: np.ndarray | None, norm_weight: np.ndarray, eps: float,
                   norm_offset: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(normed, summed)`` of the norm prologue, from float32 host arrays (``norm_weight`` holding
    bf16 values): ``summed = x (+ residual)`` and the bf16 values of ``rmsnorm(summed)``, as the
    unfused ``rmsnorm_residual`` gives them."""
    from metrale.kernels.rmsnorm import rmsnorm_residual_reference

    normed, summed = rmsnorm_residual_reference(np.asarray(x, np.float32), residual, norm_weight, eps, norm_offset)
    return bf16_to_float32(float32_to_bf16(normed)), summed


def serves_norm(rows: int, weight: QuantizedWeight) -> bool:
    """Whether a launch can take the norm into its prologue: rows it serves that the prologue stages
    in shared memory (with one scale a row, a static one, or one per group of 128)."""
    return serves(rows, weight) and shared_stage(rows, weight)


# ------------------------------------------------------------------------------- launcher

_modules: dict[str, Any] = {}


def _function(name: str) -> Any:
    function = _modules.get(name)
    if function is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=(name,))
        function = _modules[name] = module.get_function(name)
    return function


def fp8_gemv(x: DeviceArray, weight: QuantizedWeight, out: DeviceArray, stream: Any, *,
             bias: DeviceArray | None = None, multiprocessors: int = 132, split: int | None = None,
             workspace: tuple[DeviceArray, DeviceArray] | None = None, unroll: int = UNROLL,
             swiglu: bool = False, residual: DeviceArray | None = None, norm_weight: DeviceArray | None = None,
             eps: float = 1e-6, norm_offset: float = 0.0, summed: DeviceArray | None = None) -> DeviceArray:
    """``out <- s_x s_w (q_x q_w^T) (+ bias)`` (the module docstring) on ``stream``: ``x`` float32 or
    bf16 bits (uint16) ``[rows, K]``, 16-byte aligned, ``out`` float32 ``[rows, N]``; with ``swiglu``
    (a gate-and-up weight ``[2N, K]``, gate rows first, no bias) ``out`` is bf16 bits ``[rows, N]``:
    ``silu(gate) * up`` of the scaled sums, as ``silu_and_mul`` of the plain product. With
    ``norm_weight`` (bf16 bits ``[K]``, 16-byte aligned) the prologue is ``rmsnorm_residual``'s:
    ``summed <- x (+ residual)`` (float32 ``[rows, K]`` both), the product's input the bf16 values of
    ``rmsnorm(summed) * (norm_offset + norm_weight)`` (:func:`norm_reference`), for the rows
    :func:`serves_norm` serves. Rows the prologue does not stage (:func:`shared_stage`) are staged
    first into ``workspace`` (the arrays of :func:`workspace_shapes`). Raises
    :class:`~metrale.errors.KernelArgumentError` for what it does not serve (:func:`serves`)."""
    name = f"fp8_gemv ({weight.activations})"
    qg.check_weight(name, weight)
    rows = x.shape[0] if getattr(x, "ndim", 0) == 2 else -1
    columns, inner = weight.shape
    bf16_input = getattr(x, "dtype", None) == np.uint16
    check_array(name, "x", x, np.uint16 if bf16_input else np.float32, (rows, inner))
    if swiglu:
        if columns % 2 or bias is not None:
            raise KernelArgumentError(f"{name}: the gated product takes a weight of 2N rows ({columns} given) "
                                      "and no bias")
        check_array(name, "out", out, np.uint16, (rows, columns // 2))
    else:
        check_array(name, "out", out, np.float32, (rows, columns))
    if bias is not None:
        check_array(name, "bias", bias, np.float32, (columns,))
    if not serves(rows, weight):
        raise KernelArgumentError(f"{name}: {rows} rows of a {weight.codes_format} weight with {weight.activations} "
                                  f"inputs, scales {list(weight.scales.shape)}, inner size {inner}, are not served "
                                  f"(1 to {MAX_ROWS} rows, FP8 per channel or per tensor, FP8 inputs, the inner "
                                  "size a multiple of 16)")
    if not aligned(x):
        raise KernelArgumentError(f"{name}: x does not start at a 16-byte boundary")
    null = np.uint64(0)
    norm = norm_weight is not None
    if norm:
        if bf16_input or not serves_norm(rows, weight):
            raise KernelArgumentError(f"{name}: the norm prologue takes float32 rows, at most "
                                      f"{SHARED_STAGE_MAX_ROWS} that fit in shared memory ({rows} given)")
        check_array(name, "norm_weight", norm_weight, np.uint16, (inner,))
        check_array(name, "summed", summed, np.float32, (rows, inner))
        if residual is not None:
            check_array(name, "residual", residual, np.float32, (rows, inner))
        if not (aligned(norm_weight) and aligned(summed) and (residual is None or aligned(residual))):
            raise KernelArgumentError(f"{name}: norm_weight, summed and residual must start at 16-byte boundaries")
    input_scale = np.float32(float(weight.input_scale) if weight.input_scale is not None else 1.0)
    shared = shared_stage(rows, weight)
    staged: Any = null
    scales: Any = null
    if not shared:
        if workspace is None:
            raise KernelArgumentError(f"{name}: {rows} rows of inner size {inner} need a staging workspace")
        staged, scales = workspace
        staged_shape, scales_shape = workspace_shapes(rows, weight)
        check_array(name, "workspace staged", staged, np.uint32, staged_shape)
        check_array(name, "workspace scales", scales, np.float32, scales_shape)
        launch(qg._function(qg.stage_rows_name(weight.activations, True, bf16_input)), (rows,), (THREADS,), (
            x, null, input_scale, np.int32(weight.activation_group), staged, scales, np.int32(inner),
        ), 0, stream, dependent=False)
    chosen, blocks = qg.plan(columns, multiprocessors, split)
    function = _function(kernel_name(weight.activations, chosen, qg.row_tiles(rows), shared, unroll, bf16_input,
                                     swiglu, norm))
    stage = shared_bytes(rows, weight, chosen, shared)
    if stage > 48 * 1024:
        function.max_dynamic_shared_size_bytes = stage
    launch(function, (blocks,), (THREADS,), (
        x, input_scale, staged, scales, weight.codes, weight.scales, np.int32(weight.block[0]),
        bias if bias is not None else null, out, np.int32(rows), np.int32(inner),
        np.int32(columns // 2 if swiglu else columns), residual if residual is not None else null,
        norm_weight if norm else null, np.float32(eps), np.float32(norm_offset), summed if norm else null, null,
        np.int32(1),
    ), stage, stream, dependent=True)
    return out


# ------------------------------------------------------------------------ routed experts

#: The most decode tokens the routed-expert form serves. Each routed pair reads its expert's codes
#: (two tokens that chose one expert read it twice), where past it every expert's stack is
#: dequantized into bf16 each step (its codes read, twice their bytes written and read again).
MAX_EXPERT_TOKENS = 32


def _stacks_experts(weight: QuantizedWeight, rows: int) -> bool:
    """Whether each expert's ``rows`` rows of a stacked weight take whole scale blocks (or one
    scale the whole stack)."""
    block_rows = weight.block[0]
    return rows % block_rows == 0 or block_rows >= weight.shape[0]


def serves_experts(tokens: int, top_k: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> bool:
    """Whether :func:`fp8_decode_experts` serves ``tokens`` decode rows of ``top_k`` routed experts
    each over the stacks ``gate_up [E * 2I, H]`` and ``down [E * H, I]``: 1 to
    :data:`MAX_EXPERT_TOKENS` tokens, both stacks weights the GEMV serves (:func:`serves`), each
    expert's rows whole scale blocks, ``H`` and ``I`` multiples of 16."""
    hidden, inter = gate_up.shape[1], down.shape[1]
    experts = down.shape[0] // hidden if hidden else 0
    return (0 < tokens <= MAX_EXPERT_TOKENS and top_k > 0 and experts > 0 and inter % 16 == 0 and hidden % 16 == 0
            and gate_up.shape == (experts * 2 * inter, hidden) and down.shape == (experts * hidden, inter)
            and serves(1, gate_up) and serves(1, down)
            and _stacks_experts(gate_up, 2 * inter) and _stacks_experts(down, hidden))


def fp8_decode_experts_reference(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate_up: QuantizedWeight,
                                 down: QuantizedWeight) -> np.ndarray:
    """float32 ``[N, H]``: what :func:`fp8_decode_experts` computes, from host arrays. Each pair's
    ``silu(gate) * up`` (:func:`fp8_gemv_reference` of its token's row over its expert's rows,
    bf16), then its down product (its row quantized as ``down``'s inputs are), weighed by the
    pair's routing weight and summed per token in float32."""
    tokens, top_k = experts.shape
    hidden, inter = gate_up.shape[1], down.shape[1]
    out = np.zeros((tokens, hidden), np.float32)
    for t in range(tokens):
        for s in range(top_k):
            e = int(experts[t, s])
            act = fp8_gemv_reference(x[t : t + 1], _expert_rows(gate_up, e, 2 * inter), swiglu=True)
            out[t] += np.float32(weights[t, s]) * fp8_gemv_reference(act, _expert_rows(down, e, hidden))[0]
    return out


def _expert_rows(weight: QuantizedWeight, expert: int, rows: int) -> QuantizedWeight:
    """Expert ``expert``'s ``rows`` rows of a stacked weight (host arrays), with their scales."""
    from dataclasses import replace

    block_rows = weight.block[0]
    first = expert * rows
    if block_rows >= weight.shape[0]:
        scales = weight.scales
        block = (rows, weight.block[1])
    else:
        scales = weight.scales[first // block_rows : (first + rows) // block_rows]
        block = weight.block
    return replace(weight, codes=weight.codes[first : first + rows], scales=scales, shape=(rows, weight.shape[1]),
                   block=block)


def fp8_decode_experts(x: DeviceArray, experts: DeviceArray, weights: DeviceArray, gate_up: QuantizedWeight,
                       down: QuantizedWeight, act: DeviceArray, partial: DeviceArray, out: DeviceArray, stream: Any,
                       *, multiprocessors: int = 132) -> DeviceArray:
    """Routed experts of decode rows over FP8 stacks, only the chosen experts' codes read: ``out
    [N, H]`` float32 from ``x [N, H]`` float32 or bf16 bits (uint16; 16-byte aligned rows), int32 ``experts [N, k]``,
    float32 ``weights [N, k]``, ``gate_up [E * 2I, H]`` (each expert's I gate rows, then its I up
    rows) and ``down [E * H, I]``. Three launches: the gated GEMV a routed pair a grid row into
    ``act [N * k, I]`` (bf16 scratch), the down GEMV the same way into ``partial [N * k, H]``
    (float32 scratch), then each token's pairs weighed and summed
    (:func:`fp8_decode_experts_reference`). Raises :class:`~metrale.errors.KernelArgumentError` for
    what :func:`serves_experts` refuses, before any launch."""
    op = "fp8_decode_experts"
    qg.check_weight(op, gate_up)
    qg.check_weight(op, down)
    bf16_rows = getattr(x, "dtype", None) == np.uint16
    check_array(op, "x", x, np.uint16 if bf16_rows else np.float32, ndim=2)
    tokens, hidden = x.shape
    check_array(op, "experts", experts, np.int32, (tokens, None))
    top_k = experts.shape[1]
    check_array(op, "weights", weights, np.float32, (tokens, top_k))
    inter = down.shape[1]
    if not serves_experts(tokens, top_k, gate_up, down):
        raise KernelArgumentError(
            f"{op}: {tokens} tokens of {top_k} experts over gate_up {list(gate_up.shape)} and down "
            f"{list(down.shape)} ({gate_up.activations} / {down.activations} inputs) are not served (1 to "
            f"{MAX_EXPERT_TOKENS} tokens, FP8 stacks of E experts of hidden size H and width I, multiples of 16, "
            "each expert's rows whole scale blocks)")
    pairs = tokens * top_k
    check_array(op, "act", act, np.uint16, (pairs, inter))
    check_array(op, "partial", partial, np.float32, (pairs, hidden))
    check_array(op, "out", out, np.float32, (tokens, hidden))
    if not (aligned(x) and aligned(act)):
        raise KernelArgumentError(f"{op}: x and act must start at 16-byte boundaries")
    null = np.uint64(0)
    share = max(1, multiprocessors // pairs)
    for weight, rows, columns, target, gated, per_row in ((gate_up, x, 2 * inter, act, True, top_k),
                                                           (down, act, hidden, partial, False, 1)):
        chosen, blocks = qg.plan(columns, share)
        bf16_input = bf16_rows if gated else True   # the down product reads the gated product's bf16 act
        function = _function(kernel_name(weight.activations, chosen, 1, True, UNROLL, bf16_input, gated, False, True))
        stage = shared_bytes(1, weight, chosen, True)
        if stage > 48 * 1024:
            function.max_dynamic_shared_size_bytes = stage
        input_scale = np.float32(float(weight.input_scale) if weight.input_scale is not None else 1.0)
        launch(function, (blocks, pairs), (THREADS,), (
            rows, input_scale, null, null, weight.codes, weight.scales, np.int32(weight.block[0]), null, target,
            np.int32(1), np.int32(weight.shape[1]), np.int32(columns // 2 if gated else columns), null, null,
            np.float32(0.0), np.float32(0.0), null, experts, np.int32(per_row),
        ), stage, stream, dependent=True)
    launch(_slot_sum(), (-(-hidden // THREADS), tokens), (THREADS,), (partial, weights, out, np.int32(top_k),
                                                                     np.int32(hidden)), 0, stream, dependent=True)
    return out


def _slot_sum() -> Any:
    function = _modules.get("expert_slot_sum")
    if function is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",))
        function = _modules["expert_slot_sum"] = module.get_function("expert_slot_sum")
    return function
