// CUDA C++ kernels of metrale.kernels run on the CPU (g++, Linux), for tests without a GPU.
//
// Each CUDA thread of a block is a fiber (ucontext) with its own stack; fibers switch only at
// barriers: __syncthreads (the whole block) and the warp collectives (mma.sync, shuffles), which
// exchange their operands through per-warp slots between two warp barriers. The fibers of a block
// run in a shuffled order between barriers, so a result that depends on the order of threads
// between two barriers (a missing __syncthreads) changes with the seed. A barrier that some
// threads of the block (or of a warp, for a collective) never reach is reported, not waited on.
//
// mma_16x8x16 follows the PTX ISA's fragment layouts for mma.m16n8k16 .row.col with bf16
// operands, independently of the kernels (g = lane / 4, t = lane % 4): A register 0 holds row g,
// columns 2t and 2t + 1 (the lower column in the low half), register 1 row g + 8 (same columns),
// register 2 row g, columns 2t + 8 and 2t + 9, register 3 row g + 8 (those columns); B register 0
// holds rows 2t and 2t + 1 of column g, register 1 rows 2t + 8 and 2t + 9; C element 0 and 1 are
// row g, columns 2t and 2t + 1, elements 2 and 3 row g + 8. Products accumulate in float32 in k
// order.
//
// A kernel source includes this header in place of <cuda_bf16.h>, with its inline-PTX mma
// function removed and its extern __shared__ array replaced by emu::shared_memory; a launcher
// calls emu::launch.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(threads)

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
using std::max;
using std::min;

// bf16: nearest, ties to even (NaN to the canonical quiet NaN).
inline unsigned short emu_to_bf16(float value) {
    if (std::isnan(value)) return 0x7fc0;
    unsigned bits;
    std::memcpy(&bits, &value, 4);
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline float emu_from_bf16(unsigned short half) {
    const unsigned bits = (unsigned)half << 16;
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
}
struct __nv_bfloat16 { unsigned short bits; };
struct __nv_bfloat162 { unsigned short x, y; };   // x in the low half, as on the device
inline __nv_bfloat162 __floats2bfloat162_rn(float low, float high) { return {emu_to_bf16(low), emu_to_bf16(high)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float value) { return {emu_to_bf16(value)}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 value) { return value.bits; }

namespace emu {

constexpr int WARP = 32;
constexpr int MAX_WARPS = 32;
enum State { READY, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };
struct Index { unsigned x, y, z; };
struct Fiber {
    ucontext_t context;
    State state;
    Index index;
    std::vector<char> stack;
};
// One warp's exchange slot per lane.
struct Slot {
    unsigned a[4];
    unsigned b[2];
    float value;
};

inline Index block_index;
inline std::vector<Fiber> fibers;
inline int current;
inline ucontext_t scheduler;
inline Slot slots[MAX_WARPS][WARP];
inline unsigned char* shared_memory;
inline const std::function<void()>* body;

inline void wait(State state) {
    fibers[current].state = state;
    swapcontext(&fibers[current].context, &scheduler);
}
inline int lane() { return fibers[current].index.x % WARP; }
inline int warp() { return fibers[current].index.x / WARP; }

inline void fiber_main() {
    (*body)();
    fibers[current].state = DONE;
    swapcontext(&fibers[current].context, &scheduler);
}

// Runs ``kernel`` over the grid, one block at a time, ``threads`` fibers each, over
// ``shared_bytes`` of shared memory that starts as random bytes and is followed by a guard.
// Returns 0, 1 when a barrier is not reached by every thread it waits for, 2 when shared memory
// past ``shared_bytes`` was written.
inline int launch(Index grid, int threads, size_t shared_bytes, const std::function<void()>& kernel, unsigned seed) {
    std::mt19937 rng(seed);
    const size_t guard = 4096;
    std::vector<unsigned char> memory(shared_bytes + guard);
    body = &kernel;
    for (unsigned x = 0; x < grid.x; ++x)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned z = 0; z < grid.z; ++z) {
                block_index = {x, y, z};
                for (auto& byte : memory) byte = (unsigned char)rng();
                const std::vector<unsigned char> guard_bytes(memory.begin() + shared_bytes, memory.end());
                shared_memory = memory.data();
                fibers.assign(threads, Fiber{});
                for (int t = 0; t < threads; ++t) {
                    Fiber& fiber = fibers[t];
                    fiber.stack.resize(1 << 18);
                    getcontext(&fiber.context);
                    fiber.context.uc_stack.ss_sp = fiber.stack.data();
                    fiber.context.uc_stack.ss_size = fiber.stack.size();
                    fiber.context.uc_link = nullptr;
                    makecontext(&fiber.context, fiber_main, 0);
                    fiber.state = READY;
                    fiber.index = {(unsigned)t, 0, 0};
                }
                std::vector<int> order(threads);
                for (int t = 0; t < threads; ++t) order[t] = t;
                while (true) {
                    std::shuffle(order.begin(), order.end(), rng);
                    bool ran = false;
                    for (int t : order) {
                        if (fibers[t].state != READY) continue;
                        current = t;
                        swapcontext(&scheduler, &fibers[t].context);
                        ran = true;
                    }
                    if (ran) continue;
                    int done = 0, at_block = 0;
                    for (const Fiber& fiber : fibers) {
                        done += fiber.state == DONE;
                        at_block += fiber.state == AT_BLOCK_BARRIER;
                    }
                    if (done == threads) break;
                    bool released = false;
                    for (int w = 0; w * WARP < threads; ++w) {
                        int waiting = 0;
                        for (int l = 0; l < WARP; ++l) waiting += fibers[w * WARP + l].state == AT_WARP_BARRIER;
                        if (waiting == WARP) {
                            for (int l = 0; l < WARP; ++l) fibers[w * WARP + l].state = READY;
                            released = true;
                        }
                    }
                    if (released) continue;
                    if (at_block == threads) {
                        for (Fiber& fiber : fibers) fiber.state = READY;
                        continue;
                    }
                    std::fprintf(stderr, "block (%u, %u, %u): a barrier not every thread reaches\n", x, y, z);
                    return 1;
                }
                if (!std::equal(guard_bytes.begin(), guard_bytes.end(), memory.begin() + shared_bytes)) return 2;
            }
    return 0;
}

}  // namespace emu

#define threadIdx (emu::fibers[emu::current].index)
#define blockIdx (emu::block_index)
#define __syncthreads() emu::wait(emu::AT_BLOCK_BARRIER)

inline float __shfl_sync(unsigned, float value, int source) {
    const int w = emu::warp(), l = emu::lane();
    emu::slots[w][l].value = value;
    emu::wait(emu::AT_WARP_BARRIER);
    const float result = emu::slots[w][source].value;
    emu::wait(emu::AT_WARP_BARRIER);
    return result;
}

inline float __shfl_up_sync(unsigned, float value, int delta) {
    const int w = emu::warp(), l = emu::lane();
    emu::slots[w][l].value = value;
    emu::wait(emu::AT_WARP_BARRIER);
    const float result = l >= delta ? emu::slots[w][l - delta].value : value;
    emu::wait(emu::AT_WARP_BARRIER);
    return result;
}

// c[16x8] += a[16x16] * b[16x8] (see the layouts above).
inline void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    const int w = emu::warp(), l = emu::lane();
    std::memcpy(emu::slots[w][l].a, a, sizeof(emu::slots[w][l].a));
    std::memcpy(emu::slots[w][l].b, b, sizeof(emu::slots[w][l].b));
    emu::wait(emu::AT_WARP_BARRIER);
    float left[16][16], right[16][8];
    for (int source = 0; source < emu::WARP; ++source) {
        const int g = source / 4, t = source % 4;
        const unsigned* ra = emu::slots[w][source].a;
        const unsigned* rb = emu::slots[w][source].b;
        const int rows[4] = {g, g + 8, g, g + 8}, columns[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
        for (int r = 0; r < 4; ++r) {
            left[rows[r]][columns[r]] = emu_from_bf16(ra[r] & 0xffff);
            left[rows[r]][columns[r] + 1] = emu_from_bf16(ra[r] >> 16);
        }
        right[2 * t][g] = emu_from_bf16(rb[0] & 0xffff);
        right[2 * t + 1][g] = emu_from_bf16(rb[0] >> 16);
        right[2 * t + 8][g] = emu_from_bf16(rb[1] & 0xffff);
        right[2 * t + 9][g] = emu_from_bf16(rb[1] >> 16);
    }
    emu::wait(emu::AT_WARP_BARRIER);
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, columns[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        float sum = c[i];
        for (int k = 0; k < 16; ++k) sum += left[rows[i]][k] * right[k][columns[i]];
        c[i] = sum;
    }
}
