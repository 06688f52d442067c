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
* the output is written as bf16.

numba exposes no tensor-core instruction, so this kernel is CUDA C++; numba's CUDA simulator
cannot run it (its tests run on the GPU only).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array

#: Query rows of one block (four warps of 16) and keys staged per step.
BLOCK_ROWS = 64
BLOCK_KEYS = 64
THREADS = 128
HEAD_DIMS = (64, 128)

SOURCE = r"""
#include <cuda_bf16.h>

#define HEAD_DIM __HEAD_DIM__
#define BLOCK_ROWS 64
#define BLOCK_KEYS 64
#define THREADS 128
#define STRIDE (HEAD_DIM + 8)   // padded shared row (bf16): fragment reads are bank-conflict free
#define NEG_INF (__int_as_float(0xff800000))

typedef unsigned short bf16_bits;

__device__ __forceinline__ unsigned pack_bf16(float low, float high) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<unsigned*>(&pair);
}

__device__ __forceinline__ unsigned shared_pair(const bf16_bits* at) {
    return *reinterpret_cast<const unsigned*>(at);
}

// c[16x8] += a[16x16] * b[16x8]: a row-major, b column-major, bf16 in, float32 accumulate.
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Grid: (tiles, query heads); THREADS threads. q [N, nh, D] f32; k_cache, v_cache
// [blocks, block_size, nkv, D] bf16 bits; block_tables [S, max_blocks], seq_index [N],
// positions [N], tiles [T, 2] (first row, rows) int32; out [N, nh * D] bf16 bits.
extern "C" __global__ void __launch_bounds__(THREADS) prefill_attention_mma(
    const float* __restrict__ q, const bf16_bits* __restrict__ k_cache, const bf16_bits* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_index, const int* __restrict__ positions,
    const int* __restrict__ tiles, int num_heads, int num_kv_heads, int block_size, int max_blocks, float scale,
    int sliding_window, bf16_bits* __restrict__ out)
{
    __shared__ __align__(16) bf16_bits keys[BLOCK_KEYS * STRIDE];   // also stages the query tile
    __shared__ __align__(16) bf16_bits values[BLOCK_KEYS * STRIDE];

    const int tile = blockIdx.x, head = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;
    const int row0 = warp * 16 + group, row1 = row0 + 8;   // this thread's two rows in the tile
    const int* table = block_tables + (long)seq_index[first] * max_blocks;
    const int first_position = positions[first];
    const int key_end = positions[first + count - 1] + 1;
    const int position0 = row0 < count ? positions[first + row0] : -1;
    const int position1 = row1 < count ? positions[first + row1] : -1;

    // The query tile, scaled by scale * log2(e) (the softmax runs in base 2), as bf16.
    const float query_scale = scale * 1.4426950408889634f;
    for (int e = threadIdx.x; e < BLOCK_ROWS * HEAD_DIM; e += THREADS) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;
        const float value = r < count ? q[((long)(first + r) * num_heads + head) * HEAD_DIM + d] * query_scale : 0.f;
        keys[r * STRIDE + d] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
    }
    __syncthreads();
    unsigned query[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const int column = kk * 16 + quad * 2;
        query[kk][0] = shared_pair(&keys[row0 * STRIDE + column]);
        query[kk][1] = shared_pair(&keys[row1 * STRIDE + column]);
        query[kk][2] = shared_pair(&keys[row0 * STRIDE + column + 8]);
        query[kk][3] = shared_pair(&keys[row1 * STRIDE + column + 8]);
    }

    float best[2] = {NEG_INF, NEG_INF}, total[2] = {0.f, 0.f};
    float acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;

    int key_start = 0;
    if (sliding_window > 0) {
        key_start = first_position - sliding_window + 1;
        key_start = key_start < 0 ? 0 : key_start / BLOCK_KEYS * BLOCK_KEYS;
    }
    for (int base = key_start; base < key_end; base += BLOCK_KEYS) {
        __syncthreads();   // every warp is done with the previous keys (and the query staging)
        for (int e = threadIdx.x; e < BLOCK_KEYS * (HEAD_DIM / 8); e += THREADS) {
            const int key = e / (HEAD_DIM / 8), chunk = e % (HEAD_DIM / 8);
            const int position = base + key;
            uint4 k_words = make_uint4(0, 0, 0, 0), v_words = make_uint4(0, 0, 0, 0);
            if (position < key_end) {
                const long slot = (long)table[position / block_size] * block_size + position % block_size;
                const long at = (slot * num_kv_heads + kv_head) * HEAD_DIM + chunk * 8;
                k_words = *reinterpret_cast<const uint4*>(k_cache + at);
                v_words = *reinterpret_cast<const uint4*>(v_cache + at);
            }
            *reinterpret_cast<uint4*>(&keys[key * STRIDE + chunk * 8]) = k_words;
            *reinterpret_cast<uint4*>(&values[key * STRIDE + chunk * 8]) = v_words;
        }
        __syncthreads();

        float scores[BLOCK_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) scores[nt][0] = scores[nt][1] = scores[nt][2] = scores[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) {
                const bf16_bits* key_row = &keys[(nt * 8 + group) * STRIDE + kk * 16 + quad * 2];
                const unsigned operand[2] = {shared_pair(key_row), shared_pair(key_row + 8)};
                mma_16x8x16(scores[nt], query[kk], operand);
            }
        }

        float new_best[2] = {best[0], best[1]};
#pragma unroll
        for (int nt = 0; nt < BLOCK_KEYS / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int half = c / 2;
                const int position = half ? position1 : position0;
                const int key = base + nt * 8 + quad * 2 + (c & 1);
                const bool seen = key <= position && (sliding_window <= 0 || key > position - sliding_window);
                if (!seen) scores[nt][c] = NEG_INF;
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
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            acc[dt][0] *= rescale[0]; acc[dt][1] *= rescale[0];
            acc[dt][2] *= rescale[1]; acc[dt][3] *= rescale[1];
        }
#pragma unroll
        for (int kt = 0; kt < BLOCK_KEYS / 16; ++kt) {
            // The accumulators of key tiles 2kt and 2kt + 1 are the A operand of keys 16kt..16kt+15.
            const unsigned probabilities[4] = {
                pack_bf16(scores[2 * kt][0], scores[2 * kt][1]), pack_bf16(scores[2 * kt][2], scores[2 * kt][3]),
                pack_bf16(scores[2 * kt + 1][0], scores[2 * kt + 1][1]),
                pack_bf16(scores[2 * kt + 1][2], scores[2 * kt + 1][3]),
            };
            const int key = kt * 16 + quad * 2;
#pragma unroll
            for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
                const int dim = dt * 8 + group;
                const unsigned operand[2] = {
                    (unsigned)values[key * STRIDE + dim] | ((unsigned)values[(key + 1) * STRIDE + dim] << 16),
                    (unsigned)values[(key + 8) * STRIDE + dim] | ((unsigned)values[(key + 9) * STRIDE + dim] << 16),
                };
                mma_16x8x16(acc[dt], probabilities, operand);
            }
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 1);
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 2);
    }
    const long row_width = (long)num_heads * HEAD_DIM;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = h ? row1 : row0;
        if (row >= count) continue;
        const float inverse = total[h] > 0.f ? 1.f / total[h] : 0.f;
        unsigned* target = reinterpret_cast<unsigned*>(out + (first + row) * row_width + head * HEAD_DIM);
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            target[(dt * 8 + quad * 2) / 2] = pack_bf16(acc[dt][2 * h] * inverse, acc[dt][2 * h + 1] * inverse);
        }
    }
}
"""

_kernels: dict[int, Any] = {}


def _kernel(head_dim: int) -> Any:
    """The compiled kernel for ``head_dim`` (NVRTC, once per process and head size)."""
    kernel = _kernels.get(head_dim)
    if kernel is None:
        import cupy

        module = cupy.RawModule(code=SOURCE.replace("__HEAD_DIM__", str(head_dim)), options=("--std=c++17",))
        kernel = _kernels[head_dim] = module.get_function("prefill_attention_mma")
    return kernel


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether this kernel serves the geometry: GQA with a head size of 64 or 128, keys and values
    of the same size."""
    return head_dim in HEAD_DIMS and value_dim == head_dim and kv_heads > 0 and heads % kv_heads == 0


def query_tiles(row_starts: np.ndarray) -> np.ndarray:
    """``[T, 2]`` int32 (first row, row count) tiles of at most :data:`BLOCK_ROWS` rows within each
    segment ``row_starts[s]:row_starts[s + 1]``."""
    tiles = [
        (first, min(BLOCK_ROWS, int(end) - first))
        for start, end in zip(row_starts[:-1], row_starts[1:])
        for first in range(int(start), int(end), BLOCK_ROWS)
    ]
    return np.asarray(tiles, dtype=np.int32).reshape(-1, 2)


def prefill_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, tiles: DeviceArray, scale: float, sliding_window: int | None, out: DeviceArray,
    stream: Any = None,
) -> DeviceArray:
    """Causal attention of the rows of ``tiles`` (:func:`query_tiles`) over their sequences' paged
    K/V: ``out [N, nh * D]`` bf16 bits from ``q [N, nh, D]`` float32 and bf16 caches
    ``[blocks, block_size, nkv, D]``. Every row of a tile belongs to one sequence and the tile's
    rows have consecutive positions (prompt rows)."""
    op = "prefill_attention_mma"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    check_array(op, "k_cache", k_cache, np.uint16, (None, None, None, head_dim))
    blocks, block_size, kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    check_array(op, "v_cache", v_cache, np.uint16, (blocks, block_size, kv_heads, head_dim))
    if not supports(heads, kv_heads, head_dim, head_dim):
        raise KernelArgumentError(f"{op}: {heads} heads over {kv_heads} KV heads of size {head_dim} are unsupported")
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "tiles", tiles, np.int32, (None, 2))
    check_array(op, "out", out, np.uint16, (rows, heads * head_dim))
    if not tiles.shape[0]:
        return out
    import contextlib

    arguments = (
        q, k_cache, v_cache, block_tables, seq_index, positions, tiles, np.int32(heads), np.int32(kv_heads),
        np.int32(block_size), np.int32(block_tables.shape[1]), np.float32(scale), np.int32(sliding_window or 0), out,
    )
    with stream if stream is not None else contextlib.nullcontext():
        _kernel(head_dim)((int(tiles.shape[0]), heads), (THREADS,), arguments)
    return out
