"""Which part of a decode-attention key loop costs the time (diagnostic, GPU only).

    python tools/attention_probe.py

Builds stripped variants of a key loop with the grid and loads of
:func:`metrale.kernels.attention_grouped.paged_attention_grouped_kernel` and times each like
``profile_decode.py``: ``loads`` (block ids and K/V words only), ``dots`` (plus the q.k products),
``sums`` (plus a butterfly shuffle sum per (key, head) pair, as the kernel did before its
reduce-scatter), and ``full`` (the kernel as it is).
"""

from __future__ import annotations

import numpy as np


def make_variant(mode: int):
    from numba import cuda, float32, int64, uint32, uint64

    from metrale.kernels._device import bits_to_float

    keys_in_flight = 8
    threads = 128

    @cuda.jit
    def variant(q, k_words, v_words, block_tables, positions, out):
        row = cuda.blockIdx.x
        split = cuda.blockIdx.z
        splits = cuda.gridDim.z
        tid = cuda.threadIdx.x
        words = k_words.shape[3]
        lane = tid % words
        lane_group = tid // words
        lane_groups = threads // words
        kv_head = cuda.blockIdx.y
        block_size = k_words.shape[1]
        position = positions[row]
        per_split = (position + 1 + splits - 1) // splits
        lo = split * per_split
        hi = min(position + 1, lo + per_split)
        k_loaded = cuda.local.array(keys_in_flight, uint64)
        v_loaded = cuda.local.array(keys_in_flight, uint64)
        block_ids = cuda.local.array(keys_in_flight, int64)
        query = cuda.local.array(16, float32)
        for i in range(16):
            query[i] = q[row, kv_head * 4 + i // 4, 4 * lane + i % 4]
        total = float32(0.0)
        bits = uint64(0)
        step = lane_groups * keys_in_flight
        last_key = max(hi - 1, 0)
        for u in range(keys_in_flight):
            block_ids[u] = block_tables[row, min(lo + lane_group * keys_in_flight + u, last_key) // block_size]
        for base in range(lo, hi, step):
            first_key = base + lane_group * keys_in_flight
            for u in range(keys_in_flight):
                offset = min(first_key + u, last_key) % block_size
                k_loaded[u] = k_words[block_ids[u], offset, kv_head, lane]
                v_loaded[u] = v_words[block_ids[u], offset, kv_head, lane]
            for u in range(keys_in_flight):
                block_ids[u] = block_tables[row, min(first_key + step + u, last_key) // block_size]
            if mode == 0:
                for u in range(keys_in_flight):
                    bits ^= k_loaded[u] ^ v_loaded[u]
            else:
                for u in range(keys_in_flight):
                    half = uint32(k_loaded[u] & uint64(0xFFFFFFFF))
                    other = uint32(v_loaded[u] >> uint64(32))
                    for g in range(4):
                        value = query[g * 4] * bits_to_float(half << uint32(16)) + query[g * 4 + 1] * bits_to_float(
                            half & uint32(0xFFFF0000)) + query[g * 4 + 2] * bits_to_float(other << uint32(16))
                        if mode == 2:
                            for s in range(5):
                                offset_lanes = 16 >> s
                                if offset_lanes < words:
                                    value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset_lanes)
                        total += value
        out[row, kv_head * 128 + tid, split] = total + float32(bits & uint64(1))

    return variant


def main() -> None:
    import cupy as cp

    from metrale.cuda_backend import CudaBackend
    from metrale.kernels import attention_grouped
    from metrale.kernels._device import device_view, numba_stream
    from profile_decode import graph_time_us

    backend = CudaBackend()
    launch = numba_stream(backend.stream)
    d, heads, kv, context = 128, 32, 8, 512
    variants = {name: make_variant(mode) for mode, name in enumerate(("loads", "dots", "sums"))}
    for rows, splits in ((1, 1), (1, 16), (32, 4)):
        blocks_per_seq = context // 16
        k = cp.asarray(np.random.default_rng(0).integers(0, 2**14, (rows * blocks_per_seq + 1, 16, kv, d)).astype(np.uint16))
        tables = cp.arange(1, rows * blocks_per_seq + 1, dtype=np.int32).reshape(rows, blocks_per_seq)
        positions = cp.full(rows, context - 1, dtype=np.int32)
        q = cp.asarray(np.random.default_rng(1).standard_normal((rows, heads, d)).astype(np.float32))
        out = cp.zeros((rows, kv * 128, splits), dtype=np.float32)
        line = f"rows {rows:2d} splits {splits:2d}:"
        for name, kernel in variants.items():
            def call(kernel=kernel):
                kernel[(rows, kv, splits), 128, launch](
                    device_view(q), device_view(k.view(np.uint64)), device_view(k.view(np.uint64)),
                    device_view(tables), device_view(positions), device_view(out))
            line += f"  {name} {graph_time_us(backend, call):7.2f} us"
        acc = cp.zeros((rows, heads, splits, d), dtype=np.float32)
        best = cp.zeros((rows, heads, splits), dtype=np.float32)
        total = cp.zeros((rows, heads, splits), dtype=np.float32)
        seq_index = cp.arange(rows, dtype=np.int32)
        result = cp.zeros((rows, heads * d), dtype=np.uint16)

        def full():
            attention_grouped.paged_attention_grouped_kernel[(rows, kv, splits), 128, launch](
                device_view(q), device_view(k.view(np.uint64)), device_view(k.view(np.uint64)), device_view(tables),
                device_view(seq_index), device_view(positions), np.float32(0.1), np.int32(0),
                device_view(acc), device_view(best), device_view(total), device_view(result))

        line += f"  full {graph_time_us(backend, full):7.2f} us"
        print(line)


if __name__ == "__main__":
    main()
