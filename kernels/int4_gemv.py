"""The decode GEMV of 4-bit weight-only weights in groups of a multiple of 128 input columns (CUDA
C++, compiled by NVRTC through CuPy): ``y[r, n] = sum_j s[n, j] sum_{k in group j} x[r, k] (q[n, k] -
z[n, j]) (+ bias[n])``, the W4A16 formats of GPTQ, AWQ and compressed-tensors (``pack-quantized``)
with their usual groups of 128.

Each lane loads 32 consecutive codes of each of its two weight rows (16 bytes apiece, one group's
quarter) and turns every 32-bit word of 8 codes into 4 bf16 pairs with two instructions a pair
(a shift-and-mask that lays nibbles ``i`` and ``i + 4`` in the low mantissa bits of two bf16 128s,
one fused pair operation that subtracts ``128 + z``: exact integers), which feed
``mma.sync.m16n8k16`` bf16 products. The input rows are staged as bf16 with each 8 columns in the
order ``0, 4, 1, 5, 2, 6, 3, 7``, so a lane's input words pair with its weight pairs (the sum is
over all columns whichever order the products take them in). The 4 lanes of a row cover 128
columns, one group's worth: each product's sums, scaled by the group's scale, join the float32
accumulators. With more than 8 rows a warp takes two column tiles of 16 at once
(:func:`warp_tiling`), so that each 16-byte word of the staged rows it loads feeds the products of
both (over one tile of 16 weight rows, a warp at 32 input rows loads 8 bytes of them a code byte).
The prologue stages up to :data:`SHARED_STAGE_MAX_ROWS` rows in shared memory
(gathered through the act-order permutation if any); more are staged once into a global
workspace by ``stage_int4_rows``. Launched dependently (:mod:`metrale.kernels._launch`), a block
issues its first weight loads before it waits for the kernel ahead.

:func:`int4_gemv_reference` is the NumPy reference of a launch; ``tests/kernels`` runs the kernel
on the host through the CUDA emulation header against it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels import quantized_gemv as qg
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._tensor_cores import MMA_BF16
from metrale.kernels._words import HELPERS
from metrale.kernels.activation import silu_and_mul_reference
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.quantized import QuantizedWeight

MAX_ROWS = 32
#: The most rows the prologue stages in shared memory; more are staged once by ``stage_int4_rows``.
SHARED_STAGE_MAX_ROWS = 4
#: Pieces of 128 input columns (64 bytes of a row's codes) a warp loads per step, the next step's
#: in flight during each.
UNROLL = 4
THREADS = qg.THREADS
WARPS = qg.WARPS
#: Column tiles of 16 a warp may take at once (:func:`warp_tiling`).
WEIGHT_TILES = (1, 2, 4)
#: The column tiles a warp takes at once by the rows' tiles of 8: past one row tile each word of
#: the staged rows a warp reads feeds two products (four cost more registers than they save loads).
WEIGHT_TILES_BY_ROW_TILES = {1: 1, 2: 2, 4: 2}
#: Pieces a warp loads per step by its column tiles, for rows staged in the workspace: fewer with
#: more tiles, to keep its registers.
UNROLL_BY_WEIGHT_TILES = {1: 2, 2: 2, 4: 1}

KERNELS = r"""
// Input columns 8c .. 8c + 7 of row r (through `order` where given) as bf16 in the order
// 0, 4, 1, 5, 2, 6, 3, 7: four words, word j the pair (8c + j, 8c + j + 4).
template <typename INPUT>
__device__ __forceinline__ uint4 int4_staged_chunk(const INPUT* __restrict__ x, const int* __restrict__ order, int r,
                                                   int c, int K) {
    float v[8];
    const INPUT* row = x + (size_t)r * K;
    #pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = input_value(row, order != nullptr ? order[8 * c + e] : 8 * c + e);
    return make_uint4(pack_bf16_pair(v[0], v[4]), pack_bf16_pair(v[1], v[5]), pack_bf16_pair(v[2], v[6]),
                      pack_bf16_pair(v[3], v[7]));
}

// The rows staged in global memory for the GEMV, for more rows than its prologue stages:
// staged [rows][K / 8] chunks as int4_staged_chunk gives them. Grid: rows blocks of THREADS threads.
template <typename INPUT>
__global__ void __launch_bounds__(THREADS) stage_int4_rows(const INPUT* __restrict__ x, const int* __restrict__ order,
                                                           uint4* __restrict__ staged, int K) {
    const int r = blockIdx.x;
    for (int c = threadIdx.x; c < K / 8; c += THREADS) staged[(size_t)r * (K / 8) + c] = int4_staged_chunk(x, order, r, c, K);
}

// A word of 8 codes (nibble i: column i) less `offset` (bf16 pair of -(128 + zero)) as 4 bf16 pairs,
// pair j the columns j and j + 4.
__device__ __forceinline__ void int4_pairs(unsigned word, unsigned offset, unsigned* pairs) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) pairs[j] = fma_bf16x2(((word >> (4 * j)) & 0x000f000fu) | 0x43004300u, 0x3f803f80u, offset);
}

// The bf16 pair of -(128 + zero) (both halves), exact for the integer zero points 0 .. 15.
__device__ __forceinline__ unsigned int4_offset(float zero) {
    const unsigned half = (unsigned)to_bf16(-(128.0f + zero));
    return half | (half << 16);
}

// Word w (0 .. 3) of v.
__device__ __forceinline__ unsigned uint4_word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// y[r, n] = sum_j scales[n, j] sum_{k in group j} bf16(x[r, order[k]]) (q[n, k] - zero[n, j]) (+ bias[n])
// for r < rows <= 8 * ROW_TILES, n < N. codes [N, K / 2] (the even column in the low nibble);
// scales and zeros [N, K / (128 group_pieces)] (zeros: ZEROS, else 8); K a multiple of 128.
// x: INPUT [rows, K] (float32, or unsigned short: bf16 bits); out: float32 [rows, N]. SWIGLU: codes
// [2N, K / 2] (N gate rows, then N up rows), out bf16 bits [rows, N] = silu(g) * u of the gate and up
// sums, a column tile holding 8 gate rows (the MMA's rows 0-7) and their 8 up rows. A warp takes
// WEIGHT_TILES consecutive column tiles of 16 at once (a warp tile), so that each 16-byte word of
// the staged rows it loads feeds WEIGHT_TILES products. Grid: WARPS / SPLIT warp tiles a block,
// round after round; SPLIT warps share a warp tile, each over a slice of whole 128-column pieces.
// SHARED_STAGE: the prologue stages the rows in dynamic shared memory (rows * K * 2 bytes);
// otherwise staged_rows holds them (stage_int4_rows). Then (SPLIT > 1) the split's partial sums.
template <int SPLIT, int ROW_TILES, bool SHARED_STAGE, bool ZEROS, int UNROLL, typename INPUT, bool SWIGLU,
          int WEIGHT_TILES>
__global__ void __launch_bounds__(THREADS, ROW_TILES > 1 ? 1 : 2) int4_gemv(
    const INPUT* __restrict__ x, const int* __restrict__ order, const uint4* __restrict__ staged_rows,
    const unsigned char* __restrict__ codes, const float* __restrict__ scales, const float* __restrict__ zeros,
    int group_pieces, const float* __restrict__ bias, float* __restrict__ out, int rows, int K, int N) {
    DYNAMIC_SHARED;
    allow_dependents();
    constexpr int GROUPS = WARPS / SPLIT;
    constexpr int M = WEIGHT_TILES;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int pieces = K / 128, stride = K / 8;   // stride: 16-byte chunks of a staged row
    const int groups = pieces / group_pieces;
    const int slice = (pieces + SPLIT - 1) / SPLIT, part = warp % SPLIT;
    const int first_piece = part * slice;
    const int own = max(0, min(pieces, first_piece + slice) - first_piece);
    const int batches = (slice + UNROLL - 1) / UNROLL;
    const int tiles = SWIGLU ? (N + 7) / 8 : (N + 15) / 16;   // column tiles of the MMA's 16 rows
    const int warp_tiles = (tiles + M - 1) / M;
    const int tile_stride = gridDim.x * GROUPS;
    const int first_tile = blockIdx.x * GROUPS + warp / SPLIT;
    const int rounds = (warp_tiles - (int)blockIdx.x * GROUPS + tile_stride - 1) / tile_stride;
    const int steps = rounds * batches;
    const uint4 zero = {0u, 0u, 0u, 0u};

    struct Position {
        int tile, batch;   // the warp tile, the batch of pieces within the slice
    };
    auto advance = [&](Position& p) {
        if (++p.batch == batches) {
            p.batch = 0;
            p.tile += tile_stride;
        }
    };
    // The lane's weight rows of column tile m of warp tile `tile`: the MMA's rows g and g + 8.
    auto upper_row = [&](int tile, int m) -> size_t {
        const int column_tile = tile * M + m;
        return (size_t)(SWIGLU ? min(column_tile * 8 + g, N - 1) : min(column_tile * 16 + g, N - 1));
    };
    auto lower_row = [&](int tile, int m) -> size_t {
        const int column_tile = tile * M + m;
        return SWIGLU ? upper_row(tile, m) + N : (size_t)min(column_tile * 16 + g + 8, N - 1);
    };
    // The batch's codes, each piece's scales and offsets (-(128 + zero) as a bf16 pair).
    auto load = [&](const Position& p, uint4 (*upper)[M], uint4 (*lower)[M], float (*upper_scale)[M],
                    float (*lower_scale)[M], unsigned (*upper_offset)[M], unsigned (*lower_offset)[M]) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int index = p.batch * UNROLL + u;
            const int piece = first_piece + index;
            const int group = group_pieces == 1 ? piece : piece / group_pieces;
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const bool valid = p.tile * M + m < tiles && index < own;
                const size_t up = upper_row(p.tile, m), low = lower_row(p.tile, m);
                const size_t offset = (size_t)(64 * piece + 16 * q);
                upper[u][m] = valid ? __ldg(reinterpret_cast<const uint4*>(codes + up * (size_t)(K / 2) + offset)) : zero;
                lower[u][m] = valid ? __ldg(reinterpret_cast<const uint4*>(codes + low * (size_t)(K / 2) + offset)) : zero;
                upper_scale[u][m] = valid ? __ldg(scales + up * (size_t)groups + group) : 0.0f;
                lower_scale[u][m] = valid ? __ldg(scales + low * (size_t)groups + group) : 0.0f;
                if (ZEROS) {
                    upper_offset[u][m] = int4_offset(valid ? __ldg(zeros + up * (size_t)groups + group) : 8.0f);
                    lower_offset[u][m] = int4_offset(valid ? __ldg(zeros + low * (size_t)groups + group) : 8.0f);
                }
            }
        }
    };

    Position now = {first_tile, 0};
    Position next = now;
    advance(next);
    uint4 upper[UNROLL][M], lower[UNROLL][M], other_upper[UNROLL][M], other_lower[UNROLL][M];
    float upper_scale[UNROLL][M], lower_scale[UNROLL][M], other_upper_scale[UNROLL][M], other_lower_scale[UNROLL][M];
    unsigned upper_offset[UNROLL][M], lower_offset[UNROLL][M], other_upper_offset[UNROLL][M],
        other_lower_offset[UNROLL][M];
    // The first two steps' codes in flight while the prologue runs; from then on two steps are
    // always in flight, a buffer reloaded as soon as its step is done.
    if (steps > 0) load(now, upper, lower, upper_scale, lower_scale, upper_offset, lower_offset);
    if (steps > 1)
        load(next, other_upper, other_lower, other_upper_scale, other_lower_scale, other_upper_offset,
             other_lower_offset);
    wait_for_producers();   // everything below reads or writes what other kernels touch

    const uint4* stage = staged_rows;
    if (SHARED_STAGE) {
        uint4* shared_stage = reinterpret_cast<uint4*>(dynamic_shared);
        for (int i = tid; i < rows * stride; i += THREADS) {
            const int r = i / stride, c = i - r * stride;
            shared_stage[i] = int4_staged_chunk(x, order, r, c, K);
        }
        __syncthreads();
        stage = shared_stage;
    }
    float4* reduce = reinterpret_cast<float4*>(dynamic_shared + (SHARED_STAGE ? rows * stride * 16 : 0));

    float acc[M][ROW_TILES][4];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int t = 0; t < ROW_TILES; ++t) acc[m][t][0] = acc[m][t][1] = acc[m][t][2] = acc[m][t][3] = 0.0f;
    }

    auto run_step = [&](uint4 (*upper)[M], uint4 (*lower)[M], float (*upper_scale)[M], float (*lower_scale)[M],
                        unsigned (*upper_offset)[M], unsigned (*lower_offset)[M]) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int index = now.batch * UNROLL + u;
            if (index < own) {   // warp-uniform
                const int chunk = (first_piece + index) * 16 + 4 * q;
                float sums[M][ROW_TILES][4];
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) sums[m][t][0] = sums[m][t][1] = sums[m][t][2] = sums[m][t][3] = 0.0f;
                }
                // Word w of a lane's codes holds columns 8w .. 8w + 7 of its 32; the staged
                // chunk w holds the same columns of a row, paired as the codes' pairs are.
                #pragma unroll
                for (int w = 0; w < 4; ++w) {
                    uint4 in[ROW_TILES];
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        const int row = 8 * t + g;
                        in[t] = row < rows ? stage[row * stride + chunk + w] : zero;
                    }
                    #pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const unsigned up_offset = ZEROS ? upper_offset[u][m] : 0xc308c308u;   // -136: 128 + the zero point 8
                        const unsigned low_offset = ZEROS ? lower_offset[u][m] : 0xc308c308u;
                        unsigned a_upper[4], a_lower[4];
                        int4_pairs(uint4_word(upper[u][m], w), up_offset, a_upper);
                        int4_pairs(uint4_word(lower[u][m], w), low_offset, a_lower);
                        const unsigned first[4] = {a_upper[0], a_lower[0], a_upper[1], a_lower[1]};
                        const unsigned second[4] = {a_upper[2], a_lower[2], a_upper[3], a_lower[3]};
                        #pragma unroll
                        for (int t = 0; t < ROW_TILES; ++t) {
                            const unsigned b_first[2] = {in[t].x, in[t].y};
                            const unsigned b_second[2] = {in[t].z, in[t].w};
                            mma_16x8x16(sums[m][t], first, b_first);
                            mma_16x8x16(sums[m][t], second, b_second);
                        }
                    }
                }
                // The piece's sums (one group's 128 columns, or a part of a larger group) scaled at once.
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        acc[m][t][0] += sums[m][t][0] * upper_scale[u][m];
                        acc[m][t][1] += sums[m][t][1] * upper_scale[u][m];
                        acc[m][t][2] += sums[m][t][2] * lower_scale[u][m];
                        acc[m][t][3] += sums[m][t][3] * lower_scale[u][m];
                    }
                }
            }
        }
        if (now.batch == batches - 1) {
            if (SPLIT > 1) {
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        const float4 mine = {acc[m][t][0], acc[m][t][1], acc[m][t][2], acc[m][t][3]};
                        reduce[((warp * M + m) * ROW_TILES + t) * 32 + lane] = mine;
                    }
                }
                __syncthreads();
                if (part == 0) {
                    #pragma unroll
                    for (int p = 1; p < SPLIT; ++p) {
                        #pragma unroll
                        for (int m = 0; m < M; ++m) {
                            #pragma unroll
                            for (int t = 0; t < ROW_TILES; ++t) {
                                const float4 other = reduce[(((warp + p) * M + m) * ROW_TILES + t) * 32 + lane];
                                acc[m][t][0] += other.x; acc[m][t][1] += other.y;
                                acc[m][t][2] += other.z; acc[m][t][3] += other.w;
                            }
                        }
                    }
                }
                __syncthreads();
            }
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const int column_tile = now.tile * M + m;
                if (SWIGLU && part == 0 && column_tile < tiles) {
                    const int unit = column_tile * 8 + g;
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        #pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            const int r = 8 * t + 2 * q + i;
                            if (r < rows && unit < N) {
                                const float gate = acc[m][t][i], up = acc[m][t][i + 2];
                                reinterpret_cast<unsigned short*>(out)[(size_t)r * N + unit] =
                                    to_bf16(gate / (1.0f + expf(-gate)) * up);
                            }
                        }
                    }
                } else if (!SWIGLU && part == 0 && column_tile < tiles) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int n = column_tile * 16 + g + (i >= 2 ? 8 : 0);
                        if (n < N) {
                            const float add = bias != nullptr ? __ldg(bias + n) : 0.0f;
                            #pragma unroll
                            for (int t = 0; t < ROW_TILES; ++t) {
                                const int r = 8 * t + 2 * q + (i & 1);
                                if (r < rows) out[(size_t)r * N + n] = acc[m][t][i] + add;
                            }
                        }
                    }
                }
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) acc[m][t][0] = acc[m][t][1] = acc[m][t][2] = acc[m][t][3] = 0.0f;
            }
        }
        now = next;
        advance(next);
    };
    // After a step `next` is two steps ahead of the one just done: its buffer's next load.
    for (int step = 0; step < steps; step += 2) {
        run_step(upper, lower, upper_scale, lower_scale, upper_offset, lower_offset);
        if (step + 2 < steps) load(next, upper, lower, upper_scale, lower_scale, upper_offset, lower_offset);
        if (step + 1 < steps) {
            run_step(other_upper, other_lower, other_upper_scale, other_lower_scale, other_upper_offset,
                     other_lower_offset);
            if (step + 3 < steps)
                load(next, other_upper, other_lower, other_upper_scale, other_lower_scale, other_upper_offset,
                     other_lower_offset);
        }
    }
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return (qg.INSTRUCTIONS + DEPENDENT_LAUNCH + MMA_BF16 + qg.F16_PRIMITIVES + qg.CONSTANTS + HELPERS
            + qg.DEVICE_FUNCTIONS + KERNELS)


def serves(rows: int, weight: QuantizedWeight) -> bool:
    """Whether the GEMV serves ``rows`` rows of a product with ``weight``: 1 to :data:`MAX_ROWS`
    rows, 4-bit integer codes, weight-only, a scale (and zero point) per row and group of a multiple
    of 128 columns, the inner size a multiple of the group."""
    out, inner = weight.shape
    group = weight.block[1]
    return (0 < rows <= MAX_ROWS and out > 0 and weight.codes_format == "int4" and weight.activations == "weight_only"
            and weight.block[0] == 1 and group % 128 == 0 and inner % group == 0)


def shared_stage(rows: int, weight: QuantizedWeight) -> bool:
    """Whether the prologue stages the rows in shared memory (up to :data:`SHARED_STAGE_MAX_ROWS`
    that fit beside the split's partial sums); otherwise ``stage_int4_rows`` stages them first."""
    return rows <= SHARED_STAGE_MAX_ROWS and shared_bytes(rows, weight, qg.SPLITS[-1], True) <= qg.MAX_SHARED_BYTES


def shared_bytes(rows: int, weight: QuantizedWeight, split: int, staged: bool, weight_tiles: int = 1) -> int:
    """Dynamic shared memory of a launch: the staged rows (``staged``), the split's partial sums
    (``weight_tiles`` column tiles a warp)."""
    return ((rows * weight.shape[1] * 2 if staged else 0)
            + (qg.REDUCE_BYTES * qg.row_tiles(rows) * weight_tiles if split > 1 else 0))


def workspace_shape(rows: int, weight: QuantizedWeight) -> tuple[int, int]:
    """The global workspace of rows the prologue does not stage: uint32 ``[rows, K / 2]`` (bf16 pairs)."""
    return rows, weight.shape[1] // 2


def kernel_name(split: int, tiles: int, shared: bool = True, zeros: bool = False, unroll: int = UNROLL,
                bf16_input: bool = False, swiglu: bool = False, weight_tiles: int = 1) -> str:
    return (f"int4_gemv<{split}, {tiles}, {'true' if shared else 'false'}, {'true' if zeros else 'false'}, {unroll}, "
            f"{qg.input_type(bf16_input)}, {'true' if swiglu else 'false'}, {weight_tiles}>")


def warp_tiling(rows: int) -> tuple[int, int]:
    """``(weight_tiles, unroll)`` of a launch over ``rows`` rows: the column tiles of 16 a warp
    takes at once (each staged input word it loads feeds that many products;
    :data:`WEIGHT_TILES_BY_ROW_TILES`) and the pieces it loads per step: :data:`UNROLL` for rows
    the prologue stages, :data:`UNROLL_BY_WEIGHT_TILES` past them."""
    weight_tiles = WEIGHT_TILES_BY_ROW_TILES[qg.row_tiles(rows)]
    return weight_tiles, UNROLL if rows <= SHARED_STAGE_MAX_ROWS else UNROLL_BY_WEIGHT_TILES[weight_tiles]


def stage_name(bf16_input: bool = False) -> str:
    return f"stage_int4_rows<{qg.input_type(bf16_input)}>"


# ------------------------------------------------------------------------------ reference


def int4_gemv_reference(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray | None = None,
                        swiglu: bool = False) -> np.ndarray:
    """float32 ``[rows, N]``: what a launch computes, from host arrays: the input gathered in the
    weight's column order and rounded to bf16, times the dequantized weight, the sums exact
    (float64) and rounded once; with ``swiglu`` (a ``[2N, K]`` gate-and-up weight) the bf16 values
    of ``silu_and_mul`` of those sums, as float32 ``[rows, N]``."""
    y = qg.quantized_gemv_reference(x, weight, bias, exact=True)
    if not swiglu:
        return y
    units = y.shape[1] // 2
    return bf16_to_float32(float32_to_bf16(silu_and_mul_reference(y[:, :units], y[:, units:])))


# ------------------------------------------------------------------------------- launcher

_modules: dict[str, Any] = {}


def _function(name: str) -> Any:
    function = _modules.get(name)
    if function is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=(name,))
        function = _modules[name] = module.get_function(name)
    return function


def int4_gemv(x: DeviceArray, weight: QuantizedWeight, out: DeviceArray, stream: Any, *,
              bias: DeviceArray | None = None, multiprocessors: int = 132, split: int | None = None,
              workspace: DeviceArray | None = None, unroll: int | None = None, swiglu: bool = False,
              weight_tiles: int | None = None) -> DeviceArray:
    """``out <- x W^T (+ bias)`` (the module docstring) on ``stream``: ``x`` float32 or bf16 bits
    (uint16) ``[rows, K]``, ``out`` float32 ``[rows, N]``; with ``swiglu`` (a gate-and-up weight
    ``[2N, K]``, gate rows first, no bias) ``out`` is bf16 bits ``[rows, N]``: ``silu(gate) * up``,
    as ``silu_and_mul`` of the plain product. ``weight_tiles`` and ``unroll`` default to
    :func:`warp_tiling`'s. Rows the prologue does not stage
    (:func:`shared_stage`) are staged first into ``workspace`` (uint32 :func:`workspace_shape`).
    Raises :class:`~metrale.errors.KernelArgumentError` for what it does not serve (:func:`serves`)."""
    name = "int4_gemv"
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
        raise KernelArgumentError(f"{name}: {rows} rows of a {weight.codes_format} weight ({weight.activations}) in "
                                  f"blocks {weight.block}, inner size {inner}, are not served (1 to {MAX_ROWS} rows, "
                                  "4-bit weight-only codes in groups of a multiple of 128 columns)")
    default_tiles, default_unroll = warp_tiling(rows)
    weight_tiles = weight_tiles or default_tiles
    unroll = unroll or default_unroll
    if weight_tiles not in WEIGHT_TILES or unroll < 1:
        raise KernelArgumentError(f"{name}: weight_tiles must be one of {WEIGHT_TILES} ({weight_tiles} given) and "
                                  f"unroll positive ({unroll} given)")
    null = np.uint64(0)
    order = weight.input_order if weight.input_order is not None else null
    shared = shared_stage(rows, weight)
    staged: Any = null
    if not shared:
        if workspace is None:
            raise KernelArgumentError(f"{name}: {rows} rows of inner size {inner} need a staging workspace")
        check_array(name, "workspace", workspace, np.uint32, workspace_shape(rows, weight))
        staged = workspace
        launch(_function(stage_name(bf16_input)), (rows,), (THREADS,), (x, order, staged, np.int32(inner)), 0, stream,
               dependent=False)
    warp_tiles = -(-(-(-columns // qg.TILE)) // weight_tiles)
    chosen, blocks = qg.plan(warp_tiles * qg.TILE, multiprocessors, split)
    function = _function(kernel_name(chosen, qg.row_tiles(rows), shared, weight.zeros is not None, unroll, bf16_input,
                                     swiglu, weight_tiles))
    stage = shared_bytes(rows, weight, chosen, shared, weight_tiles)
    if stage > 48 * 1024:
        function.max_dynamic_shared_size_bytes = stage
    launch(function, (blocks,), (THREADS,), (
        x, order, staged, weight.codes, weight.scales, weight.zeros if weight.zeros is not None else null,
        np.int32(weight.block[1] // 128), bias if bias is not None else null, out, np.int32(rows), np.int32(inner),
        np.int32(columns // 2 if swiglu else columns),
    ), stage, stream, dependent=True)
    return out
