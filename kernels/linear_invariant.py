"""A bf16 matrix product whose every output element is computed the same way whatever the number
of rows: the linear layers' kernel under ``batch_invariant=True`` on the GPU (CUDA C++ with
``mma.sync``, compiled by NVRTC through CuPy).

``y [M, N] = x [M, K] @ W [N, K]^T (+ bias)``, bf16 in, float32 sums. What makes a row's result
independent of the other rows and of ``M`` (cuBLAS picks other kernels, tiles and split-K
reductions for other ``M``, so a row's sums take another order):

* one kernel for every ``M``; a block computes :data:`BLOCK_COLUMNS` columns of ``16 * row_tiles``
  rows, ``row_tiles`` (1 or 4) chosen from ``M`` -- which rows share a block never changes how an
  element is summed;
* each element's sum runs over ``K`` in steps of 32 in increasing order, each step two
  ``m16n8k16`` products of sixteen of its k (:func:`step_groups`: a thread loads 16 contiguous
  bytes of a row or column for both) accumulated in float32 (the tensor cores compute an element
  of a product from that element's row and column alone);
* ``K`` is split into :func:`split_count` ranges chosen from ``N`` and ``K`` only (enough blocks to
  read the weights at full bandwidth for one row); each range's float32 partial sum is written
  apart, and a second kernel adds the ranges in their order, then the bias, and rounds once.

:func:`invariant_linear_reference` is the NumPy model of that order (float32 sums of 16-term
products, the ranges added in order); the emulated tests compare the kernel with it and check a
row's bits alone and among others.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import launch
from metrale.kernels._tensor_cores import MMA_BF16

#: Output columns of a block: 4 warps of 16 (two 8-column products each).
BLOCK_COLUMNS = 64
THREADS = 128
#: Blocks to aim at for one row: enough to keep an H100 / H200's memory busy reading the weights.
TARGET_BLOCKS = 264
#: The shortest range of K a split sums (elements): shorter ones cost more in partial sums
#: written and read than they gain in blocks.
MIN_SPLIT_ELEMENTS = 512

KERNEL = r"""
#define UNROLL 4

// The products of one step of 32 k (k0 .. k0 + 31): thread (g, q) holds 16 bytes of each of its
// rows and columns, k0 + 8q .. k0 + 8q + 7; the step is two m16n8k16 products, the first over
// k0 + 8q + {0..3} for every q (each thread's words .x, .y), the second over k0 + 8q + {4..7}
// (.z, .w): the fragments' k pairs (2q, 2q + 8) of A and B name the same k, so each product
// sums sixteen terms x[m, k] w[n, k] of the step.
template <int ROW_TILES>
__device__ __forceinline__ void step_products(float (&c)[ROW_TILES][2][4], const uint4 (&a)[ROW_TILES][2],
                                              const uint4 (&b)[2]) {
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
        const unsigned first[4] = {a[r][0].x, a[r][1].x, a[r][0].y, a[r][1].y};
        const unsigned second[4] = {a[r][0].z, a[r][1].z, a[r][0].w, a[r][1].w};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const unsigned b_first[2] = {b[j].x, b[j].y}, b_second[2] = {b[j].z, b[j].w};
            mma_16x8x16(c[r][j], first, b_first);
            mma_16x8x16(c[r][j], second, b_second);
        }
    }
}

// partial[s, m, n] = the sum over split s's range of K of x[m, k] w[n, k]: its steps of 32 in
// increasing order, two products each (step_products), accumulated in float32, then a last step
// of 16 where the range ends 16 past a multiple of 32 (one product, k0 + 2q and k0 + 2q + 8).
// Grid (ceil(N / 64), ceil(M / (16 * ROW_TILES)), splits), 128 threads: warp w takes columns
// 16w .. 16w + 15 of the block's 64, every row tile. Fragments come straight from global memory
// (x and w rows K-contiguous, K a multiple of 16), UNROLL steps' loads issued before their
// products.
template <int ROW_TILES>
__global__ void __launch_bounds__(128) invariant_linear_partial(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, float* __restrict__ partial,
    int M, int N, int K, int split_elements) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const int row_base = blockIdx.y * 16 * ROW_TILES, column_base = blockIdx.x * 64 + warp * 16;
    const int k_begin = blockIdx.z * split_elements, k_end = min(K, k_begin + split_elements);
    float c[ROW_TILES][2][4];
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) c[r][j][i] = 0.0f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const unsigned short* columns[2];
    bool column_inside[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int column = column_base + 8 * j + g;
        column_inside[j] = column < N;
        columns[j] = w + (size_t)(column_inside[j] ? column : 0) * K + 8 * q;
    }
    const unsigned short* rows[ROW_TILES][2];
    bool row_inside[ROW_TILES][2];
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_base + 16 * r + 8 * h + g;
            row_inside[r][h] = row < M;
            rows[r][h] = x + (size_t)(row_inside[r][h] ? row : 0) * K + 8 * q;
        }
    }
    const int whole_end = k_begin + (k_end - k_begin) / 32 * 32;
    int k = k_begin;
    for (; k + 32 * UNROLL <= whole_end; k += 32 * UNROLL) {
        uint4 b[UNROLL][2];
        uint4 a[UNROLL][ROW_TILES][2];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
                b[u][j] = column_inside[j] ? *reinterpret_cast<const uint4*>(columns[j] + k + 32 * u) : zero;
#pragma unroll
            for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    a[u][r][h] = row_inside[r][h] ? *reinterpret_cast<const uint4*>(rows[r][h] + k + 32 * u) : zero;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) step_products<ROW_TILES>(c, a[u], b[u]);
    }
    for (; k < whole_end; k += 32) {
        uint4 b[2];
        uint4 a[ROW_TILES][2];
#pragma unroll
        for (int j = 0; j < 2; ++j) b[j] = column_inside[j] ? *reinterpret_cast<const uint4*>(columns[j] + k) : zero;
#pragma unroll
        for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                a[r][h] = row_inside[r][h] ? *reinterpret_cast<const uint4*>(rows[r][h] + k) : zero;
        step_products<ROW_TILES>(c, a, b);
    }
    if (k < k_end) {   // the range's last 16: one product in the plain layout
        const unsigned* x_words = reinterpret_cast<const unsigned*>(x);
        const unsigned* w_words = reinterpret_cast<const unsigned*>(w);
        const int words = K / 2, word = k / 2 + q;
        unsigned b[2][2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int column = column_base + 8 * j + g;
            b[j][0] = column_inside[j] ? w_words[(size_t)column * words + word] : 0u;
            b[j][1] = column_inside[j] ? w_words[(size_t)column * words + word + 4] : 0u;
        }
#pragma unroll
        for (int r = 0; r < ROW_TILES; ++r) {
            const int row = row_base + 16 * r + g;
            unsigned a[4];
            a[0] = row_inside[r][0] ? x_words[(size_t)row * words + word] : 0u;
            a[1] = row_inside[r][1] ? x_words[(size_t)(row + 8) * words + word] : 0u;
            a[2] = row_inside[r][0] ? x_words[(size_t)row * words + word + 4] : 0u;
            a[3] = row_inside[r][1] ? x_words[(size_t)(row + 8) * words + word + 4] : 0u;
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_16x8x16(c[r][j], a, b[j]);
        }
    }
    float* out = partial + (size_t)blockIdx.z * M * N;
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = row_base + 16 * r + g + (i >= 2 ? 8 : 0);
                const int column = column_base + 8 * j + 2 * q + (i & 1);
                if (row < M && column < N) out[(size_t)row * N + column] = c[r][j][i];
            }
        }
    }
}

// out[m, n] = round(sum over s in order of partial[s, m, n] (+ bias[n])): bf16 bits when
// OUT_BF16, float32 otherwise. A thread an element.
template <bool OUT_BF16>
__global__ void invariant_linear_sum(const float* __restrict__ partial, const float* __restrict__ bias, void* out,
                                     int M, int N, int splits) {
    const size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= (size_t)M * N) return;
    float sum = partial[index];
    for (int s = 1; s < splits; ++s) sum += partial[(size_t)s * M * N + index];
    if (bias != nullptr) sum += bias[index % N];
    if (OUT_BF16) {
        unsigned bits = __float_as_uint(sum);
        bits = (bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        static_cast<unsigned short*>(out)[index] = (unsigned short)bits;
    } else {
        static_cast<float*>(out)[index] = sum;
    }
}
"""

SUM_THREADS = 256


def split_count(n: int, k: int) -> int:
    """K's ranges for an ``[n, k]`` weight: from the weight's shape alone (never from the rows),
    enough blocks for one row to read the weights at full bandwidth, ranges of at least
    :data:`MIN_SPLIT_ELEMENTS` in whole steps of 16."""
    column_blocks = -(-n // BLOCK_COLUMNS)
    wanted = max(1, -(-TARGET_BLOCKS // column_blocks))
    return max(1, min(wanted, k // MIN_SPLIT_ELEMENTS))


def split_elements(n: int, k: int) -> int:
    """The length of each of K's ranges (a multiple of 32; the last range may be shorter, and end
    16 past one)."""
    per_split = -(-k // split_count(n, k))
    return -(-per_split // 32) * 32


def row_tiles(m: int) -> int:
    """Row tiles of 16 a block takes: 1 for decode batches, 4 for prompts (which rows share a block
    does not change an element's sum)."""
    return 1 if m <= 16 else 4


def step_groups(start: int, stop: int) -> list[np.ndarray]:
    """The k of each product of a range ``[start, stop)``, in the order the kernel adds them:
    per step of 32 (``k0``), ``k0 + 8q + {0..3}`` then ``k0 + 8q + {4..7}`` over ``q = 0..3``;
    a last 16 (``stop - start`` 16 past a multiple of 32) as one product."""
    groups = []
    k = start
    quads = 8 * np.arange(4)[:, None]
    while k + 32 <= stop:
        groups += [(k + quads + np.arange(4)).ravel(), (k + quads + 4 + np.arange(4)).ravel()]
        k += 32
    if k < stop:
        groups.append(np.arange(k, stop))
    return groups


def invariant_linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[M, N]``: the kernel's order of sums -- each product's sixteen terms
    (:func:`step_groups`) summed in float64 and rounded to float32 (the tensor cores' exact
    products, one rounding a product; the hardware rounds within a product in its own way, so this
    is the order, not the bits), the products added in order in float32 per range, the ranges in
    order, then the bias."""
    x = np.asarray(x, dtype=np.float32)
    weight = np.asarray(weight, dtype=np.float32)
    m, k = x.shape
    n = weight.shape[0]
    length = split_elements(n, k)
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
    """Inner sizes the kernel takes: a multiple of 16."""
    return k > 0 and k % 16 == 0


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return MMA_BF16 + KERNEL


_module: list[Any] = []


def _function(name: str) -> Any:
    if not _module:
        import cupy

        _module.append(cupy.RawModule(code=source(), options=("--std=c++17",),
                                      name_expressions=[f"invariant_linear_partial<{t}>" for t in (1, 4)]
                                      + ["invariant_linear_sum<true>", "invariant_linear_sum<false>"]))
    return _module[0].get_function(name)


def invariant_linear(x: DeviceArray, weight: DeviceArray, out: DeviceArray, partial: DeviceArray, stream: Any,
                     bias: DeviceArray | None = None) -> DeviceArray:
    """``out [M, N] <- x [M, K] @ weight [N, K]^T (+ bias)``: x and weight bf16 bits (uint16), out
    bf16 bits (uint16) or float32, ``partial`` float32 ``[split_count(N, K), M, N]`` scratch, bias
    float32 ``[N]``; every row's result the same whatever ``M``."""
    op = "invariant_linear"
    check_array(op, "x", x, np.uint16, ndim=2)
    m, k = x.shape
    check_array(op, "weight", weight, np.uint16, ndim=2)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise KernelArgumentError(f"{op}: weight has shape {list(weight.shape)}, not [N, {k}]")
    if not supports(k):
        raise KernelArgumentError(f"{op}: the inner size must be a positive multiple of 16, got {k}")
    if out.dtype not in (np.uint16, np.float32) or tuple(out.shape) != (m, n):
        raise KernelArgumentError(f"{op}: out must be bf16 bits or float32 of shape {[m, n]}, got "
                                  f"{out.dtype} {list(out.shape)}")
    splits = split_count(n, k)
    check_array(op, "partial", partial, np.float32, (splits, m, n))
    if bias is not None:
        check_array(op, "bias", bias, np.float32, (n,))
    for name, array in (("x", x), ("weight", weight), ("out", out), ("partial", partial)):
        if not array.flags.c_contiguous:
            raise KernelArgumentError(f"{op}: {name} must be contiguous")
    if m == 0 or n == 0:
        return out
    tiles = row_tiles(m)
    launch(_function(f"invariant_linear_partial<{tiles}>"),
           (-(-n // BLOCK_COLUMNS), -(-m // (16 * tiles)), splits), (THREADS,),
           (x, weight, partial, np.int32(m), np.int32(n), np.int32(k), np.int32(split_elements(n, k))), 0, stream,
           dependent=False)
    launch(_function(f"invariant_linear_sum<{'true' if out.dtype == np.uint16 else 'false'}>"),
           (-(-(m * n) // SUM_THREADS),), (SUM_THREADS,),
           (partial, bias if bias is not None else np.uint64(0), out, np.int32(m), np.int32(n), np.int32(splits)), 0, stream,
           dependent=False)
    return out
