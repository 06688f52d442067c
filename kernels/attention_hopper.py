"""Prompt attention over the paged cache on Hopper's warpgroup tensor cores (``wgmma``, sm_90a;
CUDA C++ compiled by NVRTC).

The NumPy reference is :func:`metrale.kernels.attention.paged_attention_reference`. A block of
three warpgroups (four for heads of 64 dims: :func:`consumer_groups`) owns one query head and a
tile of up to :func:`tile_rows` consecutive rows of one sequence (128, or 192 with four), and the
warpgroups specialise:

* the producer (warpgroup 0; its first warp issues, a lane a load) copies each step's keys and
  values (128, or 64 for heads of 256 dims: :func:`block_keys`) from the paged cache into shared
  memory with TMA tensor loads (``cp.async.bulk.tensor``), a page's rows a load, through one
  tensor map per cache (:func:`tensor_map`); the copies land in the 128-byte swizzle the products read, their bytes
  counted on an mbarrier per stage ("full"), two stages in flight; pages past the tile's last key
  are asked for outside the tensor, which lands zeros;
* two consumers (warpgroups 1 and 2; three for heads of 64 dims, whose steps' products are short
  against their softmax; 64 rows each: alternate groups of 8 rows, so that they share a causal
  tile's diagonal) stage their query rows once (scaled, as bf16, swizzled), then per step wait for
  the keys, run ``S = Q K^T`` as ``wgmma.m64nNk16`` products (N the step's keys) with both
  operands in shared memory, release the keys (an "empty" mbarrier the producer waits on before
  it refills the stage), run the masked online softmax in registers (the mask tested once a step,
  each row's exponentials taken against a finite base), and ``O += P V`` as ``wgmma.m64nDk16``
  with the probabilities as the A operand straight from the scores' registers and the values read
  N-major from shared memory, then release the values. Each issues a step's score product
  together with the previous step's value product (:data:`OVERLAP`, the default), its softmax of
  the one running while the other's product does. Two consumers may also take turns at issuing
  their products (named barriers, :data:`PINGPONG`, off by default: the slower form where it was
  measured, ``docs/notes/prefill.rst``).

The causal rule, sliding windows, the logit soft cap and sinks are the reference's, as in
:mod:`metrale.kernels.attention_mma`, whose prompt tiles (a cached prefix plus the chunk) this
kernel takes the same way. The producer gives up registers (``setmaxnreg``) for the consumers'
accumulators. (Key, value) head sizes of (64, 64), (128, 128), (256, 256) and MLA's expanded
(192, 128) over bf16 caches whose pages hold a power of two of at least 8 rows are served
(:func:`supports`); other geometries and FP8 caches take :mod:`metrale.kernels.attention_mma`.

Every PTX instruction sits behind a small function (:data:`INSTRUCTIONS`) so that the CPU tests
run the kernel on the host through an emulation of them (mbarrier phases, tensor loads with the
swizzle, the ``wgmma`` operand layouts of the PTX ISA).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array

#: The (key, value) head sizes served.
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
#: Registers a thread after ``setmaxnreg``, the producer's and each consumer's, by the number of
#: consumer warpgroups: 128 * 40 + 256 * 232 and 128 * 24 + 384 * 160 fit the multiprocessor's 64k.
REGISTERS = {2: (40, 232), 3: (24, 160)}
#: (Key, value) head sizes whose blocks take three consumer warpgroups (192 rows) rather than two:
#: small heads, whose steps' products are short against their softmax, keep the tensor cores
#: busier with a third warpgroup's products in flight (read at each compilation; the sweep times
#: both).
THREE_CONSUMER_HEAD_DIMS: frozenset[tuple[int, int]] = frozenset({(64, 64)})
#: The head sizes whose three-consumer form fits its registers (steps of 64 keys past 64 dims).
THREE_CONSUMER_FORMS = ((64, 64), (128, 128))
#: Whether the consumers take turns at their products (blocks of two consumers only), and whether
#: each issues a step's score product with the previous step's value product (read at each
#: compilation; the sweep ``tools/sweeps/prompt_attention_sweep.py`` times each combination).
PINGPONG = False
OVERLAP = True
#: Whether the grid's fastest dimension is the query heads, (heads, tiles), so that every head's
#: last tile is dispatched before any head's earlier ones: the blocks start longest first across
#: the whole grid and the short ones fill the last wave (with (tiles, heads), only within a head).
#: Read at each compilation and launch; the sweep times both.
HEADS_INNER = True
#: The most tiles one launch takes with :data:`HEADS_INNER` (a grid's second dimension).
MAX_TILES = 65535


def _register_list(first: int, count: int) -> str:
    return ", ".join(f"%{first + i}" for i in range(count))


def _wgmma_functions(widths: tuple[int, ...]) -> str:
    """The ``wgmma_ss<N>`` and ``wgmma_rs_mn<N>`` specialisations for each N of ``widths``."""
    parts = [
        "template <int N> __device__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, "
        "int accumulate);",
        "template <int N> __device__ void wgmma_rs_mn(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b, "
        "int accumulate);",
    ]
    for n in widths:
        count = n // 2
        outputs = ", ".join(f'"+f"(d[{i}])' for i in range(count))
        parts.append(f"""
// D (64 x {n}) += A B, A (64 x 16) and B (16 x {n}) in shared memory, both K-major.
template <> __device__ __forceinline__ void wgmma_ss<{n}>(float (&d)[{count}], unsigned long long a,
                                                         unsigned long long b, int accumulate) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{count + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{_register_list(0, count)}}}, %{count}, %{count + 1}, "
        "p, 1, 1, 0, 0;\\n}}\\n"
        : {outputs}
        : "l"(a), "l"(b), "r"(accumulate));
}}
// D (64 x {n}) += A B, A from registers (each warp's 16 rows as mma.sync's A fragment), B (16 x {n})
// in shared memory, MN-major.
template <> __device__ __forceinline__ void wgmma_rs_mn<{n}>(float (&d)[{count}], const unsigned (&a)[4],
                                                            unsigned long long b, int accumulate) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{count + 5}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{_register_list(0, count)}}}, "
        "{{%{count}, %{count + 1}, %{count + 2}, %{count + 3}}}, %{count + 4}, p, 1, 1, 1;\\n}}\\n"
        : {outputs}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}}""")
    return "\n".join(parts) + "\n"


#: The PTX behind the kernel's helpers (the CPU tests replace them with their emulation).
INSTRUCTIONS = r"""
#define DYNAMIC_SHARED extern __shared__ __align__(1024) unsigned char dynamic_shared[]
// A CUtensorMap (cuTensorMapEncodeTiled's 128 opaque bytes), passed as a __grid_constant__ parameter.
struct __align__(64) TensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}
// Two float32 values as a bf16 pair, round to nearest even (low half first).
__device__ __forceinline__ unsigned pack_bf16(float low, float high) {
    unsigned pair;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(high), "f"(low));
    return pair;
}
__device__ __forceinline__ void barrier_init(unsigned address, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(address), "r"(count) : "memory");
}
// The barriers' initialisation made visible to the async proxy (the tensor loads) before use.
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void barrier_arrive(unsigned address) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(address) : "memory");
}
// This thread's arrival, and `bytes` more that tensor loads will complete on the barrier.
__device__ __forceinline__ void barrier_expect_bytes(unsigned address, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(address), "r"(bytes) : "memory");
}
// Returns once the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(unsigned address, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(address), "r"(parity) : "memory");
}
// The box of `map` at coordinates (c0, c1, c2) into shared memory at `target`, its bytes
// completed on `barrier`; coordinates outside the tensor land zeros.
__device__ __forceinline__ void tensor_load_3d(unsigned target, const TensorMap& map, int c0, int c1, int c2,
                                               unsigned barrier) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(target), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(barrier)
        : "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// This thread's arrival at a named barrier that other threads wait at (bar.sync), without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Shared-memory writes of this thread made visible to the async proxy (wgmma's operand reads).
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int pending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(pending) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators across a wgmma's wait.
template <int count> __device__ __forceinline__ void fence_operands(float (&d)[count]) {
#pragma unroll
    for (int i = 0; i < count; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int registers> __device__ __forceinline__ void registers_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(registers));
}
template <int registers> __device__ __forceinline__ void registers_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(registers));
}
""" + _wgmma_functions((64, 128, 256))

#: The kernel, written against :data:`INSTRUCTIONS`; ``__HEAD_DIM__`` and ``__SOFTCAP__`` are filled
#: in by :func:`kernel_source`.
KERNEL = r"""
#define HEAD_DIM __HEAD_DIM__
#define VALUE_DIM __VALUE_DIM__
#define BLOCK_KEYS __BLOCK_KEYS__
#define SOFTCAP __SOFTCAP__
// The consumers take turns at issuing their products (each one's softmax then runs while the
// other's products do): a turn a product, WG 0 first.
#define PINGPONG __PINGPONG__
// Each consumer issues a step's score product with the previous step's value product, and runs
// the one's softmax while the other's runs (two products in flight, the probabilities of the
// previous step kept in registers meanwhile).
#define OVERLAP __OVERLAP__
// The grid is (heads, tiles) rather than (tiles, heads).
#define HEADS_INNER __HEADS_INNER__
// Consumer warpgroups of 64 rows each (2 or 3), after the producer's.
#define CONSUMERS __CONSUMERS__
#define TILE_ROWS (64 * CONSUMERS)
#define THREADS (128 * (CONSUMERS + 1))
#define STAGES 2
#define NEG_INF (__int_as_float(0xff800000))
// Shared memory from a 1024-byte boundary (the swizzle's period): the query tile, then STAGES
// stages of keys, then of values, each as panels of 64 columns (128-byte rows, swizzled), then
// the mbarriers.
#define K_PANELS (HEAD_DIM / 64)
#define V_PANELS (VALUE_DIM / 64)
#define Q_PANEL_BYTES (TILE_ROWS * 128)
#define KV_PANEL_BYTES (BLOCK_KEYS * 128)
#define K_STAGE_BYTES (K_PANELS * KV_PANEL_BYTES)
#define V_STAGE_BYTES (V_PANELS * KV_PANEL_BYTES)
#define Q_OFFSET 0
#define K_OFFSET (K_PANELS * Q_PANEL_BYTES)
#define V_OFFSET (K_OFFSET + STAGES * K_STAGE_BYTES)
#define BARRIER_OFFSET (V_OFFSET + STAGES * V_STAGE_BYTES)

typedef unsigned short bf16_bits;

// The 128-byte swizzle of an offset from a 1024-byte boundary: its 16-byte chunk within its
// 128-byte row XORed with the row's place among 8 (what TMA writes and wgmma reads).
__device__ __forceinline__ unsigned swizzle_128(unsigned offset) { return offset ^ (((offset >> 7) & 7u) << 4); }

// A wgmma shared-memory operand: start address, leading and stride byte offsets, 128-byte swizzle.
__device__ __forceinline__ unsigned long long matrix_descriptor(unsigned address, unsigned leading, unsigned stride) {
    return (unsigned long long)((address & 0x3ffffu) >> 4) | ((unsigned long long)((leading & 0x3ffffu) >> 4) << 16)
           | ((unsigned long long)((stride & 0x3ffffu) >> 4) << 32) | (1ull << 62);
}
// The descriptor of a matrix `bytes` (a multiple of 16) past the one described: the address field
// (bits 0-13, the address / 16) moved on by one addition. Shared addresses stay below 2^18, so the
// field never carries into the next.
__device__ __forceinline__ unsigned long long descriptor_plus(unsigned long long descriptor, unsigned bytes) {
    return descriptor + (bytes >> 4);
}

// Grid: (query heads, tiles) with HEADS_INNER, else (tiles, query heads); THREADS threads; dynamic
// shared memory: BARRIER_OFFSET, the barriers' 8 * 4 * STAGES bytes and 1024 to reach a boundary.
// k_map and v_map: tensor maps of the caches [blocks * block_size, nkv, HEAD_DIM or VALUE_DIM]
// bf16 with boxes of (64, 1, min(block_size, BLOCK_KEYS)) and the 128-byte swizzle. q [N, nh, HEAD_DIM] f32; block_tables
// [S, max_blocks], seq_index [N], positions [N], tiles [T, 2] (first row, rows) int32; out
// [N, nh * VALUE_DIM] bf16 bits. softcap > 0 caps the logits (with SOFTCAP); sinks (f32 [nh],
// or null) adds exp(sinks[head]) to each row's denominator.
extern "C" __global__ void __launch_bounds__(THREADS, 1) prefill_attention_wgmma(
    const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map, const float* __restrict__ q,
    const int* __restrict__ block_tables, const int* __restrict__ seq_index, const int* __restrict__ positions,
    const int* __restrict__ tiles, int num_heads, int num_kv_heads, int block_size, int max_blocks, int total_slots,
    float scale, int sliding_window, float softcap, const float* __restrict__ sinks, bf16_bits* __restrict__ out)
{
    DYNAMIC_SHARED;
    const unsigned raw = shared_address(dynamic_shared);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* shared = dynamic_shared + (base - raw);
    const unsigned barriers = base + BARRIER_OFFSET;
    // Per stage: keys landed, values landed (the producer's), keys free, values free (the consumers').
    auto keys_full = [&](int stage) { return barriers + 8u * stage; };
    auto values_full = [&](int stage) { return barriers + 8u * (STAGES + stage); };
    auto keys_free = [&](int stage) { return barriers + 8u * (2 * STAGES + stage); };
    auto values_free = [&](int stage) { return barriers + 8u * (3 * STAGES + stage); };

    // The last tiles first: a sequence's later rows see more keys, and the shorter tiles then fill in.
#if HEADS_INNER
    const int tile = gridDim.y - 1 - blockIdx.y, head = blockIdx.x;
#else
    const int tile = gridDim.x - 1 - blockIdx.x, head = blockIdx.y;
#endif
    const int kv_head = head / (num_heads / num_kv_heads);
    const int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    const int* table = block_tables + (long)seq_index[first] * max_blocks;
    const int first_position = positions[first];
    const int key_end = positions[first + count - 1] + 1;
    int key_start = 0;
    if (sliding_window > 0) {
        key_start = first_position - sliding_window + 1;
        key_start = key_start < 0 ? 0 : key_start / BLOCK_KEYS * BLOCK_KEYS;
    }
    const int steps = (key_end - key_start + BLOCK_KEYS - 1) / BLOCK_KEYS;

    if (threadIdx.x == 0) {
        for (int stage = 0; stage < STAGES; ++stage) {
            barrier_init(keys_full(stage), 1);
            barrier_init(values_full(stage), 1);
            barrier_init(keys_free(stage), 128 * CONSUMERS);
            barrier_init(values_free(stage), 128 * CONSUMERS);
        }
        barrier_init_fence();
    }
    __syncthreads();

    // The warpgroup, as a value the compiler knows to be the same across each warp (a shuffle's
    // result): the products below must not sit under a branch it takes for divergent.
    const int group = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);
    if (group == 0) {
        registers_decrease<__PRODUCER_REGISTERS__>();
        // The producer: its first warp issues the tensor loads, a lane a box. A step's boxes are
        // BLOCK_KEYS / box_rows pages (or one page's rows) times the panels; lane g < pages reads the
        // block table for page g of the step before the stage is free, so the table's latency hides
        // under the wait and no lane waits on another's lookup.
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            const int box_rows = block_size < BLOCK_KEYS ? block_size : BLOCK_KEYS;
            const int pages = BLOCK_KEYS / box_rows;
            for (int step = 0; step < steps; ++step) {
                const int stage = step % STAGES;
                const unsigned round = step / STAGES;
                const int position = key_start + step * BLOCK_KEYS + (lane < pages ? lane : 0) * box_rows;
                // Rows past the tile's last key: outside the tensor, zeros.
                const int slot = position < key_end ? table[position / block_size] * block_size + position % block_size
                                                    : total_slots;
                for (int half = 0; half < 2; ++half) {
                    const int panels = half ? V_PANELS : K_PANELS;
                    const unsigned landed = half ? values_full(stage) : keys_full(stage);
                    const unsigned target = base + (half ? V_OFFSET + stage * V_STAGE_BYTES : K_OFFSET + stage * K_STAGE_BYTES);
                    barrier_wait(half ? values_free(stage) : keys_free(stage), (round & 1u) ^ 1u);
                    if (lane == 0) barrier_expect_bytes(landed, half ? V_STAGE_BYTES : K_STAGE_BYTES);
                    __syncwarp();
                    for (int first_box = 0; first_box < pages * panels; first_box += 32) {
                        const int box = first_box + lane;
                        const int page = box / panels, panel = box % panels;
                        const int page_slot = __shfl_sync(0xffffffffu, slot, page < pages ? page : 0);
                        if (box < pages * panels) {
                            tensor_load_3d(target + panel * KV_PANEL_BYTES + page * box_rows * 128, half ? v_map : k_map,
                                           panel * 64, kv_head, page_slot, landed);
                        }
                    }
                }
            }
        }
        return;
    }

    // A consumer: the tile's groups of 8 rows CONSUMERS j + consumer (j = 0 .. 7), so that the
    // consumers share the keys of a causal tile's diagonal and all have rows in a tile of more
    // than 8 per consumer; its j-th group is its warp j / 2's rows (j % 2) * 8 .. + 7, and this
    // thread's two rows are row0 and row1.
    registers_increase<__CONSUMER_REGISTERS__>();
    const int consumer = group - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int quad = lane % 4;
    const int row0 = 8 * (CONSUMERS * 2 * warp + consumer) + lane / 4, row1 = row0 + 8 * CONSUMERS;
    const int position0 = row0 < count ? positions[first + row0] : -1;
    const int position1 = row1 < count ? positions[first + row1] : -1;

    // The query rows, scaled by scale * log2(e) (the softmax runs in base 2), as bf16, 8 columns a store.
    const float query_scale = scale * 1.4426950408889634f;
    for (int e = t; e < 64 * HEAD_DIM / 8; e += 128) {
        const int r = e / (HEAD_DIM / 8), chunk = e % (HEAD_DIM / 8), row = 8 * (CONSUMERS * (r / 8) + consumer) + r % 8;
        uint4 value = make_uint4(0u, 0u, 0u, 0u);
        if (row < count) {
            const float* source = q + ((long)(first + row) * num_heads + head) * HEAD_DIM + chunk * 8;
            value = make_uint4(pack_bf16(source[0] * query_scale, source[1] * query_scale),
                               pack_bf16(source[2] * query_scale, source[3] * query_scale),
                               pack_bf16(source[4] * query_scale, source[5] * query_scale),
                               pack_bf16(source[6] * query_scale, source[7] * query_scale));
        }
        const unsigned offset = Q_OFFSET + (chunk / 8) * Q_PANEL_BYTES + row * 128 + (chunk % 8) * 16;
        *reinterpret_cast<uint4*>(shared + swizzle_128(offset)) = value;
    }
    async_proxy_fence();
    named_barrier(1 + consumer, 128);
    // Turns (two consumers only): named barrier 1 + CONSUMERS + c of 256 threads, where consumer c
    // waits (128) for the other's arrival (128). Consumer 1 gives consumer 0 the first turn; the
    // turns alternate from there, and consumer 1 passes none on after its last (it would have no taker).
    const int my_turn = 1 + CONSUMERS + consumer, their_turn = 1 + CONSUMERS + (1 - consumer);
    if (PINGPONG && consumer == 1) named_barrier_arrive(their_turn, 256);

    float best[2] = {NEG_INF, NEG_INF}, total[2] = {0.f, 0.f};
    float acc[VALUE_DIM / 2];
#pragma unroll
    for (int i = 0; i < VALUE_DIM / 2; ++i) acc[i] = 0.f;
    float scores[BLOCK_KEYS / 2];
    unsigned probabilities[BLOCK_KEYS / 16][4];
    int turns_taken = 0;
    const int turns = OVERLAP ? steps + 1 : 2 * steps;
    // A turn at issuing products: wait for it, and after issue pass it on (the last of consumer 1 has no taker).
    auto take_turn = [&]() {
        if (PINGPONG) named_barrier(my_turn, 256);
    };
    auto pass_turn = [&]() {
        ++turns_taken;
        if (PINGPONG && !(consumer == 1 && turns_taken == turns)) named_barrier_arrive(their_turn, 256);
    };
    // This consumer's groups of 8 rows, CONSUMERS * 1024 bytes apart.
    const unsigned long long queries = matrix_descriptor(base + Q_OFFSET + consumer * 1024, 16, CONSUMERS * 1024);
    // S = Q K^T of the step's keys into scores (issued and committed, not waited for).
    auto issue_scores = [&](int step) {
        const int stage = step % STAGES;
        // Each product's descriptors are the step's first ones moved on by a constant (one
        // addition each rather than the fields packed again).
        const unsigned long long keys = matrix_descriptor(base + K_OFFSET + stage * K_STAGE_BYTES, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            const unsigned long long a = descriptor_plus(queries, (kk / 4) * Q_PANEL_BYTES + (kk % 4) * 32);
            const unsigned long long b = descriptor_plus(keys, (kk / 4) * KV_PANEL_BYTES + (kk % 4) * 32);
            wgmma_ss<BLOCK_KEYS>(scores, a, b, kk > 0);
        }
        wgmma_commit();
    };
    // O += P V of the step's values (issued and committed, not waited for).
    auto issue_values = [&](int step) {
        const int stage = step % STAGES;
        // Keys 16kt .. of the stage's values: 8 keys 128 bytes apart, groups of 8 keys 1024
        // apart, panels of 64 columns KV_PANEL_BYTES apart.
        const unsigned long long values = matrix_descriptor(base + V_OFFSET + stage * V_STAGE_BYTES, KV_PANEL_BYTES, 1024);
#pragma unroll
        for (int kt = 0; kt < BLOCK_KEYS / 16; ++kt)
            wgmma_rs_mn<VALUE_DIM>(acc, probabilities[kt], descriptor_plus(values, kt * 16 * 128), 1);
        wgmma_commit();
    };
    // The step's scores capped and masked, the running maxima and sums moved on, the scores turned
    // into probabilities (float32, in place); returns each row's factor for the accumulators.
    auto softmax = [&](int step, float* rescale) {
        const int step_base = key_start + step * BLOCK_KEYS;
#if SOFTCAP
        // The logits capped, in the scores' base-2 units: log2(e) softcap * tanh(score / (log2(e) softcap)).
        const float cap = softcap * 1.4426950408889634f;
#pragma unroll
        for (int i = 0; i < BLOCK_KEYS / 2; ++i) scores[i] = cap * tanhf(scores[i] / cap);
#endif
        // scores[4j + c]: row row0 (c < 2) or row1, key step_base + 8j + 2 quad + (c & 1).
        const bool all_seen = step_base + BLOCK_KEYS - 1 <= first_position
                              && (sliding_window <= 0 || step_base > key_end - 1 - sliding_window);
        // The mask is tested once for the step, outside the loops over its scores: most steps of a
        // long prompt see every key, and a test per score costs a branch per pair of them.
        if (!all_seen) {
#pragma unroll
            for (int i = 0; i < BLOCK_KEYS / 2; ++i) {
                const int position = (i % 4) / 2 ? position1 : position0;
                const int key = step_base + 8 * (i / 4) + 2 * quad + (i & 1);
                const bool seen = key <= position && (sliding_window <= 0 || key > position - sliding_window);
                if (!seen) scores[i] = NEG_INF;
            }
        }
        float new_best[2] = {best[0], best[1]};
#pragma unroll
        for (int i = 0; i < BLOCK_KEYS / 2; ++i) new_best[(i % 4) / 2] = fmaxf(new_best[(i % 4) / 2], scores[i]);
        // Each row's exponentials are taken against its maximum, or against 0 while the row has
        // seen no key (every score then -inf, each probability exp2(-inf) = 0): one test a row
        // rather than one a score.
        float base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            new_best[h] = fmaxf(new_best[h], __shfl_xor_sync(0xffffffff, new_best[h], 1));
            new_best[h] = fmaxf(new_best[h], __shfl_xor_sync(0xffffffff, new_best[h], 2));
            rescale[h] = new_best[h] == NEG_INF ? 1.f : exp2f(best[h] - new_best[h]);
            best[h] = new_best[h];
            base[h] = new_best[h] == NEG_INF ? 0.f : new_best[h];
            total[h] *= rescale[h];
        }
#pragma unroll
        for (int i = 0; i < BLOCK_KEYS / 2; ++i) {
            const int h = (i % 4) / 2;
            const float p = exp2f(scores[i] - base[h]);
            scores[i] = p;
            total[h] += p;
        }
    };
    auto rescale_accumulators = [&](const float* rescale) {
#pragma unroll
        for (int i = 0; i < VALUE_DIM / 2; ++i) acc[i] *= rescale[(i % 4) / 2];
    };
    // Keys 16kt .. 16kt + 15 (score tiles 2kt and 2kt + 1) as the A fragment of the value product.
    auto pack_probabilities = [&]() {
#pragma unroll
        for (int kt = 0; kt < BLOCK_KEYS / 16; ++kt) {
            probabilities[kt][0] = pack_bf16(scores[8 * kt + 0], scores[8 * kt + 1]);
            probabilities[kt][1] = pack_bf16(scores[8 * kt + 2], scores[8 * kt + 3]);
            probabilities[kt][2] = pack_bf16(scores[8 * kt + 4], scores[8 * kt + 5]);
            probabilities[kt][3] = pack_bf16(scores[8 * kt + 6], scores[8 * kt + 7]);
        }
    };
    auto parity = [&](int step) { return (unsigned)(step / STAGES) & 1u; };

#if OVERLAP
    // Each turn issues the next step's scores and the previous step's values together: the
    // softmax of the one runs while the other's product does. (Every step's products run in every
    // consumer, also where none of its rows sees a key of the step: a product under a branch the
    // compiler cannot prove uniform over the warpgroup is serialized.)
    barrier_wait(keys_full(0), parity(0));
    take_turn();
    wgmma_fence();
    issue_scores(0);
    pass_turn();
    wgmma_wait<0>();
    fence_operands(scores);
    barrier_arrive(keys_free(0));
    {
        float rescale[2];
        softmax(0, rescale);
        pack_probabilities();
    }
    for (int step = 1; step < steps; ++step) {
        barrier_wait(keys_full(step % STAGES), parity(step));
        barrier_wait(values_full((step - 1) % STAGES), parity(step - 1));
        take_turn();
        wgmma_fence();
        issue_scores(step);
        issue_values(step - 1);
        pass_turn();
        // The groups complete in order: with one left in flight, the scores have landed.
        wgmma_wait<1>();
        fence_operands(scores);
        barrier_arrive(keys_free(step % STAGES));
        float rescale[2];
        softmax(step, rescale);
        wgmma_wait<0>();
        fence_operands(acc);
        barrier_arrive(values_free((step - 1) % STAGES));
        rescale_accumulators(rescale);
        pack_probabilities();
    }
    barrier_wait(values_full((steps - 1) % STAGES), parity(steps - 1));
    take_turn();
    wgmma_fence();
    issue_values(steps - 1);
    pass_turn();
    wgmma_wait<0>();
    fence_operands(acc);
    barrier_arrive(values_free((steps - 1) % STAGES));
#else
    for (int step = 0; step < steps; ++step) {
        const int stage = step % STAGES;
        barrier_wait(keys_full(stage), parity(step));
        take_turn();
        wgmma_fence();
        issue_scores(step);
        pass_turn();
        wgmma_wait<0>();
        fence_operands(scores);
        barrier_arrive(keys_free(stage));
        float rescale[2];
        softmax(step, rescale);
        rescale_accumulators(rescale);
        pack_probabilities();
        barrier_wait(values_full(stage), parity(step));
        take_turn();
        wgmma_fence();
        issue_values(step);
        pass_turn();
        wgmma_wait<0>();
        fence_operands(acc);
        barrier_arrive(values_free(stage));
    }
#endif

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 1);
        total[h] += __shfl_xor_sync(0xffffffff, total[h], 2);
        // The sink's term, exp(sink) in the scale of the running maximum (base 2); a row's own key
        // is always seen, so best is finite for every row of the tile.
        if (sinks != nullptr && best[h] != NEG_INF) total[h] += exp2f(sinks[head] * 1.4426950408889634f - best[h]);
    }
    const long row_width = (long)num_heads * VALUE_DIM;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = h ? row1 : row0;
        if (row >= count) continue;
        const float inverse = total[h] > 0.f ? 1.f / total[h] : 0.f;
        unsigned* target = reinterpret_cast<unsigned*>(out + (first + row) * row_width + head * VALUE_DIM);
#pragma unroll
        for (int dt = 0; dt < VALUE_DIM / 8; ++dt) {
            target[(dt * 8 + quad * 2) / 2] = pack_bf16(acc[4 * dt + 2 * h] * inverse, acc[4 * dt + 2 * h + 1] * inverse);
        }
    }
}
"""


def block_keys(head_dim: int, value_dim: int, consumers: int | None = None) -> int:
    """Keys a step: 128, or 64 for heads of 256 dims (the accumulators of 256 value columns leave
    registers for 64 scores a thread, not 128) and for heads of more than 64 dims with three
    consumers (160 registers a thread)."""
    consumers = consumers or consumer_groups(head_dim, value_dim)
    return 64 if max(head_dim, value_dim) > (64 if consumers == 3 else 192) else 128


def consumer_groups(head_dim: int, value_dim: int) -> int:
    """Consumer warpgroups of a block for the head sizes: 3 for :data:`THREE_CONSUMER_HEAD_DIMS`,
    else 2."""
    served = (head_dim, value_dim) in THREE_CONSUMER_HEAD_DIMS and (head_dim, value_dim) in THREE_CONSUMER_FORMS
    return 3 if served else 2


def tile_rows(head_dim: int, value_dim: int) -> int:
    """Query rows of a block for the head sizes (64 a consumer warpgroup): the most a tile of
    :func:`query_tiles` may hold for :func:`prefill_attention` at these sizes."""
    return 64 * consumer_groups(head_dim, value_dim)


def shared_bytes(head_dim: int, value_dim: int, consumers: int | None = None) -> int:
    """Dynamic shared memory of one block: the query tile, two stages of keys and of values (bf16),
    the mbarriers, and up to 1024 bytes to reach the swizzle's boundary."""
    consumers = consumers or consumer_groups(head_dim, value_dim)
    keys = block_keys(head_dim, value_dim, consumers)
    rows = 64 * consumers
    return (head_dim // 64) * rows * 128 + 2 * (head_dim + value_dim) // 64 * keys * 128 + 8 * 4 * 2 + 1024


def kernel_source(head_dim: int, value_dim: int, softcap: bool = False, with_instructions: bool = True,
                  pingpong: bool = False, overlap: bool = True, consumers: int = 2, heads_inner: bool = True) -> str:
    """The kernel's CUDA C++ for the key and value head sizes, with the logit soft cap compiled in
    or not, ``consumers`` (2 or 3) consumer warpgroups, the two consumers taking turns at their
    products (``pingpong``, two consumers only) or not, each consumer's softmax under its own
    products (``overlap``) or not, a grid of (heads, tiles) (``heads_inner``, :data:`HEADS_INNER`)
    or of (tiles, heads), with its PTX helpers, or without them for the CPU emulation, which
    brings its own."""
    if consumers not in REGISTERS:
        raise ValueError(f"consumers must be one of {sorted(REGISTERS)}, got {consumers}")
    if pingpong and consumers != 2:
        raise ValueError("the consumers take turns only when there are two")
    if consumers == 3 and (head_dim, value_dim) not in THREE_CONSUMER_FORMS:
        raise ValueError(f"three consumers serve head sizes {THREE_CONSUMER_FORMS}, not {(head_dim, value_dim)}")
    producer_registers, consumer_registers = REGISTERS[consumers]
    kernel = (KERNEL.replace("__HEAD_DIM__", str(head_dim)).replace("__VALUE_DIM__", str(value_dim))
              .replace("__BLOCK_KEYS__", str(block_keys(head_dim, value_dim, consumers)))
              .replace("__SOFTCAP__", str(int(softcap))).replace("__PINGPONG__", str(int(pingpong)))
              .replace("__OVERLAP__", str(int(overlap))).replace("__CONSUMERS__", str(consumers))
              .replace("__HEADS_INNER__", str(int(heads_inner)))
              .replace("__PRODUCER_REGISTERS__", str(producer_registers))
              .replace("__CONSUMER_REGISTERS__", str(consumer_registers)))
    return (INSTRUCTIONS if with_instructions else "") + kernel


def supports(heads: int, kv_heads: int, head_dim: int, value_dim: int, block_size: int) -> bool:
    """Whether this kernel serves the geometry: GQA with (key, value) head sizes of (64, 64),
    (128, 128), (192, 128) or (256, 256), and pages of a power of two of at least 8 rows (a page's
    rows are one tensor load, or a step's rows one of a page's)."""
    return ((head_dim, value_dim) in HEAD_DIMS and kv_heads > 0 and heads % kv_heads == 0
            and block_size >= 8 and block_size & (block_size - 1) == 0)


def box_rows(block_size: int, head_dim: int, value_dim: int) -> int:
    """Rows of one tensor load: a page's, or a step's where a page holds more."""
    return min(block_size, block_keys(head_dim, value_dim))


# ----------------------------------------------------------------------------------- tensor maps

#: CUtensorMapDataType, CUtensorMapSwizzle and friends (cuda.h).
_UINT16 = 1
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0


class TensorMapBytes(ctypes.Structure):
    """A ``CUtensorMap``: 128 opaque bytes, passed to the kernel by value (the kernel's parameter
    is 64-byte aligned; the launch copies the bytes, whatever this copy's alignment)."""

    _pack_ = 8
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_encode: list[Any] = []


def _encode_function() -> Any:
    if not _encode:
        function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        function.restype = ctypes.c_int
        _encode.append(function)
    return _encode[0]


def tensor_map(cache: DeviceArray, rows: int) -> TensorMapBytes:
    """The tensor map of a bf16 cache ``[blocks, block_size, nkv, D]`` (its bits as uint16) that
    the kernel's loads read: three dimensions (D, nkv, blocks * block_size), boxes of 64 columns of
    one KV head and ``rows`` slots (:func:`box_rows`), the 128-byte swizzle, zeros outside."""
    blocks, block_size, kv_heads, head_dim = cache.shape
    dims = (ctypes.c_uint64 * 3)(head_dim, kv_heads, blocks * block_size)
    strides = (ctypes.c_uint64 * 2)(head_dim * 2, kv_heads * head_dim * 2)
    box = (ctypes.c_uint32 * 3)(64, 1, rows)
    element_strides = (ctypes.c_uint32 * 3)(1, 1, 1)
    result = TensorMapBytes()
    status = _encode_function()(
        ctypes.byref(result), _UINT16, 3, ctypes.c_void_p(int(cache.data.ptr)), dims, strides, box, element_strides,
        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if status:
        raise KernelArgumentError(f"prefill_attention_wgmma: cuTensorMapEncodeTiled failed ({status}) for a cache of "
                                  f"shape {list(cache.shape)}")
    return result


# ---------------------------------------------------------------------------------------- launch

_kernels: dict[tuple[int, int, bool, bool, bool, int, bool], Any] = {}
_maps: dict[tuple[int, tuple[int, ...], int], TensorMapBytes] = {}


def _kernel(head_dim: int, value_dim: int, softcap: bool) -> Any:
    """The compiled kernel for the head sizes (capped logits or not): NVRTC for sm_90a, once per
    process and geometry."""
    consumers = consumer_groups(head_dim, value_dim)
    pingpong = PINGPONG and consumers == 2
    key = (head_dim, value_dim, softcap, pingpong, OVERLAP, consumers, HEADS_INNER)
    kernel = _kernels.get(key)
    if kernel is None:
        from cupy.cuda import driver

        from metrale.kernels._compile import compile_module

        source = kernel_source(head_dim, value_dim, softcap, pingpong=pingpong, overlap=OVERLAP, consumers=consumers,
                               heads_inner=HEADS_INNER)
        kernel = compile_module(source, "sm_90a").get_function("prefill_attention_wgmma")
        driver.funcSetAttribute(kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                shared_bytes(head_dim, value_dim, consumers))
        _kernels[key] = kernel
    return kernel


def _cached_map(cache: DeviceArray, rows: int) -> TensorMapBytes:
    key = (int(cache.data.ptr), tuple(cache.shape), rows)
    entry = _maps.get(key)
    if entry is None:
        entry = _maps[key] = tensor_map(cache, rows)
    return entry


def available() -> bool:
    """Whether the current device runs sm_90a code (compute capability 9.0); False where there is
    no CUDA device (or no CuPy) to ask."""
    try:
        import cupy

        return str(cupy.cuda.Device().compute_capability) == "90"
    except Exception:  # no CuPy, no driver, no device: nothing here runs sm_90a code
        return False


def prefill_attention(
    q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray, seq_index: DeviceArray,
    positions: DeviceArray, tiles: DeviceArray, scale: float, sliding_window: int | None, out: DeviceArray,
    stream: Any = None, softcap: float | None = None, sinks: DeviceArray | None = None,
) -> DeviceArray:
    """Causal attention of the rows of ``tiles`` (:func:`query_tiles` of the same head sizes, at
    most :func:`tile_rows` rows a tile) over their sequences' paged K/V: ``out [N, nh * Dv]`` bf16
    bits from ``q [N, nh, D]`` float32 and bf16 caches ``k_cache [blocks, block_size, nkv, D]``, ``v_cache [blocks,
    block_size, nkv, Dv]``, as :func:`metrale.kernels.attention_mma.prefill_attention` takes them.
    Raises :class:`~metrale.errors.KernelArgumentError` for what :func:`supports` refuses."""
    from metrale.kernels._launch import launch

    op = "prefill_attention_wgmma"
    check_array(op, "q", q, np.float32, ndim=3)
    rows, heads, head_dim = q.shape
    check_array(op, "k_cache", k_cache, np.uint16, (None, None, None, head_dim))
    blocks, block_size, kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    check_array(op, "v_cache", v_cache, np.uint16, (blocks, block_size, kv_heads, None))
    value_dim = v_cache.shape[3]
    if not supports(heads, kv_heads, head_dim, value_dim, block_size):
        raise KernelArgumentError(
            f"{op}: {heads} heads over {kv_heads} KV heads of sizes {head_dim} (keys) and {value_dim} (values) "
            f"in pages of {block_size} rows are unsupported")
    if blocks * block_size >= 2**31:
        raise KernelArgumentError(f"{op}: a cache of {blocks * block_size} slots exceeds the tensor maps' int32 rows")
    check_array(op, "block_tables", block_tables, np.int32, ndim=2)
    check_array(op, "seq_index", seq_index, np.int32, (rows,))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "tiles", tiles, np.int32, (None, 2))
    check_array(op, "out", out, np.uint16, (rows, heads * value_dim))
    if softcap is not None and not softcap >= 0:
        raise KernelArgumentError(f"{op}: softcap must be positive (or None), got {softcap}")
    if sinks is not None:
        check_array(op, "sinks", sinks, np.float32, (heads,))
    if not tiles.shape[0]:
        return out
    if HEADS_INNER and tiles.shape[0] > MAX_TILES:
        raise KernelArgumentError(f"{op}: {tiles.shape[0]} tiles exceed the grid's {MAX_TILES} (its second dimension)")
    kernel = _kernel(head_dim, value_dim, bool(softcap))
    rows_a_load = box_rows(block_size, head_dim, value_dim)
    arguments = (
        _cached_map(k_cache, rows_a_load), _cached_map(v_cache, rows_a_load), q, block_tables, seq_index, positions,
        tiles, np.int32(heads), np.int32(kv_heads), np.int32(block_size), np.int32(block_tables.shape[1]),
        np.int32(blocks * block_size), np.float32(scale), np.int32(sliding_window or 0), np.float32(softcap or 0.0),
        sinks if sinks is not None else np.uint64(0), out,
    )
    consumers = consumer_groups(head_dim, value_dim)
    threads = 128 * (consumers + 1)  # the producer's warpgroup and the consumers'
    grid = (heads, int(tiles.shape[0])) if HEADS_INNER else (int(tiles.shape[0]), heads)
    launch(kernel, grid, (threads,), arguments,
           shared_bytes(head_dim, value_dim, consumers), stream, dependent=False)
    return out


def query_tiles(row_starts: np.ndarray, head_dim: int = 128, value_dim: int | None = None) -> np.ndarray:
    """``[T, 2]`` int32 (first row, row count) tiles of at most :func:`tile_rows` rows of the head
    sizes (``value_dim`` defaults to ``head_dim``) within each segment ``row_starts[s]:row_starts[s +
    1]``: the tiles :func:`prefill_attention` takes at those sizes (a tile of more rows than its
    sizes' blocks hold would leave the rest unwritten)."""
    from metrale.kernels.attention_mma import query_tiles as tiles_of

    return tiles_of(row_starts, tile_rows(head_dim, head_dim if value_dim is None else value_dim))
