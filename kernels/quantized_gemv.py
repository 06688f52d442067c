"""Products with quantized weights on the GPU (CUDA C++, compiled by NVRTC through CuPy): a decode
GEMV that reads the codes and dequantizes them in registers, and a dequantization into bf16 for the
prompt GEMMs that cuBLAS runs.

``quantized_gemv`` computes ``y = quantize(x) W^T (+ bias)`` for up to :data:`MAX_ROWS` rows,
``W`` a :class:`~metrale.kernels.quantized.QuantizedWeight` (FP8 E4M3, INT4, INT8 or MXFP4 codes;
scales per block of rows and columns; optional zero points; optional act-order). Its prologue
stages the input rows in shared memory as bf16: gathered in the weight's column order, quantized
under the weight's activation scheme as :func:`~metrale.kernels.quantized.quantize_activations`
does (the row or group maxima reduced by a warp each), rounded to bf16. Rows the prologue does
not take (:func:`shared_stage`: several rows of a product whose column tiles are split, more than
:data:`SHARED_STAGE_MAX_ROWS` of any, rows that do not fit shared memory) are staged the same way
once by ``stage_rows`` into a global workspace first, which the product reads through the L1 cache. The product follows
:mod:`metrale.kernels.decode_gemv`'s: ``mma.sync.m16n8k16`` with 16 output columns as the M side and
a tile of 8 rows as the N side, each lane feeding its A fragment from the 8 codes of one chunk of 8
input columns of its two columns converted in registers: the weight stream is the codes' bytes, a
quarter (INT4, MXFP4) or half (FP8, INT8) of bf16's. ``SPLIT`` warps share a tile of columns, each
over a slice of the input.

Where the weight's column blocks and the inputs' groups are whole steps of 32 input columns
(:func:`exact_path`: per-channel, per-tensor, groups of 32 or more, DeepSeek's blocks), the products
are exact: the weights enter unscaled (integer codes less their zero point, FP4 and FP8 values; FP8
codes converted to f16 two at a time), quantized inputs enter as their codes on f16 tensor cores
(FP8 and INT8 codes are exact in f16), weight-only inputs as bf16, and each step's sums are scaled
by the step's weight and input scales as they join the float32 accumulators. Otherwise each weight
is scaled into bf16 (``(code - zero) * scale``) before the product, the input staged as the bf16 of
its quantized value.

``dequantize_bf16`` writes the bf16 matrix a quantized weight stands for, for the prompt
products (many rows: cuBLAS on bf16 tensor cores, its time spread over the rows), and
``stage_activations`` their input; for FP8 weights whose scales factor out of the sums,
``quantize_rows_fp8`` writes the input rows' E4M3 codes and scales for a product on FP8 tensor
cores (:meth:`metrale.kernels.linear.CublasLtGemm.fp8`) instead, whose unscaled product
``scale_product`` then scales by rows and columns in one pass; ``silu_and_mul_fp8_rows`` writes
those codes and scales for the down projection straight from a bf16 gate/up product (the SwiGLU
gate on the way).

:func:`quantized_gemv_reference` is the NumPy reference of what a launch computes (the staged
input and the dequantized weight rounded to bf16, float32 accumulation); ``tests/kernels`` runs the
kernels on the host through the CUDA emulation header against it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import launch
from metrale.kernels._tensor_cores import F16_PRIMITIVES, MMA_BF16
from metrale.kernels._words import HELPERS, aligned
from metrale.kernels.quantized import (
    FP8_E4M3_MAX,
    INT8_MAX,
    MIN_ACTIVATION_SCALE,
    QuantizedWeight,
    dequantize,
    quantize_activations,
)

#: Codes (template ``CODES``) and activation schemes (template ``ACT``) by their layout names.
CODES = {"fp8": 0, "int4": 1, "int8": 2, "mxfp4": 3}
ACTIVATIONS = {"weight_only": 0, "fp8_token": 1, "fp8_tensor": 2, "fp8_group": 3, "int8_token": 4}
MAX_ROWS = 32
ROW_TILES = (1, 2, 4)
WARPS = 8
THREADS = 32 * WARPS
SPLITS = (1, 2, 4, 8)
#: Chunks of 8 codes a lane may load at once, most first (:func:`load_chunks`).
LOAD_CHUNKS = (4, 2, 1)
UNROLL = 4
TILE = 16
MAX_SHARED_BYTES = 227 * 1024
#: The most rows the GEMV's own prologue stages when its column tiles are not split (one row
#: otherwise; :func:`shared_stage`); more are staged once by ``stage_rows``.
SHARED_STAGE_MAX_ROWS = 4
REDUCE_BYTES = WARPS * 32 * 16
#: float4 words of a row each thread of ``rmsnorm_fp8_rows`` keeps in registers.
NORM_FP8_QUADS = 8

INSTRUCTIONS = r"""
#define DYNAMIC_SHARED extern __shared__ __align__(16) unsigned char dynamic_shared[]
"""

CONSTANTS = f"""
#define WARPS {WARPS}
#define THREADS {THREADS}
#define CODES_FP8 {CODES["fp8"]}
#define CODES_INT4 {CODES["int4"]}
#define CODES_INT8 {CODES["int8"]}
#define CODES_MXFP4 {CODES["mxfp4"]}
#define ACT_NONE {ACTIVATIONS["weight_only"]}
#define ACT_FP8_TOKEN {ACTIVATIONS["fp8_token"]}
#define ACT_FP8_TENSOR {ACTIVATIONS["fp8_tensor"]}
#define ACT_FP8_GROUP {ACTIVATIONS["fp8_group"]}
#define ACT_INT8_TOKEN {ACTIVATIONS["int8_token"]}
#define FP8_MAX {FP8_E4M3_MAX:.1f}f
#define INT8_MAX_VALUE {INT8_MAX:.1f}f
#define MIN_SCALE {MIN_ACTIVATION_SCALE:.1e}f
#define GEMV_UNROLL {UNROLL}
#define NORM_FP8_QUADS {NORM_FP8_QUADS}
"""

#: The device functions every kernel of quantized weights shares (:mod:`metrale.kernels.quantized_moe_decode` too):
#: the codes' values, FP8 rounding, a chunk of 8 weights dequantized to bf16, the warp maximum.
DEVICE_FUNCTIONS = r"""
// The value of an FP8 E4M3 code (0x7f / 0xff, NaN, never stored by a quantizer, read as 480).
__device__ __forceinline__ float e4m3_value(unsigned code) {
    const unsigned exponent = (code >> 3) & 15u, mantissa = code & 7u;
    const float magnitude = exponent == 0u ? (float)mantissa * 0.001953125f
                                           : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
    return code & 0x80u ? -magnitude : magnitude;
}

// The value of an FP4 E2M1 code (bit 3 the sign).
__device__ __forceinline__ float e2m1_value(unsigned code) {
    const unsigned exponent = (code >> 1) & 3u, mantissa = code & 1u;
    const float magnitude = exponent == 0u ? 0.5f * (float)mantissa
                                           : (1.0f + 0.5f * (float)mantissa) * (float)(1u << (exponent - 1u));
    return code & 8u ? -magnitude : magnitude;
}

// value rounded to the nearest E4M3 value (ties to the even code), saturating at +-448.
__device__ __forceinline__ float round_e4m3(float value) {
    const float magnitude = fminf(fabsf(value), FP8_MAX);
    float rounded;
    if (magnitude < 0.015625f) {
        rounded = rintf(magnitude * 512.0f) * 0.001953125f;   // subnormal codes: steps of 2**-9
    } else {
        const unsigned bits = __float_as_uint(magnitude);
        rounded = __uint_as_float((bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u);
    }
    return copysignf(rounded, value);
}

// Code i (0..7) of a chunk of 8 codes, as its raw value: codes holds 8 bytes (FP8, INT8) or 8 nibbles
// (INT4, MXFP4) in two words.
template <int CODES>
__device__ __forceinline__ float code_value(uint2 codes, int i) {
    if (CODES == CODES_INT4 || CODES == CODES_MXFP4) {
        const unsigned nibble = (codes.x >> (4 * i)) & 15u;
        return CODES == CODES_INT4 ? (float)nibble : e2m1_value(nibble);
    }
    const unsigned byte = ((i < 4 ? codes.x : codes.y) >> (8 * (i & 3))) & 255u;
    return CODES == CODES_FP8 ? e4m3_value(byte) : (float)byte;
}

// The 8 codes of chunk `chunk` (input columns 8 chunk .. 8 chunk + 7) of weight row `column`.
template <int CODES>
__device__ __forceinline__ uint2 load_codes(const unsigned char* __restrict__ codes, size_t column, int chunk, int K) {
    if (CODES == CODES_INT4 || CODES == CODES_MXFP4) {
        const unsigned word = __ldg(reinterpret_cast<const unsigned*>(codes + column * (size_t)(K / 2)) + chunk);
        return make_uint2(word, 0u);
    }
    return __ldg(reinterpret_cast<const uint2*>(codes + column * (size_t)K) + chunk);
}

// Chunks chunk .. chunk + LOAD - 1 of weight row `column` in one load of LOAD * 8 bytes (FP8, INT8) or
// LOAD * 4 bytes (INT4, MXFP4), chunk a multiple of LOAD: chunk j's codes are chunk_codes<CODES, LOAD>(.., j).
template <int CODES, int LOAD>
__device__ __forceinline__ uint4 load_chunks(const unsigned char* __restrict__ codes, size_t column, int chunk, int K) {
    constexpr bool NIBBLES = CODES == CODES_INT4 || CODES == CODES_MXFP4;
    const unsigned char* row = codes + column * (size_t)(NIBBLES ? K / 2 : K);
    constexpr int BYTES = LOAD * (NIBBLES ? 4 : 8);
    if (BYTES == 16) return __ldg(reinterpret_cast<const uint4*>(row) + chunk / LOAD);
    if (BYTES == 8) {
        const uint2 pair = __ldg(reinterpret_cast<const uint2*>(row) + chunk / LOAD);
        return make_uint4(pair.x, pair.y, 0u, 0u);
    }
    return make_uint4(__ldg(reinterpret_cast<const unsigned*>(row) + chunk), 0u, 0u, 0u);
}

// Chunk j of a load_chunks load, as load_codes gives a chunk.
template <int CODES, int LOAD>
__device__ __forceinline__ uint2 chunk_codes(uint4 loaded, int j) {
    if (CODES == CODES_INT4 || CODES == CODES_MXFP4)
        return make_uint2(j == 0 ? loaded.x : j == 1 ? loaded.y : j == 2 ? loaded.z : loaded.w, 0u);
    return j == 0 ? make_uint2(loaded.x, loaded.y) : make_uint2(loaded.z, loaded.w);
}

// The chunk's 8 weights (code - zero) * scale as 4 bf16 pairs.
template <int CODES>
__device__ __forceinline__ uint4 dequantize_chunk(uint2 codes, float scale, float zero) {
    float w[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = (code_value<CODES>(codes, i) - zero) * scale;
    uint4 pairs;
    pairs.x = (unsigned)to_bf16(w[0]) | ((unsigned)to_bf16(w[1]) << 16);
    pairs.y = (unsigned)to_bf16(w[2]) | ((unsigned)to_bf16(w[3]) << 16);
    pairs.z = (unsigned)to_bf16(w[4]) | ((unsigned)to_bf16(w[5]) << 16);
    pairs.w = (unsigned)to_bf16(w[6]) | ((unsigned)to_bf16(w[7]) << 16);
    return pairs;
}

// Two float32 values as bf16 bits (exact for the small integers and FP8 / FP4 values packed here).
__device__ __forceinline__ unsigned pack_bf16_pair(float low, float high) {
    return (unsigned)to_bf16(low) | ((unsigned)to_bf16(high) << 16);
}

// Element i of input rows held as float32 or as bf16 bits.
__device__ __forceinline__ float input_value(const float* x, size_t i) { return x[i]; }
__device__ __forceinline__ float input_value(const unsigned short* x, size_t i) { return bf16_bits(x[i]); }

// 8 consecutive input values of chunk c (16-byte aligned rows): bf16 bits (one load) or float32 (two).
__device__ __forceinline__ void load_eight(const unsigned short* __restrict__ x, size_t c, float* v) {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(x) + c);
    v[0] = bf16_low(w.x); v[1] = bf16_high(w.x); v[2] = bf16_low(w.y); v[3] = bf16_high(w.y);
    v[4] = bf16_low(w.z); v[5] = bf16_high(w.z); v[6] = bf16_low(w.w); v[7] = bf16_high(w.w);
}
__device__ __forceinline__ void load_eight(const float* __restrict__ x, size_t c, float* v) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x) + 2 * c);
    const float4 b = __ldg(reinterpret_cast<const float4*>(x) + 2 * c + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ float warp_max(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

struct QuantizedOperand {
    const unsigned char* codes;   // [N, K] bytes (FP8, INT8) or [N, K / 2] (INT4, MXFP4)
    const float* scales;          // [ceil(N / block_rows), scale_columns]
    const float* zeros;           // like scales, or null: 0 (FP8, MXFP4), 2**(bits - 1) (INT4, INT8)
    int block_rows, block_columns, scale_columns;
};

// The scale column (and zero point column) of input column k: none for one scale column, a shift
// for blocks of a power of two columns, else a 32-bit division (rows and columns fit an int).
__device__ __forceinline__ int scale_column(const QuantizedOperand& w, int k) {
    if (w.scale_columns == 1) return 0;
    return (w.block_columns & (w.block_columns - 1)) == 0 ? k >> (__ffs(w.block_columns) - 1) : k / w.block_columns;
}

// The index of the first scale of weight row `row`.
__device__ __forceinline__ size_t scale_row(const QuantizedOperand& w, int row) {
    return (size_t)(row / w.block_rows) * (size_t)w.scale_columns;
}

__device__ __forceinline__ size_t scale_index(const QuantizedOperand& w, int row, int k) {
    return scale_row(w, row) + (size_t)scale_column(w, k);
}

// The chunk's 8 weights (code - zero) * scale as bf16 pairs, from its codes (load_codes).
template <int CODES>
__device__ __forceinline__ uint4 scaled_chunk(const QuantizedOperand& w, size_t column, int chunk, uint2 codes,
                                              bool valid) {
    if (!valid) return make_uint4(0u, 0u, 0u, 0u);
    const size_t at = scale_index(w, (int)column, 8 * chunk);
    const float default_zero = CODES == CODES_INT4 ? 8.0f : CODES == CODES_INT8 ? 128.0f : 0.0f;
    const float zero = w.zeros != nullptr ? __ldg(w.zeros + at) : default_zero;
    return dequantize_chunk<CODES>(codes, __ldg(w.scales + at), zero);
}

template <int CODES>
__device__ __forceinline__ uint4 weight_chunk(const QuantizedOperand& w, size_t column, int chunk, int K, bool valid) {
    if (!valid) return make_uint4(0u, 0u, 0u, 0u);
    return scaled_chunk<CODES>(w, column, chunk, load_codes<CODES>(w.codes, column, chunk, K), true);
}

"""

KERNELS = r"""
// The chunk's 8 weights without their scale, exactly, as 4 pairs for the product (f16 with F16, else
// bf16): integer codes less their zero point, FP4 and FP8 values as they are; from the chunk's codes
// (load_codes). The common cases take few instructions a pair: FP8 codes converted two at a time
// (e4m3x2_to_f16x2); integer codes with the default zero point (no zero points stored) as
// magic-number floats, a code q in the low mantissa bits of 2**7 (bf16) or 2**10 (f16), less
// 2**7 + zero (2**10 + zero) in one fused pair operation, exact for these small integers.
template <int CODES, bool F16>
__device__ __forceinline__ uint4 exact_chunk(const QuantizedOperand& w, size_t column, int chunk, uint2 codes,
                                             bool valid) {
    if (!valid) return make_uint4(0u, 0u, 0u, 0u);
    unsigned pairs[4];
    if (CODES == CODES_FP8 && F16) {
        pairs[0] = e4m3x2_to_f16x2(codes.x);
        pairs[1] = e4m3x2_to_f16x2(codes.x >> 16);
        pairs[2] = e4m3x2_to_f16x2(codes.y);
        pairs[3] = e4m3x2_to_f16x2(codes.y >> 16);
    } else if (CODES == CODES_INT4 && !F16 && w.zeros == nullptr) {
        // Nibbles 2p and 2p + 1 (bits 8p .. 8p + 7) into the low 4 bits of each half; 0x4300 is
        // bf16's 128, 0xc308 its -136 (128 + the zero point 8), 0x3f80 its 1.
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
            const unsigned bits = (codes.x >> (8 * p)) & 0xffu;
            const unsigned halves = ((bits | (bits << 12)) & 0x000f000fu) | 0x43004300u;
            pairs[p] = fma_bf16x2(halves, 0x3f803f80u, 0xc308c308u);
        }
    } else if (CODES == CODES_INT8 && F16 && w.zeros == nullptr) {
        // Bytes 2p and 2p + 1 into the low 8 bits of each half; 0x6400 is f16's 1024, 0xe480 its
        // -1152 (1024 + the zero point 128), 0x3c00 its 1.
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
            const unsigned bits = ((p < 2 ? codes.x : codes.y) >> (16 * (p & 1))) & 0xffffu;
            const unsigned halves = ((bits | (bits << 8)) & 0x00ff00ffu) | 0x64006400u;
            pairs[p] = fma_f16x2(halves, 0x3c003c00u, 0xe480e480u);
        }
    } else {
        float zero = 0.0f;
        if (CODES == CODES_INT4 || CODES == CODES_INT8) {
            zero = w.zeros != nullptr ? __ldg(w.zeros + scale_index(w, (int)column, 8 * chunk))
                                      : (CODES == CODES_INT4 ? 8.0f : 128.0f);
        }
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
            const float low = code_value<CODES>(codes, 2 * p) - zero, high = code_value<CODES>(codes, 2 * p + 1) - zero;
            pairs[p] = F16 ? pack_f16(low, high) : pack_bf16_pair(low, high);
        }
    }
    return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

// The activation scales of `rows` rows of x (float32 [rows, K], columns gathered through order):
// max|values| / 448 (/ 127 for ACT_INT8_TOKEN) of each row (ACT_FP8_TOKEN, ACT_INT8_TOKEN) or of each
// group of `group` columns (ACT_FP8_GROUP) into act_scale [rows][groups]. The block's `warps` warps
// (this one `warp`) share the (row, group) tasks; with fewer tasks than warps each task's columns
// are dealt among warps / tasks of them, whose maxima meet in `partial` (warps floats of shared
// memory), so a decode row's maximum is not one warp's long walk. Every thread of the block calls it.
// The input rows as float32 or as bf16 bits (INPUT): the largest magnitude of the
// 4 elements at 4i (a 16- or 8-byte load).
__device__ __forceinline__ float quad_amax(const float* row, int i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(row) + i);
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}
__device__ __forceinline__ float quad_amax(const unsigned short* row, int i) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(row) + i);
    return fmaxf(fmaxf(fabsf(bf16_low(v.x)), fabsf(bf16_high(v.x))), fmaxf(fabsf(bf16_low(v.y)), fabsf(bf16_high(v.y))));
}

template <int ACT, typename INPUT>
__device__ void activation_scales(const INPUT* __restrict__ x, const int* __restrict__ order, int rows, int K,
                                  int group, int groups, float* act_scale, float* partial, int warp, int warps,
                                  int lane) {
    const float limit = ACT == ACT_INT8_TOKEN ? INT8_MAX_VALUE : FP8_MAX;
    const int tasks = rows * groups, parts = tasks < warps ? warps / tasks : 1;
    for (int item = warp; item < tasks * parts; item += warps) {
        const int task = item % tasks, part = item / tasks;
        const int r = task / groups, j = task - r * groups;
        float amax = 0.0f;
        if (order == nullptr && group % 4 == 0 && reinterpret_cast<size_t>(x) % (4 * sizeof(INPUT)) == 0) {
            // Four columns a load, four loads in flight: the loop is the loads' latency otherwise.
            const INPUT* row = x + (size_t)r * K + (size_t)j * group;
            const int count = (min(K, (j + 1) * group) - j * group) / 4;
            #pragma unroll 4
            for (int i = 32 * part + lane; i < count; i += 32 * parts) amax = fmaxf(amax, quad_amax(row, i));
        } else {
            for (int k = j * group + 32 * part + lane; k < min(K, (j + 1) * group); k += 32 * parts)
                amax = fmaxf(amax, fabsf(input_value(x, (size_t)r * K + (order != nullptr ? order[k] : k))));
        }
        amax = warp_max(amax);
        if (lane == 0) {
            if (parts == 1) act_scale[task] = fmaxf(amax / limit, MIN_SCALE);
            else partial[item] = amax;
        }
    }
    if (parts > 1) {
        __syncthreads();
        for (int task = warp * 32 + lane; task < tasks; task += warps * 32) {
            float amax = 0.0f;
            for (int part = 0; part < parts; ++part) amax = fmaxf(amax, partial[part * tasks + task]);
            act_scale[task] = fmaxf(amax / limit, MIN_SCALE);
        }
    }
}

// Chunk c (input columns 8c .. 8c + 7) of row r as the products take it: x gathered and quantized
// (row_scales: the row's activation scales), as bf16 values, or (F16: the exact path over quantized
// inputs) the codes as f16, their scales applied to the products' sums.
template <int ACT, bool F16, typename INPUT>
__device__ __forceinline__ uint4 staged_chunk(const INPUT* __restrict__ x, const int* __restrict__ order,
                                              float input_scale, const float* row_scales, int r, int c, int K,
                                              int group) {
    float v[8];
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int k = 8 * c + e;
        float value = input_value(x, (size_t)r * K + (order != nullptr ? order[k] : k));
        if (ACT == ACT_FP8_TENSOR) {
            value = round_e4m3(value / input_scale) * (F16 ? 1.0f : input_scale);
        } else if (ACT == ACT_FP8_TOKEN || ACT == ACT_FP8_GROUP) {
            const float s = row_scales[k / group];
            value = round_e4m3(value / s) * (F16 ? 1.0f : s);
        } else if (ACT == ACT_INT8_TOKEN) {
            const float s = row_scales[0];
            value = fminf(fmaxf(rintf(value / s), -INT8_MAX_VALUE), INT8_MAX_VALUE) * (F16 ? 1.0f : s);
        }
        v[e] = value;
    }
    if (F16) return make_uint4(pack_f16(v[0], v[1]), pack_f16(v[2], v[3]), pack_f16(v[4], v[5]), pack_f16(v[6], v[7]));
    return make_uint4(pack_bf16_pair(v[0], v[1]), pack_bf16_pair(v[2], v[3]), pack_bf16_pair(v[4], v[5]),
                      pack_bf16_pair(v[6], v[7]));
}

// y[r, n] = dot(staged[r, :], W[n, :]) (+ bias[n]) for r < rows <= 8 * ROW_TILES, n < N. staged[r, k]
// = bf16(quantize(x[r, order[k]])) (order null: k): ACT_NONE keeps the value, ACT_FP8_TOKEN /
// ACT_INT8_TOKEN quantize each row with scale max|row| / 448 (/ 127), ACT_FP8_GROUP each row's
// groups of act_group columns, ACT_FP8_TENSOR with input_scale. x: INPUT [rows, K] (float32, or
// unsigned short: bf16 bits); out: float32
// [rows, N]; K a multiple of 32, block_columns a multiple of 8. Grid: as decode_gemv's, WARPS / SPLIT
// column tiles of 16 a block, round after round. SHARED_STAGE: the prologue stages the rows in
// dynamic shared memory, rows * ceil(K / 64) * 128 bytes of staged input, then rows * groups floats
// of activation scales; otherwise stage_rows staged them in global memory (staged_rows,
// staged_scales, the same layout), for rows that do not fit. Then (SPLIT > 1) the split's partial
// products.
template <int CODES, int ACT, int SPLIT, int ROW_TILES, bool EXACT, bool SHARED_STAGE, int LOAD, typename INPUT>
__global__ void __launch_bounds__(THREADS, ROW_TILES > 1 ? 1 : 2) quantized_gemv(
    const INPUT* __restrict__ x, const int* __restrict__ order, float input_scale, int act_group,
    const uint4* __restrict__ staged_rows, const float* __restrict__ staged_scales,
    const unsigned char* __restrict__ codes, const float* __restrict__ scales, const float* __restrict__ zeros,
    int block_rows, int block_columns, int scale_columns, const float* __restrict__ bias, float* __restrict__ out,
    int rows, int K, int N) {
    DYNAMIC_SHARED;
    const QuantizedOperand w = {codes, scales, zeros, block_rows, block_columns, scale_columns};
    constexpr int GROUPS = WARPS / SPLIT;
    constexpr bool QUANTIZED_ROWS = ACT == ACT_FP8_TOKEN || ACT == ACT_INT8_TOKEN || ACT == ACT_FP8_GROUP;
    // EXACT: the products take the weights unscaled and (quantized schemes) the inputs' codes, on f16
    // tensor cores when the inputs are quantized (bf16 otherwise); each step's sums are scaled by its
    // weight and input scales, once per step of 32 input columns.
    constexpr bool F16 = EXACT && ACT != ACT_NONE;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int chunks = K / 8, stride = (chunks + 7) / 8 * 8;
    const int tiles = (N + 15) / 16;
    // A split's slices are whole groups of 4 * LOAD chunks (a load of each of the 4 lanes of a column).
    const int slice = ((chunks + 4 * LOAD - 1) / (4 * LOAD) + SPLIT - 1) / SPLIT * 4 * LOAD;
    const int part = warp % SPLIT;
    const int first_chunk = part * slice, end_chunk = min(chunks, first_chunk + slice);
    // Chunks of a batch: 4 * UNROLL, twice as many for 4-bit codes (the same bytes in flight).
    constexpr int UNROLL = CODES == CODES_INT4 || CODES == CODES_MXFP4 ? 2 * GEMV_UNROLL : GEMV_UNROLL;
    const int batches = (slice + 4 * UNROLL - 1) / (4 * UNROLL);
    const int tile_stride = gridDim.x * GROUPS;
    const int first_tile = blockIdx.x * GROUPS + warp / SPLIT;
    const int rounds = (tiles - (int)blockIdx.x * GROUPS + tile_stride - 1) / tile_stride;
    const int steps = rounds * batches;
    const uint4 zero = {0u, 0u, 0u, 0u};
    const int group = ACT == ACT_FP8_GROUP ? act_group : K;
    const int groups = (K + group - 1) / group;

    // Batch `step` of this warp: tile first_tile + (step / batches) * tile_stride; its chunks in LOADS
    // groups of 4 * LOAD, group v from chunk first_chunk + (step % batches) * 4 * UNROLL + 4 * LOAD * v,
    // of which the lane loads chunks + LOAD * q .. + LOAD - 1 of columns g and g + 8 at once; on the
    // exact path each group's weight scales too (none past the slice's end).
    constexpr int LOADS = UNROLL / LOAD;
    auto load = [&](int step, uint4* upper, uint4* lower, float* upper_scale, float* lower_scale) {
        const int round = step / batches, batch = step - round * batches;
        const int tile = first_tile + round * tile_stride;
        const size_t column = (size_t)min(tile * 16 + g, N - 1), below = (size_t)min(tile * 16 + g + 8, N - 1);
        const float* upper_scales = w.scales + scale_row(w, (int)column);
        const float* lower_scales = w.scales + scale_row(w, (int)below);
        #pragma unroll
        for (int v = 0; v < LOADS; ++v) {
            const int group_chunk = first_chunk + batch * 4 * UNROLL + 4 * LOAD * v, chunk = group_chunk + LOAD * q;
            const bool valid = tile < tiles && chunk < end_chunk;
            upper[v] = valid ? load_chunks<CODES, LOAD>(w.codes, column, chunk, K) : zero;
            lower[v] = valid ? load_chunks<CODES, LOAD>(w.codes, below, chunk, K) : zero;
            upper_scale[v] = lower_scale[v] = 0.0f;
            if (EXACT && group_chunk < end_chunk) {
                const int scales_column = scale_column(w, 8 * group_chunk);
                upper_scale[v] = __ldg(upper_scales + scales_column);
                lower_scale[v] = __ldg(lower_scales + scales_column);
            }
        }
    };

    uint4 upper[LOADS], lower[LOADS];
    float upper_scale[LOADS], lower_scale[LOADS];
    if (steps > 0) load(0, upper, lower, upper_scale, lower_scale);   // in flight while the prologue runs

    const uint4* stage = staged_rows;
    const float* act_scale = staged_scales;   // [rows][groups]
    if (SHARED_STAGE) {
        // 1. The activation scales, 2. the staged rows.
        uint4* shared_stage = reinterpret_cast<uint4*>(dynamic_shared);
        float* shared_scales = reinterpret_cast<float*>(shared_stage + rows * stride);
        if (QUANTIZED_ROWS) {
            activation_scales<ACT>(x, order, rows, K, group, groups, shared_scales,
                                   reinterpret_cast<float*>(shared_stage), warp, WARPS, lane);
            __syncthreads();
        }
        for (int i = tid; i < rows * chunks; i += THREADS) {
            const int r = i / chunks, c = i - r * chunks;
            shared_stage[r * stride + c] = staged_chunk<ACT, F16>(x, order, input_scale, shared_scales + r * groups,
                                                                  r, c, K, group);
        }
        __syncthreads();
        stage = shared_stage;
        act_scale = shared_scales;
    }

    // The rows' input scales where one serves a whole row (per token).
    float row_input_scale[ROW_TILES][2];
    #pragma unroll
    for (int t = 0; t < ROW_TILES; ++t) {
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = 8 * t + 2 * q + i;
            row_input_scale[t][i] = QUANTIZED_ROWS && ACT != ACT_FP8_GROUP && r < rows ? act_scale[r * groups] : 0.0f;
        }
    }

    // 3. The products, batch after batch: each lane dequantizes chunk (base + 4u + q) of columns g
    // and g + 8, the next batch's codes (and step scales) in flight during each.
    const int scales_at = !SHARED_STAGE ? 0 : rows * stride * 16 + (QUANTIZED_ROWS ? (rows * groups * 4 + 15) / 16 * 16 : 0);
    float4* reduce = reinterpret_cast<float4*>(dynamic_shared + scales_at);   // [WARPS][ROW_TILES][32]
    float acc[ROW_TILES][4], sums[ROW_TILES][4];
    #pragma unroll
    for (int t = 0; t < ROW_TILES; ++t) {
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
        sums[t][0] = sums[t][1] = sums[t][2] = sums[t][3] = 0.0f;
    }
    for (int step = 0; step < steps; ++step) {
        uint4 next_upper[LOADS], next_lower[LOADS];
        float next_upper_scale[LOADS], next_lower_scale[LOADS];
        if (step + 1 < steps) load(step + 1, next_upper, next_lower, next_upper_scale, next_lower_scale);
        const int round = step / batches, batch = step - round * batches;
        const int tile = first_tile + round * tile_stride;
        const size_t column = (size_t)min(tile * 16 + g, N - 1), below = (size_t)min(tile * 16 + g + 8, N - 1);
        #pragma unroll
        for (int v = 0; v < LOADS; ++v) {
            const int group_chunk = first_chunk + batch * 4 * UNROLL + 4 * LOAD * v;
            if (group_chunk < end_chunk) {   // warp-uniform
                #pragma unroll
                for (int j = 0; j < LOAD; ++j) {
                    // The lanes' chunks of one pair of products: chunk group_chunk + LOAD * q + j of each lane.
                    const int chunk = group_chunk + LOAD * q + j;
                    const bool valid = tile < tiles && chunk < end_chunk;
                    const uint2 upper_codes = chunk_codes<CODES, LOAD>(upper[v], j);
                    const uint2 lower_codes = chunk_codes<CODES, LOAD>(lower[v], j);
                    const uint4 upper_pairs = EXACT ? exact_chunk<CODES, F16>(w, column, chunk, upper_codes, valid)
                                                    : scaled_chunk<CODES>(w, column, chunk, upper_codes, valid);
                    const uint4 lower_pairs = EXACT ? exact_chunk<CODES, F16>(w, below, chunk, lower_codes, valid)
                                                    : scaled_chunk<CODES>(w, below, chunk, lower_codes, valid);
                    const unsigned a0[4] = {upper_pairs.x, lower_pairs.x, upper_pairs.y, lower_pairs.y};
                    const unsigned a1[4] = {upper_pairs.z, lower_pairs.z, upper_pairs.w, lower_pairs.w};
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        const int row = 8 * t + g;
                        const uint4 in = row < rows && valid ? stage[row * stride + chunk] : zero;
                        const unsigned b0[2] = {in.x, in.y};
                        const unsigned b1[2] = {in.z, in.w};
                        if (F16) {
                            mma_16x8x16_f16(sums[t], a0, b0);
                            mma_16x8x16_f16(sums[t], a1, b1);
                        } else {
                            mma_16x8x16(EXACT ? sums[t] : acc[t], a0, b0);
                            mma_16x8x16(EXACT ? sums[t] : acc[t], a1, b1);
                        }
                    }
                }
                if (EXACT) {
                    // The group's 32 * LOAD input columns share their weight and input scales (blocks
                    // of whole groups, load_chunks' launcher choice): the sums, scaled, join the accumulators.
                    const int input_group = ACT == ACT_FP8_GROUP ? 8 * group_chunk / group : 0;
                    #pragma unroll
                    for (int t = 0; t < ROW_TILES; ++t) {
                        #pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            const int r = 8 * t + 2 * q + i;
                            float input = 1.0f;
                            if (ACT == ACT_FP8_TENSOR) input = input_scale;
                            else if (ACT == ACT_FP8_GROUP) input = r < rows ? act_scale[r * groups + input_group] : 0.0f;
                            else if (QUANTIZED_ROWS) input = row_input_scale[t][i];
                            acc[t][i] += sums[t][i] * upper_scale[v] * input;
                            acc[t][i + 2] += sums[t][i + 2] * lower_scale[v] * input;
                            sums[t][i] = sums[t][i + 2] = 0.0f;
                        }
                    }
                }
            }
        }
        #pragma unroll
        for (int v = 0; v < LOADS; ++v) {
            upper[v] = next_upper[v];
            lower[v] = next_lower[v];
            upper_scale[v] = next_upper_scale[v];
            lower_scale[v] = next_lower_scale[v];
        }
        if (batch == batches - 1) {
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
            #pragma unroll
            for (int t = 0; t < ROW_TILES; ++t) {
                if (part == 0 && tile < tiles) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = 8 * t + 2 * q + (i & 1), n = tile * 16 + g + (i >= 2 ? 8 : 0);
                        if (r < rows && n < N) out[(size_t)r * N + n] = bias != nullptr ? acc[t][i] + bias[n] : acc[t][i];
                    }
                }
                acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
            }
        }
    }
}

// The GEMV's staged rows in global memory, for rows that do not fit its shared memory: staged
// [rows][ceil(K / 64) * 8] chunks of 8 as the GEMV's prologue writes them, scales [rows][groups].
// Grid: rows blocks of THREADS threads.
template <int ACT, bool F16, typename INPUT>
__global__ void __launch_bounds__(THREADS) stage_rows(
    const INPUT* __restrict__ x, const int* __restrict__ order, float input_scale, int act_group,
    uint4* __restrict__ staged, float* __restrict__ scales, int K) {
    __shared__ float partial[WARPS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, r = blockIdx.x;
    const int chunks = K / 8, stride = (chunks + 7) / 8 * 8;
    const int group = ACT == ACT_FP8_GROUP ? act_group : K;
    const int groups = (K + group - 1) / group;
    const INPUT* row = x + (size_t)r * K;
    float* row_scales = scales + (size_t)r * groups;
    if (ACT == ACT_FP8_TOKEN || ACT == ACT_INT8_TOKEN || ACT == ACT_FP8_GROUP) {
        activation_scales<ACT>(row, order, 1, K, group, groups, row_scales, partial, warp, WARPS, lane);
        __syncthreads();
    }
    for (int c = tid; c < chunks; c += THREADS)
        staged[(size_t)r * stride + c] = staged_chunk<ACT, F16>(row, order, input_scale, row_scales, 0, c, K, group);
}

// out[r, k] = bf16(quantize(x[r, order[k]])) (order null: k), the input of a prompt product with a
// quantized weight, quantized as the GEMV's prologue quantizes it. Grid: (rows, groups) blocks of
// THREADS threads, groups = ceil(K / act_group) for ACT_FP8_GROUP, else 1.
template <int ACT>
__global__ void __launch_bounds__(THREADS) stage_activations(
    const float* __restrict__ x, const int* __restrict__ order, float input_scale, int act_group,
    unsigned short* __restrict__ out, int rows, int K) {
    __shared__ float partial[WARPS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int r = blockIdx.x, group = ACT == ACT_FP8_GROUP ? act_group : K;
    const int begin = blockIdx.y * group, end = min(K, begin + group);
    const float* row = x + (size_t)r * K;
    float s = ACT == ACT_FP8_TENSOR ? input_scale : 1.0f;
    if (ACT == ACT_FP8_TOKEN || ACT == ACT_INT8_TOKEN || ACT == ACT_FP8_GROUP) {
        float amax = 0.0f;
        for (int k = begin + tid; k < end; k += THREADS) amax = fmaxf(amax, fabsf(row[order != nullptr ? order[k] : k]));
        amax = warp_max(amax);
        if (lane == 0) partial[warp] = amax;
        __syncthreads();
        amax = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, partial[w]);
        s = fmaxf(amax / (ACT == ACT_INT8_TOKEN ? INT8_MAX_VALUE : FP8_MAX), MIN_SCALE);
    }
    for (int k = begin + tid; k < end; k += THREADS) {
        float value = row[order != nullptr ? order[k] : k];
        if (ACT == ACT_INT8_TOKEN) value = fminf(fmaxf(rintf(value / s), -INT8_MAX_VALUE), INT8_MAX_VALUE) * s;
        else if (ACT != ACT_NONE) value = round_e4m3(value / s) * s;
        out[(size_t)r * K + k] = to_bf16(value);
    }
}

// The E4M3 code of an E4M3 value (as round_e4m3 returns).
__device__ __forceinline__ unsigned e4m3_code_of(float value) {
    const float magnitude = fabsf(value);
    const unsigned bits = __float_as_uint(magnitude);
    const unsigned code = magnitude < 0.015625f ? (unsigned)(magnitude * 512.0f)
                                                : ((((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u));
    return code | ((__float_as_uint(value) >> 24) & 0x80u);   // the sign bit, -0.0's too
}

// codes[r, k] = E4M3 code of x[r, order[k]] / scales[r] (order null: k), the FP8 input of a prompt
// product on FP8 tensor cores: ACT_FP8_TOKEN computes scales[r] = max|row| / 448, ACT_FP8_TENSOR
// writes input_scale. Grid rows blocks of THREADS threads.
template <int ACT, typename INPUT>
__global__ void __launch_bounds__(THREADS) quantize_rows_fp8(
    const INPUT* __restrict__ x, const int* __restrict__ order, float input_scale, unsigned char* __restrict__ codes,
    float* __restrict__ scales, int K) {
    __shared__ float partial[WARPS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, r = blockIdx.x;
    const INPUT* row = x + (size_t)r * K;
    unsigned char* row_codes = codes + (size_t)r * K;
    // Rows in their own order, 16-byte aligned, codes 8-byte aligned: 8 values a load, 8 codes a store.
    const bool chunked = order == nullptr && K % 8 == 0 && reinterpret_cast<size_t>(row) % 16 == 0
                         && reinterpret_cast<size_t>(row_codes) % 8 == 0;
    float s = input_scale;
    if (ACT == ACT_FP8_TOKEN) {
        float amax = 0.0f;
        if (chunked) {
            #pragma unroll 4
            for (int c = tid; c < K / 8; c += THREADS) {
                float v[8];
                load_eight(row, c, v);
                #pragma unroll
                for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
            }
        } else {
            for (int k = tid; k < K; k += THREADS)
                amax = fmaxf(amax, fabsf(input_value(row, order != nullptr ? order[k] : k)));
        }
        amax = warp_max(amax);
        if (lane == 0) partial[warp] = amax;
        __syncthreads();
        amax = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, partial[w]);
        s = fmaxf(amax / FP8_MAX, MIN_SCALE);
    }
    if (chunked) {
        #pragma unroll 2
        for (int c = tid; c < K / 8; c += THREADS) {
            float v[8];
            load_eight(row, c, v);
            const uint2 pairs = make_uint2(e4m3x2_of(v[0] / s, v[1] / s) | (e4m3x2_of(v[2] / s, v[3] / s) << 16),
                                           e4m3x2_of(v[4] / s, v[5] / s) | (e4m3x2_of(v[6] / s, v[7] / s) << 16));
            reinterpret_cast<uint2*>(row_codes)[c] = pairs;
        }
    } else {
        for (int k = tid; k < K; k += THREADS)
            row_codes[k] = (unsigned char)e4m3_code_of(round_e4m3(input_value(row, order != nullptr ? order[k] : k) / s));
    }
    if (tid == 0) scales[r] = s;
}

// codes[r, c] = E4M3 code of a[r, c] / scales[r], a = bf16(silu(gate) * up) of a product's bf16 rows
// gate_up [rows, 2 * width] (gate = its first width values, up the rest), rounded as silu_and_mul rounds
// it: silu_and_mul then quantize_rows_fp8 of its bf16 rows (the same codes and scales, ACT_FP8_TOKEN's
// scales[r] = max|a[r]| / 448, ACT_FP8_TENSOR's input_scale) in one pass, the activations kept in
// dynamic shared memory (width * 2 bytes). Grid rows blocks of THREADS threads; width a multiple of 8,
// gate_up and codes 16-byte aligned.
template <int ACT>
__global__ void __launch_bounds__(THREADS) silu_and_mul_fp8_rows(
    const uint4* __restrict__ gate_up, float input_scale, unsigned char* __restrict__ codes,
    float* __restrict__ scales, int width) {
    DYNAMIC_SHARED;
    uint4* activations = reinterpret_cast<uint4*>(dynamic_shared);   // [width / 8]: the row's bf16 values, 8 a word
    __shared__ float partial[WARPS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, r = blockIdx.x, words = width / 8;
    const uint4* gate = gate_up + (size_t)r * 2 * words;
    float amax = 0.0f;
    #pragma unroll 2
    for (int c = tid; c < words; c += THREADS) {
        const uint4 g = __ldg(gate + c), u = __ldg(gate + words + c);
        const uint4 a = make_uint4(silu_mul_pair(g.x, u.x), silu_mul_pair(g.y, u.y), silu_mul_pair(g.z, u.z),
                                   silu_mul_pair(g.w, u.w));
        activations[c] = a;
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(bf16_low(a.x)), fabsf(bf16_high(a.x))),
                                 fmaxf(fabsf(bf16_low(a.y)), fabsf(bf16_high(a.y)))));
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(bf16_low(a.z)), fabsf(bf16_high(a.z))),
                                 fmaxf(fabsf(bf16_low(a.w)), fabsf(bf16_high(a.w)))));
    }
    float s = input_scale;
    if (ACT == ACT_FP8_TOKEN) {
        amax = warp_max(amax);
        if (lane == 0) partial[warp] = amax;
    }
    __syncthreads();   // (also: every word staged before any is read below)
    if (ACT == ACT_FP8_TOKEN) {
        amax = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, partial[w]);
        s = fmaxf(amax / FP8_MAX, MIN_SCALE);
    }
    uint2* row_codes = reinterpret_cast<uint2*>(codes + (size_t)r * width);
    for (int c = tid; c < words; c += THREADS) {
        const uint4 a = activations[c];
        const float v[8] = {bf16_low(a.x), bf16_high(a.x), bf16_low(a.y), bf16_high(a.y),
                            bf16_low(a.z), bf16_high(a.z), bf16_low(a.w), bf16_high(a.w)};
        row_codes[c] = make_uint2(e4m3x2_of(v[0] / s, v[1] / s) | (e4m3x2_of(v[2] / s, v[3] / s) << 16),
                                  e4m3x2_of(v[4] / s, v[5] / s) | (e4m3x2_of(v[6] / s, v[7] / s) << 16));
    }
    if (tid == 0) scales[r] = s;
}

// residual[r, :] <- x[r, :] (+ residual[r, :]) (float32); codes[r, k] = E4M3 code of a[r, k] / scales[r],
// a = bf16(residual[r, :] * inv * (offset + weight)), inv = 1 / sqrt(mean(residual[r, :]^2) + eps): the
// norm of rmsnorm_residual_words (the same sums in the same order) and then quantize_rows_fp8 of its
// bf16 rows (ACT_FP8_TOKEN's scales[r] = max|a[r]| / 448, ACT_FP8_TENSOR's input_scale) in one pass, the
// row kept in registers, no bf16 rows written. Grid rows blocks of THREADS threads; x, residual
// float32 [rows, hidden], weight bf16 bits [hidden], codes [rows, hidden] 4-byte aligned; hidden a
// multiple of 4 and at most THREADS * NORM_FP8_QUADS * 4.
template <int ACT>
__global__ void __launch_bounds__(THREADS) rmsnorm_fp8_rows(
    const float* __restrict__ x, float* __restrict__ residual, const unsigned short* __restrict__ weight, float eps,
    float offset, int add_residual, float input_scale, unsigned char* __restrict__ codes, float* __restrict__ scales,
    int hidden) {
    __shared__ float partial[WARPS];
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, quads = hidden / 4;
    const float4* in = reinterpret_cast<const float4*>(x) + (size_t)r * quads;
    float4* sums = reinterpret_cast<float4*>(residual) + (size_t)r * quads;
    float4 kept[NORM_FP8_QUADS];
    float squares = residual_row_sums<NORM_FP8_QUADS>(in, sums, add_residual, quads, tid, THREADS, kept);
    squares = warp_sum(squares);
    if (lane == 0) partial[warp] = squares;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) total += partial[w];
    const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
    // The normed values, rounded to bf16 as the norm writes them, in place of the sums.
    const uint2* gains = reinterpret_cast<const uint2*>(weight);
    float amax = 0.0f;
    #pragma unroll
    for (int j = 0; j < NORM_FP8_QUADS; ++j) {
        const int quad = tid + j * THREADS;
        if (quad < quads) {
            const float4 value = kept[j];
            const uint2 gain = __ldg(gains + quad);
            float4 normed;
            normed.x = bf16_low(to_bf16(value.x * inv * (offset + bf16_low(gain.x))));
            normed.y = bf16_low(to_bf16(value.y * inv * (offset + bf16_high(gain.x))));
            normed.z = bf16_low(to_bf16(value.z * inv * (offset + bf16_low(gain.y))));
            normed.w = bf16_low(to_bf16(value.w * inv * (offset + bf16_high(gain.y))));
            kept[j] = normed;
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(normed.x), fabsf(normed.y)), fmaxf(fabsf(normed.z), fabsf(normed.w))));
        }
    }
    float s = input_scale;
    if (ACT == ACT_FP8_TOKEN) {
        amax = warp_max(amax);
        __syncthreads();   // every warp has read the sums of squares
        if (lane == 0) partial[warp] = amax;
        __syncthreads();
        amax = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, partial[w]);
        s = fmaxf(amax / FP8_MAX, MIN_SCALE);
    }
    unsigned* row_codes = reinterpret_cast<unsigned*>(codes + (size_t)r * hidden);
    #pragma unroll
    for (int j = 0; j < NORM_FP8_QUADS; ++j) {
        const int quad = tid + j * THREADS;
        if (quad < quads) {
            const float4 v = kept[j];
            row_codes[quad] = e4m3x2_of(v.x / s, v.y / s) | (e4m3x2_of(v.z / s, v.w / s) << 16);
        }
    }
    if (tid == 0) scales[r] = s;
}

// out[n, k] = bf16((code - zero) * scale) of every weight, a thread per chunk of 8 (K a multiple of 8).
template <int CODES>
__global__ void dequantize_bf16(const unsigned char* __restrict__ codes, const float* __restrict__ scales,
                                const float* __restrict__ zeros, int block_rows, int block_columns, int scale_columns,
                                uint4* __restrict__ out, int N, int K) {
    const QuantizedOperand w = {codes, scales, zeros, block_rows, block_columns, scale_columns};
    const size_t chunks = (size_t)N * (K / 8);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (size_t)gridDim.x * blockDim.x) {
        const size_t column = i / (size_t)(K / 8);
        const int chunk = (int)(i - column * (size_t)(K / 8));
        out[i] = weight_chunk<CODES>(w, column, chunk, K, true);
    }
}

__device__ __forceinline__ bool quads_of(const float* out, const float* column_scales, int columns) {
    return columns % 4 == 0 && reinterpret_cast<size_t>(out) % 16 == 0 && reinterpret_cast<size_t>(column_scales) % 16 == 0;
}

// out[r, c] = out[r, c] * row_scales[r] * column_scales[c] (the product rounded after each factor),
// in place: the scales of an FP8 tensor-core product. Threads over a row's columns, 4 at a time where
// every row and the column scales start on 16 bytes (columns a multiple of 4), one at a time otherwise
// (the launch sizes the grid for each); blocks over the rows in a grid-stride loop (gridDim.y rows at
// once), no division per element.
extern "C" __global__ void __launch_bounds__(THREADS) scale_product(
    float* __restrict__ out, const float* __restrict__ row_scales, const float* __restrict__ column_scales, int rows,
    int columns) {
    const int t = blockIdx.x * THREADS + threadIdx.x;
    if (quads_of(out, column_scales, columns)) {
        if (t >= columns / 4) return;
        const float4 c = reinterpret_cast<const float4*>(column_scales)[t];
        #pragma unroll 4
        for (int r = blockIdx.y; r < rows; r += gridDim.y) {
            const float s = row_scales[r];
            float4* at = reinterpret_cast<float4*>(out + (size_t)r * columns) + t;
            float4 v = *at;
            v.x = v.x * s * c.x; v.y = v.y * s * c.y; v.z = v.z * s * c.z; v.w = v.w * s * c.w;
            *at = v;
        }
    } else {
        if (t >= columns) return;
        const float c = column_scales[t];
        for (int r = blockIdx.y; r < rows; r += gridDim.y) {
            float* at = out + (size_t)r * columns + t;
            *at = *at * row_scales[r] * c;
        }
    }
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return INSTRUCTIONS + MMA_BF16 + F16_PRIMITIVES + CONSTANTS + HELPERS + DEVICE_FUNCTIONS + KERNELS


def row_tiles(rows: int) -> int:
    return next(t for t in ROW_TILES if 8 * t >= rows)


def activation_groups(weight: QuantizedWeight) -> int:
    """The activation scales a row of the prologue computes (1 per row; per group for ``fp8_group``)."""
    inner = weight.shape[1]
    return -(-inner // weight.activation_group) if weight.activations == "fp8_group" else 1


def shared_bytes(rows: int, weight: QuantizedWeight, split: int, shared_stage: bool = True) -> int:
    """Dynamic shared memory of a launch: the staged rows and the activation scales (when the
    prologue stages them, ``shared_stage``), the split's partial products."""
    staged = rows * -(-weight.shape[1] // 64) * 128 if shared_stage else 0
    scales = -(-rows * activation_groups(weight) * 4 // 16) * 16 if shared_stage else 0
    return staged + scales + (REDUCE_BYTES * row_tiles(rows) if split > 1 else 0)


def shared_stage(rows: int, weight: QuantizedWeight, multiprocessors: int = 132, split: int | None = None) -> bool:
    """Whether the prologue stages the rows in shared memory, where they fit beside the largest
    split's partial products: one row, or up to :data:`SHARED_STAGE_MAX_ROWS` when the launch's
    split (:func:`plan`) is 1. Otherwise :func:`stage_rows` stages them once in a global workspace
    first. Every block's prologue reads and quantizes all the rows: a cost that grows with the rows
    and is paid once per tile of columns when the tiles are split (many short blocks), once per
    several tiles when they are not (each block then loops over its tiles with the rows at hand)."""
    if shared_bytes(rows, weight, SPLITS[-1]) > MAX_SHARED_BYTES:
        return False
    return rows == 1 or (rows <= SHARED_STAGE_MAX_ROWS and plan(weight.shape[0], multiprocessors, split)[0] == 1)


def workspace_shapes(rows: int, weight: QuantizedWeight) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of the global workspace of rows that do not fit shared memory: the staged rows
    (uint32 ``[rows, ceil(K / 64) * 32]``, chunks of 8 bf16 or f16 values) and the activation scales
    (float32 ``[rows, groups]``)."""
    return (rows, -(-weight.shape[1] // 64) * 32), (rows, activation_groups(weight))


def supports(rows: int, weight: QuantizedWeight) -> bool:
    """Whether the decode GEMV serves ``rows`` rows of a product with ``weight``: at most
    :data:`MAX_ROWS` rows, the inner size a multiple of 32, column blocks of whole chunks of 8."""
    out, inner = weight.shape
    return 0 < rows <= MAX_ROWS and inner % 32 == 0 and weight.block[1] % 8 == 0 and out > 0


def plan(columns: int, multiprocessors: int, split: int | None = None) -> tuple[int, int]:
    """``(split, blocks)``: the smallest split whose tiles give every multiprocessor a block's
    worth of warps, and the blocks that cover the tiles (at most two a multiprocessor without a
    split: the warps loop)."""
    tiles = -(-columns // TILE)
    if split is None:
        split = next((s for s in SPLITS if tiles * s >= multiprocessors * WARPS), SPLITS[-1])
    blocks = -(-tiles // (WARPS // split))
    return split, (min(blocks, 2 * multiprocessors) if split == 1 else blocks)


def exact_path(weight: QuantizedWeight) -> bool:
    """Whether a launch takes the exact products (unscaled weights, the inputs' codes, the scales
    applied to each step's sums): the weight's column blocks and the inputs' groups whole steps of
    32 columns. Otherwise each weight is scaled into bf16 before the product."""
    return weight.block[1] % 32 == 0 and (weight.activations != "fp8_group" or weight.activation_group % 32 == 0)


def load_chunks(weight: QuantizedWeight, exact: bool) -> int:
    """The chunks of 8 codes a lane loads at once (:data:`LOAD_CHUNKS`): 16 bytes (2 chunks of 8-bit
    codes, 4 of 4-bit ones), fewer on the exact path where the scales change more often: there the
    four lanes' loads of a column, 32 input columns a chunk each, join their sums before one weight
    scale (and one input scale) applies, so a scale block (and an input group) must hold them."""
    most = 4 if weight.codes_format in ("int4", "mxfp4") else 2
    if not exact:
        return most
    return next(n for n in LOAD_CHUNKS if n <= most and weight.block[1] % (32 * n) == 0
                and (weight.activations != "fp8_group" or weight.activation_group % (32 * n) == 0))


def input_type(bf16_input: bool) -> str:
    """The kernels' ``INPUT``: the input rows as float32, or as bf16 bits."""
    return "unsigned short" if bf16_input else "float"


def kernel_name(codes: str, activations: str, split: int, tiles: int, exact: bool = True,
                shared: bool = True, load: int = 1, bf16_input: bool = False) -> str:
    return (f"quantized_gemv<{CODES[codes]}, {ACTIVATIONS[activations]}, {split}, {tiles}, "
            f"{'true' if exact else 'false'}, {'true' if shared else 'false'}, {load}, {input_type(bf16_input)}>")


def stage_rows_name(activations: str, exact: bool, bf16_input: bool = False) -> str:
    """The staging kernel of a launch's rows: its chunks hold f16 codes on the exact path over
    quantized inputs, bf16 values otherwise."""
    f16 = exact and activations != "weight_only"
    return f"stage_rows<{ACTIVATIONS[activations]}, {'true' if f16 else 'false'}, {input_type(bf16_input)}>"


# ------------------------------------------------------------------------------ reference


def round_bf16(values: np.ndarray) -> np.ndarray:
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    return bf16_to_float32(float32_to_bf16(np.asarray(values, dtype=np.float32)))


def quantized_gemv_reference(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray | None = None,
                             exact: bool | None = None) -> np.ndarray:
    """float32 ``[rows, N]``: what a launch computes, from host arrays: the input gathered and
    quantized as :func:`~metrale.kernels.quantized.quantized_linear_reference` does; on the exact
    path (:func:`exact_path`) times the exact weights (a weight-only product's input rounded to
    bf16), otherwise the input and every dequantized weight rounded to bf16; float32 sums.
    ``exact`` overrides :func:`exact_path`'s choice (a launch of the other path)."""
    x = np.asarray(x, dtype=np.float32)
    if weight.input_order is not None:
        x = x[:, np.asarray(weight.input_order)]
    if exact_path(weight) if exact is None else exact:
        staged = quantize_activations(x, weight) if weight.activations != "weight_only" else round_bf16(x)
        y = staged.astype(np.float64) @ dequantize(weight, stored_order=True).astype(np.float64).T
        return (y + bias if bias is not None else y).astype(np.float32)
    staged = round_bf16(quantize_activations(x, weight))
    y = staged @ round_bf16(dequantize(weight, stored_order=True)).T
    return (y + bias if bias is not None else y).astype(np.float32)


def stage_activations_reference(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """float32 ``[rows, K]`` holding the bf16 values :func:`stage_activations` writes."""
    x = np.asarray(x, dtype=np.float32)
    if weight.input_order is not None:
        x = x[:, np.asarray(weight.input_order)]
    return round_bf16(quantize_activations(x, weight))


def dequantize_bf16_reference(weight: QuantizedWeight) -> np.ndarray:
    """float32 ``[N, K]`` holding the bf16 values :func:`dequantize_bf16` writes (stored column order)."""
    return round_bf16(dequantize(weight, stored_order=True))


# ------------------------------------------------------------------------------- launchers

_modules: dict[str, Any] = {}


def _function(name: str) -> Any:
    function = _modules.get(name)
    if function is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=(name,))
        function = _modules[name] = module.get_function(name)
    return function


def _operand(weight: QuantizedWeight) -> tuple:
    """The kernels' weight arguments: codes, scales, zero points (a null pointer when None), the
    rows and columns a scale covers, the scales' columns."""
    null = np.uint64(0)
    return (weight.codes, weight.scales, weight.zeros if weight.zeros is not None else null, np.int32(weight.block[0]),
            np.int32(weight.block[1]), np.int32(weight.scales.shape[1]))


def check_weight(name: str, weight: QuantizedWeight) -> None:
    """Raise :class:`~metrale.errors.KernelArgumentError` unless the weight's device arrays have the
    layout's dtypes and shapes, 16-byte aligned codes."""
    out, inner = weight.shape
    columns = inner // 2 if weight.codes_format in ("int4", "mxfp4") else inner
    check_array(name, "codes", weight.codes, np.uint8, (out, columns))
    check_array(name, "scales", weight.scales, np.float32, tuple(weight.scales.shape))
    if weight.zeros is not None:
        check_array(name, "zeros", weight.zeros, np.float32, tuple(weight.scales.shape))
    if weight.input_order is not None:
        check_array(name, "input_order", weight.input_order, np.int32, (inner,))
    if not aligned(weight.codes):
        raise KernelArgumentError(f"{name}: the codes do not start at a 16-byte boundary")


def quantized_gemv(x: DeviceArray, weight: QuantizedWeight, out: DeviceArray, stream: Any, *,
                   bias: DeviceArray | None = None, multiprocessors: int = 132, split: int | None = None,
                   workspace: tuple[DeviceArray, DeviceArray] | None = None) -> DeviceArray:
    """``out <- quantize(x) W^T (+ bias)`` (the module docstring) on ``stream``: ``x`` float32 or bf16
    bits (uint16) ``[rows, K]``, ``out`` float32 ``[rows, N]``. Rows the prologue does not take
    (:func:`shared_stage`) are staged first into ``workspace`` (the arrays of
    :func:`workspace_shapes`). Raises
    :class:`~metrale.errors.KernelArgumentError` for what it does not serve (:func:`supports`)."""
    name = f"quantized_gemv ({weight.codes_format}, {weight.activations})"
    check_weight(name, weight)
    rows = x.shape[0] if getattr(x, "ndim", 0) == 2 else -1
    columns, inner = weight.shape
    bf16_input = getattr(x, "dtype", None) == np.uint16
    check_array(name, "x", x, np.uint16 if bf16_input else np.float32, (rows, inner))
    check_array(name, "out", out, np.float32, (rows, columns))
    if bias is not None:
        check_array(name, "bias", bias, np.float32, (columns,))
    if not supports(rows, weight):
        raise KernelArgumentError(f"{name}: {rows} rows of inner size {inner}, column blocks of {weight.block[1]}, "
                                  f"are not served (1 to {MAX_ROWS} rows, the inner size a multiple of 32, "
                                  "column blocks a multiple of 8)")
    null = np.uint64(0)
    order = weight.input_order if weight.input_order is not None else null
    input_scale = np.float32(float(weight.input_scale) if weight.input_scale is not None else 1.0)
    exact, shared = exact_path(weight), shared_stage(rows, weight, multiprocessors, split)
    staged: Any = null
    scales: Any = null
    if not shared:
        if workspace is None:
            raise KernelArgumentError(f"{name}: {rows} rows of inner size {inner} need a staging workspace")
        staged, scales = workspace
        staged_shape, scales_shape = workspace_shapes(rows, weight)
        check_array(name, "workspace staged", staged, np.uint32, staged_shape)
        check_array(name, "workspace scales", scales, np.float32, scales_shape)
        launch(_function(stage_rows_name(weight.activations, exact, bf16_input)), (rows,), (THREADS,), (
            x, order, input_scale, np.int32(weight.activation_group), staged, scales, np.int32(inner),
        ), 0, stream, dependent=False)
    chosen, blocks = plan(columns, multiprocessors, split)
    function = _function(kernel_name(weight.codes_format, weight.activations, chosen, row_tiles(rows), exact, shared,
                                     load_chunks(weight, exact), bf16_input))
    stage = shared_bytes(rows, weight, chosen, shared)
    if stage > 48 * 1024:
        function.max_dynamic_shared_size_bytes = stage
    launch(function, (blocks,), (THREADS,), (
        x, order, input_scale, np.int32(weight.activation_group), staged, scales, *_operand(weight),
        bias if bias is not None else null, out, np.int32(rows), np.int32(inner), np.int32(columns),
    ), stage, stream, dependent=False)
    return out


def fp8_tensor_core_path(weight: QuantizedWeight) -> bool:
    """Whether a prompt product with ``weight`` runs on FP8 tensor cores: FP8 weights and inputs
    (per token or per tensor) whose scales are constant along the inner size (per channel or per
    tensor: they factor out of each sum, applied to the product's rows and columns after), no
    act-order, the inner size a multiple of 16 and the width of 4."""
    out, inner = weight.shape
    return (weight.codes_format == "fp8" and weight.activations in ("fp8_token", "fp8_tensor")
            and weight.scales.shape[1] == 1 and weight.input_order is None and inner % 16 == 0 and out % 4 == 0)


def quantize_rows_fp8(x: DeviceArray, weight: QuantizedWeight, codes: DeviceArray, scales: DeviceArray,
                      stream: Any) -> DeviceArray:
    """``codes`` (uint8 ``[rows, K]``) and ``scales`` (float32 ``[rows]``) <- ``x`` (float32, or bf16
    bits: uint16) quantized to FP8 E4M3 per row (``fp8_token``) or with the weight's static input scale (``fp8_tensor``)."""
    name = f"quantize_rows_fp8 ({weight.activations})"
    if weight.activations not in ("fp8_token", "fp8_tensor"):
        raise KernelArgumentError(f"{name}: only per-token and per-tensor FP8 inputs are written as codes")
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    return _quantize_rows(name, x, weight.shape[1], weight.activations, weight.input_order, input_scale, codes, scales,
                          stream)


#: The widest activation row :func:`silu_and_mul_fp8_rows` keeps in shared memory (bf16, beside the
#: block's float per warp).
SILU_FP8_MAX_WIDTH = (MAX_SHARED_BYTES - 4 * WARPS) // 16 * 8


def silu_and_mul_fp8_rows(gate_up: DeviceArray, weight: QuantizedWeight, codes: DeviceArray, scales: DeviceArray,
                          stream: Any) -> DeviceArray:
    """``codes`` (uint8 ``[rows, I]``) and ``scales`` (float32 ``[rows]``) <- the FP8 input of the
    product with ``weight`` (``[N, I]``, per-token or per-tensor FP8 inputs) of ``silu_and_mul(gate_up)``
    (bf16 bits ``[rows, 2 I]``), without the bf16 activations in between: the codes and scales
    :func:`~metrale.kernels.activation.silu_and_mul_words` then :func:`quantize_rows_fp8` give."""
    name = f"silu_and_mul_fp8_rows ({weight.activations})"
    if weight.activations not in ("fp8_token", "fp8_tensor"):
        raise KernelArgumentError(f"{name}: only per-token and per-tensor FP8 inputs are written as codes")
    rows, width = (gate_up.shape[0] if getattr(gate_up, "ndim", 0) == 2 else -1), weight.shape[1]
    check_array(name, "gate_up", gate_up, np.uint16, (rows, 2 * width))
    check_array(name, "codes", codes, np.uint8, (rows, width))
    check_array(name, "scales", scales, np.float32, (rows,))
    if not serves_silu_fp8_rows(gate_up, weight) or not aligned(codes):
        raise KernelArgumentError(f"{name}: takes a 16-byte aligned gate_up whose halves are multiples of 8 values "
                                  f"(at most {SILU_FP8_MAX_WIDTH} of them) and 16-byte aligned codes")
    if rows == 0:
        return codes
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    function = _function(f"silu_and_mul_fp8_rows<{ACTIVATIONS[weight.activations]}>")
    shared = width * 2
    if shared > 48 * 1024:
        function.max_dynamic_shared_size_bytes = shared
    launch(function, (rows,), (THREADS,), (gate_up, np.float32(input_scale), codes, scales, np.int32(width)), shared,
           stream, dependent=False)
    return codes


def serves_silu_fp8_rows(gate_up: Any, weight: QuantizedWeight) -> bool:
    """Whether :func:`silu_and_mul_fp8_rows` takes ``gate_up`` into the product with ``weight``: per-token or
    per-tensor FP8 inputs of an inner size that is a multiple of 8 whose bf16 row fits shared memory,
    the rows 16-byte aligned bf16 bits."""
    width = weight.shape[1]
    return (weight.activations in ("fp8_token", "fp8_tensor") and weight.input_order is None and width % 8 == 0
            and width <= SILU_FP8_MAX_WIDTH and getattr(gate_up, "dtype", None) == np.uint16
            and tuple(gate_up.shape[1:]) == (2 * width,) and aligned(gate_up))


#: The widest row :func:`rmsnorm_fp8_rows` takes (each thread keeps :data:`NORM_FP8_QUADS` float4 words of it).
NORM_FP8_MAX_WIDTH = THREADS * NORM_FP8_QUADS * 4


def rmsnorm_fp8_rows(x: DeviceArray, residual: DeviceArray, norm_weight: DeviceArray, eps: float, offset: float,
                     add_residual: bool, weight: QuantizedWeight, codes: DeviceArray, scales: DeviceArray,
                     stream: Any) -> DeviceArray:
    """``residual`` (float32 ``[rows, H]``) <- ``x`` (+ ``residual`` where ``add_residual``), in place,
    and ``codes`` (uint8 ``[rows, H]``) and ``scales`` (float32 ``[rows]``) <- the FP8 input of the
    product with ``weight`` (``[N, H]``, per-token or per-tensor FP8 inputs) of that sum's RMSNorm
    (``norm_weight`` bf16 bits ``[H]``, gains ``offset + weight``), without the bf16 normed rows in
    between: the sums, codes and scales :func:`~metrale.kernels.rmsnorm.rmsnorm_residual_words` then
    :func:`quantize_rows_fp8` give."""
    name = f"rmsnorm_fp8_rows ({weight.activations})"
    if weight.activations not in ("fp8_token", "fp8_tensor"):
        raise KernelArgumentError(f"{name}: only per-token and per-tensor FP8 inputs are written as codes")
    rows, hidden = (x.shape[0], weight.shape[1]) if getattr(x, "ndim", 0) == 2 else (-1, weight.shape[1])
    check_array(name, "x", x, np.float32, (rows, hidden))
    check_array(name, "residual", residual, np.float32, (rows, hidden))
    check_array(name, "norm_weight", norm_weight, np.uint16, (hidden,))
    check_array(name, "codes", codes, np.uint8, (rows, hidden))
    check_array(name, "scales", scales, np.float32, (rows,))
    if not serves_rmsnorm_fp8_rows(x, norm_weight, weight) or not aligned(residual) or not aligned(codes):
        raise KernelArgumentError(f"{name}: takes 16-byte aligned rows of a multiple of 4 values (at most "
                                  f"{NORM_FP8_MAX_WIDTH}), norm weights and codes")
    if rows == 0:
        return codes
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    launch(_function(f"rmsnorm_fp8_rows<{ACTIVATIONS[weight.activations]}>"), (rows,), (THREADS,), (
        x, residual, norm_weight, np.float32(eps), np.float32(offset), np.int32(bool(add_residual)),
        np.float32(input_scale), codes, scales, np.int32(hidden)), 0, stream, dependent=False)
    return codes


def serves_rmsnorm_fp8_rows(x: Any, norm_weight: Any, weight: QuantizedWeight) -> bool:
    """Whether :func:`rmsnorm_fp8_rows` takes the norm of ``x`` into the product with ``weight``:
    per-token or per-tensor FP8 inputs in the weight's own column order, float32 rows of a multiple
    of 4 values (at most :data:`NORM_FP8_MAX_WIDTH`), bf16 norm weights, 16-byte aligned."""
    width = weight.shape[1]
    return (weight.activations in ("fp8_token", "fp8_tensor") and weight.input_order is None and width % 4 == 0
            and 0 < width <= NORM_FP8_MAX_WIDTH and getattr(x, "dtype", None) == np.float32
            and getattr(x, "ndim", 0) == 2 and x.shape[1] == width and aligned(x)
            and getattr(norm_weight, "dtype", None) == np.uint16 and aligned(norm_weight))


#: Rows of a ``scale_product`` launch's grid (each block takes every such row in turn).
SCALE_GRID_ROWS = 1024


def scale_product(out: DeviceArray, row_scales: DeviceArray, column_scales: DeviceArray, stream: Any) -> DeviceArray:
    """``out[r, c] <- out[r, c] * row_scales[r] * column_scales[c]`` in place, in one pass: the scales
    of an FP8 tensor-core product (float32 ``out [rows, columns]``, ``row_scales [rows]``,
    ``column_scales [columns]``), rounded as two passes, rows first, would round them."""
    op = "scale_product"
    check_array(op, "out", out, np.float32, ndim=2)
    rows, columns = out.shape
    check_array(op, "row_scales", row_scales, np.float32, (rows,))
    check_array(op, "column_scales", column_scales, np.float32, (columns,))
    if rows == 0 or columns == 0:
        return out
    quads = columns % 4 == 0 and aligned(out) and aligned(column_scales)   # as the kernel's quads_of decides
    threads_wide = columns // 4 if quads else columns
    grid = (-(-threads_wide // THREADS), min(rows, SCALE_GRID_ROWS))
    launch(_function("scale_product"), grid, (THREADS,),
           (out, row_scales, column_scales, np.int32(rows), np.int32(columns)), 0, stream, dependent=False)
    return out


def quantize_matrix_fp8(matrix: DeviceArray, codes: DeviceArray, scales: DeviceArray, stream: Any) -> DeviceArray:
    """``codes`` (uint8 ``[rows, K]``) and ``scales`` (float32 ``[rows]``) <- ``matrix`` (float32 ``[rows,
    K]``) as FP8 E4M3 with one scale a row, ``max |row| / 448``: the online quantization of a weight
    (:func:`~metrale.kernels.quantized.quantize_fp8_per_channel`), on the device."""
    inner = matrix.shape[1] if getattr(matrix, "ndim", 0) == 2 else -1
    return _quantize_rows("quantize_matrix_fp8", matrix, inner, "fp8_token", None, 1.0, codes, scales, stream)


def _quantize_rows(name: str, x: DeviceArray, inner: int, activations: str, order: Any, input_scale: float,
                   codes: DeviceArray, scales: DeviceArray, stream: Any) -> DeviceArray:
    rows = x.shape[0] if getattr(x, "ndim", 0) == 2 else -1
    bf16_input = getattr(x, "dtype", None) == np.uint16
    check_array(name, "x", x, np.uint16 if bf16_input else np.float32, (rows, inner))
    check_array(name, "codes", codes, np.uint8, (rows, inner))
    check_array(name, "scales", scales, np.float32, (rows,))
    if rows == 0:
        return codes
    function = _function(f"quantize_rows_fp8<{ACTIVATIONS[activations]}, {input_type(bf16_input)}>")
    launch(function, (rows,), (THREADS,), (
        x, order if order is not None else np.uint64(0), np.float32(input_scale), codes, scales, np.int32(inner)),
        0, stream, dependent=False)
    return codes


def stage_activations(x: DeviceArray, weight: QuantizedWeight, out: DeviceArray, stream: Any) -> DeviceArray:
    """``out`` (uint16 bf16 bits ``[rows, K]``) <- ``x`` (float32 ``[rows, K]``) in the weight's column
    order, quantized under its activation scheme: the input of a prompt product."""
    name = f"stage_activations ({weight.activations})"
    rows, inner = (x.shape[0], weight.shape[1]) if getattr(x, "ndim", 0) == 2 else (-1, weight.shape[1])
    check_array(name, "x", x, np.float32, (rows, inner))
    check_array(name, "out", out, np.uint16, (rows, inner))
    if weight.input_order is not None:
        check_array(name, "input_order", weight.input_order, np.int32, (inner,))
    if rows == 0:
        return out
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    function = _function(f"stage_activations<{ACTIVATIONS[weight.activations]}>")
    launch(function, (rows, activation_groups(weight)), (THREADS,), (
        x, weight.input_order if weight.input_order is not None else np.uint64(0), np.float32(input_scale),
        np.int32(weight.activation_group), out, np.int32(rows), np.int32(inner)), 0, stream, dependent=False)
    return out


def dequantize_bf16(weight: QuantizedWeight, out: DeviceArray, stream: Any) -> DeviceArray:
    """``out`` (uint16 bf16 bits ``[N, K]``) <- the weight's values in its stored column order."""
    name = f"dequantize_bf16 ({weight.codes_format})"
    check_weight(name, weight)
    columns, inner = weight.shape
    check_array(name, "out", out, np.uint16, (columns, inner))
    if inner % 8 or weight.block[1] % 8:
        raise KernelArgumentError(f"{name}: the inner size {inner} and column blocks {weight.block[1]} must be "
                                  "multiples of 8")
    function = _function(f"dequantize_bf16<{CODES[weight.codes_format]}>")
    chunks = columns * inner // 8
    launch(function, (min(-(-chunks // 256), 65535),), (256,),
           (*_operand(weight), out, np.int32(columns), np.int32(inner)), 0, stream, dependent=False)
    return out
