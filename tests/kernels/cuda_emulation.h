// The CUDA features of metrale.kernels.moe_grouped emulated on the host, so that its kernels run
// (slowly) without a GPU: one std::thread per CUDA thread, the blocks of a launch one after
// another. ldmatrix and mma.sync follow the fragment layouts of the PTX ISA; cp.async copies are
// queued per thread and land only when cp.async.wait_group requires them (or at once, with
// emu::defer_copies = 0), so a missing wait reads stale shared memory. Included in place of the
// module's INSTRUCTIONS (metrale.kernels.moe_grouped, metrale.kernels.attention_latent_mma).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static   // the blocks of a launch run one at a time
#define DYNAMIC_SHARED unsigned char* dynamic_shared = emu::dynamic_shared

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
using std::max;
using std::min;

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace emu {

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "emulation: %s\n", what);
    std::abort();
}

alignas(16) unsigned char dynamic_shared[256 * 1024];
std::barrier<>* block_barrier = nullptr;
std::vector<std::barrier<>*> warp_barriers;
struct Exchange { unsigned address[32]; unsigned a[32][4]; unsigned b[32][2]; float c[32][4]; };
std::vector<Exchange> exchange;   // what the lanes of each warp hand to a warp-wide instruction
int defer_copies = 1;

struct Copy { unsigned target; const unsigned char* source; bool valid; unsigned bytes = 16; };
thread_local std::deque<std::vector<Copy>> committed;   // oldest group first
thread_local std::vector<Copy> open_group;

inline void land(const Copy& copy) {
    if (copy.target % copy.bytes || copy.target + copy.bytes > sizeof(dynamic_shared)) fail("cp.async target out of place");
    if (reinterpret_cast<std::uintptr_t>(copy.source) % copy.bytes) fail("cp.async source not aligned to its size");
    if (copy.valid) std::memcpy(dynamic_shared + copy.target, copy.source, copy.bytes);
    else std::memset(dynamic_shared + copy.target, 0, copy.bytes);
}

inline int lane() { return threadIdx.x % 32; }
inline int warp() { return threadIdx.x / 32; }

inline float bf16_value(unsigned bits) {
    const unsigned word = (bits & 0xffffu) << 16;
    float value;
    std::memcpy(&value, &word, 4);
    return value;
}

inline unsigned bf16_round(float value) {
    unsigned word;
    std::memcpy(&word, &value, 4);
    if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (word + 0x7fffu + ((word >> 16) & 1u)) >> 16;
}

// kernel() on every thread of every block of grid x block (x only), one block at a time.
template <typename Kernel>
void launch(dim3 grid, dim3 block, Kernel kernel) {
    gridDim = grid;
    blockDim = block;
    const int threads = static_cast<int>(block.x);
    const int warps = (threads + 31) / 32;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            std::barrier<> barrier(threads);
            block_barrier = &barrier;
            std::vector<std::barrier<>*> per_warp;
            for (int w = 0; w < warps; ++w) per_warp.push_back(new std::barrier<>(std::min(32, threads - 32 * w)));
            warp_barriers = per_warp;
            exchange.assign(warps, Exchange{});
            std::memset(dynamic_shared, 0xff, sizeof(dynamic_shared));   // NaN in bf16 and float32: an unwritten read shows
            std::vector<std::thread> pool;
            for (int t = 0; t < threads; ++t) {
                pool.emplace_back([=] {
                    threadIdx.x = t;
                    blockIdx.x = bx;
                    blockIdx.y = by;
                    blockIdx.z = bz;
                    committed.clear();
                    open_group.clear();
                    kernel();
                    if (!open_group.empty()) fail("copies issued but never committed");
                    for (const auto& group : committed) {
                        if (!group.empty()) fail("copies still in flight when the thread ends");
                    }
                });
            }
            for (auto& thread : pool) thread.join();
            for (auto* barrier_of_warp : per_warp) delete barrier_of_warp;
        }
    }
    }
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

// Programmatic dependent launch (metrale.kernels._launch): the emulation runs one launch at a time.
inline void wait_for_producers() {}
inline void allow_dependents() {}

// The blocks of a launch run one after another: every write is visible to the next block.
inline void __threadfence() {}

inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barriers[emu::warp()]->arrive_and_wait(); }
inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST); }

inline float __int_as_float(int bits) {
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
}

inline unsigned __float_as_uint(float value) {
    unsigned bits;
    std::memcpy(&bits, &value, 4);
    return bits;
}

template <typename T> inline T __ldg(const T* pointer) { return *pointer; }

inline float __uint_as_float(unsigned bits) {
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
}

// __shfl_xor_sync over the whole warp: lane t gets the value of lane t ^ mask.
inline float __shfl_xor_sync(unsigned, float value, int mask) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    exchange.c[t][0] = value;
    barrier->arrive_and_wait();
    const float result = exchange.c[t ^ mask][0];
    barrier->arrive_and_wait();
    return result;
}

// __ballot_sync over the whole warp: bit t set where lane t's predicate holds.
inline unsigned __ballot_sync(unsigned, int predicate) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    exchange.address[emu::lane()] = predicate != 0;
    barrier->arrive_and_wait();
    const int lanes = std::min(32, static_cast<int>(blockDim.x) - 32 * emu::warp());
    unsigned bits = 0;
    for (int l = 0; l < lanes; ++l) bits |= exchange.address[l] << l;
    barrier->arrive_and_wait();
    return bits;
}

inline int __popc(unsigned value) { return __builtin_popcount(value); }
inline int __ffs(int value) { return __builtin_ffs(value); }

inline unsigned shared_address(const void* pointer) {
    const auto* byte = static_cast<const unsigned char*>(pointer);
    if (byte < emu::dynamic_shared || byte >= emu::dynamic_shared + sizeof(emu::dynamic_shared)) {
        emu::fail("shared_address of a pointer outside shared memory");
    }
    return static_cast<unsigned>(byte - emu::dynamic_shared);
}

inline void copy_16(unsigned target, const void* source, bool valid) {
    const emu::Copy copy{target, static_cast<const unsigned char*>(source), valid};
    if (emu::defer_copies) emu::open_group.push_back(copy);
    else emu::land(copy);
}

// cp.async.ca of 4 bytes (zeros when !valid), in the same groups as copy_16.
inline void copy_4(unsigned target, const void* source, bool valid) {
    const emu::Copy copy{target, static_cast<const unsigned char*>(source), valid, 4};
    if (emu::defer_copies) emu::open_group.push_back(copy);
    else emu::land(copy);
}

inline void commit_copies() {
    emu::committed.push_back(emu::open_group);
    emu::open_group.clear();
}

template <int pending>
inline void wait_copies() {
    while (static_cast<int>(emu::committed.size()) > pending) {
        for (const auto& copy : emu::committed.front()) emu::land(copy);
        emu::committed.pop_front();
    }
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane l addresses row l % 8 of matrix l / 8; register
// i of lane t holds row t / 4, elements 2 (t % 4) (low half) and 2 (t % 4) + 1 of matrix i.
inline void load_matrices(unsigned* fragment, unsigned address) {
    if (address % 16) emu::fail("ldmatrix row address not 16-byte aligned");
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    exchange.address[t] = address;
    barrier->arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        std::memcpy(&fragment[i], emu::dynamic_shared + exchange.address[i * 8 + t / 4] + 4 * (t % 4), 4);
    }
    barrier->arrive_and_wait();
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: the same addresses; register i of lane t holds
// column t / 4, rows 2 (t % 4) (low half) and 2 (t % 4) + 1 of matrix i.
inline void load_matrices_transposed(unsigned* fragment, unsigned address) {
    if (address % 16) emu::fail("ldmatrix row address not 16-byte aligned");
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    exchange.address[t] = address;
    barrier->arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        unsigned short low, high;
        std::memcpy(&low, emu::dynamic_shared + exchange.address[i * 8 + 2 * (t % 4)] + 2 * (t / 4), 2);
        std::memcpy(&high, emu::dynamic_shared + exchange.address[i * 8 + 2 * (t % 4) + 1] + 2 * (t / 4), 2);
        fragment[i] = low | (unsigned)high << 16;
    }
    barrier->arrive_and_wait();
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, g = lane / 4, q = lane % 4: A element i
// (register i / 2, half i % 2) at row g (i in 0, 1, 4, 5) or g + 8, column 2 q + (i & 1) (+ 8
// for i >= 4); B element i at row (k) 2 q + (i & 1) (+ 8 for i >= 2), column g; C element i at
// row g (i < 2) or g + 8, column 2 q + (i & 1).
inline void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    for (int i = 0; i < 4; ++i) {
        exchange.a[t][i] = a[i];
        exchange.c[t][i] = c[i];
    }
    exchange.b[t][0] = b[0];
    exchange.b[t][1] = b[1];
    barrier->arrive_and_wait();
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        for (int i = 0; i < 8; ++i) {
            const unsigned word = exchange.a[l][i / 2];
            const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
            A[row][2 * q + (i & 1) + (i >= 4 ? 8 : 0)] = emu::bf16_value(i % 2 ? word >> 16 : word);
        }
        for (int i = 0; i < 4; ++i) {
            const unsigned word = exchange.b[l][i / 2];
            B[2 * q + (i & 1) + (i >= 2 ? 8 : 0)][g] = emu::bf16_value(i % 2 ? word >> 16 : word);
        }
        for (int i = 0; i < 4; ++i) C[i < 2 ? g : g + 8][2 * q + (i & 1)] = exchange.c[l][i];
    }
    barrier->arrive_and_wait();
    const int g = t / 4, q = t % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? g : g + 8, column = 2 * q + (i & 1);
        float sum = C[row][column];
        for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][column];
        c[i] = sum;
    }
}

inline unsigned pack_bf16(float low, float high) { return emu::bf16_round(low) | (emu::bf16_round(high) << 16); }

namespace emu {

// IEEE f16 bits -> float32.
inline float f16_value(unsigned bits) {
    const unsigned sign = (bits >> 15) & 1u, exponent = (bits >> 10) & 31u, mantissa = bits & 1023u;
    float magnitude;
    if (exponent == 0) magnitude = std::ldexp((float)mantissa, -24);
    else if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
    else magnitude = std::ldexp((float)(mantissa | 1024u), (int)exponent - 25);
    return sign ? -magnitude : magnitude;
}

// float32 -> IEEE f16 bits, round to nearest even (overflow to infinity).
inline unsigned f16_round(float value) {
    const unsigned sign = std::signbit(value) ? 0x8000u : 0u;
    const float magnitude = std::fabs(value);
    if (std::isnan(value)) return 0x7e00u;
    if (magnitude == 0.0f) return sign;
    int exponent;
    std::frexp(magnitude, &exponent);   // magnitude = m * 2**exponent, m in [0.5, 1)
    exponent -= 1;                      // magnitude = m' * 2**exponent, m' in [1, 2)
    if (exponent < -14) return sign | (unsigned)std::nearbyint(std::ldexp(magnitude, 24));   // subnormal (or 2**-14)
    unsigned steps = (unsigned)std::nearbyint(std::ldexp(magnitude, 10 - exponent));   // 1024 .. 2048
    if (steps == 2048u) {
        steps = 1024u;
        exponent += 1;
    }
    if (exponent > 15) return sign | 0x7c00u;
    return sign | ((unsigned)(exponent + 15) << 10) | (steps - 1024u);
}

}  // namespace emu

inline unsigned pack_f16(float low, float high) { return emu::f16_round(low) | (emu::f16_round(high) << 16); }

namespace emu {

// The value of an E4M3 code (0x7f and 0xff are NaN).
inline float e4m3(unsigned code) {
    const unsigned exponent = (code >> 3) & 15u, mantissa = code & 7u;
    float magnitude;
    if ((code & 0x7fu) == 0x7fu) magnitude = NAN;
    else if (exponent == 0) magnitude = std::ldexp((float)mantissa, -9);
    else magnitude = std::ldexp((float)(mantissa | 8u), (int)exponent - 10);
    return (code & 0x80u) ? -magnitude : magnitude;
}

}  // namespace emu

// cvt.rn.f16x2.e4m3x2: the two codes of the low 16 bits (the low byte the first) as an f16 pair.
inline unsigned e4m3x2_to_f16x2(unsigned pair) {
    return emu::f16_round(emu::e4m3(pair & 255u)) | (emu::f16_round(emu::e4m3((pair >> 8) & 255u)) << 16);
}

// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the eight bytes y:x (x's the low four).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned selector) {
    const unsigned long long bytes = ((unsigned long long)y << 32) | x;
    unsigned result = 0;
    for (int i = 0; i < 4; ++i) result |= (unsigned)((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 255u) << (8 * i);
    return result;
}

// The float32 values of an f16 pair's halves.
inline float f16_low(unsigned pair) { return emu::f16_value(pair & 0xffffu); }
inline float f16_high(unsigned pair) { return emu::f16_value(pair >> 16); }

// cvt.rn.satfinite.e4m3x2.f32 (with `high` as a, `low` as b): the E4M3 codes of two float32 values,
// rounded to the nearest (ties to the even code) and saturated at +-448; the low byte from `low`.
inline unsigned e4m3x2_of(float low, float high) {
    auto code = [](float value) -> unsigned {
        if (std::isnan(value)) return 0x7fu;
        const float magnitude = std::fmin(std::fabs(value), 448.0f);
        unsigned result;
        if (magnitude < 0.015625f) {
            result = (unsigned)std::nearbyint(magnitude * 512.0f);   // subnormal codes: steps of 2**-9
        } else {
            unsigned bits;
            std::memcpy(&bits, &magnitude, 4);
            result = ((bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
        }
        return result | (std::signbit(value) ? 0x80u : 0u);
    };
    return code(low) | (code(high) << 8);
}

// fma.rn.bf16x2 and fma.rn.f16x2: a * b + c of each half, rounded once.
inline unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned result = 0;
    for (int half = 0; half < 2; ++half) {
        const double value = (double)emu::bf16_value((a >> (16 * half)) & 0xffffu) * emu::bf16_value((b >> (16 * half)) & 0xffffu)
                             + emu::bf16_value((c >> (16 * half)) & 0xffffu);
        result |= emu::bf16_round((float)value) << (16 * half);
    }
    return result;
}

inline unsigned fma_f16x2(unsigned a, unsigned b, unsigned c) {
    unsigned result = 0;
    for (int half = 0; half < 2; ++half) {
        const double value = (double)emu::f16_value((a >> (16 * half)) & 0xffffu) * emu::f16_value((b >> (16 * half)) & 0xffffu)
                             + emu::f16_value((c >> (16 * half)) & 0xffffu);
        result |= emu::f16_round((float)value) << (16 * half);
    }
    return result;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: as mma_16x8x16 with f16 operands.
inline void mma_16x8x16_f16(float* c, const unsigned* a, const unsigned* b) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    for (int i = 0; i < 4; ++i) {
        exchange.a[t][i] = a[i];
        exchange.c[t][i] = c[i];
    }
    exchange.b[t][0] = b[0];
    exchange.b[t][1] = b[1];
    barrier->arrive_and_wait();
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        for (int i = 0; i < 8; ++i) {
            const unsigned word = exchange.a[l][i / 2];
            const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
            A[row][2 * q + (i & 1) + (i >= 4 ? 8 : 0)] = emu::f16_value((i % 2 ? word >> 16 : word) & 0xffffu);
        }
        for (int i = 0; i < 4; ++i) {
            const unsigned word = exchange.b[l][i / 2];
            B[2 * q + (i & 1) + (i >= 2 ? 8 : 0)][g] = emu::f16_value((i % 2 ? word >> 16 : word) & 0xffffu);
        }
        for (int i = 0; i < 4; ++i) C[i < 2 ? g : g + 8][2 * q + (i & 1)] = exchange.c[l][i];
    }
    barrier->arrive_and_wait();
    const int g = t / 4, q = t % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? g : g + 8, column = 2 * q + (i & 1);
        float sum = C[row][column];
        for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][column];
        c[i] = sum;
    }
}

// A load of what another block wrote (the blocks of a launch run one after another here).
inline float load_coherent(const float* address) { return *address; }

// Host side of the tests' main functions: arrays filled with 0xff bytes (NaN / -1 where a kernel
// writes nothing), read from and written to files.
#include <fstream>
#include <string>

template <typename T> T* allocate(size_t count) {
    T* data = static_cast<T*>(std::aligned_alloc(256, (count * sizeof(T) / 256 + 1) * 256));
    std::memset(data, 0xff, count * sizeof(T));   // NaN / -1 where nothing is written
    return data;
}
template <typename T> T* read(const std::string& path, size_t count) {
    T* data = allocate<T>(count);
    std::ifstream file(path, std::ios::binary);
    file.read(reinterpret_cast<char*>(data), count * sizeof(T));
    if (!file) emu::fail("short input");
    return data;
}
template <typename T> void write(const std::string& path, const T* data, size_t count) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data), count * sizeof(T));
}
