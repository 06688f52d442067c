// The CUDA features of metrale.kernels' CUDA C++ kernels emulated on the host, so that they run
// (slowly) without a GPU. Each CUDA thread of a block is a fiber (ucontext) with its own stack, all
// on one host thread, the blocks of a launch one after another; a fiber runs until it must wait (a
// barrier, a warp-wide instruction, an mbarrier phase, setmaxnreg's registers) and the fibers
// waiting are resumed in a shuffled order, so that a result depending on the order of threads
// between two barriers shows. When every thread of a block waits and nothing can change any more,
// the run fails saying what each waits for (where a GPU would hang). ldmatrix and mma.sync follow
// the fragment layouts of the PTX ISA; cp.async copies are queued per thread and land only when
// cp.async.wait_group requires them (or at once, with emu::defer_copies = 0), so a missing wait
// reads stale shared memory.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
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

dim3 threadIdx, blockIdx;   // the running fiber's (swapped in and out with it)
dim3 blockDim, gridDim;

namespace emu {

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "emulation: %s\n", what);
    std::abort();
}

// Fibers: one per CUDA thread of the running block.
struct Fiber {
    ucontext_t context;
    bool finished = false;
    const char* waiting_for = nullptr;   // set while the fiber waits, what for
};
std::vector<Fiber> fibers;
std::vector<std::unique_ptr<char[]>> fiber_stacks;
constexpr size_t FIBER_STACK_BYTES = 1 << 18;
int current_fiber = -1;
ucontext_t scheduler_context;
unsigned long long changes = 0;   // counts every change a waiting fiber could be waiting for

// Back to the scheduler until it resumes this fiber, which waits for `what`.
inline void suspend(const char* what) {
    fibers[current_fiber].waiting_for = what;
    swapcontext(&fibers[current_fiber].context, &scheduler_context);
    fibers[current_fiber].waiting_for = nullptr;
}

// Suspends until `ready()` holds.
template <typename Ready> inline void wait_until(Ready ready, const char* what) {
    if (ready()) return;
    do suspend(what); while (!ready());
    ++changes;   // moving on is a change for the deadlock check
}

// A barrier of `expected` arrivals a phase (std::barrier's arrive and arrive_and_wait, for fibers).
struct Barrier {
    int expected, arrived = 0;
    unsigned phase = 0;
    explicit Barrier(int count) : expected(count) {}
    unsigned arrive() {
        const unsigned mine = phase;
        ++changes;
        if (++arrived == expected) {
            arrived = 0;
            ++phase;
        }
        return mine;
    }
    void arrive_and_wait() {
        const unsigned mine = arrive();
        wait_until([&] { return phase != mine; }, "a barrier some threads of the block or warp never reach");
    }
};

alignas(1024) unsigned char dynamic_shared[256 * 1024];
Barrier* block_barrier = nullptr;
std::vector<Barrier*> warp_barriers;
struct Exchange { unsigned address[32]; unsigned a[32][4]; unsigned b[32][2]; float c[32][4]; };
std::vector<Exchange> exchange;   // what the lanes of each warp hand to a warp-wide instruction
int defer_copies = 1;
void block_started();   // resets the Hopper features' per-block state (below)
bool wgmma_all_waited();   // whether this thread has no wgmma in flight (below)
void exchange_thread_state(int fiber);   // swaps the per-thread globals with a fiber's (below)
void start_thread_states(int threads);   // each fiber's first thread state (below)
// setmaxnreg: each thread starts with what ptxas gives a block of blockDim threads and one block
// an SM (__launch_bounds__(threads, 1): the register file shared out, a multiple of 8); what a
// warpgroup's .dec releases goes to its block's pool, from which an .inc takes or waits.
int thread_registers = 0;
int register_pool = 0;
inline int launch_registers(int threads) { return std::min(255, 65536 / threads) / 8 * 8; }

struct Copy { unsigned target; const unsigned char* source; bool valid; unsigned bytes = 16; };
std::deque<std::vector<Copy>> committed;   // oldest group first
std::vector<Copy> open_group;

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

const std::function<void()>* fiber_body = nullptr;

inline void fiber_main() {
    (*fiber_body)();
    if (!open_group.empty()) fail("copies issued but never committed");
    if (!wgmma_all_waited()) fail("wgmma products issued and never waited for");
    for (const auto& group : committed) {
        if (!group.empty()) fail("copies still in flight when the thread ends");
    }
    fibers[current_fiber].finished = true;
    ++changes;
    swapcontext(&fibers[current_fiber].context, &scheduler_context);
}

// Every thread of the block waits and a whole round of resuming them changed nothing: on a GPU,
// a hang. Says what the threads wait for.
[[noreturn]] inline void deadlock() {
    std::set<std::string> reasons;
    for (const auto& fiber : fibers) {
        if (!fiber.finished && fiber.waiting_for != nullptr) reasons.insert(fiber.waiting_for);
    }
    std::string what = "every thread of the block waits and nothing can change:";
    for (const auto& reason : reasons) what += " [" + reason + "]";
    fail(what.c_str());
}

// kernel() on every thread of every block of grid x block (x only), one block at a time.
template <typename Kernel>
void launch(dim3 grid, dim3 block, Kernel kernel) {
    gridDim = grid;
    blockDim = block;
    const int threads = static_cast<int>(block.x);
    const int warps = (threads + 31) / 32;
    const std::function<void()> body = kernel;
    fiber_body = &body;
    while (static_cast<int>(fiber_stacks.size()) < threads) fiber_stacks.emplace_back(new char[FIBER_STACK_BYTES]);
    std::mt19937 order_random(12345);
    std::vector<int> order(threads);
    for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            Barrier barrier(threads);
            block_barrier = &barrier;
            std::vector<Barrier*> per_warp;
            for (int w = 0; w < warps; ++w) per_warp.push_back(new Barrier(std::min(32, threads - 32 * w)));
            warp_barriers = per_warp;
            block_started();
            exchange.assign(warps, Exchange{});
            std::memset(dynamic_shared, 0xff, sizeof(dynamic_shared));   // NaN in bf16 and float32: an unwritten read shows
            blockIdx.x = bx;
            blockIdx.y = by;
            blockIdx.z = bz;
            start_thread_states(threads);
            fibers.assign(threads, Fiber{});
            for (int t = 0; t < threads; ++t) {
                getcontext(&fibers[t].context);
                fibers[t].context.uc_stack.ss_sp = fiber_stacks[t].get();
                fibers[t].context.uc_stack.ss_size = FIBER_STACK_BYTES;
                fibers[t].context.uc_link = nullptr;
                makecontext(&fibers[t].context, fiber_main, 0);
                order[t] = t;
            }
            int finished = 0;
            while (finished < threads) {
                std::shuffle(order.begin(), order.end(), order_random);
                const unsigned long long changes_before = changes;
                bool all_waiting = true;
                for (int t : order) {
                    if (fibers[t].finished) continue;
                    current_fiber = t;
                    exchange_thread_state(t);
                    swapcontext(&scheduler_context, &fibers[t].context);
                    exchange_thread_state(t);
                    current_fiber = -1;
                    if (fibers[t].finished) ++finished;
                    else if (fibers[t].waiting_for == nullptr) all_waiting = false;
                }
                if (finished < threads && all_waiting && changes == changes_before) deadlock();
            }
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
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

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

// __shfl_sync over the whole warp: each lane gets the value of the lane it names as `source`.
inline int __shfl_sync(unsigned, int value, int source) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    exchange.address[emu::lane()] = static_cast<unsigned>(value);
    barrier->arrive_and_wait();
    const int result = static_cast<int>(exchange.address[source]);
    barrier->arrive_and_wait();
    return result;
}

// __shfl_down_sync over the whole warp: lane t gets the value of lane t + delta, its own past lane 31.
inline unsigned __shfl_down_sync(unsigned, unsigned value, int delta) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    exchange.address[t] = value;
    barrier->arrive_and_wait();
    const unsigned result = t + delta < 32 ? exchange.address[t + delta] : value;
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

// movmatrix.sync.aligned.m8n8.trans.b16: lane t holds row t / 4, columns 2 (t % 4) (low half) and
// 2 (t % 4) + 1 of an 8x8 matrix; it gets row t / 4 of the transpose, i.e. column t / 4, rows
// 2 (t % 4) and 2 (t % 4) + 1.
inline unsigned transpose_matrix(unsigned fragment) {
    auto& exchange = emu::exchange[emu::warp()];
    auto* barrier = emu::warp_barriers[emu::warp()];
    const int t = emu::lane();
    exchange.address[t] = fragment;
    barrier->arrive_and_wait();
    const int column = t / 4, shift = 16 * (column % 2);
    const unsigned low = (exchange.address[(2 * (t % 4)) * 4 + column / 2] >> shift) & 0xffffu;
    const unsigned high = (exchange.address[(2 * (t % 4) + 1) * 4 + column / 2] >> shift) & 0xffffu;
    barrier->arrive_and_wait();
    return low | high << 16;
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

// ------------------------------------------------------------------------------------------------
// Hopper (sm_90a): mbarriers, TMA tensor loads, named barriers and wgmma, as
// metrale.kernels.attention_hopper's INSTRUCTIONS name them.
//
// mbarriers live in dynamic shared memory and are tracked here by their offset: a phase completes
// when its pending arrivals and its expected transaction bytes both reach zero. A tensor load
// copies its box at once (zeros outside the tensor), in the 128-byte swizzle if its map asks for
// it, and completes its bytes on the barrier it names. A wgmma is recorded at issue and runs when a
// wait (wgmma.wait_group, warpgroup-wide) needs its committed group: its shared operands read
// then, through their descriptors (start address, leading and stride byte offsets, 128-byte
// swizzle), its register operands from the fragment layouts of the PTX ISA; accumulators or
// register operands that change between the issue and that wait fail the run, as does a thread
// that ends with products in flight.
#include <chrono>
#include <map>
#include <mutex>
#include <type_traits>

#define __grid_constant__

// The emulation's tensor map: what cuTensorMapEncodeTiled records of a tiled map of up to three
// dimensions (element counts, byte strides of dimensions 1 and 2, the box, the swizzle).
struct TensorMap {
    const unsigned char* base;
    unsigned long long dims[3];
    unsigned long long strides[3];   // bytes; strides[0] is the element size
    unsigned box[3];
    int swizzle_128;
};

namespace emu {

struct Mbarrier { int expected = 0, pending = 0; long long bytes = 0; unsigned phase = 0; };
std::mutex hopper_mutex;
std::map<unsigned, Mbarrier> mbarriers;
std::map<int, std::pair<int, Barrier*>> named_barriers;   // id -> (threads, barrier)
std::vector<Barrier*> warpgroup_barriers;
struct GroupExchange {
    unsigned long long descriptor_a[128], descriptor_b[128];
    unsigned a[128][4];
};
std::vector<GroupExchange> group_exchange;

void block_started() {
    std::lock_guard<std::mutex> lock(hopper_mutex);
    register_pool = 0;
    mbarriers.clear();
    for (auto& entry : named_barriers) delete entry.second.second;
    named_barriers.clear();
    for (auto* barrier : warpgroup_barriers) delete barrier;
    warpgroup_barriers.clear();
    const int groups = static_cast<int>(blockDim.x) / 128;
    for (int g = 0; g < groups; ++g) warpgroup_barriers.push_back(new Barrier(128));
    group_exchange.assign(groups, GroupExchange{});
}

// The 128-byte swizzle of a shared-memory byte offset: its 16-byte chunk within 128 bytes XORed
// with its 128-byte row within 1024 (Swizzle<3, 4, 3>).
inline unsigned swizzled(unsigned offset) { return offset ^ (((offset >> 7) & 7u) << 4); }

inline void complete(Mbarrier& barrier) {
    ++changes;   // called after every arrival and every load's bytes
    if (barrier.pending < 0 || barrier.bytes < 0) fail("mbarrier over-arrived");
    if (barrier.pending == 0 && barrier.bytes == 0) {
        barrier.phase += 1;
        barrier.pending = barrier.expected;
    }
}

inline Mbarrier& mbarrier_at(unsigned address) {
    auto found = mbarriers.find(address);
    if (found == mbarriers.end()) fail("mbarrier used before its init");
    return found->second;
}

inline float shared_bf16(unsigned offset) {
    unsigned short bits;
    std::memcpy(&bits, dynamic_shared + offset, 2);
    return bf16_value(bits);
}

// Element (row, k) of a K-major operand (rows of 128 bytes, groups of 8 rows `stride` bytes apart).
inline float k_major(unsigned long long descriptor, int row, int k) {
    const unsigned start = static_cast<unsigned>(descriptor & 0x3fffu) << 4;
    const unsigned stride = static_cast<unsigned>((descriptor >> 32) & 0x3fffu) << 4;
    return shared_bf16(swizzled(start + (row % 8) * 128 + (row / 8) * stride + 2 * k));
}

// Element (k, column) of an MN-major operand: 64 columns a 128-byte row, 8 rows of k 128 bytes
// apart, groups of 8 k `stride` bytes apart, groups of 64 columns `leading` bytes apart.
inline float mn_major(unsigned long long descriptor, int k, int column) {
    const unsigned start = static_cast<unsigned>(descriptor & 0x3fffu) << 4;
    const unsigned leading = static_cast<unsigned>((descriptor >> 16) & 0x3fffu) << 4;
    const unsigned stride = static_cast<unsigned>((descriptor >> 32) & 0x3fffu) << 4;
    return shared_bf16(swizzled(start + 2 * (column % 64) + (column / 64) * leading + (k % 8) * 128 + (k / 8) * stride));
}

inline void check_descriptor(unsigned long long descriptor) {
    if ((descriptor >> 62) != 1) fail("wgmma descriptor without the 128-byte swizzle");
    if ((descriptor >> 49) & 7u) fail("wgmma descriptor with a base offset");
}

// D (64 x N, this thread's N / 2 accumulators) += A (64 x 16) B (16 x N): A's element (row, k) from
// `a_of`, B's (k, column) from `b_of`.
template <int N, typename AOf, typename BOf>
inline void warpgroup_product(float* d, int accumulate, AOf a_of, BOf b_of) {
    const int t = threadIdx.x % 128, w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int j = 0; j < N / 8; ++j) {
        for (int i = 0; i < 4; ++i) {
            const int row = 16 * w + g + 8 * (i / 2), column = 8 * j + 2 * q + (i & 1);
            float sum = accumulate ? d[4 * j + i] : 0.0f;
            for (int k = 0; k < 16; ++k) sum += a_of(row, k) * b_of(k, column);
            d[4 * j + i] = sum;
        }
    }
}

}  // namespace emu

inline void barrier_init(unsigned address, unsigned count) {
    std::lock_guard<std::mutex> lock(emu::hopper_mutex);
    if (address % 8) emu::fail("mbarrier not 8-byte aligned");
    emu::Mbarrier barrier;
    barrier.expected = barrier.pending = static_cast<int>(count);
    emu::mbarriers[address] = barrier;
    ++emu::changes;
}
inline void barrier_init_fence() {}

inline void barrier_arrive(unsigned address) {
    std::lock_guard<std::mutex> lock(emu::hopper_mutex);
    auto& barrier = emu::mbarrier_at(address);
    barrier.pending -= 1;
    emu::complete(barrier);
}

// mbarrier.arrive.expect_tx: `bytes` more to come from tensor loads, and this thread's arrival.
inline void barrier_expect_bytes(unsigned address, unsigned bytes) {
    std::lock_guard<std::mutex> lock(emu::hopper_mutex);
    auto& barrier = emu::mbarrier_at(address);
    barrier.bytes += bytes;
    barrier.pending -= 1;
    emu::complete(barrier);
}

// Returns once the phase of parity `parity` has completed (the barrier's phase count moved past it).
inline void barrier_wait(unsigned address, unsigned parity) {
    const auto started = std::chrono::steady_clock::now();
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(emu::hopper_mutex);
            if ((emu::mbarrier_at(address).phase & 1u) != (parity & 1u)) {
                ++emu::changes;
                return;
            }
        }
        if (std::chrono::steady_clock::now() - started > std::chrono::seconds(60)) emu::fail("mbarrier wait never ends");
        emu::suspend("an mbarrier phase that never completes");
    }
}

// cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.
inline void tensor_load_3d(unsigned target, const TensorMap& map, int c0, int c1, int c2, unsigned barrier) {
    if (target % (map.swizzle_128 ? 1024 : 128)) emu::fail("tensor load target not aligned");
    const unsigned element = static_cast<unsigned>(map.strides[0]);
    if (map.swizzle_128 && map.box[0] * element != 128) emu::fail("a 128-byte swizzle needs 128-byte box rows");
    unsigned offset = target;
    for (unsigned z = 0; z < map.box[2]; ++z) {
        for (unsigned y = 0; y < map.box[1]; ++y) {
            for (unsigned x = 0; x < map.box[0]; ++x, offset += element) {
                const long long coordinates[3] = {(long long)c0 + x, (long long)c1 + y, (long long)c2 + z};
                bool inside = true;
                for (int d = 0; d < 3; ++d) inside = inside && coordinates[d] >= 0 && coordinates[d] < (long long)map.dims[d];
                unsigned char* destination = emu::dynamic_shared + (map.swizzle_128 ? emu::swizzled(offset) : offset);
                if (destination + element > emu::dynamic_shared + sizeof(emu::dynamic_shared)) emu::fail("tensor load past shared memory");
                if (inside) {
                    std::memcpy(destination, map.base + coordinates[0] * element + coordinates[1] * map.strides[1]
                                + coordinates[2] * map.strides[2], element);
                } else {
                    std::memset(destination, 0, element);
                }
            }
        }
    }
    std::lock_guard<std::mutex> lock(emu::hopper_mutex);
    auto& mbarrier = emu::mbarrier_at(barrier);
    mbarrier.bytes -= static_cast<long long>(offset - target);
    emu::complete(mbarrier);
}

// bar.sync id, threads.
inline void named_barrier(int id, int threads) {
    emu::Barrier* barrier;
    {
        std::lock_guard<std::mutex> lock(emu::hopper_mutex);
        auto found = emu::named_barriers.find(id);
        if (found == emu::named_barriers.end()) {
            found = emu::named_barriers.emplace(id, std::make_pair(threads, new emu::Barrier(threads))).first;
        }
        if (found->second.first != threads) emu::fail("a named barrier used with two thread counts");
        barrier = found->second.second;
    }
    barrier->arrive_and_wait();
}

// bar.arrive id, threads: this thread's arrival, not waiting for the barrier's phase to complete.
inline void named_barrier_arrive(int id, int threads) {
    emu::Barrier* barrier;
    {
        std::lock_guard<std::mutex> lock(emu::hopper_mutex);
        auto found = emu::named_barriers.find(id);
        if (found == emu::named_barriers.end()) {
            found = emu::named_barriers.emplace(id, std::make_pair(threads, new emu::Barrier(threads))).first;
        }
        if (found->second.first != threads) emu::fail("a named barrier used with two thread counts");
        barrier = found->second.second;
    }
    (void)barrier->arrive();
}

inline void async_proxy_fence() {}
namespace emu {

// A wgmma as issued: it runs when a wait needs its group, reading its shared operands then, its
// registers as they were at issue (a change to them while it is in flight fails the run).
struct WgmmaOp {
    int n = 0;
    bool a_in_registers = false;
    float* d = nullptr;
    std::vector<float> d_at_issue;
    const unsigned* a = nullptr;
    unsigned a_at_issue[4] = {};
    unsigned long long descriptor_a = 0, descriptor_b = 0;
    int accumulate = 0;
};
std::vector<WgmmaOp> open_wgmma;
std::deque<std::vector<WgmmaOp>> committed_wgmma;   // oldest group first

bool wgmma_all_waited() { return open_wgmma.empty() && committed_wgmma.empty(); }

inline void wgmma_issue(WgmmaOp op, float* d, int n) {
    op.d = d;
    op.n = n;
    op.d_at_issue.assign(d, d + n / 2);
    open_wgmma.push_back(std::move(op));
}

// One product, with the warpgroup: its operands gathered from the 128 threads' issues.
inline void wgmma_run(const WgmmaOp& op) {
    const int group = threadIdx.x / 128, t = threadIdx.x % 128;
    auto& exchange = group_exchange[group];
    exchange.descriptor_a[t] = op.descriptor_a;
    exchange.descriptor_b[t] = op.descriptor_b;
    for (int i = 0; i < 4; ++i) exchange.a[t][i] = op.a_at_issue[i];
    warpgroup_barriers[group]->arrive_and_wait();
    for (int l = 0; l < 128; ++l) {
        if (exchange.descriptor_a[l] != op.descriptor_a || exchange.descriptor_b[l] != op.descriptor_b) {
            fail("wgmma descriptors differ across the warpgroup");
        }
    }
    check_descriptor(op.descriptor_b);
    if (op.a_in_registers) {
        float A[64][16];
        for (int l = 0; l < 128; ++l) {
            const int w = l / 32, g = (l % 32) / 4, q = l % 4;
            for (int i = 0; i < 8; ++i) {
                const unsigned word = exchange.a[l][i / 2];
                const int row = 16 * w + g + ((i / 2) % 2 ? 8 : 0), k = 2 * q + (i & 1) + (i >= 4 ? 8 : 0);
                A[row][k] = bf16_value(i % 2 ? word >> 16 : word);
            }
        }
        auto product = [&](auto n_constant) {
            warpgroup_product<decltype(n_constant)::value>(op.d, op.accumulate, [&](int row, int k) { return A[row][k]; },
                [&](int k, int column) { return mn_major(op.descriptor_b, k, column); });
        };
        switch (op.n) {
            case 64: product(std::integral_constant<int, 64>{}); break;
            case 128: product(std::integral_constant<int, 128>{}); break;
            case 256: product(std::integral_constant<int, 256>{}); break;
            default: fail("wgmma width not emulated");
        }
    } else {
        check_descriptor(op.descriptor_a);
        auto product = [&](auto n_constant) {
            warpgroup_product<decltype(n_constant)::value>(op.d, op.accumulate,
                [&](int row, int k) { return k_major(op.descriptor_a, row, k); },
                [&](int k, int column) { return k_major(op.descriptor_b, column, k); });
        };
        switch (op.n) {
            case 64: product(std::integral_constant<int, 64>{}); break;
            case 128: product(std::integral_constant<int, 128>{}); break;
            case 256: product(std::integral_constant<int, 256>{}); break;
            default: fail("wgmma width not emulated");
        }
    }
    warpgroup_barriers[group]->arrive_and_wait();
}

// A committed group's products in their order: each first product of an accumulator array finds
// it as it was at issue, each register operand as it was at issue.
inline void wgmma_run_group(const std::vector<WgmmaOp>& ops) {
    std::vector<const float*> touched;
    for (const auto& op : ops) {
        if (std::find(touched.begin(), touched.end(), op.d) == touched.end()) {
            if (!std::equal(op.d_at_issue.begin(), op.d_at_issue.end(), op.d)) {
                fail("wgmma accumulators changed while the product was in flight");
            }
            touched.push_back(op.d);
        }
        if (op.a_in_registers && !std::equal(op.a_at_issue, op.a_at_issue + 4, op.a)) {
            fail("wgmma register operand changed while the product was in flight");
        }
        wgmma_run(op);
    }
}

}  // namespace emu

inline void wgmma_fence() {}
inline void wgmma_commit() {
    emu::committed_wgmma.push_back(std::move(emu::open_wgmma));
    emu::open_wgmma.clear();
}
// wgmma.wait_group: the groups older than the `pending` newest run now (a warpgroup-wide wait).
template <int pending> inline void wgmma_wait() {
    while (static_cast<int>(emu::committed_wgmma.size()) > pending) {
        emu::wgmma_run_group(emu::committed_wgmma.front());
        emu::committed_wgmma.pop_front();
    }
}
template <int count> inline void fence_operands(float (&)[count]) {}
// setmaxnreg.inc: waits until the block's pool holds the registers this thread asks for.
template <int registers> inline void registers_increase() {
    static_assert(registers % 8 == 0 && registers >= 24 && registers <= 256, "setmaxnreg takes 24 .. 256, a multiple of 8");
    if (registers < emu::thread_registers) emu::fail("setmaxnreg.inc below the thread's registers");
    const int wanted = registers - emu::thread_registers;
    const auto started = std::chrono::steady_clock::now();
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(emu::hopper_mutex);
            if (emu::register_pool >= wanted) {
                emu::register_pool -= wanted;
                emu::thread_registers = registers;
                ++emu::changes;
                return;
            }
        }
        if (std::chrono::steady_clock::now() - started > std::chrono::seconds(60)) {
            emu::fail("setmaxnreg.inc never gets its registers (no warpgroup released them with .dec)");
        }
        emu::suspend("setmaxnreg.inc's registers, which no warpgroup released with .dec");
    }
}
// setmaxnreg.dec: this thread's registers above `registers` go to the block's pool.
template <int registers> inline void registers_decrease() {
    static_assert(registers % 8 == 0 && registers >= 24 && registers <= 256, "setmaxnreg takes 24 .. 256, a multiple of 8");
    if (registers > emu::thread_registers) emu::fail("setmaxnreg.dec above the thread's registers");
    std::lock_guard<std::mutex> lock(emu::hopper_mutex);
    emu::register_pool += emu::thread_registers - registers;
    emu::thread_registers = registers;
    ++emu::changes;
}

// wgmma.mma_async.m64nNk16.f32.bf16.bf16, both operands in shared memory and K-major.
template <int N>
inline void wgmma_ss(float (&d)[N / 2], unsigned long long descriptor_a, unsigned long long descriptor_b, int accumulate) {
    emu::WgmmaOp op;
    op.descriptor_a = descriptor_a;
    op.descriptor_b = descriptor_b;
    op.accumulate = accumulate;
    emu::wgmma_issue(std::move(op), d, N);
}

// wgmma.mma_async.m64nNk16.f32.bf16.bf16, A from registers (the m16n8k16 A fragment of each warp's
// 16 rows), B in shared memory and MN-major (imm-trans-b 1).
template <int N>
inline void wgmma_rs_mn(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long descriptor_b, int accumulate) {
    emu::WgmmaOp op;
    op.a_in_registers = true;
    op.a = a;
    for (int i = 0; i < 4; ++i) op.a_at_issue[i] = a[i];
    op.descriptor_b = descriptor_b;
    op.accumulate = accumulate;
    emu::wgmma_issue(std::move(op), d, N);
}

namespace emu {

// The per-thread globals of a fiber while it is not running (swapped with the globals as it is
// resumed and again as it suspends: O(1) for the queues).
struct ThreadState {
    dim3 thread_index, block_index;
    int registers = 0;
    std::deque<std::vector<Copy>> committed;
    std::vector<Copy> open_group;
    std::vector<WgmmaOp> open_wgmma;
    std::deque<std::vector<WgmmaOp>> committed_wgmma;
};
std::vector<ThreadState> thread_states;

void start_thread_states(int threads) {
    thread_states.assign(threads, ThreadState{});
    for (int t = 0; t < threads; ++t) {
        thread_states[t].thread_index.x = t;
        thread_states[t].block_index = blockIdx;
        thread_states[t].registers = launch_registers(threads);
    }
}

void exchange_thread_state(int fiber) {
    ThreadState& state = thread_states[fiber];
    std::swap(threadIdx, state.thread_index);
    std::swap(blockIdx, state.block_index);
    std::swap(thread_registers, state.registers);
    std::swap(committed, state.committed);
    std::swap(open_group, state.open_group);
    std::swap(open_wgmma, state.open_wgmma);
    std::swap(committed_wgmma, state.committed_wgmma);
}

}  // namespace emu
