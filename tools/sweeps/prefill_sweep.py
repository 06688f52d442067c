"""Prefill attention on the GPU: the tensor-core kernel (``metrale.kernels.attention_mma``)
against the CUDA-core kernel (``metrale.kernels.attention_prefill``) on the same prompt rows.

Prints, per geometry and prompt, the microseconds of each (CUDA events) and the tensor-core
kernel's achieved TFLOP/s (4 * d flops per visible (row, key) pair and head). Run from the
repository root::

    python3 tools/sweeps/prefill_sweep.py [--lengths 512,2048,8192] [--prefix 0] [--geometries 32x8x64,32x8x128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import cuda_event_time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192", help="prompt lengths (rows)")
    parser.add_argument("--prefix", type=int, default=0, help="cached tokens before the prompt")
    parser.add_argument("--geometries", default="32x8x64,32x8x128",
                        help="heads x kv heads x head dim [x value dim], comma-separated")
    args = parser.parse_args()

    import cupy as cp

    from metrale.kernels import attention_mma, attention_prefill

    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    print(f"{'heads':>9} {'d/dv':>8} {'rows':>6} {'prefix':>6} {'mma us':>9} {'TFLOP/s':>8} {'cuda-core us':>13} {'speedup':>8}")
    geometries = [tuple(int(part) for part in geometry.split("x")) for geometry in args.geometries.split(",")]
    for heads, kv_heads, head_dim, *value in geometries:
        value_dim = value[0] if value else head_dim
        for rows in (int(n) for n in args.lengths.split(",")):
            block_size, context = 16, args.prefix + rows
            blocks = -(-context // block_size) + 1
            table = cp.asarray(np.arange(1, blocks, dtype=np.int32)[None, :])
            q = cp.asarray(rng.standard_normal((rows, heads, head_dim)).astype(np.float32))
            k_cache = cp.asarray(rng.integers(0x3C00, 0x3F80, (blocks, block_size, kv_heads, head_dim)).astype(np.uint16))
            v_cache = cp.asarray(rng.integers(0x3C00, 0x3F80, (blocks, block_size, kv_heads, value_dim)).astype(np.uint16))
            seq_index = cp.zeros(rows, dtype=np.int32)
            positions = cp.arange(args.prefix, context, dtype=np.int32)
            starts = np.array([0, rows], np.int32)
            out = cp.empty((rows, heads * value_dim), dtype=np.uint16)
            scale = head_dim**-0.5
            mma_tiles = cp.asarray(attention_mma.query_tiles(starts))
            core_tiles = cp.asarray(attention_prefill.query_tiles(starts, attention_prefill.rows_per_tile(heads, kv_heads)))
            with stream:
                mma = cuda_event_time(lambda: attention_mma.prefill_attention(
                    q, k_cache, v_cache, table, seq_index, positions, mma_tiles, scale, None, out, stream), stream)
                core = None
                if attention_prefill.supports(heads, kv_heads, head_dim, value_dim):
                    core = cuda_event_time(lambda: attention_prefill.paged_attention_prefill(
                        q, attention_prefill.as_words(k_cache), attention_prefill.as_words(v_cache), table, seq_index,
                        positions, core_tiles, scale, None, out, stream), stream, repeats=3, warmup=1)
            pairs = rows * args.prefix + rows * (rows + 1) / 2
            tflops = 2 * (head_dim + value_dim) * heads * pairs / mma.median / 1e12
            line = (f"{heads:>4}/{kv_heads:<4} {head_dim:4d}/{value_dim:<3d} {rows:6d} {args.prefix:6d} {mma.median_us:9.1f} "
                    f"{tflops:8.1f}")
            if core is not None:
                line += f" {core.median_us:13.1f} {core.median / mma.median:7.1f}x"
            print(line)


if __name__ == "__main__":
    main()
