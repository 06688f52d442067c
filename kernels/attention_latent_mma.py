"""Absorbed MLA decode attention on tensor cores (CUDA C++ with ``mma.sync``, compiled by NVRTC
through CuPy), for DeepSeek's latent rows of 576 values (512 latent + 64 RoPE dims).

The NumPy reference is :func:`metrale.kernels.attention_latent.latent_attention_reference`;
:func:`latent_attention_model` is the NumPy model of this kernel's own steps (its bf16 roundings,
its splits and their merge). Flash-decoding: a block of four warps owns one decode row, a group
of 16 heads and a split of the row's keys, and streams the split's latent rows through shared
memory 64 at a time (``cp.async``, two stages, gathered from the paged cache):

* ``S = Q L^T``: the 16 heads are the M dimension of ``mma.m16n8k16``; the queries (scaled by
  ``scale * log2(e)``, as bf16) stay in shared memory and are read with ``ldmatrix``. Each warp
  takes 16 of the 64 keys over the full 576-wide reduction, so the scores need no cross-warp sum:
  only the per-head maximum (16 floats a warp) and the probabilities (a 16 x 64 bf16 tile) pass
  through shared memory;
* an online softmax in base 2, its running maximum shared by the four warps;
* ``O += P V`` with ``V`` the same staged rows' first 512 columns (``ldmatrix.trans``): each warp
  owns 128 of the 512 output columns (16 n-tiles, 64 float32 accumulators a thread) for all
  64 keys of the step.

An FP8 cache (:class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray`: E4M3 codes, a float32
scale per slot) is staged as its codes, half the bytes, and each step converts them into one bf16
tile (exactly: every E4M3 value is a bf16 value) that both products read as above; a key's scale
multiplies its scores and its probabilities, whose sums stay unscaled.

Each block writes its unnormalised partial ``O``, running maximum (natural-log units) and sum;
:func:`metrale.kernels.attention_combine.combine` merges the splits into bf16 ``[rows, heads *
512]`` (both kernels launch dependently), the contract of
:func:`metrale.kernels.attention_latent.latent_attention`.
numba's CUDA simulator cannot run this kernel; ``tests/kernels/test_attention_latent_mma.py``
runs its source on the CPU through ``tests/kernels/cuda_emulation.h``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels import attention_combine
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._tensor_cores import F16_PRIMITIVES, MMA_BF16, STAGED_COPIES, TRANSPOSED_LOAD
from metrale.kernels.attention_grouped import MAX_SPLITS
from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

#: Heads of one block: the M dimension of the products.
BLOCK_HEADS = 16
#: Keys staged per step.
BLOCK_KEYS = 64
THREADS = 128
#: The latent row (r + d_r) and value (r) widths served: DeepSeek-V2 / V3.
WIDTH = 576
VALUE_DIM = 512
#: Multiprocessors the split count aims to fill when the device cannot be asked (an H200's).
DEFAULT_MULTIPROCESSORS = 132
LOG2_E = 1.4426950408889634
# Padded shared rows (bf16): the 8 rows an ldmatrix reads lie 16 bytes apart modulo 128, in distinct banks.
ROW_STRIDE = WIDTH + 8
PROBABILITY_STRIDE = BLOCK_KEYS + 8
#: Dynamic shared memory of a block: the query tile, two stages of latent rows, the probabilities.
SHARED_BYTES = 2 * (BLOCK_HEADS * ROW_STRIDE + 2 * BLOCK_KEYS * ROW_STRIDE + BLOCK_HEADS * PROBABILITY_STRIDE)
#: Over an FP8 cache: the query tile, one tile of converted keys, the probabilities (bf16), then
#: two stages of codes.
FP8_SHARED_BYTES = (2 * (BLOCK_HEADS * ROW_STRIDE + BLOCK_KEYS * ROW_STRIDE + BLOCK_HEADS * PROBABILITY_STRIDE)
                    + 2 * BLOCK_KEYS * WIDTH)

#: The PTX instructions the kernel uses (``cp.async``, ``ldmatrix``, ``mma.sync``), the bf16
#: packing and the dynamic shared memory, each behind a small function or macro (the CPU
#: emulation of the tests replaces this part).
INSTRUCTIONS = MMA_BF16 + STAGED_COPIES + TRANSPOSED_LOAD + DEPENDENT_LAUNCH
#: And over an FP8 cache: the bf16 pair product that restores the codes' exponents.
FP8_INSTRUCTIONS = F16_PRIMITIVES

#: The kernel, written against :data:`INSTRUCTIONS`.
KERNEL = r"""
#define WIDTH 576
#define VALUE_DIM 512
#define BLOCK_HEADS 16
#define BLOCK_KEYS 64
#define THREADS 128
#define WARPS (THREADS / 32)
#define WARP_COLUMNS (VALUE_DIM / WARPS)   // output columns a warp owns: 128
#define WARP_KEYS (BLOCK_KEYS / WARPS)     // keys a warp scores per step: 16
#define ROW_STRIDE (WIDTH + 8)
#define PROBABILITY_STRIDE (BLOCK_KEYS + 8)
#define NEG_INF (__int_as_float(0xff800000))
#define KEY_TILES (FP8_CACHE ? 1 : 2)   // bf16 tiles of keys: the two stages, or the one converted tile

typedef unsigned short bf16_bits;
#if FP8_CACHE
typedef unsigned char cache_t;   // E4M3 codes, a float32 scale per slot beside them
#else
typedef bf16_bits cache_t;
#endif
#define CHUNK_VALUES (16 / (int)sizeof(cache_t))   // values of one 16-byte copy

#if FP8_CACHE
// Four E4M3 codes (the low byte the first) as two bf16 pairs, exactly: each code's sign and low
// seven bits placed as a bf16's are the value times 2^-120 (E4M3's exponent bias is 7, bf16's 127;
// its subnormals land on bf16 subnormals), and one bf16 product by 2^120 restores it. (The NaN
// codes 0x7f and 0xff read as +-480; the cache's writes saturate, and write them only for NaN rows.)
__device__ __forceinline__ void e4m3x4_to_bf16x4(unsigned codes, unsigned* pairs) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned spread = __byte_perm(codes, 0u, half ? 0x4342u : 0x4140u);   // codes in bits 0-7, 16-23
        const unsigned shifted = ((spread << 8) & 0x80008000u) | ((spread << 4) & 0x07f007f0u);
        pairs[half] = fma_bf16x2(shifted, 0x7b807b80u, 0x80008000u);   // * 2^120 + (-0)
    }
}
#endif

// Grid: (rows, heads / BLOCK_HEADS, splits); THREADS threads; dynamic shared memory: the query
// tile [BLOCK_HEADS, ROW_STRIDE], two stages [BLOCK_KEYS, ROW_STRIDE] and the probabilities
// [BLOCK_HEADS, PROBABILITY_STRIDE], all bf16 (FP8_CACHE: one bf16 tile of keys instead of the
// two stages, which hold codes [BLOCK_KEYS, WIDTH] after the probabilities). q [N, heads, WIDTH]
// f32; latent [blocks, block_size, WIDTH] bf16 bits (FP8_CACHE: E4M3 codes, and latent_scales
// [blocks, block_size] f32, a row's value code * scale); block_tables [S, max_blocks], seq_index
// [N], positions [N] int32;
// split z takes keys [z * split_keys, (z + 1) * split_keys) of its row (split_keys a multiple of
// BLOCK_KEYS). out_acc [N, heads, splits, VALUE_DIM] f32 (unnormalised), out_max (natural-log
// units) and out_sum [N, heads, splits] f32.
extern "C" __global__ void __launch_bounds__(THREADS) latent_attention_mma(
    const float* __restrict__ q, const cache_t* __restrict__ latent, const float* __restrict__ latent_scales,
    const int* __restrict__ block_tables,
    const int* __restrict__ seq_index, const int* __restrict__ positions, int num_heads, int block_size,
    int max_blocks, int split_keys, float scale, float* __restrict__ out_acc, float* __restrict__ out_max,
    float* __restrict__ out_sum)
{
    DYNAMIC_SHARED;
    bf16_bits* query_tile = reinterpret_cast<bf16_bits*>(dynamic_shared);
    bf16_bits* stages = query_tile + BLOCK_HEADS * ROW_STRIDE;
    bf16_bits* probabilities = stages + KEY_TILES * BLOCK_KEYS * ROW_STRIDE;
    __shared__ long long stage_rows[2][BLOCK_KEYS];   // cache rows of each stage's keys (-1 past the split)
#if FP8_CACHE
    cache_t* code_stages = reinterpret_cast<cache_t*>(probabilities + BLOCK_HEADS * PROBABILITY_STRIDE);
    __shared__ float stage_scales[2][BLOCK_KEYS];   // each stage's keys' scales (0 past the split)
    __shared__ float key_scales[BLOCK_KEYS];        // the converted tile's
#endif
    __shared__ float warp_max[WARPS][BLOCK_HEADS];
    __shared__ float warp_total[WARPS][BLOCK_HEADS];
    __shared__ float head_best[BLOCK_HEADS];

    allow_dependents();
    wait_for_producers();   // the queries and the step's latents come from the kernels ahead
    const int row = blockIdx.x, head_base = blockIdx.y * BLOCK_HEADS, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;   // this thread's heads: group and group + 8
    const int matrix = lane / 8, matrix_row = lane % 8;   // ldmatrix: row matrix_row of matrix `matrix`
    const int* table = block_tables + (long)seq_index[row] * max_blocks;
    const int context = positions[row] + 1;
    const int lo = split * split_keys;
    const int hi = min(context, lo + split_keys);

    // The 16 heads' queries, scaled by scale * log2(e) (the softmax runs in base 2), as bf16.
    const float query_scale = scale * 1.4426950408889634f;
    const float4* query_rows = reinterpret_cast<const float4*>(q + ((long)row * num_heads + head_base) * WIDTH);
    for (int e = threadIdx.x; e < BLOCK_HEADS * WIDTH / 4; e += THREADS) {
        const int h = e / (WIDTH / 4), d = 4 * (e % (WIDTH / 4));
        const float4 value = query_rows[e];
        unsigned* target = reinterpret_cast<unsigned*>(&query_tile[h * ROW_STRIDE + d]);
        target[0] = pack_bf16(value.x * query_scale, value.y * query_scale);
        target[1] = pack_bf16(value.z * query_scale, value.w * query_scale);
    }

    auto find_rows = [&](int stage, int base) {
        if (threadIdx.x < BLOCK_KEYS) {
            const int position = base + threadIdx.x;
            const long long cache_row = position < hi
                ? (long long)table[position / block_size] * block_size + position % block_size : -1;
            stage_rows[stage][threadIdx.x] = cache_row;
#if FP8_CACHE
            stage_scales[stage][threadIdx.x] = cache_row < 0 ? 0.f : latent_scales[cache_row];
#endif
        }
    };
    auto load_stage = [&](int stage) {
#if FP8_CACHE
        cache_t* keys = code_stages + stage * BLOCK_KEYS * WIDTH;
        const int stride = WIDTH;
#else
        cache_t* keys = stages + stage * BLOCK_KEYS * ROW_STRIDE;
        const int stride = ROW_STRIDE;
#endif
        for (int e = threadIdx.x; e < BLOCK_KEYS * (WIDTH / CHUNK_VALUES); e += THREADS) {
            const int key = e / (WIDTH / CHUNK_VALUES), chunk = e % (WIDTH / CHUNK_VALUES);
            const long long cache_row = stage_rows[stage][key];
            copy_16(shared_address(&keys[key * stride + chunk * CHUNK_VALUES]),
                    latent + (cache_row < 0 ? 0 : cache_row) * WIDTH + chunk * CHUNK_VALUES, cache_row >= 0);
        }
        commit_copies();
    };

    float best[2] = {NEG_INF, NEG_INF}, total[2] = {0.f, 0.f};
    float acc[WARP_COLUMNS / 8][4];
#pragma unroll
    for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;

    // A operand of the kk-th 16 dims: matrices (heads 0-7, dims 0-7), (heads 8-15, dims 0-7),
    // (heads 0-7, dims 8-15), (heads 8-15, dims 8-15).
    const unsigned query_fragment =
        shared_address(&query_tile[((matrix & 1) * 8 + matrix_row) * ROW_STRIDE + (matrix >> 1) * 8]);
    // A operand of the kt-th 16 keys' probabilities, the same way.
    const unsigned probability_fragment =
        shared_address(&probabilities[((matrix & 1) * 8 + matrix_row) * PROBABILITY_STRIDE + (matrix >> 1) * 8]);

    find_rows(0, lo);
    find_rows(1, lo + BLOCK_KEYS);
    __syncthreads();   // the query tile and the first stages' rows
    if (lo < hi) load_stage(0);
    int stage = 0;
    for (int base = lo; base < hi; base += BLOCK_KEYS, stage ^= 1) {
        wait_copies<0>();
        // This stage has landed for every thread; every warp is done with the other stage, whose
        // rows (found a step ago) are ready.
        __syncthreads();
        if (base + BLOCK_KEYS < hi) load_stage(stage ^ 1);
#if FP8_CACHE
        // The stage's codes into the bf16 tile (keys past the split were copied as zeros), its
        // scales beside it; the stage's rows and scales are then free for the step after next.
        if (threadIdx.x < BLOCK_KEYS) key_scales[threadIdx.x] = stage_scales[stage][threadIdx.x];
        const cache_t* codes = code_stages + stage * BLOCK_KEYS * WIDTH;
        for (int e = threadIdx.x; e < BLOCK_KEYS * (WIDTH / 16); e += THREADS) {
            const int key = e / (WIDTH / 16), chunk = e % (WIDTH / 16);
            const uint4 word = *reinterpret_cast<const uint4*>(&codes[key * WIDTH + chunk * 16]);
            uint4 converted[2];
            unsigned* pairs = reinterpret_cast<unsigned*>(converted);
            e4m3x4_to_bf16x4(word.x, pairs);
            e4m3x4_to_bf16x4(word.y, pairs + 2);
            e4m3x4_to_bf16x4(word.z, pairs + 4);
            e4m3x4_to_bf16x4(word.w, pairs + 6);
            uint4* target = reinterpret_cast<uint4*>(&stages[key * ROW_STRIDE + chunk * 16]);
            target[0] = converted[0];
            target[1] = converted[1];
        }
        find_rows(stage, base + 2 * BLOCK_KEYS);   // after this thread's read of the stage's scales
        __syncthreads();   // the tile and its scales
        const bf16_bits* keys = stages;
#else
        find_rows(stage, base + 2 * BLOCK_KEYS);   // this stage's rows were last read by its copies, before the barrier
        const bf16_bits* keys = stages + stage * BLOCK_KEYS * ROW_STRIDE;
#endif

        // Scores of the warp's 16 keys: n-tiles 0 (keys warp * 16 + 0-7) and 1 (+ 8-15). B operand
        // of the kk-th 16 dims: matrices (keys of tile 0, dims 0-7), (tile 0, dims 8-15), (tile 1,
        // dims 0-7), (tile 1, dims 8-15).
        float scores[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const unsigned key_fragment =
            shared_address(&keys[(warp * WARP_KEYS + (matrix >> 1) * 8 + matrix_row) * ROW_STRIDE + (matrix & 1) * 8]);
#pragma unroll 4
        for (int kk = 0; kk < WIDTH / 16; ++kk) {
            unsigned query[4], operand[4];
            load_matrices(query, query_fragment + kk * 32);
            load_matrices(operand, key_fragment + kk * 32);
            mma_16x8x16(scores[0], query, operand);
            mma_16x8x16(scores[1], query, operand + 2);
        }

        // Keys past the split score -inf (the first key of a step never is).
        float local[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
#if FP8_CACHE
                scores[nt][c] *= key_scales[warp * WARP_KEYS + nt * 8 + quad * 2 + (c & 1)];
#endif
                if (base + warp * WARP_KEYS + nt * 8 + quad * 2 + (c & 1) >= hi) scores[nt][c] = NEG_INF;
                local[c / 2] = fmaxf(local[c / 2], scores[nt][c]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            local[h] = fmaxf(local[h], __shfl_xor_sync(0xffffffff, local[h], 1));
            local[h] = fmaxf(local[h], __shfl_xor_sync(0xffffffff, local[h], 2));
        }
        if (quad == 0) {
            warp_max[warp][group] = local[0];
            warp_max[warp][group + 8] = local[1];
        }
        __syncthreads();
        float rescale[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float new_best = best[h];
#pragma unroll
            for (int w = 0; w < WARPS; ++w) new_best = fmaxf(new_best, warp_max[w][group + 8 * h]);
            rescale[h] = exp2f(best[h] - new_best);   // 0 at the first step (best = -inf)
            best[h] = new_best;
            total[h] *= rescale[h];
        }
        // The probabilities, as bf16, into the shared tile [head, key] every warp reads.
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            float p[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                p[c] = exp2f(scores[nt][c] - best[c / 2]);
                total[c / 2] += p[c];
            }
            const int key = warp * WARP_KEYS + nt * 8 + quad * 2;
#if FP8_CACHE
            // P V over the codes: each key's scale on its probabilities (their sums stay unscaled).
            const float low_scale = key_scales[key], high_scale = key_scales[key + 1];
            p[0] *= low_scale; p[1] *= high_scale; p[2] *= low_scale; p[3] *= high_scale;
#endif
            *reinterpret_cast<unsigned*>(&probabilities[group * PROBABILITY_STRIDE + key]) = pack_bf16(p[0], p[1]);
            *reinterpret_cast<unsigned*>(&probabilities[(group + 8) * PROBABILITY_STRIDE + key]) = pack_bf16(p[2], p[3]);
        }
#pragma unroll
        for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) {
            acc[dt][0] *= rescale[0]; acc[dt][1] *= rescale[0];
            acc[dt][2] *= rescale[1]; acc[dt][3] *= rescale[1];
        }
        __syncthreads();

        // B operand of value tiles dt, dt + 1 of the warp's columns (transposed loads): matrices
        // (keys 0-7, columns of dt), (keys 8-15, dt), (keys 0-7, dt + 1), (keys 8-15, dt + 1) of
        // the kt-th 16 keys.
        const unsigned value_fragment = shared_address(
            &keys[((matrix & 1) * 8 + matrix_row) * ROW_STRIDE + warp * WARP_COLUMNS + (matrix >> 1) * 8]);
#pragma unroll
        for (int kt = 0; kt < BLOCK_KEYS / 16; ++kt) {
            unsigned weights[4];
            load_matrices(weights, probability_fragment + kt * 32);
#pragma unroll
            for (int dt = 0; dt < WARP_COLUMNS / 8; dt += 2) {
                unsigned operand[4];
                load_matrices_transposed(operand, value_fragment + (kt * 16 * ROW_STRIDE + dt * 8) * 2);
                mma_16x8x16(acc[dt], weights, operand);
                mma_16x8x16(acc[dt + 1], weights, operand + 2);
            }
        }
    }

    // The partials: each warp its 128 columns; the sums over the four warps' keys.
    const long head_row0 = ((long)row * num_heads + head_base + group) * splits + split;
    const long head_row1 = head_row0 + 8L * splits;
#pragma unroll
    for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) {
        const int column = warp * WARP_COLUMNS + dt * 8 + quad * 2;
        *reinterpret_cast<float2*>(&out_acc[head_row0 * VALUE_DIM + column]) = make_float2(acc[dt][0], acc[dt][1]);
        *reinterpret_cast<float2*>(&out_acc[head_row1 * VALUE_DIM + column]) = make_float2(acc[dt][2], acc[dt][3]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 1);
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 2);
    }
    if (quad == 0) {
        warp_total[warp][group] = total[0];
        warp_total[warp][group + 8] = total[1];
        if (warp == 0) {
            head_best[group] = best[0];
            head_best[group + 8] = best[1];
        }
    }
    __syncthreads();
    if (threadIdx.x < BLOCK_HEADS) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += warp_total[w][threadIdx.x];
        const long at = ((long)row * num_heads + head_base + threadIdx.x) * splits + split;
        out_sum[at] = sum;
        out_max[at] = head_best[threadIdx.x] * 0.6931471805599453f;   // base 2 to natural-log units
    }
}
"""



def kernel_source(fp8: bool = False, with_instructions: bool = True) -> str:
    """The kernel's CUDA C++ over a bf16 cache or an FP8 one; without its PTX helpers (for the
    CPU emulation, whose header has its own) when ``with_instructions`` is false."""
    helpers = (INSTRUCTIONS + (FP8_INSTRUCTIONS if fp8 else "")) if with_instructions else ""
    return helpers + f"#define FP8_CACHE {int(fp8)}\n" + KERNEL


SOURCE = kernel_source()

_kernels: dict[bool, Any] = {}
_multiprocessors: dict[int, int] = {}


def _kernel(fp8: bool = False) -> Any:
    """The compiled kernel over a bf16 or an FP8 cache (NVRTC, once per process each)."""
    kernel = _kernels.get(fp8)
    if kernel is None:
        import cupy

        module = cupy.RawModule(code=kernel_source(fp8), options=("--std=c++17", "--use_fast_math"))
        kernel = module.get_function("latent_attention_mma")
        kernel.max_dynamic_shared_size_bytes = FP8_SHARED_BYTES if fp8 else SHARED_BYTES
        _kernels[fp8] = kernel
    return kernel


def supports(heads: int, width: int, value_dim: int) -> bool:
    """Whether this kernel serves the geometry: heads a multiple of 16, latent rows of 576 values
    (512 latent + 64 RoPE dims) and values of 512 (DeepSeek-V2 / V3's MLA); others keep
    :func:`metrale.kernels.attention_latent.latent_attention`."""
    return heads > 0 and heads % BLOCK_HEADS == 0 and width == WIDTH and value_dim == VALUE_DIM


def split_count(rows: int, heads: int, max_context: int, multiprocessors: int = DEFAULT_MULTIPROCESSORS) -> int:
    """Key splits per row: as many as keep the grid within one wave of ``multiprocessors`` blocks
    (a block fills a multiprocessor's shared memory), at least one step of :data:`BLOCK_KEYS` keys
    each, at most ``MAX_SPLITS`` (the merge's limit)."""
    blocks = max(1, rows * (heads // BLOCK_HEADS))
    steps = max(1, -(-int(max_context) // BLOCK_KEYS))
    return max(1, min(multiprocessors // blocks, MAX_SPLITS, steps))


def split_keys(max_context: int, splits: int) -> int:
    """Keys of one split: an equal share of ``max_context``, rounded up to whole steps."""
    return max(1, -(-max(1, int(max_context)) // (splits * BLOCK_KEYS))) * BLOCK_KEYS


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def latent_attention_partials_model(
    q: np.ndarray, latent: np.ndarray, block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
    scale: float, splits: int, keys_per_split: int, latent_scales: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's per-split results in NumPy: ``(out_acc [N, heads, splits, VALUE_DIM], out_max,
    out_sum [N, heads, splits])`` float32, as the blocks write them. Queries are scaled by ``scale
    * log2(e)`` and rounded to bf16; split ``z`` takes keys ``[z * keys_per_split, (z + 1) *
    keys_per_split)`` of its row in steps of :data:`BLOCK_KEYS`; an online softmax in base 2 whose
    probabilities enter ``P V`` as bf16 (their sums stay float32); ``out_max`` in natural-log units
    (``-inf`` and a zero sum for a split without keys). ``latent`` holds float32 values
    (bf16-exact) ``[blocks, block_size, WIDTH]``; with ``latent_scales [blocks, block_size]`` (an
    FP8 cache) ``latent`` holds its codes' values and each key's scale multiplies its scores (in
    float32) and its probabilities (before their bf16 rounding; the sums stay unscaled)."""
    rows, heads, _ = q.shape
    block_size = latent.shape[1]
    out_acc = np.zeros((rows, heads, splits, VALUE_DIM), np.float32)
    out_max = np.full((rows, heads, splits), -np.inf, np.float32)
    out_sum = np.zeros((rows, heads, splits), np.float32)
    for row in range(rows):
        queries = _bf16(q[row] * np.float32(scale * LOG2_E))
        context = int(positions[row]) + 1
        table = block_tables[seq_index[row]]
        for split in range(splits):
            lo, hi = split * keys_per_split, min(context, (split + 1) * keys_per_split)
            best = np.full(heads, -np.inf, np.float32)
            total = np.zeros(heads, np.float32)
            acc = np.zeros((heads, VALUE_DIM), np.float32)
            for base in range(lo, hi, BLOCK_KEYS):
                steps = range(base, min(hi, base + BLOCK_KEYS))
                keys = np.stack([latent[table[j // block_size], j % block_size] for j in steps]).astype(np.float32)
                key_scales = (np.ones(len(keys), np.float32) if latent_scales is None else
                              np.array([latent_scales[table[j // block_size], j % block_size] for j in steps], np.float32))
                scores = (queries @ keys.T) * key_scales
                new_best = np.maximum(best, scores.max(axis=1))
                rescale = np.exp2(best - new_best)
                best = new_best
                p = np.exp2(scores - best[:, None])
                total = total * rescale + p.sum(axis=1, dtype=np.float32)
                acc = acc * rescale[:, None] + _bf16(p * key_scales) @ keys[:, :VALUE_DIM]
            out_acc[row, :, split] = acc
            out_max[row, :, split] = best * np.float32(math.log(2.0))
            out_sum[row, :, split] = total
    return out_acc, out_max, out_sum


def combine_partials_model(out_acc: np.ndarray, out_max: np.ndarray, out_sum: np.ndarray) -> np.ndarray:
    """The log-sum-exp merge of the splits (what :func:`metrale.kernels.attention_combine.combine`
    computes), float32
    ``[N, heads, value_dim]`` before its bf16 rounding; splits with a zero sum weigh nothing."""
    used = out_sum > 0
    top = np.where(used, out_max, -np.inf).max(axis=2, keepdims=True)
    with np.errstate(invalid="ignore"):  # -inf - -inf where no split has keys: masked
        weights = np.where(used, np.exp(np.where(used, out_max - top, 0.0)), 0.0).astype(np.float32)
    numerator = np.einsum("nhs,nhsd->nhd", weights, out_acc)
    total = (weights * out_sum).sum(axis=2)[..., None]
    return np.where(total > 0, numerator / np.where(total > 0, total, 1.0), 0.0).astype(np.float32)


def latent_attention_model(
    q: np.ndarray, latent: np.ndarray, block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
    scale: float, splits: int, keys_per_split: int, latent_scales: np.ndarray | None = None,
) -> np.ndarray:
    """The kernel's algorithm end to end in NumPy: :func:`latent_attention_partials_model` merged by
    :func:`combine_partials_model`, float32 ``[N, heads, VALUE_DIM]``."""
    return combine_partials_model(*latent_attention_partials_model(
        q, latent, block_tables, seq_index, positions, scale, splits, keys_per_split, latent_scales))


def multiprocessor_count() -> int:
    """The current device's multiprocessors (asked once per device)."""
    import cupy

    device = cupy.cuda.Device().id
    count = _multiprocessors.get(device)
    if count is None:
        count = _multiprocessors[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return count


def latent_attention(
    q: DeviceArray, latent: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray, positions: DeviceArray,
    value_dim: int, scale: float, max_context: int, out: DeviceArray, stream: Any = None,
) -> DeviceArray:
    """The tensor-core launcher of :func:`metrale.kernels.attention_latent.latent_attention` (same
    arguments and result): bf16 bits ``out [N, heads * value_dim]`` from float32 ``q [N, heads,
    576]`` over the bf16 latent cache ``[blocks, block_size, 576]`` (uint16) or an FP8 one
    (:class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray`: E4M3 codes of that shape, a float32
    scale a slot; each key's scale multiplies its scores and its probabilities); only geometries
    that :func:`supports` accepts."""
    op = "latent_attention_mma"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, width = q.shape
    if not supports(heads, width, value_dim):
        raise KernelArgumentError(
            f"{op}: {heads} heads of latent width {width} and value dim {value_dim} are unsupported "
            f"(heads a multiple of {BLOCK_HEADS}, width {WIDTH}, value dim {VALUE_DIM})")
    fp8 = isinstance(latent, Fp8CacheArray)
    if fp8:
        check_array(op, "latent codes", latent.codes, np.uint8, (None, None, width))
        check_array(op, "latent scales", latent.scales, np.float32, tuple(latent.codes.shape[:2]))
    else:
        check_array(op, "latent", latent, np.uint16, (None, None, width))
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if not rows:
        return out
    import cupy

    splits = split_count(rows, heads, max_context, multiprocessor_count())
    keys = split_keys(max_context, splits)
    with stream if stream is not None else contextlib.nullcontext():
        out_acc = cupy.empty((rows, heads, splits, value_dim), dtype=np.float32)
        out_max = cupy.empty((rows, heads, splits), dtype=np.float32)
        out_sum = cupy.empty((rows, heads, splits), dtype=np.float32)
        # (Over a bf16 cache the scales' argument is unread: the rows stand in for it.)
        arguments = (
            q, latent.codes if fp8 else latent, latent.scales if fp8 else latent, block_tables, seq_index, positions,
            np.int32(heads), np.int32(latent.shape[1]), np.int32(block_tables.shape[1]), np.int32(keys),
            np.float32(scale), out_acc, out_max, out_sum,
        )
    launch(_kernel(fp8), (rows, heads // BLOCK_HEADS, splits), (THREADS,), arguments,
           FP8_SHARED_BYTES if fp8 else SHARED_BYTES, stream, dependent=True)
    attention_combine.combine(out_acc, out_max, out_sum, out, stream)
    return out
