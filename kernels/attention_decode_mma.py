"""Paged decode attention on tensor cores (CUDA C++ with ``mma.sync``, compiled by NVRTC through
CuPy): one query row per sequence, grouped-query heads, any block size, sliding windows.

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`;
:func:`decode_attention_partials_model` is the NumPy model of this kernel's own steps (its bf16
roundings, its splits). Flash-decoding: a block of four warps owns one decode row, up to 16 query
heads of one KV head (the M dimension of ``mma.m16n8k16``; a group of fewer heads is padded with
zero queries) and a split of the row's keys, and streams the split's keys and values through
shared memory 64 at a time with ``cp.async`` (three stages for head sizes up to 128, so two
stages' copies are in flight while one is computed; two stages at 256; more for a launch of one
split whose grid stays resident with them, :func:`launch_stages`):

* ``S = Q K^T``: each warp scores 16 of the 64 keys over the full head size, so the scores need
  no cross-warp sum; the queries (scaled by ``scale * log2(e)``, as bf16) stay in shared memory;
* an online softmax in base 2 whose running maximum the four warps share;
* ``O += P V``: each warp owns a quarter of the value columns for all 64 keys. The probabilities
  enter as two bf16 parts, ``P = P_high + P_low`` (``P_low`` the rounding error of ``P_high``),
  each multiplied by the values: about 16 bits of each probability are kept, so the result does
  not depend on how the keys were split to within float32-like error (one bf16 rounding of ``P``
  moved greedy tokens of small random models between a captured graph's split count and an eager
  step's), and the extra products cost little in a kernel bound by its cache reads.

An FP8 cache (E4M3 codes, a float32 scale per slot and KV head) is staged as its codes and
scales, half of a bf16 cache's bytes, and its products are transposed: the keys, then the value
dims, are the M dimension and the query heads the N dimension, in tiles of 8 (:func:`head_tiles`),
so a group of 4 query heads fills half of a product's rows where it would fill a quarter of 16.
The warps divide a step's keys for both products: each copies its own 16 keys' and values' codes
and scales into the stage and waits for them alone, loads the codes as fragments (``ldmatrix`` of
byte pairs, the values' transposed), converts them in registers into f16 (exact: every E4M3 value
is an f16 value), scores them, keeps its own online softmax and multiplies its values by its
probabilities (turned into the B operand by ``movmatrix``) for every column; the four warps'
softmaxes and accumulators merge once after the last step, so the loop has no barrier across the
block. The products are f16 (the queries and the probabilities' two parts
too), a key's scale multiplies its scores and a value's scale its probabilities, over the warp's
step's largest value scale so they stay within ``[0, 1]`` (the accumulator kept in units of that
scale, rescaled with the running maximum).

The keys of a row (those the sliding window leaves) are divided evenly between the splits of the
grid's last axis, on the device from the row's position, so a graph captured for the longest
context serves every shorter one. With one split a block writes the normalised bf16 output; with
more it writes unnormalised partials that the last split of each row and head block to finish
merges itself (with counters) or :func:`metrale.kernels.attention_combine.combine` merges after
it. Both kernels launch dependently. Why: the CUDA-core decode
kernels keep a short chain of loads in flight per warp and read the cache at about half the
memory bandwidth at large batches; here the copies of whole stages overlap the arithmetic.
numba's CUDA simulator cannot run this kernel; ``tests/kernels/test_attention_decode_mma.py``
runs its source on the CPU through ``tests/kernels/cuda_emulation.h``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels import attention_combine
from metrale.kernels._device import SIMULATED, DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._tensor_cores import F16_PRIMITIVES, MMA_BF16, STAGED_COPIES, TRANSPOSED_LOAD
from metrale.kernels.attention_grouped import MAX_SPLITS
from metrale.kernels.attention_latent_mma import multiprocessor_count

#: Query heads of one block: the M dimension of the products.
BLOCK_HEADS = 16
#: Keys staged per step.
BLOCK_KEYS = 64
THREADS = 128
#: The head sizes served (keys and values of the same size).
HEAD_DIMS = (32, 64, 128, 256)
#: Multiprocessors the split count aims to fill when the device cannot be asked (an H200's).
DEFAULT_MULTIPROCESSORS = 132
#: Dynamic shared memory a block may take.
MAX_SHARED_BYTES = 227 * 1024
LOG2_E = 1.4426950408889634


def stages(head_dim: int) -> int:
    """Shared-memory stages of keys and values that keep the most blocks resident: three up to
    128 dims, two above (shared memory)."""
    return 3 if head_dim <= 128 else 2


#: The most stages a launch takes (:func:`launch_stages`).
MAX_STAGES = 6
#: A launch's stage count instead of :func:`launch_stages`'s choice (None: the choice).
STAGES_OVERRIDE: int | None = None


def shared_bytes(head_dim: int, stage_count: int | None = None, fp8: bool = False) -> int:
    """Dynamic shared memory of a block: the query tile, the stages (``stage_count``, by default
    :func:`stages`), the probabilities' two bf16 parts (all bf16); for an FP8 cache (``fp8``) the
    query tile and the stages' codes (rows padded by 16 bytes) and float32 scales."""
    stride = head_dim + 8
    count = stages(head_dim) if stage_count is None else stage_count
    if fp8:
        return 2 * BLOCK_HEADS * stride + count * (2 * BLOCK_KEYS * (head_dim + 16) + 2 * BLOCK_KEYS * 4)
    return 2 * (BLOCK_HEADS * stride + count * 2 * BLOCK_KEYS * stride + 2 * BLOCK_HEADS * (BLOCK_KEYS + 8))


def static_shared_bytes(stage_count: int) -> int:
    """Static shared memory of a block: each stage's key offsets (8 bytes a key), the warps'
    maxima and sums, the heads' maxima and the merge's flag."""
    return stage_count * BLOCK_KEYS * 8 + 2 * (THREADS // 32) * BLOCK_HEADS * 4 + BLOCK_HEADS * 4 + 4


def fits(head_dim: int, stage_count: int, fp8: bool = False) -> bool:
    """Whether a block of ``stage_count`` stages fits the shared memory a block may take, its
    dynamic and static parts together."""
    return shared_bytes(head_dim, stage_count, fp8) + static_shared_bytes(stage_count) <= MAX_SHARED_BYTES


def blocks_per_multiprocessor(head_dim: int, stage_count: int | None = None, fp8: bool = False) -> int:
    """Blocks a multiprocessor holds at once (its 227 KB of shared memory decide)."""
    return max(1, MAX_SHARED_BYTES // (shared_bytes(head_dim, stage_count, fp8) + 2048))


def launch_stages(rows: int, heads: int, kv_heads: int, head_dim: int, splits: int, max_context: int,
                  multiprocessors: int = DEFAULT_MULTIPROCESSORS, fp8: bool = False) -> int:
    """Stages of a launch: :func:`stages`, or more for a launch of one split (a batch of many
    rows: each block walks all of its row's keys, one stage after another) where the grid still
    fits in one wave of resident blocks with them, so that more of a block's keys are in flight
    while it computes; at most one more than a block's steps and :data:`MAX_STAGES`
    (docs/benchmarks.rst, "decode attention, stages at one split")."""
    if STAGES_OVERRIDE is not None:
        if not 2 <= STAGES_OVERRIDE <= MAX_STAGES or not fits(head_dim, STAGES_OVERRIDE, fp8):
            raise KernelArgumentError(f"decode_attention_mma: {STAGES_OVERRIDE} stages of {head_dim} dims (2 to "
                                      f"{MAX_STAGES}, within {MAX_SHARED_BYTES} bytes of shared memory)")
        return STAGES_OVERRIDE
    count = stages(head_dim)
    if splits > 1:
        return count
    blocks = max(1, rows * kv_heads * head_blocks(heads, kv_heads))
    steps = max(1, -(-int(max_context) // BLOCK_KEYS))
    while (count < min(MAX_STAGES, steps + 1)
           and fits(head_dim, count + 1, fp8)
           and multiprocessors * blocks_per_multiprocessor(head_dim, count + 1, fp8) >= blocks):
        count += 1
    return count


#: A load of what another block of the same launch wrote (past the L1 cache).
COHERENT_LOAD = r"""
__device__ __forceinline__ float load_coherent(const float* address) { return __ldcg(address); }
"""

#: The PTX helpers the kernel uses (the CPU emulation of the tests replaces them).
INSTRUCTIONS = MMA_BF16 + STAGED_COPIES + TRANSPOSED_LOAD + COHERENT_LOAD + DEPENDENT_LAUNCH

#: The helpers of an FP8 cache: the f16 tensor-core product and packing, the codes' f16 values
#: (exact), f16 halves as float32, 4-byte copies (the scales), an 8x8 matrix's transpose.
FP8_INSTRUCTIONS = F16_PRIMITIVES + r"""
// An 8x8 matrix of 16-bit values across the warp, lane t holding row t / 4, columns 2 (t % 4) and
// 2 (t % 4) + 1 (the low half the first): the same lane's part of its transpose.
__device__ __forceinline__ unsigned transpose_matrix(unsigned fragment) {
    unsigned result;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(result) : "r"(fragment));
    return result;
}
__device__ __forceinline__ float f16_low(unsigned pair) { return __half2float(__ushort_as_half((unsigned short)pair)); }
__device__ __forceinline__ float f16_high(unsigned pair) { return __half2float(__ushort_as_half((unsigned short)(pair >> 16))); }

// 4 bytes from global to shared memory (through L1; cp.async.cg copies 16 only); zeros when !valid.
__device__ __forceinline__ void copy_4(unsigned target, const void* source, bool valid) {
    const int bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(target), "l"(source), "r"(bytes));
}
"""

#: The kernel, written against :data:`INSTRUCTIONS`.
KERNEL = r"""
#define BLOCK_HEADS 16
#define BLOCK_KEYS 64
#define THREADS 128
#define WARPS (THREADS / 32)
#define WARP_COLUMNS (HEAD_DIM / WARPS)   // value columns a warp owns
#define WARP_KEYS (BLOCK_KEYS / WARPS)    // keys a warp scores per step: 16
#define STRIDE (HEAD_DIM + 8)             // padded shared rows: an ldmatrix's 8 rows fall in distinct banks
#define PROBABILITY_STRIDE (BLOCK_KEYS + 8)
#define PROBABILITY_PART (2 * BLOCK_HEADS * PROBABILITY_STRIDE)   // bytes from the high parts to the low
#define STAGE_ELEMENTS (2 * BLOCK_KEYS * STRIDE)   // keys, then values
#define NEG_INF (__int_as_float(0xff800000))
#define RAW_STRIDE (HEAD_DIM + 16)   // FP8_CACHE: a staged row of codes, padded as STRIDE is
#define RAW_STAGE_BYTES (2 * BLOCK_KEYS * RAW_STRIDE)   // FP8_CACHE: a stage's key and value codes

typedef unsigned short bf16_bits;
#if FP8_CACHE
typedef unsigned char cache_t;   // E4M3 codes, a float32 scale per (slot, KV head) beside them
// The operands are f16: the codes' values exactly, the queries and probabilities to 11 bits.
#define MMA_16x8x16 mma_16x8x16_f16
#define PACK_OPERANDS pack_f16
#else
typedef bf16_bits cache_t;
#define MMA_16x8x16 mma_16x8x16
#define PACK_OPERANDS pack_bf16
#endif
#if FP8_CACHE
// Each warp finds the rows of, copies, waits for and reads only its own 16 keys of a step, so the
// warps of a block never wait for each other inside the loop.
#define ROW_FINDER (lane < WARP_KEYS)
#define ROW_KEY (warp * WARP_KEYS + lane)
#define STAGE_BARRIER() __syncwarp()
#else
#define ROW_FINDER (threadIdx.x < BLOCK_KEYS)
#define ROW_KEY ((int)threadIdx.x)
#define STAGE_BARRIER() __syncthreads()
#endif

// Grid: (rows, kv_heads * head_blocks, splits), head_blocks = ceil(group / BLOCK_HEADS); THREADS
// threads; dynamic shared memory: the query tile [BLOCK_HEADS, STRIDE], STAGES stages of
// [BLOCK_KEYS, STRIDE] keys and values, the probabilities' high and low parts [2, BLOCK_HEADS,
// PROBABILITY_STRIDE], bf16. FP8_CACHE: k_cache and v_cache hold E4M3 codes and k_scales, v_scales
// [blocks, block_size, num_kv_heads] their scales; the stages hold the codes [2, BLOCK_KEYS,
// RAW_STRIDE] and scales [2, BLOCK_KEYS] as copied (so the cache's bytes, half of bf16's, are
// what the copies read) and the query tile f16 values, each 16 dims in the order the key
// fragments take them; no probabilities pass through shared memory. Each warp takes its 16 keys
// of a step through both products on its own, transposed so that the keys and then the value
// dims are the M dimension and HEAD_TILES tiles of 8 heads the N dimension (a group of up to 8
// heads fills half a tile, not a quarter): it loads the codes as fragments (ldmatrix of byte
// pairs), converts them in registers, scores its keys, keeps its own online softmax, and
// multiplies its values by its probabilities for every column -- and copies and waits for its own
// keys of each stage (STAGE_BARRIER a warp's), so the warps never wait for each other in the
// loop; their softmaxes merge after it. The operands are f16: a score is the
// query times the key's codes, times the key's scale after the product; a probability enters P V
// times its value's scale over the warp's step's largest value scale (the accumulator kept in
// units of that scale, rescaled as the running maximum rescales it), so both parts stay within
// [0, 1].
// q [N, num_heads, HEAD_DIM] f32; k_cache, v_cache [blocks, block_size, num_kv_heads, HEAD_DIM]
// bf16 bits; block_tables [S, max_blocks], seq_index [N], positions [N] int32. One split: out
// [N, num_heads * HEAD_DIM] bf16 bits. More: out_acc [N, num_heads, splits, HEAD_DIM] f32
// (unnormalised), out_max (natural-log units) and out_sum [N, num_heads, splits] f32, which the
// combine kernel merges into out; or, with counters (int32 [N, gridDim.y], zero between launches),
// the last split of each (row, head block) to finish merges them into out itself. With SOFTCAP the
// logits are capped, softcap * tanh(logit / softcap); sinks (f32 [num_heads], or null) give each
// head's softmax one more logit, counted by split 0 as a key already seen whose value is zero.
extern "C" __global__ void __launch_bounds__(THREADS) decode_attention_mma(
    const float* __restrict__ q, const cache_t* __restrict__ k_cache, const cache_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_index, const int* __restrict__ positions,
    int num_heads, int num_kv_heads, int block_size, int max_blocks, float scale, int sliding_window, float softcap,
    const float* __restrict__ sinks, float* __restrict__ out_acc, float* __restrict__ out_max,
    float* __restrict__ out_sum, bf16_bits* __restrict__ out, int* __restrict__ counters,
    const float* __restrict__ k_scales, const float* __restrict__ v_scales)
{
    DYNAMIC_SHARED;
    bf16_bits* query_tile = reinterpret_cast<bf16_bits*>(dynamic_shared);
    bf16_bits* stages = query_tile + BLOCK_HEADS * STRIDE;
#if FP8_CACHE
    unsigned char* raw_stages = reinterpret_cast<unsigned char*>(stages);
    float* raw_scales = reinterpret_cast<float*>(raw_stages + STAGES * RAW_STAGE_BYTES);   // [STAGES][2][BLOCK_KEYS]
    // After the loop the warps' accumulators pass through the stages' codes.
    static_assert(WARPS * BLOCK_HEADS * HEAD_DIM * 4 <= 2 * RAW_STAGE_BYTES, "the merge fits two stages");
#else
    bf16_bits* probabilities = stages + STAGES * STAGE_ELEMENTS;   // high parts, then low parts
#endif
    __shared__ long long stage_rows[STAGES][BLOCK_KEYS];   // element offsets of each stage's keys (-1 past the split)
    __shared__ float warp_max[WARPS][BLOCK_HEADS];
    __shared__ float warp_total[WARPS][BLOCK_HEADS];
    __shared__ float head_best[BLOCK_HEADS];

    allow_dependents();   // the next kernel (o_proj) may start fetching its weights
    const int row = blockIdx.x, split = blockIdx.z, splits = gridDim.z;
    const int group_size = num_heads / num_kv_heads;
    const int head_blocks = (group_size + BLOCK_HEADS - 1) / BLOCK_HEADS;
    const int kv_head = blockIdx.y / head_blocks;
    const int head_base = kv_head * group_size + (blockIdx.y % head_blocks) * BLOCK_HEADS;
    const int block_heads = min(BLOCK_HEADS, kv_head * group_size + group_size - head_base);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;   // this thread's heads: group and group + 8
    const int matrix = lane / 8, matrix_row = lane % 8;   // ldmatrix: row matrix_row of matrix `matrix`
    const int* table = block_tables + (long)seq_index[row] * max_blocks;
    const int context = positions[row] + 1;
    const int first_key = sliding_window > 0 ? max(0, context - sliding_window) : 0;
    const int split_keys = (context - first_key + splits - 1) / splits;
    const int lo = first_key + split * split_keys;
    const int hi = min(context, lo + split_keys);

    // ROW_FINDER threads: the cache offset of key base + ROW_KEY (-1 past the split).
    auto row_offset = [&](int base) -> long long {
        const int position = base + ROW_KEY;
        const long long cache_row = position < hi
            ? (long long)table[position / block_size] * block_size + position % block_size : -1;
        return cache_row < 0 ? -1 : (cache_row * num_kv_heads + kv_head) * HEAD_DIM;
    };
    auto find_rows = [&](int stage, int base) {
        if (ROW_FINDER) stage_rows[stage][ROW_KEY] = row_offset(base);
    };
    // The copies of a stage; `skipped` (a key of the stage, or -1) gets none: the step's own key,
    // which the kernels ahead are still writing when the first stages are issued.
    auto load_stage = [&](int stage, int skipped) {
#if FP8_CACHE
        unsigned char* raw = raw_stages + stage * RAW_STAGE_BYTES;
        for (int e = lane; e < 2 * WARP_KEYS * (HEAD_DIM / 16); e += 32) {   // the warp's keys
            const int half = e / (WARP_KEYS * (HEAD_DIM / 16));   // 0: keys, 1: values
            const int key = warp * WARP_KEYS + (e / (HEAD_DIM / 16)) % WARP_KEYS, chunk = e % (HEAD_DIM / 16);
            if (key == skipped) continue;
            const long long offset = stage_rows[stage][key];   // in codes: bytes
            const cache_t* source = (half ? v_cache : k_cache) + (offset < 0 ? 0 : offset) + chunk * 16;
            copy_16(shared_address(&raw[(half * BLOCK_KEYS + key) * RAW_STRIDE + chunk * 16]), source, offset >= 0);
        }
        // A key past the split copies scale 0 (and codes 0): its values are zeros.
        for (int e = lane; e < 2 * WARP_KEYS; e += 32) {
            const int half = e / WARP_KEYS, key = warp * WARP_KEYS + e % WARP_KEYS;
            if (key == skipped) continue;
            const long long offset = stage_rows[stage][key];
            const float* source = (half ? v_scales : k_scales) + (offset < 0 ? 0 : offset / HEAD_DIM);
            copy_4(shared_address(&raw_scales[(stage * 2 + half) * BLOCK_KEYS + key]), source, offset >= 0);
        }
#else
        bf16_bits* keys = stages + stage * STAGE_ELEMENTS;
        for (int e = threadIdx.x; e < 2 * BLOCK_KEYS * (HEAD_DIM / 8); e += THREADS) {
            const int half = e / (BLOCK_KEYS * (HEAD_DIM / 8));   // 0: keys, 1: values
            const int key = (e / (HEAD_DIM / 8)) % BLOCK_KEYS, chunk = e % (HEAD_DIM / 8);
            if (key == skipped) continue;
            const long long offset = stage_rows[stage][key];
            const bf16_bits* source = (half ? v_cache : k_cache) + (offset < 0 ? 0 : offset) + chunk * 8;
            copy_16(shared_address(&keys[(half * BLOCK_KEYS + key) * STRIDE + chunk * 8]), source, offset >= 0);
        }
#endif
    };

#if FP8_CACHE
    // Lane (g, q) keeps the softmax of heads 8 nt + 2q and 2q + 1 over the warp's keys; the
    // accumulator O^T [dims, heads]: acc[mt][nt] rows g (dim 16 mt + 2g) and g + 8 (dim 2g + 1).
    float best[HEAD_TILES][2], total[HEAD_TILES][2];
#pragma unroll
    for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int head = nt * 8 + quad * 2 + e;
            const bool sink = sinks != nullptr && split == 0 && head < block_heads;
            // The sink: every lane starts its heads' maximum there; one lane a head counts its 1.
            best[nt][e] = sink ? sinks[head_base + head] * 1.4426950408889634f : NEG_INF;
            total[nt][e] = sink && warp == 0 && group == 0 ? 1.f : 0.f;
        }
    }
    float acc[HEAD_DIM / 16][HEAD_TILES][4];
#pragma unroll
    for (int mt = 0; mt < HEAD_DIM / 16; ++mt) {
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
    }
    float value_unit = 1.f;   // acc's unit: the warp's latest step's largest value scale
    // B operand of the 16-dim steps s and s + 1 for heads 0-7: matrices (heads, positions 16s +
    // 0-7), (16s + 8-15), (16 (s + 1) + 0-7), (16 (s + 1) + 8-15).
    const unsigned query_fragment = shared_address(&query_tile[matrix_row * STRIDE + matrix * 8]);
#else
    float best[2] = {NEG_INF, NEG_INF}, total[2] = {0.f, 0.f};
    if (sinks != nullptr && split == 0) {
        // The sink: every thread starts its heads' maximum there; one thread a head counts its 1.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (group + 8 * h >= block_heads) continue;
            best[h] = sinks[head_base + group + 8 * h] * 1.4426950408889634f;
            total[h] = warp == 0 && quad == 0 ? 1.f : 0.f;
        }
    }
    float acc[WARP_COLUMNS / 8][4];
#pragma unroll
    for (int dt = 0; dt < (int)(sizeof(acc) / sizeof(acc[0])); ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;

    // A operand of the kk-th 16 dims: matrices (heads 0-7, dims 0-7), (heads 8-15, dims 0-7),
    // (heads 0-7, dims 8-15), (heads 8-15, dims 8-15).
    const unsigned query_fragment =
        shared_address(&query_tile[((matrix & 1) * 8 + matrix_row) * STRIDE + (matrix >> 1) * 8]);
    // A operand of the kt-th 16 keys' probabilities, the same way (the low parts PROBABILITY_PART bytes on).
    const unsigned probability_fragment =
        shared_address(&probabilities[((matrix & 1) * 8 + matrix_row) * PROBABILITY_STRIDE + (matrix >> 1) * 8]);
#endif

    // Step j's keys go to stage j % STAGES. The rows of steps 0 .. STAGES - 1 first, the copies of
    // steps 0 .. STAGES - 2 then; at step j the copies of step j + STAGES - 1 are issued and the
    // rows of step j + STAGES found. Every step commits one copy group (empty past the split), so
    // waiting for all but the newest STAGES - 2 groups means this step's keys have landed.
    // Before the wait for the kernels ahead: the row metadata (uploaded before the step) and the
    // first stages' keys and values of earlier positions (written by earlier steps: a decode row
    // is its sequence's only row in a step), the step's own key (position context - 1, which the
    // kernel ahead writes) left out.
#pragma unroll
    for (int s = 0; s < STAGES; ++s) find_rows(s, lo + s * BLOCK_KEYS);
    STAGE_BARRIER();   // the first stages' rows
    // Only the split that holds the own key skips its copy: in another split the key is past `hi`,
    // and its zero-filled copy keeps the stage's value row finite (a probability of 0 times
    // whatever shared memory held there could be NaN).
    const int own_key = context - 1;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const int base = lo + s * BLOCK_KEYS;
        const bool holds_own_key = own_key >= base && own_key < base + BLOCK_KEYS && own_key < hi;
        if (base < hi) load_stage(s, holds_own_key ? own_key - base : -1);
        commit_copies();
    }
    wait_for_producers();   // the queries and the step's own key and value come from the kernels ahead

    // The block's queries, scaled by scale * log2(e) (the softmax runs in base 2), as bf16 (f16
    // for an FP8 cache); zero rows past the group.
    const float query_scale = scale * 1.4426950408889634f;
    const float4* query_rows = reinterpret_cast<const float4*>(q + ((long)row * num_heads + head_base) * HEAD_DIM);
    for (int e = threadIdx.x; e < BLOCK_HEADS * HEAD_DIM / 4; e += THREADS) {
        const int h = e / (HEAD_DIM / 4), d = 4 * (e % (HEAD_DIM / 4));
        const float4 value = h < block_heads ? query_rows[e] : float4{0.f, 0.f, 0.f, 0.f};
#if FP8_CACHE
        // Dims 16s + 4j .. + 3 at the positions 16s + 2j, + 1 and 16s + 2j + 8, + 9 (a key fragment's
        // k positions 2q, 2q + 1, 2q + 8, 2q + 9 for lane q's four codes).
        const int first = (d & ~15) + (d & 15) / 2, second = first + 8;
#else
        const int first = d, second = d + 2;
#endif
        unsigned* target = reinterpret_cast<unsigned*>(&query_tile[h * STRIDE]);
        target[first / 2] = PACK_OPERANDS(value.x * query_scale, value.y * query_scale);
        target[second / 2] = PACK_OPERANDS(value.z * query_scale, value.w * query_scale);
    }
    // The step's own key and value, if a stage issued above holds it: plain loads and stores (no
    // copy of the stage writes its place), seen by the warps that read it after the first step's barrier.
    if (own_key >= lo && own_key < hi && own_key < lo + (STAGES - 1) * BLOCK_KEYS) {
        const int own_stage = (own_key - lo) / BLOCK_KEYS, key = (own_key - lo) % BLOCK_KEYS;
        const long long offset = stage_rows[own_stage][key];
#if FP8_CACHE
        unsigned char* raw = raw_stages + own_stage * RAW_STAGE_BYTES;
        for (int e = lane; warp == key / WARP_KEYS && e < 2 * (HEAD_DIM / 16); e += 32) {   // the key's warp
            const int half = e / (HEAD_DIM / 16), chunk = e % (HEAD_DIM / 16);
            const uint4 value = *reinterpret_cast<const uint4*>((half ? v_cache : k_cache) + offset + chunk * 16);
            *reinterpret_cast<uint4*>(&raw[(half * BLOCK_KEYS + key) * RAW_STRIDE + chunk * 16]) = value;
        }
        if (warp == key / WARP_KEYS && lane < 2) {
            raw_scales[(own_stage * 2 + lane) * BLOCK_KEYS + key] = (lane ? v_scales : k_scales)[offset / HEAD_DIM];
        }
#else
        bf16_bits* keys = stages + own_stage * STAGE_ELEMENTS;
        for (int e = threadIdx.x; e < 2 * (HEAD_DIM / 8); e += THREADS) {
            const int half = e / (HEAD_DIM / 8), chunk = e % (HEAD_DIM / 8);
            const uint4 value = *reinterpret_cast<const uint4*>((half ? v_cache : k_cache) + offset + chunk * 8);
            *reinterpret_cast<uint4*>(&keys[(half * BLOCK_KEYS + key) * STRIDE + chunk * 8]) = value;
        }
#endif
    }
#if FP8_CACHE
    __syncthreads();   // the query tile (the loop's barriers are the warps' own)
#endif
    int stage = 0;
    // The rows of step j + STAGES are loaded from the block table at step j and stored before step
    // j + 1's barrier (their copies are issued after it): the table's latency overlaps a step.
    long long pending_rows = -1;
    int pending_stage = -1;
    for (int base = lo; base < hi; base += BLOCK_KEYS) {
        if (pending_stage >= 0 && ROW_FINDER) stage_rows[pending_stage][ROW_KEY] = pending_rows;
        wait_copies<STAGES - 2>();
        // This step's stage has landed for every thread (of the warp, for an FP8 cache); every
        // warp (the warp) is done with the previous step's stage, which the next copies fill, and
        // its rows (found a step ago) are ready.
        STAGE_BARRIER();
        const int refill = stage == 0 ? STAGES - 1 : stage - 1;
        if (base + (STAGES - 1) * BLOCK_KEYS < hi) load_stage(refill, -1);
        commit_copies();
        // This stage's rows were last read by its copies, steps ago.
        if (ROW_FINDER) pending_rows = row_offset(base + STAGES * BLOCK_KEYS);
        pending_stage = stage;
#if FP8_CACHE
        const unsigned char* raw = raw_stages + stage * RAW_STAGE_BYTES;
        const float* key_scales = raw_scales + stage * 2 * BLOCK_KEYS;
        const float* value_scales = key_scales + BLOCK_KEYS;
        const int warp_key = warp * WARP_KEYS;   // the warp's 16 keys of the step
        const unsigned warp_codes =
            shared_address(&raw[(warp_key + (matrix & 1) * 8 + matrix_row) * RAW_STRIDE + (matrix >> 1) * 16]);

        // S^T = K Q^T, the warp's keys as M and each tile of 8 heads as N. A operand of the dims
        // 16s .. 16s + 15: ldmatrix of the codes as byte pairs, matrices (keys 0-7, dims of s),
        // (keys 8-15, s), (keys 0-7, s + 1), (keys 8-15, s + 1); lane (g, q) gets key g's codes
        // 16s + 4q .. 16s + 4q + 3, the k positions 2q, 2q + 1, 2q + 8, 2q + 9 (the query tile holds its
        // dims in that order).
        float scores[HEAD_TILES][4];
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) scores[nt][0] = scores[nt][1] = scores[nt][2] = scores[nt][3] = 0.f;
#pragma unroll
        for (int s = 0; s < HEAD_DIM / 16; s += 2) {
            unsigned codes[4];
            load_matrices(codes, warp_codes + s * 16);
            unsigned queries[HEAD_TILES][4];
#pragma unroll
            for (int nt = 0; nt < HEAD_TILES; ++nt) load_matrices(queries[nt], query_fragment + (nt * 8 * STRIDE + s * 16) * 2);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const unsigned operand[4] = {
                    e4m3x2_to_f16x2(codes[2 * half] & 0xffffu), e4m3x2_to_f16x2(codes[2 * half + 1] & 0xffffu),
                    e4m3x2_to_f16x2(codes[2 * half] >> 16), e4m3x2_to_f16x2(codes[2 * half + 1] >> 16)};
#pragma unroll
                for (int nt = 0; nt < HEAD_TILES; ++nt) MMA_16x8x16(scores[nt], operand, queries[nt] + 2 * half);
            }
        }
        // A lane's scores: keys g (c 0, 1) and g + 8 (c 2, 3), heads 8 nt + 2q + (c & 1); each key's
        // scale on them (0 past the split, whose scores are masked below).
        const float key_scale[2] = {key_scales[warp_key + group], key_scales[warp_key + group + 8]};
        const float value_scale[2] = {value_scales[warp_key + group], value_scales[warp_key + group + 8]};
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) scores[nt][c] *= key_scale[c / 2];
        }
#if SOFTCAP
        const float cap = softcap * 1.4426950408889634f;
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) scores[nt][c] = cap * tanhf(scores[nt][c] / cap);
        }
#endif
        // The warp's own softmax over its keys (the warps merge theirs after the loop): a warp
        // whose keys of the step are all past the split, and that has seen none, keeps zeros.
        float rescale[HEAD_TILES][2], shift[HEAD_TILES][2];
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (base + warp_key + group + 8 * (c / 2) >= hi) scores[nt][c] = NEG_INF;
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float local = fmaxf(scores[nt][e], scores[nt][e + 2]);
                local = fmaxf(local, __shfl_xor_sync(0xffffffff, local, 4));
                local = fmaxf(local, __shfl_xor_sync(0xffffffff, local, 8));
                local = fmaxf(local, __shfl_xor_sync(0xffffffff, local, 16));
                const float new_best = fmaxf(best[nt][e], local);
                shift[nt][e] = new_best == NEG_INF ? 0.f : new_best;
                rescale[nt][e] = exp2f(best[nt][e] - shift[nt][e]);   // 0 at the warp's first keys (best = -inf)
                best[nt][e] = new_best;
                total[nt][e] *= rescale[nt][e];
            }
        }
        // The step's value unit of the warp: the largest value scale of its 16 keys.
        float step_unit = fmaxf(value_scale[0], value_scale[1]);
        step_unit = fmaxf(step_unit, __shfl_xor_sync(0xffffffff, step_unit, 4));
        step_unit = fmaxf(step_unit, __shfl_xor_sync(0xffffffff, step_unit, 8));
        step_unit = fmaxf(step_unit, __shfl_xor_sync(0xffffffff, step_unit, 16));
        step_unit = step_unit > 0.f ? step_unit : 1.f;
        const float unit_change = value_unit / step_unit, inverse_unit = 1.f / step_unit;
        value_unit = step_unit;
        // P^T, the probabilities times their values' scales over the unit, in two f16 parts: a
        // lane's pair (key g or g + 8; heads 2q, 2q + 1) is its row of an 8x8 matrix [keys, heads],
        // whose transpose (movmatrix) gives the lane (head g; keys 2q, 2q + 1): the B operand of P V.
        unsigned weights[HEAD_TILES][2], low_weights[HEAD_TILES][2];
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) {
            float p[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                p[c] = exp2f(scores[nt][c] - shift[nt][c & 1]);
                total[nt][c & 1] += p[c];
                p[c] *= value_scale[c / 2] * inverse_unit;
            }
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const unsigned high = pack_f16(p[2 * k], p[2 * k + 1]);
                weights[nt][k] = transpose_matrix(high);
                low_weights[nt][k] = transpose_matrix(pack_f16(p[2 * k] - f16_low(high), p[2 * k + 1] - f16_high(high)));
            }
        }
#pragma unroll
        for (int mt = 0; mt < HEAD_DIM / 16; ++mt) {
#pragma unroll
            for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[mt][nt][c] *= rescale[nt][c & 1] * unit_change;
            }
        }
        // O^T += V^T P^T, the value dims as M: transposed ldmatrix of the codes as byte pairs,
        // matrices (keys 0-7, dims of mt), (keys 8-15, mt), (keys 0-7, mt + 1), (keys 8-15, mt + 1);
        // lane (g, q) gets keys 2q and 2q + 1 of dims 16 mt + 2g and 2g + 1, which one byte
        // permutation makes the rows g (dim 2g) and g + 8 (dim 2g + 1) of the A operand.
        const unsigned value_codes = warp_codes + BLOCK_KEYS * RAW_STRIDE;
#pragma unroll
        for (int mt = 0; mt < HEAD_DIM / 16; mt += 2) {
            unsigned codes[4];
            load_matrices_transposed(codes, value_codes + mt * 16);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const unsigned first = __byte_perm(codes[2 * half], 0, 0x3120);   // keys 2q, 2q + 1
                const unsigned second = __byte_perm(codes[2 * half + 1], 0, 0x3120);   // keys 2q + 8, 2q + 9
                const unsigned operand[4] = {e4m3x2_to_f16x2(first & 0xffffu), e4m3x2_to_f16x2(first >> 16),
                                             e4m3x2_to_f16x2(second & 0xffffu), e4m3x2_to_f16x2(second >> 16)};
#pragma unroll
                for (int nt = 0; nt < HEAD_TILES; ++nt) {
                    MMA_16x8x16(acc[mt + half][nt], operand, weights[nt]);
                    MMA_16x8x16(acc[mt + half][nt], operand, low_weights[nt]);
                }
            }
        }
#else
        const bf16_bits* keys = stages + stage * STAGE_ELEMENTS;
        const bf16_bits* values = keys + BLOCK_KEYS * STRIDE;

        // Scores of the warp's 16 keys: n-tiles 0 (keys warp * 16 + 0-7) and 1 (+ 8-15). B operand
        // of the kk-th 16 dims: matrices (keys of tile 0, dims 0-7), (tile 0, dims 8-15), (tile 1,
        // dims 0-7), (tile 1, dims 8-15).
        float scores[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const unsigned key_fragment =
            shared_address(&keys[(warp * WARP_KEYS + (matrix >> 1) * 8 + matrix_row) * STRIDE + (matrix & 1) * 8]);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            unsigned query[4], operand[4];
            load_matrices(query, query_fragment + kk * 32);
            load_matrices(operand, key_fragment + kk * 32);
            MMA_16x8x16(scores[0], query, operand);
            MMA_16x8x16(scores[1], query, operand + 2);
        }

#if SOFTCAP
        // The logits capped, in the scores' base-2 units: log2(e) softcap * tanh(score / (log2(e) softcap)).
        const float cap = softcap * 1.4426950408889634f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) scores[nt][c] = cap * tanhf(scores[nt][c] / cap);
        }
#endif
        // Keys past the split score -inf (the first key of a step never is).
        float local[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
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
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned high = pack_bf16(p[2 * h], p[2 * h + 1]);
                const unsigned low = pack_bf16(p[2 * h] - __uint_as_float(high << 16),
                                               p[2 * h + 1] - __uint_as_float(high & 0xffff0000u));
                bf16_bits* at = &probabilities[(group + 8 * h) * PROBABILITY_STRIDE + key];
                *reinterpret_cast<unsigned*>(at) = high;
                *reinterpret_cast<unsigned*>(at + BLOCK_HEADS * PROBABILITY_STRIDE) = low;
            }
        }
#pragma unroll
        for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) {
            acc[dt][0] *= rescale[0]; acc[dt][1] *= rescale[0];
            acc[dt][2] *= rescale[1]; acc[dt][3] *= rescale[1];
        }
        __syncthreads();

        // B operand of value tiles dt, dt + 1 of the warp's columns (transposed loads): matrices
        // (keys 0-7, columns of dt), (keys 8-15, dt), (keys 0-7, dt + 1), (keys 8-15, dt + 1) of
        // the kt-th 16 keys. A warp of one tile (32 dims) loads the same four matrices, the last
        // two from its neighbour's columns (the last warp's from the rows' padding), unused.
        const unsigned value_fragment = shared_address(
            &values[((matrix & 1) * 8 + matrix_row) * STRIDE + warp * WARP_COLUMNS + (matrix >> 1) * 8]);
#pragma unroll
        for (int kt = 0; kt < BLOCK_KEYS / 16; ++kt) {
            unsigned weights[4], low_weights[4];
            load_matrices(weights, probability_fragment + kt * 32);
            load_matrices(low_weights, probability_fragment + PROBABILITY_PART + kt * 32);
#pragma unroll
            for (int dt = 0; dt < WARP_COLUMNS / 8; dt += 2) {
                unsigned operand[4];
                load_matrices_transposed(operand, value_fragment + (kt * 16 * STRIDE + dt * 8) * 2);
                MMA_16x8x16(acc[dt], weights, operand);
                MMA_16x8x16(acc[dt], low_weights, operand);
#if WARP_COLUMNS >= 16
                MMA_16x8x16(acc[dt + 1], weights, operand + 2);
                MMA_16x8x16(acc[dt + 1], low_weights, operand + 2);
#endif
            }
        }
#endif
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    wait_copies<0>();   // no copy may land after the block has gone
#if FP8_CACHE
    // The warps' softmaxes merged: each head's maximum over the warps, each warp's sums and
    // accumulators (times its unit) rescaled to it and summed in warp order through the stages'
    // memory, into the layout the bf16 kernel ends with (a warp a quarter of the columns; lane
    // (g, q) heads g and g + 8), its sums and maxima too.
#pragma unroll
    for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            total[nt][e] += __shfl_xor_sync(0xffffffff, total[nt][e], 4);
            total[nt][e] += __shfl_xor_sync(0xffffffff, total[nt][e], 8);
            total[nt][e] += __shfl_xor_sync(0xffffffff, total[nt][e], 16);
            if (group == 0) warp_max[warp][nt * 8 + quad * 2 + e] = best[nt][e];
        }
    }
    __syncthreads();   // every warp is past its last reads of the stages, and the maxima are in
    float* partial = reinterpret_cast<float*>(raw_stages);   // [WARPS][BLOCK_HEADS][HEAD_DIM]
#pragma unroll
    for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int head = nt * 8 + quad * 2 + e;
            float top = NEG_INF;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_max[w][head]);
            const float weight = top == NEG_INF ? 0.f : exp2f(best[nt][e] - top);
            const float factor = weight * value_unit;
            if (group == 0) warp_total[warp][head] = total[nt][e] * weight;
            float* target = partial + (warp * BLOCK_HEADS + head) * HEAD_DIM + 2 * group;
#pragma unroll
            for (int mt = 0; mt < HEAD_DIM / 16; ++mt) {
                *reinterpret_cast<float2*>(target + mt * 16) = make_float2(acc[mt][nt][e] * factor, acc[mt][nt][e + 2] * factor);
            }
        }
    }
    __syncthreads();
    float merged[WARP_COLUMNS / 8][4];
    float head_sums[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int head = group + 8 * h;
        const bool present = head < HEAD_TILES * 8;
        float top = NEG_INF, sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            top = present ? fmaxf(top, warp_max[w][head]) : NEG_INF;
            sum += present ? warp_total[w][head] : 0.f;
        }
        best[0][h] = top;
        head_sums[h] = sum;
#pragma unroll
        for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int column = warp * WARP_COLUMNS + dt * 8 + quad * 2 + c;
                float value = 0.f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) value += present ? partial[(w * BLOCK_HEADS + head) * HEAD_DIM + column] : 0.f;
                merged[dt][2 * h + c] = value;
            }
        }
    }
    __syncthreads();   // the sums read before the lines below write theirs
    // As the bf16 kernel's lanes hold them: one lane a head its sum (the shuffles below add the rest).
    float head_totals[2] = {warp == 0 && quad == 0 ? head_sums[0] : 0.f, warp == 0 && quad == 0 ? head_sums[1] : 0.f};
#define OUTPUT_ACC merged
#define OUTPUT_BEST best[0]
#define OUTPUT_TOTAL head_totals
#else
#define OUTPUT_ACC acc
#define OUTPUT_BEST best
#define OUTPUT_TOTAL total
#endif

    // The sums over the four warps' keys, and the maximum every warp shares.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        OUTPUT_TOTAL[h] += __shfl_xor_sync(0xffffffff, OUTPUT_TOTAL[h], 1);
        OUTPUT_TOTAL[h] += __shfl_xor_sync(0xffffffff, OUTPUT_TOTAL[h], 2);
    }
    if (quad == 0) {
        warp_total[warp][group] = OUTPUT_TOTAL[0];
        warp_total[warp][group + 8] = OUTPUT_TOTAL[1];
        if (warp == 0) {
            head_best[group] = OUTPUT_BEST[0];
            head_best[group + 8] = OUTPUT_BEST[1];
        }
    }
    __syncthreads();
    float head_total[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) head_total[h] += warp_total[w][group + 8 * h];
    }
    if (splits == 1) {
        // The normalised output, as bf16 pairs (a row has at least one key).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (group + 8 * h >= block_heads) continue;
            const float inverse = 1.f / head_total[h];
            unsigned* target = reinterpret_cast<unsigned*>(out + ((long)row * num_heads + head_base + group + 8 * h) * HEAD_DIM);
#pragma unroll
            for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) {
                const int column = warp * WARP_COLUMNS + dt * 8 + quad * 2;
                target[column / 2] = pack_bf16(OUTPUT_ACC[dt][2 * h] * inverse, OUTPUT_ACC[dt][2 * h + 1] * inverse);
            }
        }
        return;
    }
    // The partials: each warp its columns.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (group + 8 * h >= block_heads) continue;
        const long head_row = ((long)row * num_heads + head_base + group + 8 * h) * splits + split;
#pragma unroll
        for (int dt = 0; dt < WARP_COLUMNS / 8; ++dt) {
            const int column = warp * WARP_COLUMNS + dt * 8 + quad * 2;
            *reinterpret_cast<float2*>(&out_acc[head_row * HEAD_DIM + column]) =
                make_float2(OUTPUT_ACC[dt][2 * h], OUTPUT_ACC[dt][2 * h + 1]);
        }
    }
    if (threadIdx.x < block_heads) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += warp_total[w][threadIdx.x];
        const long at = ((long)row * num_heads + head_base + threadIdx.x) * splits + split;
        out_sum[at] = sum;
        out_max[at] = head_best[threadIdx.x] * 0.6931471805599453f;   // base 2 to natural-log units
    }
    if (counters == nullptr) return;

    // The last split of this row and head block to finish merges the splits by log-sum-exp, as
    // the combine kernel does: a split without keys weighs nothing.
    __shared__ int merges;
    __threadfence();   // this block's partials are visible before its ticket is
    __syncthreads();
    int* counter = counters + (long)row * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) merges = atomicAdd(counter, 1) == splits - 1;
    __syncthreads();
    if (!merges) return;
    __threadfence();   // the other splits' partials are visible
    // Every (head, split)'s sum and maximum loaded at once, a thread each, then each head's
    // weights from shared memory: the loads of the merge's critical path overlap.
    float* split_weight = reinterpret_cast<float*>(stages);   // [BLOCK_HEADS][MAX_SPLITS]; the stages are free now
    float* split_max = split_weight + BLOCK_HEADS * MAX_SPLITS;   // [BLOCK_HEADS][MAX_SPLITS]
    float* head_sum = split_max + BLOCK_HEADS * MAX_SPLITS;   // [BLOCK_HEADS]
    for (int e = threadIdx.x; e < block_heads * splits; e += THREADS) {
        const int h = e / splits, s = e % splits;
        const long at = ((long)row * num_heads + head_base + h) * splits + s;
        const float split_sum = load_coherent(out_sum + at), best = load_coherent(out_max + at);
        split_weight[h * MAX_SPLITS + s] = split_sum;
        split_max[h * MAX_SPLITS + s] = split_sum > 0.f ? best : NEG_INF;
    }
    __syncthreads();
    if (threadIdx.x < block_heads) {
        const float* sums = split_weight + threadIdx.x * MAX_SPLITS;
        const float* maxima = split_max + threadIdx.x * MAX_SPLITS;
        float top = NEG_INF;
        for (int s = 0; s < splits; ++s) top = fmaxf(top, maxima[s]);
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float split_sum = sums[s];
            const float weight = split_sum > 0.f ? expf(maxima[s] - top) : 0.f;
            split_weight[threadIdx.x * MAX_SPLITS + s] = weight;
            sum += weight * split_sum;
        }
        head_sum[threadIdx.x] = sum;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < block_heads * HEAD_DIM; e += THREADS) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        const long first = ((long)row * num_heads + head_base + h) * splits;
        float numerator = 0.f;
#pragma unroll 8
        for (int s = 0; s < splits; ++s) {
            numerator += split_weight[h * MAX_SPLITS + s] * load_coherent(out_acc + (first + s) * HEAD_DIM + d);
        }
        const float total = head_sum[h], value = total > 0.f ? numerator / total : 0.f;
        out[((long)row * num_heads + head_base + h) * HEAD_DIM + d] = (bf16_bits)(pack_bf16(value, 0.f) & 0xffffu);
    }
    if (threadIdx.x == 0) *counter = 0;   // for the next launch
}
"""


def kernel_source(head_dim: int, with_instructions: bool = True, stage_count: int | None = None,
                  softcap: bool = False, fp8: bool = False, head_tiles: int = 2) -> str:
    """The kernel's CUDA C++ for keys and values of ``head_dim``, ``stage_count`` stages (by
    default :func:`stages`), with ``softcap`` the logits capped, with ``fp8`` over an FP8 cache
    (whose blocks take ``head_tiles`` tiles of 8 query heads, :func:`head_tiles`), with the PTX
    helpers, or without them for the CPU emulation, which brings its own."""
    count = stages(head_dim) if stage_count is None else stage_count
    constants = (f"#define HEAD_DIM {head_dim}\n#define STAGES {count}\n#define MAX_SPLITS {MAX_SPLITS}\n"
                 f"#define SOFTCAP {int(softcap)}\n#define FP8_CACHE {int(fp8)}\n#define HEAD_TILES {head_tiles}\n")
    helpers = (INSTRUCTIONS + (FP8_INSTRUCTIONS if fp8 else "")) if with_instructions else ""
    return helpers + constants + KERNEL


_kernels: dict[tuple[int, int, bool, bool, int], Any] = {}


def _kernel(head_dim: int, stage_count: int, softcap: bool, fp8: bool = False, tiles: int = 2) -> Any:
    """The compiled kernel for ``head_dim``, ``stage_count``, capped logits or not, an FP8 cache or
    not and ``tiles`` tiles of 8 heads (an FP8 cache's; NVRTC, once per process each)."""
    key = (head_dim, stage_count, softcap, fp8, tiles if fp8 else 2)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy

        module = cupy.RawModule(code=kernel_source(head_dim, stage_count=stage_count, softcap=softcap, fp8=fp8,
                                                   head_tiles=key[4]),
                                options=("--std=c++17", "--use_fast_math"))
        kernel = module.get_function("decode_attention_mma")
        kernel.max_dynamic_shared_size_bytes = shared_bytes(head_dim, stage_count, fp8)
        _kernels[key] = kernel
    return kernel


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel serves the geometry: keys and values of one of :data:`HEAD_DIMS`, whole
    query-head groups, a GPU (numba's simulator runs the CUDA-core kernels instead)."""
    return (
        not SIMULATED and kv_heads > 0 and heads % kv_heads == 0 and head_dim == value_dim and head_dim in HEAD_DIMS
    )


def head_blocks(heads: int, kv_heads: int) -> int:
    """Blocks along the grid's second axis per KV head: its query heads in groups of 16."""
    return -(-(heads // kv_heads) // BLOCK_HEADS)


def head_tiles(heads: int, kv_heads: int) -> int:
    """Tiles of 8 query heads a block of the FP8 cache's form takes (the N dimension of its
    products): one for groups of up to 8 heads, two above."""
    return 1 if heads // kv_heads <= 8 else 2


def split_count(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int,
                multiprocessors: int = DEFAULT_MULTIPROCESSORS, fp8: bool = False) -> int:
    """Key splits per row: as many as keep the grid within one wave of resident blocks, at least
    one step of :data:`BLOCK_KEYS` keys of ``max_context`` each, at most ``MAX_SPLITS`` (the merge's
    limit)."""
    blocks = max(1, rows * kv_heads * head_blocks(heads, kv_heads))
    resident = multiprocessors * blocks_per_multiprocessor(head_dim, fp8=fp8)
    steps = max(1, -(-int(max_context) // BLOCK_KEYS))
    return max(1, min(resident // blocks, MAX_SPLITS, steps))


def counter_count(rows: int, heads: int, kv_heads: int) -> int:
    """Counters a launch that merges its own splits needs: one per row and block of heads."""
    return rows * kv_heads * head_blocks(heads, kv_heads)


#: The most partials (bytes) the last split's block merges itself: past it the merge kernel's
#: blocks, a head and 128 value columns each, share the reads (docs/notes/decode-kernels.rst,
#: "The registry's thresholds").
MAX_MERGE_BYTES = 32 * 1024


def merges_itself(heads: int, kv_heads: int, head_dim: int, splits: int) -> bool:
    """Whether a launch with counters should merge its splits in its last block rather than in
    :func:`metrale.kernels.attention_combine.combine`: at most :data:`MAX_MERGE_BYTES` of partials
    a block (its heads times ``head_dim`` float32 values, per split)."""
    block_heads = min(BLOCK_HEADS, heads // max(1, kv_heads))
    return splits * block_heads * head_dim * 4 <= MAX_MERGE_BYTES


def device_split_count(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int,
                       fp8: bool = False) -> int:
    """:func:`split_count` for the current device's multiprocessors."""
    return split_count(rows, heads, kv_heads, head_dim, max_context, multiprocessor_count(), fp8)


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def split_range(position: int, split: int, splits: int, sliding_window: int | None) -> tuple[int, int]:
    """Keys ``[lo, hi)`` of split ``split`` of a row at ``position``: the window's keys (all up to
    the position without one) in ``splits`` equal shares, as the kernel divides them."""
    context = position + 1
    first = max(0, context - sliding_window) if sliding_window else 0
    share = -(-(context - first) // splits)
    lo = first + split * share
    return lo, min(context, lo + share)


def decode_attention_partials_model(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray, seq_index: np.ndarray,
    positions: np.ndarray, scale: float, sliding_window: int | None, splits: int, softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's per-split results in NumPy: ``(out_acc [N, heads, splits, d], out_max, out_sum
    [N, heads, splits])`` float32, as the blocks write them. Queries are scaled by ``scale *
    log2(e)`` and rounded to bf16; a split's keys (:func:`split_range`) go in steps of
    :data:`BLOCK_KEYS` through an online softmax in base 2 whose probabilities enter ``P V`` as the
    sum of two bf16 parts (their sums stay float32); ``out_max`` in natural-log units (``-inf`` and a zero sum for a
    split without keys). The caches hold float32 values (bf16-exact) ``[blocks, block_size,
    kv_heads, d]``. ``softcap`` caps the scores (in base-2 units, ``log2(e) softcap``); ``sinks
    [heads]`` start split 0's maximum at the head's sink and its sum at 1."""
    rows, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out_acc = np.zeros((rows, heads, splits, head_dim), np.float32)
    out_max = np.full((rows, heads, splits), -np.inf, np.float32)
    out_sum = np.zeros((rows, heads, splits), np.float32)
    for row in range(rows):
        queries = _bf16(q[row] * np.float32(scale * LOG2_E)).reshape(kv_heads, group, head_dim)
        table = block_tables[seq_index[row]]
        for split in range(splits):
            lo, hi = split_range(int(positions[row]), split, splits, sliding_window)
            best = np.full((kv_heads, group), -np.inf, np.float32)
            total = np.zeros((kv_heads, group), np.float32)
            if sinks is not None and split == 0:
                best = (np.asarray(sinks, np.float32) * np.float32(LOG2_E)).reshape(kv_heads, group)
                total = np.ones((kv_heads, group), np.float32)
            acc = np.zeros((kv_heads, group, head_dim), np.float32)
            for base in range(lo, hi, BLOCK_KEYS):
                places = [(table[j // block_size], j % block_size) for j in range(base, min(hi, base + BLOCK_KEYS))]
                keys = np.stack([k_cache[b, o] for b, o in places], axis=1).astype(np.float32)  # [kv, keys, d]
                values = np.stack([v_cache[b, o] for b, o in places], axis=1).astype(np.float32)
                scores = queries @ keys.transpose(0, 2, 1)  # [kv, group, keys]
                if softcap:
                    cap = np.float32(softcap * LOG2_E)
                    scores = cap * np.tanh(scores / cap)
                new_best = np.maximum(best, scores.max(axis=2))
                rescale = np.exp2(best - new_best)
                best = new_best
                p = np.exp2(scores - best[..., None])
                total = total * rescale + p.sum(axis=2, dtype=np.float32)
                high = _bf16(p)
                acc = acc * rescale[..., None] + (high @ values + _bf16(p - high) @ values)
            out_acc[row, :, split] = acc.reshape(heads, head_dim)
            out_max[row, :, split] = (best * np.float32(math.log(2.0))).reshape(heads)
            out_sum[row, :, split] = total.reshape(heads)
    return out_acc, out_max, out_sum


def dequantized_cache(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[blocks, block_size, kv_heads, d]``: an FP8 cache's rows as the prompt kernel
    (:mod:`metrale.kernels.attention_mma`) reads them, each code's value times its row's scale
    rounded to bf16 (host arrays)."""
    from metrale.kernels.quantized import fp8_e4m3_to_float32

    return _bf16(fp8_e4m3_to_float32(codes) * np.asarray(scales, np.float32)[..., None])


def decode_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, scale: float, sliding_window: int | None, workspace: tuple, out: DeviceArray,
    stream: Any = None, counters: DeviceArray | None = None, softcap: float | None = None,
    sinks: DeviceArray | None = None,
) -> DeviceArray:
    """Bf16 bits ``out [N, heads * d]`` from float32 ``q [N, heads, d]`` (one decode row per
    sequence) over the paged bf16 caches ``[blocks, block_size, kv_heads, d]``: the tensor-core
    launcher behind :func:`metrale.kernels.attention.paged_attention`, with its workspace ``(acc,
    max, sum)`` of ``splits`` (:func:`device_split_count`) along the third axis; only geometries
    that :func:`supports` accepts. With ``counters`` (int32, at least :func:`counter_count` of
    them, zero between launches; launches that share them run one after another), the last split
    of each row and head block merges the splits itself and no combine kernel runs. ``softcap`` (a
    positive number, or None) caps the logits; ``sinks`` (float32 ``[heads]``, or None) adds a sink
    logit to each head's softmax. ``k_cache`` and ``v_cache`` may be
    :class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray` s on the device (E4M3 codes, a float32
    scale per slot and head): the products take the codes' values exactly as f16 operands, the
    queries and probabilities as f16, and the scales in float32 (a key's on its scores, a value's
    on its probabilities), so the result is at least as close to the float attention over the
    codes times their scales as the bf16 kernel's over :func:`dequantized_cache`."""
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    op = "decode_attention_mma"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    fp8 = isinstance(k_cache, Fp8CacheArray)
    if fp8 != isinstance(v_cache, Fp8CacheArray):
        raise KernelArgumentError(f"{op}: the key and value caches must both be FP8 or both bf16")
    k_scales = v_scales = None
    if fp8:
        k_scales, v_scales, k_cache, v_cache = k_cache.scales, v_cache.scales, k_cache.codes, v_cache.codes
    cache_dtype = np.uint8 if fp8 else np.uint16
    check_array(op, "k_cache", k_cache, cache_dtype, ndim=4)
    kv_heads = k_cache.shape[2]
    if not supports(heads, kv_heads, head_dim, v_cache.shape[-1]):
        raise KernelArgumentError(
            f"{op}: {heads} query heads over {kv_heads} KV heads of sizes {head_dim} / {v_cache.shape[-1]} are unsupported "
            f"(sizes {HEAD_DIMS}, whole groups)")
    check_array(op, "k_cache", k_cache, cache_dtype, (None, None, kv_heads, head_dim))
    check_array(op, "v_cache", v_cache, cache_dtype, k_cache.shape)
    if fp8:
        check_array(op, "k_cache scales", k_scales, np.float32, k_cache.shape[:3])
        check_array(op, "v_cache scales", v_scales, np.float32, k_cache.shape[:3])
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "out", out, np.uint16, (rows, heads * head_dim))
    if sinks is not None:
        check_array(op, "sinks", sinks, np.float32, (heads,))
    if softcap is not None and not softcap >= 0:
        raise KernelArgumentError(f"{op}: softcap must be positive (or None), got {softcap}")
    acc, best, total = workspace
    splits = acc.shape[2] if acc.ndim == 4 else 0
    check_array(op, "workspace acc", acc, np.float32, (rows, heads, splits, head_dim))
    check_array(op, "workspace max", best, np.float32, (rows, heads, splits))
    check_array(op, "workspace sum", total, np.float32, (rows, heads, splits))
    if not splits or splits > MAX_SPLITS:
        raise KernelArgumentError(f"{op}: {splits} splits in the workspace (1 to {MAX_SPLITS})")
    merged = counters is not None and splits > 1
    if counters is not None and merged:
        check_array(op, "counters", counters, np.int32, ndim=1)
        if counters.shape[0] < counter_count(rows, heads, kv_heads):
            raise KernelArgumentError(f"{op}: {counters.shape[0]} counters, the grid needs "
                                      f"{counter_count(rows, heads, kv_heads)}")
    if not rows:
        return out
    arguments = (
        q, k_cache, v_cache, block_tables, seq_index, positions, np.int32(heads), np.int32(kv_heads),
        np.int32(k_cache.shape[1]), np.int32(block_tables.shape[1]), np.float32(scale), np.int32(sliding_window or 0),
        np.float32(softcap or 0.0), sinks if sinks is not None else np.uint64(0), acc, best, total, out,
        counters if merged else np.uint64(0), k_scales if fp8 else np.uint64(0), v_scales if fp8 else np.uint64(0),
    )
    grid = (rows, kv_heads * head_blocks(heads, kv_heads), splits)
    count = launch_stages(rows, heads, kv_heads, head_dim, splits, block_tables.shape[1] * k_cache.shape[1],
                          multiprocessor_count(), fp8)
    kernel = _kernel(head_dim, count, bool(softcap), fp8, head_tiles(heads, kv_heads))
    launch(kernel, grid, (THREADS,), arguments, shared_bytes(head_dim, count, fp8), stream, dependent=True)
    if splits > 1 and not merged:
        attention_combine.combine(acc, best, total, out, stream)
    return out
