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
accumulators. The prologue stages up to :data:`SHARED_STAGE_MAX_ROWS` rows in shared memory
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

// y[r, n] = sum_j scales[n, j] sum_{k in group j} bf16(x[r, order[k]]) (q[n, k] - zero[n, j]) (+ bias[n])
// for r < rows <= 8 * ROW_TILES, n < N. codes [N, K / 2] (the even column in the low nibble);
// scales and zeros [N, K / (128 group_pieces)] (zeros: ZEROS, else 8); K a multiple of 128.
// x: INPUT [rows, K] (float32, or unsigned short: bf16 bits); out: float32 [rows, N]. SWIGLU: codes
// [2N, K / 2] (N gate rows, then N up rows), out bf16 bits [rows, N] = silu(g) * u of the gate and up
// sums, a column tile holding 8 gate rows (the MMA's rows 0-7) and their 8 up rows. Grid: WARPS /
// SPLIT column tiles of 16 a block, round after round; SPLIT warps share a tile, each over a slice of
// whole 128-column pieces. SHARED_STAGE: the prologue stages the rows in dynamic shared memory
// (rows * K * 2 bytes); otherwise staged_rows holds them (stage_int4_rows). Then (SPLIT > 1) the
// split's partial sums.
template <int SPLIT, int ROW_TILES, bool SHARED_STAGE, bool ZEROS, int UNROLL, typename INPUT, bool SWIGLU>
__global__ void __launch_bounds__(THREADS, ROW_TILES > 1 ? 1 : 2) int4_gemv(
    const INPUT* __restrict__ x, const int* __restrict__ order, const uint4* __restrict__ staged_rows,
    const unsigned char* __restrict__ codes, const float* __restrict__ scales, const float* __restrict__ zeros,
    int group_pieces, const float* __restrict__ bias, float* __restrict__ out, int rows, int K, int N) {
    DYNAMIC_SHARED;
    allow_dependents();
    constexpr int GROUPS = WARPS / SPLIT;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int pieces = K / 128, stride = K / 8;   // stride: 16-byte chunks of a staged row
    const int groups = pieces / group_pieces;
    const int slice = (pieces + SPLIT - 1) / SPLIT, part = warp % SPLIT;
    const int first_piece = part * slice;
    const int own = max(0, min(pieces, first_piece + slice) - first_piece);
    const int batches = (slice + UNROLL - 1) / UNROLL;
    const int tiles = SWIGLU ? (N + 7) / 8 : (N + 15) / 16;
    const int tile_stride = gridDim.x * GROUPS;
    const int first_tile = blockIdx.x * GROUPS + warp / SPLIT;
    const int rounds = (tiles - (int)blockIdx.x * GROUPS + tile_stride - 1) / tile_stride;
    const int steps = rounds * batches;
    const uint4 zero = {0u, 0u, 0u, 0u};

    struct Position {
        int tile, batch;
        const unsigned char* upper;   // the lane's first codes of the slice, weight rows g and g + 8
        const unsigned char* lower;
        const float* upper_scales;    // the rows' first scales (and zero points) of the slice
        const float* lower_scales;
        const float* upper_zeros;
        const float* lower_zeros;
    };
    auto enter_tile = [&](Position& p, int tile) {
        p.tile = tile;
        p.batch = 0;
        const size_t upper = (size_t)(SWIGLU ? min(tile * 8 + g, N - 1) : min(tile * 16 + g, N - 1));
        const size_t lower = SWIGLU ? upper + N : (size_t)min(tile * 16 + g + 8, N - 1);
        const size_t offset = (size_t)(64 * first_piece + 16 * q);
        p.upper = codes + upper * (size_t)(K / 2) + offset;
        p.lower = codes + lower * (size_t)(K / 2) + offset;
        p.upper_scales = scales + upper * (size_t)groups;
        p.lower_scales = scales + lower * (size_t)groups;
        if (ZEROS) {
            p.upper_zeros = zeros + upper * (size_t)groups;
            p.lower_zeros = zeros + lower * (size_t)groups;
        }
    };
    auto advance = [&](Position& p) {
        if (++p.batch == batches) enter_tile(p, p.tile + tile_stride);
    };
    // The batch's codes, each piece's scales and offsets (-(128 + zero) as a bf16 pair).
    auto load = [&](const Position& p, uint4* upper, uint4* lower, float* upper_scale, float* lower_scale,
                    unsigned* upper_offset, unsigned* lower_offset) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int index = p.batch * UNROLL + u;
            const bool valid = p.tile < tiles && index < own;
            upper[u] = valid ? __ldg(reinterpret_cast<const uint4*>(p.upper + 64 * index)) : zero;
            lower[u] = valid ? __ldg(reinterpret_cast<const uint4*>(p.lower + 64 * index)) : zero;
            const int group = group_pieces == 1 ? first_piece + index : (first_piece + index) / group_pieces;
            upper_scale[u] = valid ? __ldg(p.upper_scales + group) : 0.0f;
            lower_scale[u] = valid ? __ldg(p.lower_scales + group) : 0.0f;
            if (ZEROS) {
                upper_offset[u] = int4_offset(valid ? __ldg(p.upper_zeros + group) : 8.0f);
                lower_offset[u] = int4_offset(valid ? __ldg(p.lower_zeros + group) : 8.0f);
            }
        }
    };

    Position now, next;
    enter_tile(now, first_tile);
    next = now;
    advance(next);
    uint4 upper[UNROLL], lower[UNROLL], other_upper[UNROLL], other_lower[UNROLL];
    float upper_scale[UNROLL], lower_scale[UNROLL], other_upper_scale[UNROLL], other_lower_scale[UNROLL];
    unsigned upper_offset[UNROLL], lower_offset[UNROLL], other_upper_offset[UNROLL], other_lower_offset[UNROLL];
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

    float acc[ROW_TILES][4];
    #pragma unroll
    for (int t = 0; t < ROW_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

    auto run_step = [&](const uint4* upper, const uint4* lower, const float* upper_scale, const float* lower_scale,
                        const unsigned* upper_offset, const unsigned* lower_offset) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int index = now.batch * UNROLL + u;
            if (index < own) {   // warp-uniform
                const unsigned up_offset = ZEROS ? upper_offset[u] : 0xc308c308u;   // -136: 128 + the zero point 8
                const unsigned low_offset = ZEROS ? lower_offset[u] : 0xc308c308u;
                unsigned a_upper[16], a_lower[16];
                int4_pairs(upper[u].x, up_offset, a_upper);
                int4_pairs(upper[u].y, up_offset, a_upper + 4);
                int4_pairs(upper[u].z, up_offset, a_upper + 8);
                int4_pairs(upper[u].w, up_offset, a_upper + 12);
                int4_pairs(lower[u].x, low_offset, a_lower);
                int4_pairs(lower[u].y, low_offset, a_lower + 4);
                int4_pairs(lower[u].z, low_offset, a_lower + 8);
                int4_pairs(lower[u].w, low_offset, a_lower + 12);
                const int chunk = (first_piece + index) * 16 + 4 * q;
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) {
                    const int row = 8 * t + g;
                    unsigned in[16];
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const uint4 words = row < rows ? stage[row * stride + chunk + i] : zero;
                        in[4 * i] = words.x; in[4 * i + 1] = words.y; in[4 * i + 2] = words.z; in[4 * i + 3] = words.w;
                    }
                    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const unsigned a[4] = {a_upper[2 * j], a_lower[2 * j], a_upper[2 * j + 1], a_lower[2 * j + 1]};
                        const unsigned b[2] = {in[2 * j], in[2 * j + 1]};
                        mma_16x8x16(sums, a, b);
                    }
                    acc[t][0] += sums[0] * upper_scale[u];
                    acc[t][1] += sums[1] * upper_scale[u];
                    acc[t][2] += sums[2] * lower_scale[u];
                    acc[t][3] += sums[3] * lower_scale[u];
                }
            }
        }
        if (now.batch == batches - 1) {
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
                #pragma unroll
                for (int t = 0; t < ROW_TILES; ++t) {
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int r = 8 * t + 2 * q + i;
                        if (r < rows && unit < N) {
                            const float gate = acc[t][i], up = acc[t][i + 2];
                            reinterpret_cast<unsigned short*>(out)[(size_t)r * N + unit] =
                                to_bf16(gate / (1.0f + expf(-gate)) * up);
                        }
                    }
                }
            } else if (part == 0 && now.tile < tiles) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int n = now.tile * 16 + g + (i >= 2 ? 8 : 0);
                    if (n < N) {
                        const float add = bias != nullptr ? __ldg(bias + n) : 0.0f;
                        #pragma unroll
                        for (int t = 0; t < ROW_TILES; ++t) {
                            const int r = 8 * t + 2 * q + (i & 1);
                            if (r < rows) out[(size_t)r * N + n] = acc[t][i] + add;
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


def shared_bytes(rows: int, weight: QuantizedWeight, split: int, staged: bool) -> int:
    """Dynamic shared memory of a launch: the staged rows (``staged``), the split's partial sums."""
    return (rows * weight.shape[1] * 2 if staged else 0) + (qg.REDUCE_BYTES * qg.row_tiles(rows) if split > 1 else 0)


def workspace_shape(rows: int, weight: QuantizedWeight) -> tuple[int, int]:
    """The global workspace of rows the prologue does not stage: uint32 ``[rows, K / 2]`` (bf16 pairs)."""
    return rows, weight.shape[1] // 2


def kernel_name(split: int, tiles: int, shared: bool = True, zeros: bool = False, unroll: int = UNROLL,
                bf16_input: bool = False, swiglu: bool = False) -> str:
    return (f"int4_gemv<{split}, {tiles}, {'true' if shared else 'false'}, {'true' if zeros else 'false'}, {unroll}, "
            f"{qg.input_type(bf16_input)}, {'true' if swiglu else 'false'}>")


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
              workspace: DeviceArray | None = None, unroll: int = UNROLL, swiglu: bool = False) -> DeviceArray:
    """``out <- x W^T (+ bias)`` (the module docstring) on ``stream``: ``x`` float32 or bf16 bits
    (uint16) ``[rows, K]``, ``out`` float32 ``[rows, N]``; with ``swiglu`` (a gate-and-up weight
    ``[2N, K]``, gate rows first, no bias) ``out`` is bf16 bits ``[rows, N]``: ``silu(gate) * up``,
    as ``silu_and_mul`` of the plain product. Rows the prologue does not stage
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
    chosen, blocks = qg.plan(columns, multiprocessors, split)
    function = _function(kernel_name(chosen, qg.row_tiles(rows), shared, weight.zeros is not None, unroll, bf16_input,
                                     swiglu))
    stage = shared_bytes(rows, weight, chosen, shared)
    if stage > 48 * 1024:
        function.max_dynamic_shared_size_bytes = stage
    launch(function, (blocks,), (THREADS,), (
        x, order, staged, weight.codes, weight.scales, weight.zeros if weight.zeros is not None else null,
        np.int32(weight.block[1] // 128), bias if bias is not None else null, out, np.int32(rows), np.int32(inner),
        np.int32(columns // 2 if swiglu else columns),
    ), stage, stream, dependent=True)
    return out
