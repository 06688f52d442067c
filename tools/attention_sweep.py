"""GPU time of the decode attention kernels over batch sizes and split counts.

    python tools/attention_sweep.py [--head-dim 128] [--context 512]

Prints, for each batch size and split count, the grouped kernel alone, the combine kernel alone
and an empty kernel (the per-node cost of a graph), each timed as in ``profile_decode.py``.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()

    import cupy as cp
    from numba import cuda

    from metrale.cuda_backend import CudaBackend
    from metrale.kernels import attention, attention_grouped
    from metrale.kernels._device import device_view, numba_stream
    from profile_decode import graph_time_us

    @cuda.jit
    def empty_kernel(x):
        pass

    backend = CudaBackend()
    stream = backend.stream
    launch = numba_stream(stream)
    d, heads, kv = args.head_dim, args.heads, args.kv_heads
    dummy = cp.zeros(1, dtype=np.float32)
    print(f"empty kernel: {graph_time_us(backend, lambda: empty_kernel[1, 32, launch](device_view(dummy))):.2f} us")
    for rows in (1, 32):
        blocks_per_seq = -(-args.context // 16)
        cache_shape = (rows * blocks_per_seq + 1, 16, kv, d)
        k = cp.asarray(np.random.default_rng(0).integers(0, 2**15, cache_shape).astype(np.uint16) & 0x3FFF)
        v = k.copy()
        tables = cp.arange(1, rows * blocks_per_seq + 1, dtype=np.int32).reshape(rows, blocks_per_seq)
        seq_index = cp.arange(rows, dtype=np.int32)
        positions = cp.full(rows, args.context - 1, dtype=np.int32)
        q = cp.asarray(np.random.default_rng(1).standard_normal((rows, heads, d)).astype(np.float32))
        out = cp.zeros((rows, heads * d), dtype=np.uint16)
        kv_bytes = 2 * rows * args.context * kv * d * 2
        for splits in (1, 2, 4, 8, 16, 32):
            acc = cp.zeros((rows, heads, splits, d), dtype=np.float32)
            best = cp.zeros((rows, heads, splits), dtype=np.float32)
            total = cp.zeros((rows, heads, splits), dtype=np.float32)
            grid = (rows, kv * attention_grouped.head_blocks(heads, kv), splits)

            def grouped():
                attention_grouped.paged_attention_grouped_kernel[grid, attention_grouped.DECODE_THREADS, launch](
                    device_view(q), device_view(k.view(np.uint64)), device_view(v.view(np.uint64)),
                    device_view(tables), device_view(seq_index), device_view(positions), np.float32(d**-0.5),
                    np.int32(0), device_view(acc), device_view(best), device_view(total), device_view(out),
                )

            def combine():
                attention_grouped.grouped_combine_kernel[(rows, heads), attention_grouped.COMBINE_THREADS, launch](
                    device_view(acc), device_view(best), device_view(total), device_view(out)
                )

            g = graph_time_us(backend, grouped)
            c = graph_time_us(backend, combine) if splits > 1 else 0.0
            if rows == 1 and splits == 1:
                kernel = attention_grouped.paged_attention_grouped_kernel
                print("grouped kernel registers", kernel.get_regs_per_thread(), "local bytes",
                      kernel.get_local_mem_per_thread(), "shared bytes", kernel.get_shared_mem_per_block())
            print(f"rows {rows:3d} splits {splits:3d}: grouped {g:8.2f} us ({kv_bytes / g / 1e3:6.0f} GB/s)  combine {c:6.2f} us")


if __name__ == "__main__":
    main()
