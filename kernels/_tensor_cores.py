"""CUDA C++ shared by the tensor-core kernels (compiled by NVRTC through CuPy): the bf16 header
and the ``mma.sync`` product every one of them is built on. A kernel's source starts with
:data:`MMA_BF16`."""

from __future__ import annotations

MMA_BF16 = r"""
#include <cuda_bf16.h>

// c[16x8] += a[16x16] * b[16x8]: a row-major, b column-major, bf16 in, float32 accumulate.
// Fragments (g = lane / 4, q = lane % 4): a0 (row g, k 2q, 2q + 1), a1 (row g + 8), a2 (row g,
// k 2q + 8, 2q + 9), a3 (row g + 8, k 2q + 8, 2q + 9); b0 (k 2q, 2q + 1, column g), b1 (k 2q + 8,
// 2q + 9); c0, c1 (row g, columns 2q, 2q + 1), c2, c3 (row g + 8).
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""
