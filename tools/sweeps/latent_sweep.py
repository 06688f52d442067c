"""GPU time and bandwidth of MLA's absorbed decode attention, by batch, context and heads.

    python tools/sweeps/latent_sweep.py [--rows 1,32] [--contexts 512,2048,8192] [--heads 16,128]
               [--kernel mma] [--kv-cache-dtype auto,fp8]

For each case, builds a paged latent cache of 576-value rows (DeepSeek-V2 / V3: 512 latent + 64
RoPE dims, bf16) with one sequence per row, times :func:`metrale.kernels.attention_latent.
latent_attention` (the kernel and the split merge, replayed from a CUDA graph by
``timing.graph_time``) and prints microseconds and the GB/s of the latent rows it must read
(rows x context x 1152 bytes). ``--kernel mma`` times the tensor-core kernel of
:mod:`metrale.kernels.attention_latent_mma` instead (heads in multiples of 16).
``--kv-cache-dtype fp8`` times each case over an FP8 cache as well (E4M3 codes and a float32 scale
a row, :class:`metrale.kernels.kv_cache_fp8.Fp8CacheArray`: rows of 580 bytes). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32", help="decode rows (comma-separated)")
    parser.add_argument("--contexts", default="512,2048,8192", help="cached tokens per row (comma-separated)")
    parser.add_argument("--heads", default="16,128", help="query heads (comma-separated)")
    parser.add_argument("--kernel", choices=("cores", "mma"), default="cores",
                        help="CUDA-core kernel (attention_latent) or tensor cores (attention_latent_mma)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="cache dtypes to time, comma-separated: auto (bf16 latents), fp8")
    args = parser.parse_args()
    dtypes = args.kv_cache_dtype.split(",")
    if not set(dtypes) <= {"auto", "fp8"}:
        parser.error(f"--kv-cache-dtype takes auto and fp8, got {args.kv_cache_dtype!r}")

    import cupy as cp
    from timing import graph_time

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import attention_latent, attention_latent_mma
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    backend = CudaBackend()
    kernel = attention_latent_mma if args.kernel == "mma" else attention_latent
    width, value_dim, block_size = 576, 512, 16
    rng = np.random.default_rng(0)
    for heads in (int(h) for h in args.heads.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                blocks = -(-context // block_size)
                shape = (rows * blocks + 1, block_size, width)
                caches = {"auto": (cp.asarray(rng.integers(0, 2**14, shape).astype(np.uint16)), 2 * width),
                          "fp8": (Fp8CacheArray(cp.asarray(rng.integers(0, 0x7F, shape).astype(np.uint8)),
                                                cp.full(shape[:2], 0.01, dtype=cp.float32)), width + 4)}
                tables = cp.asarray((1 + np.arange(rows * blocks, dtype=np.int32)).reshape(rows, blocks))
                seq_index = cp.arange(rows, dtype=cp.int32)
                positions = cp.full(rows, context - 1, dtype=cp.int32)
                q = cp.asarray(rng.standard_normal((rows, heads, width)).astype(np.float32))
                out = cp.empty((rows, heads * value_dim), dtype=cp.uint16)
                splits = (attention_latent_mma.split_count(rows, heads, context, attention_latent_mma.multiprocessor_count())
                          if args.kernel == "mma" else attention_latent.split_count(rows, heads, context))
                for dtype in dtypes:
                    latent, row_bytes = caches[dtype]

                    def call():
                        kernel.latent_attention(q, latent, tables, seq_index, positions, value_dim, 0.1,
                                                context, out, backend.stream)

                    micros = graph_time(backend, call).median_us
                    gigabytes = rows * context * row_bytes / 1e9
                    print(f"{dtype:4} heads {heads:4d} rows {rows:3d} context {context:6d} splits {splits:3d}: "
                          f"{micros:9.1f} us {gigabytes / micros * 1e6:8.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
