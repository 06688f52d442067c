"""GPU time of MLA's per-head products (``head_linear``) by rows: the CUDA C++ kernel against one
cuBLAS product per head, at DeepSeek-V2-Lite's sizes by default.

    python3 tools/sweeps/head_linear_sweep.py [--rows 1,2,4,8,16,32] [--heads 16] [--rank 512] [--nope 128]

Times the key product (a strided float32 view of the queries' no-RoPE part, ``[rows, heads,
nope]``, by ``w_uk [heads * rank, nope]``) and the value product (bf16 ``[rows, heads, rank]`` by
``w_uv [heads * nope, rank]``) both ways, each replayed from a CUDA graph (``timing.graph_time``;
the cuBLAS path includes rounding the float32 input to bf16, as the op does). The op layer takes
the kernel up to :data:`metrale.ops.selection.HEAD_LINEAR_WORD_ROWS` rows. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="rows (comma-separated)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rank", type=int, default=512, help="the latent width (kv_lora_rank)")
    parser.add_argument("--nope", type=int, default=128, help="the no-RoPE query width and the value width")
    parser.add_argument("--rope", type=int, default=64, help="the RoPE query width (beside the no-RoPE part)")
    args = parser.parse_args()

    import cupy as cp
    from timing import graph_time

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import head_linear

    backend = CudaBackend()
    kernels = backend.kernels
    heads, rank, nope = args.heads, args.rank, args.nope
    rng = np.random.default_rng(0)
    with backend.activate():
        w_uk = cp.asarray(rng.integers(0x3C00, 0x3C80, (heads * rank, nope)).astype(np.uint16))
        w_uv = cp.asarray(rng.integers(0x3C00, 0x3C80, (heads * nope, rank)).astype(np.uint16))
    print(f"heads {heads}, rank {rank}, no-RoPE width {nope}: microseconds per product")
    print(f"{'rows':>5} {'key: kernel':>12} {'key: cuBLAS':>12} {'value: kernel':>14} {'value: cuBLAS':>14}")
    for rows in (int(r) for r in args.rows.split(",")):
        with backend.activate():
            queries = cp.asarray(rng.standard_normal((rows, heads, nope + args.rope)).astype(np.float32))
            mixed = cp.asarray(rng.integers(0x3C00, 0x3C80, (rows, heads, rank)).astype(np.uint16))
            key_out = cp.empty((rows, heads, rank), np.float32)
            value_out = cp.empty((rows, heads, nope), np.float32)
        key_in = queries[:, :, :nope]
        times = []
        for x, weight, out in ((key_in, w_uk, key_out), (mixed, w_uv, value_out)):
            def words(x=x, weight=weight, out=out):
                head_linear.head_linear_words(x, weight, out, backend.stream)

            def per_head(x=x, weight=weight, out=out):
                kernels.gemm.per_head(kernels.as_bf16(x) if x.dtype == np.float32 else x, weight, out)

            times += [graph_time(backend, words).median * 1e6, graph_time(backend, per_head).median * 1e6]
        print(f"{rows:5d} {times[0]:12.1f} {times[1]:12.1f} {times[2]:14.1f} {times[3]:14.1f}")


if __name__ == "__main__":
    main()
