"""CUDA C++ helpers on bf16 words that the decode kernels share (the GEMVs of
:mod:`metrale.kernels.decode_gemv`, the MoE, Gated DeltaNet, LoRA, norm and activation kernels),
and the alignment their 16-byte loads need."""

from __future__ import annotations

from typing import Any

#: The bf16 conversions, the 8-wide bf16 dot product, the warp sum and a norm's first pass the
#: decode kernels share (:mod:`metrale.kernels.moe_decode`, :mod:`metrale.kernels.gdn_decode` too).
HELPERS = r"""
__device__ __forceinline__ float bf16_low(unsigned word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(unsigned word) { return __uint_as_float(word & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }

// float32 -> bf16 bits, round to nearest even; NaN stays NaN (metrale.kernels._device.float_to_bf16).
__device__ __forceinline__ unsigned short to_bf16(float value) {
    const unsigned word = __float_as_uint(value);
    if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (unsigned short)((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float dot8(const uint4 w, const uint4 x) {
    float sum = bf16_low(w.x) * bf16_low(x.x);
    sum += bf16_high(w.x) * bf16_high(x.x);
    sum += bf16_low(w.y) * bf16_low(x.y);
    sum += bf16_high(w.y) * bf16_high(x.y);
    sum += bf16_low(w.z) * bf16_low(x.z);
    sum += bf16_high(w.z) * bf16_high(x.z);
    sum += bf16_low(w.w) * bf16_low(x.w);
    sum += bf16_high(w.w) * bf16_high(x.w);
    return sum;
}

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// The first pass of a norm over a row kept in registers: kept[j] <- in[quad] (+ sums[quad] where
// add_residual), written back to sums[quad], for quad = tid + j * threads < quads; returns this
// thread's sum of the squares, its quads in order (rmsnorm_residual_words and rmsnorm_fp8_rows: the
// same sums in the same order).
template <int QUADS>
__device__ __forceinline__ float residual_row_sums(const float4* __restrict__ in, float4* __restrict__ sums,
                                                   int add_residual, int quads, int tid, int threads, float4* kept) {
#pragma unroll
    for (int j = 0; j < QUADS; ++j) {
        const int quad = tid + j * threads;
        if (quad < quads) {
            float4 value = in[quad];
            if (add_residual) {
                const float4 other = sums[quad];
                value.x += other.x; value.y += other.y; value.z += other.z; value.w += other.w;
            }
            kept[j] = value;
        }
    }
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < QUADS; ++j) {
        const int quad = tid + j * threads;
        if (quad < quads) {
            const float4 value = kept[j];
            sums[quad] = value;
            squares += value.x * value.x + value.y * value.y + value.z * value.z + value.w * value.w;
        }
    }
    return squares;
}

// bf16(silu(g) * u) for the two bf16 values of each word.
__device__ __forceinline__ unsigned silu_mul_pair(unsigned gate, unsigned up) {
    const float g0 = bf16_low(gate), g1 = bf16_high(gate);
    const float v0 = g0 / (1.0f + expf(-g0)) * bf16_low(up), v1 = g1 / (1.0f + expf(-g1)) * bf16_high(up);
    return (unsigned)to_bf16(v0) | ((unsigned)to_bf16(v1) << 16);
}
"""


def aligned(array: Any) -> bool:
    """Whether a device array starts at a 16-byte boundary (host arrays: always)."""
    pointer = getattr(getattr(array, "data", None), "ptr", None)
    return pointer is None or pointer % 16 == 0
