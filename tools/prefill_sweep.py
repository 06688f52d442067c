"""GPU time of the prefill attention kernel alone, by prompt length and head geometry.

    python tools/prefill_sweep.py [--lengths 512,2048] [--geometries 32x8x64,32x8x128]

For each geometry (query heads x KV heads x head dim) and prompt length, builds one sequence's
paged cache and queries with random values, times :func:`metrale.kernels.attention_prefill.
paged_attention_prefill` over the whole prompt (replayed from a CUDA graph by
``timing.graph_time``, so launch overhead is left out) and prints microseconds and the achieved
TFLOP/s of its causal products (2 x 2 x heads x head dim per visible query-key pair). Needs a CUDA device.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048", help="prompt lengths (comma-separated)")
    parser.add_argument("--geometries", default="32x8x64,32x8x128", help="heads x kv heads x head dim, comma-separated")
    args = parser.parse_args()

    import cupy as cp
    from timing import graph_time

    from metrale.cuda_backend import CudaBackend
    from metrale.kernels import attention_prefill

    backend = CudaBackend()
    block_size = 16
    rng = np.random.default_rng(0)
    for geometry in args.geometries.split(","):
        heads, kv_heads, head_dim = (int(part) for part in geometry.split("x"))
        for length in (int(value) for value in args.lengths.split(",")):
            blocks = -(-length // block_size)
            shape = (blocks + 1, block_size, kv_heads, head_dim)
            k_cache = cp.asarray(rng.integers(0, 2**14, shape).astype(np.uint16))
            v_cache = cp.asarray(rng.integers(0, 2**14, shape).astype(np.uint16))
            tables = cp.arange(1, blocks + 1, dtype=np.int32).reshape(1, blocks)
            seq_index = cp.zeros(length, dtype=np.int32)
            positions = cp.arange(length, dtype=np.int32)
            q = cp.asarray(rng.standard_normal((length, heads, head_dim)).astype(np.float32))
            tiles = cp.asarray(attention_prefill.query_tiles(
                np.array([0, length]), attention_prefill.rows_per_tile(heads, kv_heads)))
            out = cp.zeros((length, heads * head_dim), dtype=np.uint16)

            def prefill():
                attention_prefill.paged_attention_prefill(
                    q, attention_prefill.as_words(k_cache), attention_prefill.as_words(v_cache), tables, seq_index,
                    positions, tiles, head_dim**-0.5, None, out, backend.stream,
                )

            microseconds = graph_time(backend, prefill).median_us
            flops = 4.0 * heads * head_dim * length * (length + 1) / 2
            print(f"heads {heads:3d} kv {kv_heads:2d} dim {head_dim:3d} prompt {length:5d}: "
                  f"{microseconds:9.1f} us  {flops / microseconds / 1e6:6.2f} TFLOP/s")


if __name__ == "__main__":
    main()
