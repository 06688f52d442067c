"""Prefill attention over the paged cache on tensor cores (CUDA C++ with ``mma.sync``, compiled
by NVRTC through CuPy).

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`. A block of
four warps owns one query head and a tile of up to 64 consecutive rows of one sequence (each warp
16 rows); it streams that sequence's keys and values through shared memory 64 keys at a time,
gathered from the paged cache, and keeps a flash-attention online softmax in registers:

* ``S = Q K^T`` and ``O += P V`` run as ``mma.sync.m16n8k16`` bf16 products with float32
  accumulation; the probabilities ``P`` go from the first product's accumulators to the second's
  operand registers without leaving the thread;
* the causal rule (key position <= the row's position) and the optional sliding window mask the
  scores; keys past the tile's last position are never read;
* an optional logit soft cap, ``softcap * tanh(score / softcap)`` before the mask (Gemma-2), and
  optional sinks, one logit per query head counted in the softmax's denominator and never attended
  (GPT-OSS), as the reference takes them;
* the output is written as bf16.

Decode rows (:func:`decode_rows_attention`) take the same kernel compiled with its tile's rows
taken by one row's query heads of a KV head (all at the row's position) instead of one head's
consecutive rows: the row's keys are read once for the group, and every output is computed as the
prompt form computes the same query row (its products' rows are independent of the tile's other
rows, the keys are stepped through in the same steps, and steps a row does not see add exact
zeros), so a row gives the same bits through either -- what the batch-invariant mode needs.

numba exposes no tensor-core instruction, so this kernel is CUDA C++. Its CPU tests run the kernel
on the host with an emulation of the PTX instructions in place of ``INSTRUCTIONS``; its GPU tests
(``-m gpu``) run it as NVRTC compiles it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._tensor_cores import MMA_BF16, STAGED_COPIES, TRANSPOSED_LOAD

#: Query rows of one block (four warps of 16).
BLOCK_ROWS = 64
THREADS = 128
#: The (key, value) head sizes served.
HEAD_DIMS = ((32, 32), (64, 64), (128, 128), (192, 128), (256, 256))

INSTRUCTIONS = MMA_BF16 + STAGED_COPIES + TRANSPOSED_LOAD

#: The kernel, written against :data:`INSTRUCTIONS` (the CPU tests build it against an emulation
#: of them); ``__HEAD_DIM__``, ``__VALUE_DIM__``, ``__BLOCK_KEYS__`` and ``__SOFTCAP__`` are
#: filled in by :func:`kernel_source`, which defines ``FP8_CACHE`` before it.
KERNEL = r"""

#define HEAD_DIM __HEAD_DIM__
#define VALUE_DIM __VALUE_DIM__
#define BLOCK_KEYS __BLOCK_KEYS__
#define BLOCK_ROWS 64
#define THREADS 128
// Padded shared rows (bf16): the 8 rows of an ldmatrix read fall into distinct banks.
#define K_STRIDE (HEAD_DIM + 8)
#define V_STRIDE (VALUE_DIM + 8)
#define STAGE_ELEMENTS (BLOCK_KEYS * (K_STRIDE + V_STRIDE))
// Queries of more than 192 dims are read from shared memory at every key step: kept in
// registers they would leave too few for the accumulators.
#define QUERY_IN_SHARED (HEAD_DIM > 192)
#define NEG_INF (__int_as_float(0xff800000))
#define SOFTCAP __SOFTCAP__
// FP8_CACHE: a stage's key and value codes, unpadded (bytes).
#define RAW_STAGE_BYTES (BLOCK_KEYS * (HEAD_DIM + VALUE_DIM))
// The elements before the stages' codes: the query tile and the one bf16 stage (they share their
// space unless the queries stay in shared memory).
#define WORK_ELEMENTS (QUERY_IN_SHARED ? BLOCK_ROWS * K_STRIDE + STAGE_ELEMENTS \
                                       : (STAGE_ELEMENTS > BLOCK_ROWS * K_STRIDE ? STAGE_ELEMENTS : BLOCK_ROWS * K_STRIDE))

typedef unsigned short bf16_bits;
#if FP8_CACHE
typedef unsigned char cache_t;   // E4M3 codes, a float32 scale per (slot, KV head) beside them
#else
typedef bf16_bits cache_t;
#endif

// Grid: (tiles, query heads); THREADS threads; dynamic shared memory: the query tile (when
// QUERY_IN_SHARED) and two stages of BLOCK_KEYS keys and values. q [N, nh, HEAD_DIM] f32;
// k_cache [blocks, block_size, nkv, HEAD_DIM], v_cache [blocks, block_size, nkv, VALUE_DIM] bf16
// bits; block_tables [S, max_blocks], seq_index [N], positions [N], tiles [T, 2] (first row, rows)
// int32; out [N, nh * VALUE_DIM] bf16 bits. With SOFTCAP, softcap > 0 caps the logits; sinks (f32
// [nh], or null) adds exp(sinks[head]) to each row's denominator. FP8_CACHE: the caches hold E4M3
// codes, k_scales and v_scales [blocks, block_size, nkv] their scales; two stages of codes and
// scales are copied, and each step's are scaled into one bf16 stage (code * scale, rounded once)
// that the products read.
extern "C" __global__ void __launch_bounds__(THREADS) prefill_attention_mma(
    const float* __restrict__ q, const cache_t* __restrict__ k_cache, const cache_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_index, const int* __restrict__ positions,
    const int* __restrict__ tiles, int num_heads, int num_kv_heads, int block_size, int max_blocks, float scale,
    int sliding_window, float softcap, const float* __restrict__ sinks, bf16_bits* __restrict__ out,
    const float* __restrict__ k_scales, const float* __restrict__ v_scales)
{
    DYNAMIC_SHARED;
    bf16_bits* shared = reinterpret_cast<bf16_bits*>(dynamic_shared);
    bf16_bits* query_tile = shared;   // [BLOCK_ROWS, K_STRIDE]: staging, or for good when QUERY_IN_SHARED
    bf16_bits* stages = shared + (QUERY_IN_SHARED ? BLOCK_ROWS * K_STRIDE : 0);   // FP8_CACHE: the one bf16 stage
#if FP8_CACHE
    unsigned char* raw_stages = reinterpret_cast<unsigned char*>(shared + WORK_ELEMENTS);   // [2][RAW_STAGE_BYTES]
    float* raw_scales = reinterpret_cast<float*>(raw_stages + 2 * RAW_STAGE_BYTES);   // [2][2][BLOCK_KEYS]
#endif

    const int tile = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;
    const int row0 = warp * 16 + group, row1 = row0 + 8;   // this thread's two rows in the tile
#if HEAD_ROWS
    // The tile's rows are query heads of one KV head, all of one row (a decode row) of q: heads
    // first_head + r. Grid (rows, KV heads x chunks of BLOCK_ROWS heads).
    const int group_size = num_heads / num_kv_heads, chunks = (group_size + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int kv_head = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    const int first_head = kv_head * group_size + chunk * BLOCK_ROWS;
    const int first = tiles[2 * tile];
    const int count = min(group_size - chunk * BLOCK_ROWS, BLOCK_ROWS);
    const int key_end = positions[first] + 1;
    const int position0 = row0 < count ? positions[first] : -1;
    const int position1 = row1 < count ? positions[first] : -1;
#define QUERY_ROW(r) (first)
#define ROW_HEAD(r) (first_head + (r))
#else
    const int head = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    const int key_end = positions[first + count - 1] + 1;
    const int position0 = row0 < count ? positions[first + row0] : -1;
    const int position1 = row1 < count ? positions[first + row1] : -1;
#define QUERY_ROW(r) (first + (r))
#define ROW_HEAD(r) (head)
#endif
    // A warp with no row of the tile only copies (the products of its rows would all be masked).
    const bool idle = HEAD_ROWS && warp * 16 >= count;
    const int* table = block_tables + (long)seq_index[first] * max_blocks;
    const int first_position = positions[first];
    // ldmatrix: this lane addresses row (lane % 8) of matrix (lane / 8).
    const int matrix = lane / 8, matrix_row = lane % 8;

    // The query tile, scaled by scale * log2(e) (the softmax runs in base 2), as bf16.
    const float query_scale = scale * 1.4426950408889634f;
    for (int e = threadIdx.x; e < BLOCK_ROWS * HEAD_DIM / 2; e += THREADS) {
        const int r = e / (HEAD_DIM / 2), d = 2 * (e % (HEAD_DIM / 2));
        const float* source = q + ((long)QUERY_ROW(r) * num_heads + ROW_HEAD(r)) * HEAD_DIM + d;
        *reinterpret_cast<unsigned*>(&query_tile[r * K_STRIDE + d]) =
            r < count ? pack_bf16(source[0] * query_scale, source[1] * query_scale) : 0u;
    }
    __syncthreads();
    // A operand of kk: matrices (rows 0-7, dims 0-7), (rows 8-15, dims 0-7), (rows 0-7, dims 8-15),
    // (rows 8-15, dims 8-15) of the warp's 16 rows and the kk-th 16 dims.
    const bf16_bits* query_fragment = &query_tile[(warp * 16 + (matrix & 1) * 8 + matrix_row) * K_STRIDE + (matrix >> 1) * 8];
#if !QUERY_IN_SHARED
    unsigned query[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) load_matrices(query[kk], shared_address(query_fragment + kk * 16));
    __syncthreads();   // the staging area becomes the first stage
#endif

    float best[2] = {NEG_INF, NEG_INF}, total[2] = {0.f, 0.f};
    float acc[VALUE_DIM / 8][4];
#pragma unroll
    for (int dt = 0; dt < VALUE_DIM / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;

    int key_start = 0;
    if (sliding_window > 0) {
        key_start = first_position - sliding_window + 1;
        key_start = key_start < 0 ? 0 : key_start / BLOCK_KEYS * BLOCK_KEYS;
    }
    // Each stage's keys as rows of the cache (slot * nkv + kv head; -1 past key_end), worked out
    // one step ahead by BLOCK_KEYS threads: the copies then need no division or table read.
    __shared__ long long stage_rows[2][BLOCK_KEYS];
    auto find_rows = [&](int stage, int base) {
        if (threadIdx.x < BLOCK_KEYS) {
            const int position = base + threadIdx.x;
            stage_rows[stage][threadIdx.x] = position < key_end
                ? ((long long)table[position / block_size] * block_size + position % block_size) * num_kv_heads + kv_head
                : -1;
        }
    };
    // Queue the keys and values of [base, base + BLOCK_KEYS) into a stage (zeros past key_end).
    auto load_stage = [&](int stage) {
#if FP8_CACHE
        unsigned char* raw_keys = raw_stages + stage * RAW_STAGE_BYTES;
        unsigned char* raw_values = raw_keys + BLOCK_KEYS * HEAD_DIM;
        for (int e = threadIdx.x; e < BLOCK_KEYS * (HEAD_DIM / 16); e += THREADS) {
            const int key = e / (HEAD_DIM / 16), chunk = e % (HEAD_DIM / 16);
            const long long row = stage_rows[stage][key];
            copy_16(shared_address(&raw_keys[key * HEAD_DIM + chunk * 16]),
                    k_cache + (row < 0 ? 0 : row) * HEAD_DIM + chunk * 16, row >= 0);
        }
        for (int e = threadIdx.x; e < BLOCK_KEYS * (VALUE_DIM / 16); e += THREADS) {
            const int key = e / (VALUE_DIM / 16), chunk = e % (VALUE_DIM / 16);
            const long long row = stage_rows[stage][key];
            copy_16(shared_address(&raw_values[key * VALUE_DIM + chunk * 16]),
                    v_cache + (row < 0 ? 0 : row) * VALUE_DIM + chunk * 16, row >= 0);
        }
        // A key past key_end copies scale 0 (and codes 0): zeros.
        for (int e = threadIdx.x; e < 2 * BLOCK_KEYS; e += THREADS) {
            const int half = e / BLOCK_KEYS, key = e % BLOCK_KEYS;
            const long long row = stage_rows[stage][key];
            copy_4(shared_address(&raw_scales[(stage * 2 + half) * BLOCK_KEYS + key]),
                   (half ? v_scales : k_scales) + (row < 0 ? 0 : row), row >= 0);
        }
#else
        bf16_bits* keys = stages + stage * STAGE_ELEMENTS;
        bf16_bits* values = keys + BLOCK_KEYS * K_STRIDE;
        for (int e = threadIdx.x; e < BLOCK_KEYS * (HEAD_DIM / 8); e += THREADS) {
            const int key = e / (HEAD_DIM / 8), chunk = e % (HEAD_DIM / 8);
            const long long row = stage_rows[stage][key];
            copy_16(shared_address(&keys[key * K_STRIDE + chunk * 8]), k_cache + (row < 0 ? 0 : row) * HEAD_DIM + chunk * 8,
                    row >= 0);
        }
        for (int e = threadIdx.x; e < BLOCK_KEYS * (VALUE_DIM / 8); e += THREADS) {
            const int key = e / (VALUE_DIM / 8), chunk = e % (VALUE_DIM / 8);
            const long long row = stage_rows[stage][key];
            copy_16(shared_address(&values[key * V_STRIDE + chunk * 8]),
                    v_cache + (row < 0 ? 0 : row) * VALUE_DIM + chunk * 8, row >= 0);
        }
#endif
        commit_copies();
    };

    find_rows(0, key_start);
    find_rows(1, key_start + BLOCK_KEYS);
    __syncthreads();
    if (key_start < key_end) load_stage(0);
    int stage = 0;
    for (int base = key_start; base < key_end; base += BLOCK_KEYS, stage ^= 1) {
        if (base + BLOCK_KEYS < key_end) {
            load_stage(stage ^ 1);
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        // This stage's rows were last read by the copies queued a step ago, before the barrier.
        find_rows(stage, base + 2 * BLOCK_KEYS);
#if FP8_CACHE
        // The step's codes times their scales into the bf16 stage (every warp finished reading it
        // before the previous step's closing barrier).
        {
            const unsigned char* raw_keys = raw_stages + stage * RAW_STAGE_BYTES;
            const unsigned char* raw_values = raw_keys + BLOCK_KEYS * HEAD_DIM;
            const float* key_scales = raw_scales + stage * 2 * BLOCK_KEYS;
            bf16_bits* keys_out = stages;
            bf16_bits* values_out = stages + BLOCK_KEYS * K_STRIDE;
            for (int e = threadIdx.x; e < BLOCK_KEYS * (HEAD_DIM / 8); e += THREADS) {
                const int key = e / (HEAD_DIM / 8), chunk = e % (HEAD_DIM / 8);
                const uint2 codes = *reinterpret_cast<const uint2*>(&raw_keys[key * HEAD_DIM + chunk * 8]);
                *reinterpret_cast<uint4*>(&keys_out[key * K_STRIDE + chunk * 8]) = scaled_e4m3x8(codes, key_scales[key]);
            }
            for (int e = threadIdx.x; e < BLOCK_KEYS * (VALUE_DIM / 8); e += THREADS) {
                const int key = e / (VALUE_DIM / 8), chunk = e % (VALUE_DIM / 8);
                const uint2 codes = *reinterpret_cast<const uint2*>(&raw_values[key * VALUE_DIM + chunk * 8]);
                *reinterpret_cast<uint4*>(&values_out[key * V_STRIDE + chunk * 8]) =
                    scaled_e4m3x8(codes, key_scales[BLOCK_KEYS + key]);
            }
        }
        __syncthreads();
        const bf16_bits* keys = stages;
#else
        const bf16_bits* keys = stages + stage * STAGE_ELEMENTS;
#endif
        const bf16_bits* values = keys + BLOCK_KEYS * K_STRIDE;
        if (idle) {
            __syncthreads();   // the closing barrier of the step below
            continue;
        }

        float scores[BLOCK_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) scores[nt][0] = scores[nt][1] = scores[nt][2] = scores[nt][3] = 0.f;
        // B operand of key tiles nt, nt + 1: matrices (keys of nt, dims 0-7), (keys of nt, dims
        // 8-15), (keys of nt + 1, dims 0-7), (keys of nt + 1, dims 8-15) of the kk-th 16 dims.
        const bf16_bits* key_fragment = &keys[((matrix >> 1) * 8 + matrix_row) * K_STRIDE + (matrix & 1) * 8];
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#if QUERY_IN_SHARED
            unsigned query_kk[4];
            load_matrices(query_kk, shared_address(query_fragment + kk * 16));
#else
            const unsigned* query_kk = query[kk];
#endif
#pragma unroll
            for (int nt = 0; nt < BLOCK_KEYS / 8; nt += 2) {
                unsigned operand[4];
                load_matrices(operand, shared_address(key_fragment + nt * 8 * K_STRIDE + kk * 16));
                mma_16x8x16(scores[nt], query_kk, operand);
                mma_16x8x16(scores[nt + 1], query_kk, operand + 2);
            }
        }

#if SOFTCAP
        // The logits capped, in the scores' base-2 units: log2(e) softcap * tanh(score / (log2(e) softcap)).
        const float cap = softcap * 1.4426950408889634f;
#pragma unroll
        for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) scores[nt][c] = cap * tanhf(scores[nt][c] / cap);
        }
#endif
        // Every row of the tile sees every key of this step: no mask to apply.
        const bool all_seen = base + BLOCK_KEYS - 1 <= first_position
                              && (sliding_window <= 0 || base > key_end - 1 - sliding_window);
        float new_best[2] = {best[0], best[1]};
#pragma unroll
        for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int half = c / 2;
                if (!all_seen) {
                    const int position = half ? position1 : position0;
                    const int key = base + nt * 8 + quad * 2 + (c & 1);
                    const bool seen = key <= position && (sliding_window <= 0 || key > position - sliding_window);
                    if (!seen) scores[nt][c] = NEG_INF;
                }
                new_best[half] = fmaxf(new_best[half], scores[nt][c]);
            }
        }
        float rescale[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            new_best[h] = fmaxf(new_best[h], __shfl_xor_sync(0xffffffff, new_best[h], 1));
            new_best[h] = fmaxf(new_best[h], __shfl_xor_sync(0xffffffff, new_best[h], 2));
            rescale[h] = new_best[h] == NEG_INF ? 1.f : exp2f(best[h] - new_best[h]);
            best[h] = new_best[h];
            total[h] *= rescale[h];
        }
#pragma unroll
        for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int h = c / 2;
                const float p = best[h] == NEG_INF ? 0.f : exp2f(scores[nt][c] - best[h]);
                scores[nt][c] = p;
                total[h] += p;
            }
        }
#pragma unroll
        for (int dt = 0; dt < VALUE_DIM / 8; ++dt) {
            acc[dt][0] *= rescale[0]; acc[dt][1] *= rescale[0];
            acc[dt][2] *= rescale[1]; acc[dt][3] *= rescale[1];
        }
        // B operand of value tiles dt, dt + 1 (transposed loads): matrices (keys 0-7, dims of dt),
        // (keys 8-15, dims of dt), (keys 0-7, dims of dt + 1), (keys 8-15, dims of dt + 1) of the
        // kt-th 16 keys.
        const bf16_bits* value_fragment = &values[((matrix & 1) * 8 + matrix_row) * V_STRIDE + (matrix >> 1) * 8];
#pragma unroll
        for (int kt = 0; kt < BLOCK_KEYS / 16; ++kt) {
            // The accumulators of key tiles 2kt and 2kt + 1 are the A operand of keys 16kt..16kt+15.
            const unsigned probabilities[4] = {
                pack_bf16(scores[2 * kt][0], scores[2 * kt][1]), pack_bf16(scores[2 * kt][2], scores[2 * kt][3]),
                pack_bf16(scores[2 * kt + 1][0], scores[2 * kt + 1][1]),
                pack_bf16(scores[2 * kt + 1][2], scores[2 * kt + 1][3]),
            };
#pragma unroll
            for (int dt = 0; dt < VALUE_DIM / 8; dt += 2) {
                unsigned operand[4];
                load_matrices_transposed(operand, shared_address(value_fragment + kt * 16 * V_STRIDE + dt * 8));
                mma_16x8x16(acc[dt], probabilities, operand);
                mma_16x8x16(acc[dt + 1], probabilities, operand + 2);
            }
        }
        __syncthreads();   // every warp is done with this stage before it is refilled
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 1);
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 2);
        // The sink's term, exp(sink) in the scale of the running maximum (base 2); a row's own key
        // is always seen, so best is finite.
        if (sinks != nullptr) {
            const int row = h ? row1 : row0;
            total[h] += exp2f(sinks[row < count ? ROW_HEAD(row) : ROW_HEAD(0)] * 1.4426950408889634f - best[h]);
        }
    }
    const long row_width = (long)num_heads * VALUE_DIM;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = h ? row1 : row0;
        if (row >= count) continue;
        const float inverse = total[h] > 0.f ? 1.f / total[h] : 0.f;
        unsigned* target = reinterpret_cast<unsigned*>(out + QUERY_ROW(row) * row_width + ROW_HEAD(row) * VALUE_DIM);
#pragma unroll
        for (int dt = 0; dt < VALUE_DIM / 8; ++dt) {
            target[(dt * 8 + quad * 2) / 2] = pack_bf16(acc[dt][2 * h] * inverse, acc[dt][2 * h + 1] * inverse);
        }
    }
}
"""


_kernels: dict[tuple[int, int, bool, bool, bool], tuple[Any, int]] = {}


def block_keys(head_dim: int, value_dim: int) -> int:
    """Keys staged per step: 64, or 32 for heads of more than 192 dims (shared memory)."""
    return 32 if max(head_dim, value_dim) > 192 else 64


def shared_bytes(head_dim: int, value_dim: int, fp8: bool = False) -> int:
    """Dynamic shared memory of one block: two stages of keys and values (padded rows), plus the
    query tile where it stays in shared memory (it otherwise shares the first stage's space); for
    an FP8 cache (``fp8``) one bf16 stage, then two stages of codes and float32 scales."""
    keys = block_keys(head_dim, value_dim)
    stage = keys * (head_dim + 8 + value_dim + 8)
    stages = stage if fp8 else 2 * stage
    query = BLOCK_ROWS * (head_dim + 8)
    work = 2 * (stages + query if head_dim > 192 else max(stages, query))
    return work + (2 * keys * (head_dim + value_dim) + 2 * 2 * keys * 4 if fp8 else 0)


#: Eight E4M3 codes of an FP8 cache scaled into bf16, written against :data:`FP8_INSTRUCTIONS`
#: (part of the kernel source, with or without the instructions).
FP8_CONVERSION = r"""
#if FP8_CACHE
// Eight E4M3 codes (a uint2) times `scale`, as eight bf16 values (a uint4): each pair's f16 values
// (exact), then float32 products rounded once.
__device__ __forceinline__ uint4 scaled_e4m3x8(uint2 codes, float scale) {
    uint4 out;
    unsigned* words = reinterpret_cast<unsigned*>(&out);
    const unsigned pairs[4] = {codes.x & 0xffffu, codes.x >> 16, codes.y & 0xffffu, codes.y >> 16};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned h = e4m3x2_to_f16x2(pairs[i]);
        words[i] = pack_bf16(f16_low(h) * scale, f16_high(h) * scale);
    }
    return out;
}
#endif
"""


def kernel_source(head_dim: int, value_dim: int, softcap: bool = False, with_instructions: bool = True,
                  fp8: bool = False, head_rows: bool = False) -> str:
    """The kernel's CUDA C++ for the head sizes, with the logit soft cap compiled in or not, over
    an FP8 cache (``fp8``) or a bf16 one, with its PTX helpers, or without them for the CPU
    emulation, which brings its own; ``head_rows``: the decode rows' form (a tile's rows are one
    row's query heads of a KV head, :func:`decode_rows_attention`)."""
    from metrale.kernels.attention_decode_mma import FP8_INSTRUCTIONS

    kernel = (KERNEL.replace("__HEAD_DIM__", str(head_dim)).replace("__VALUE_DIM__", str(value_dim))
              .replace("__BLOCK_KEYS__", str(block_keys(head_dim, value_dim))).replace("__SOFTCAP__", str(int(softcap)))
)
    helpers = (INSTRUCTIONS + (FP8_INSTRUCTIONS if fp8 else "")) if with_instructions else ""
    return helpers + f"#define FP8_CACHE {int(fp8)}\n#define HEAD_ROWS {int(head_rows)}\n" + FP8_CONVERSION + kernel


def _kernel(head_dim: int, value_dim: int, softcap: bool = False, fp8: bool = False,
            head_rows: bool = False) -> tuple[Any, int]:
    """The compiled kernel for the head sizes (capped logits or not, an FP8 cache or not, the
    decode rows' form or the prompts') and its shared memory bytes (NVRTC, once per process and
    geometry)."""
    key = (head_dim, value_dim, softcap, fp8, head_rows)
    entry = _kernels.get(key)
    if entry is None:
        import cupy

        code = kernel_source(head_dim, value_dim, softcap, fp8=fp8, head_rows=head_rows)
        kernel = cupy.RawModule(code=code, options=("--std=c++17", "--use_fast_math")).get_function("prefill_attention_mma")
        size = shared_bytes(head_dim, value_dim, fp8)
        kernel.max_dynamic_shared_size_bytes = size
        entry = _kernels[key] = (kernel, size)
    return entry


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel serves the geometry: GQA with (key, value) head sizes of (32, 32),
    (64, 64), (128, 128), (192, 128) (MLA's expanded form) or (256, 256)."""
    return (head_dim, value_dim) in HEAD_DIMS and kv_heads > 0 and heads % kv_heads == 0


def query_tiles(row_starts: np.ndarray, rows: int = BLOCK_ROWS) -> np.ndarray:
    """``[T, 2]`` int32 (first row, row count) tiles of at most ``rows`` rows (this kernel's
    :data:`BLOCK_ROWS`) within each segment ``row_starts[s]:row_starts[s + 1]``."""
    tiles = [
        (first, min(rows, int(end) - first))
        for start, end in zip(row_starts[:-1], row_starts[1:])
        for first in range(int(start), int(end), rows)
    ]
    return np.asarray(tiles, dtype=np.int32).reshape(-1, 2)


def prefill_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, tiles: DeviceArray, scale: float, sliding_window: int | None, out: DeviceArray,
    stream: Any = None, softcap: float | None = None, sinks: DeviceArray | None = None,
) -> DeviceArray:
    """Causal attention of the rows of ``tiles`` (:func:`query_tiles`) over their sequences' paged
    K/V: ``out [N, nh * Dv]`` bf16 bits from ``q [N, nh, D]`` float32 and bf16 caches ``k_cache
    [blocks, block_size, nkv, D]``, ``v_cache [blocks, block_size, nkv, Dv]``. Every row of a tile
    belongs to one sequence and the tile's rows have consecutive positions (prompt rows).
    ``softcap`` (a positive number; None or 0 for none) caps the logits; ``sinks`` (float32 ``[nh]``, or
    None) adds a sink logit to each head's softmax. The caches may be
    :class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray` s on the device: each step's codes times
    their scales are rounded to bf16 in shared memory, and the rest is the bf16 kernel's."""
    return _attention("prefill_attention_mma", q, k_cache, v_cache, block_tables, seq_index, positions, tiles, scale,
                      sliding_window, out, stream, softcap, sinks, head_rows=False)


def decode_rows(rows: int) -> np.ndarray:
    """The ``[rows, 2]`` int32 tiles of :func:`decode_rows_attention`: ``(row, 1)`` each."""
    return np.stack([np.arange(rows, dtype=np.int32), np.ones(rows, np.int32)], axis=1).reshape(-1, 2)


def decode_rows_blocks(rows: int, heads: int, kv_heads: int) -> int:
    """Blocks of a :func:`decode_rows_attention` launch over ``rows`` decode rows: per row, each
    KV head's query heads in tiles of :data:`BLOCK_ROWS` rows (:func:`prefill_attention` takes the
    same rows in ``rows * heads`` blocks)."""
    return rows * kv_heads * -(-(heads // kv_heads) // BLOCK_ROWS)


def decode_rows_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, tiles: DeviceArray, scale: float, sliding_window: int | None, out: DeviceArray,
    stream: Any = None, softcap: float | None = None, sinks: DeviceArray | None = None,
) -> DeviceArray:
    """The same attention for rows that are each a sequence's next position (decode rows:
    ``tiles`` of :func:`decode_rows`, a row each), with a block's tile rows taken by one row's
    query heads of a KV head instead of one head's rows: each row's keys are read once for its
    group of query heads, not once per head. Every output is computed as
    :func:`prefill_attention` computes the same query row -- the same products, from the same
    fragment positions, over the same steps of keys -- so a row gives the same bits through
    either (the batch-invariant mode's decode rows)."""
    return _attention("decode_rows_attention_mma", q, k_cache, v_cache, block_tables, seq_index, positions, tiles,
                      scale, sliding_window, out, stream, softcap, sinks, head_rows=True)


def _attention(op: str, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray,
               seq_index: DeviceArray, positions: DeviceArray, tiles: DeviceArray, scale: float,
               sliding_window: int | None, out: DeviceArray, stream: Any, softcap: float | None,
               sinks: DeviceArray | None, *, head_rows: bool) -> DeviceArray:
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    fp8 = isinstance(k_cache, Fp8CacheArray)
    if fp8 != isinstance(v_cache, Fp8CacheArray):
        raise KernelArgumentError(f"{op}: the key and value caches must both be FP8 or both bf16")
    k_scales = v_scales = None
    if fp8:
        k_scales, v_scales, k_cache, v_cache = k_cache.scales, v_cache.scales, k_cache.codes, v_cache.codes
    cache_dtype = np.uint8 if fp8 else np.uint16
    check_array(op, "k_cache", k_cache, cache_dtype, (None, None, None, head_dim))
    blocks, block_size, kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    check_array(op, "v_cache", v_cache, cache_dtype, (blocks, block_size, kv_heads, None))
    if fp8:
        check_array(op, "k_cache scales", k_scales, np.float32, (blocks, block_size, kv_heads))
        check_array(op, "v_cache scales", v_scales, np.float32, (blocks, block_size, kv_heads))
    value_dim = v_cache.shape[3]
    if not supports(heads, kv_heads, head_dim, value_dim):
        raise KernelArgumentError(
            f"{op}: {heads} heads over {kv_heads} KV heads of sizes {head_dim} (keys) and {value_dim} (values) are unsupported")
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "tiles", tiles, np.int32, (None, 2))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if softcap is not None and not softcap >= 0:
        raise KernelArgumentError(f"{op}: softcap must be positive (or None), got {softcap}")
    if sinks is not None:
        check_array(op, "sinks", sinks, np.float32, (heads,))
    if not tiles.shape[0]:
        return out
    import contextlib

    arguments = (
        q, k_cache, v_cache, block_tables, seq_index, positions, tiles, np.int32(heads), np.int32(kv_heads),
        np.int32(block_size), np.int32(block_tables.shape[1]), np.float32(scale), np.int32(sliding_window or 0),
        np.float32(softcap or 0.0), sinks if sinks is not None else np.uint64(0), out,
        k_scales if fp8 else np.uint64(0), v_scales if fp8 else np.uint64(0),
    )
    columns = decode_rows_blocks(1, heads, kv_heads) if head_rows else heads
    with stream if stream is not None else contextlib.nullcontext():
        kernel, size = _kernel(head_dim, value_dim, bool(softcap), fp8, head_rows)
        kernel((int(tiles.shape[0]), columns), (THREADS,), arguments, shared_mem=size)
    return out
