"""CUDA C++ shared by the tensor-core kernels (compiled by NVRTC through CuPy): the bf16 header
and the ``mma.sync`` product every one of them is built on (a kernel's source starts with
:data:`MMA_BF16`), and the staging helpers of the kernels that stream tiles through shared memory
(:data:`STAGED_COPIES`, :data:`TRANSPOSED_LOAD`), each PTX instruction behind a small function or
macro so that the CPU emulation of the tests can replace them."""

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

#: ``cp.async`` copies and their groups, ``ldmatrix``, the bf16 packing and the dynamic shared memory.
STAGED_COPIES = r"""

#define DYNAMIC_SHARED extern __shared__ __align__(16) unsigned char dynamic_shared[]

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// 16 bytes from global to shared memory, bypassing L1; zeros instead when !valid (the source is
// then not read, but must still be a valid address).
__device__ __forceinline__ void copy_16(unsigned target, const void* source, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(target), "l"(source), "r"(bytes));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `pending` of this thread's committed copy groups are still in flight.
template <int pending>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(pending)); }

// Four 8x8 bf16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8 (16 bytes); register i of lane t gets row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1 of matrix i.
__device__ __forceinline__ void load_matrices(unsigned* fragment, unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
                 : "r"(address));
}

__device__ __forceinline__ unsigned pack_bf16(float low, float high) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<unsigned*>(&pair);
}
"""

#: ``ldmatrix.trans``: the B operand of ``P V`` from value rows staged as they are stored.
TRANSPOSED_LOAD = r"""// The same four matrices transposed: register i of lane t gets column t / 4, rows 2 (t % 4) and
// 2 (t % 4) + 1 of matrix i.
__device__ __forceinline__ void load_matrices_transposed(unsigned* fragment, unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
                 : "r"(address));
}

"""

#: The GPU's f16 tensor-core product and f16 packing (the CUDA emulation header has its own).
F16_PRIMITIVES = r"""
#include <cuda_fp16.h>

// mma_16x8x16 with f16 operands (fragments as for bf16).
__device__ __forceinline__ void mma_16x8x16_f16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two float32 values as f16 bits, round to nearest even (low half first).
__device__ __forceinline__ unsigned pack_f16(float low, float high) {
    const __half2 pair = __floats2half2_rn(low, high);
    return *reinterpret_cast<const unsigned*>(&pair);
}

// Two E4M3 codes (the low byte the first) as an f16 pair in one instruction: exact, every E4M3
// value is an f16 value (the NaN codes give NaN).
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned pair) {
    unsigned result;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(result) : "h"((unsigned short)pair));
    return result;
}

// a * b + c of two bf16 pairs, or of two f16 pairs (round to nearest even).
__device__ __forceinline__ unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned result;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(result) : "r"(a), "r"(b), "r"(c));
    return result;
}

// Two float32 values as E4M3 codes in one instruction, rounded to the nearest (ties to the even
// code) and saturated at +-448 (satfinite; NaN stays NaN): the low byte from `low`.
__device__ __forceinline__ unsigned e4m3x2_of(float low, float high) {
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(high), "f"(low));
    return pair;
}

__device__ __forceinline__ unsigned fma_f16x2(unsigned a, unsigned b, unsigned c) {
    unsigned result;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(result) : "r"(a), "r"(b), "r"(c));
    return result;
}
"""
