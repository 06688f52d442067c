"""Which part of the decode-attention kernel costs the time (diagnostic, GPU only).

    python tools/profiling/attention_probe.py [--rows 1] [--context 512] [--splits 16]

Compiles variants of the kernel of :func:`metrale.kernels.attention_grouped.grouped_kernel`
cut short at successive points of its source and times each, replayed from a CUDA graph
(``timing.graph_time``): ``arguments`` (returns at once), ``setup`` (queries staged in shared
memory), ``tiles`` (the key loop, its result written without the merge of the warps) and
``full`` (the kernel as it is).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

# (variant, source line after which it returns, statement that keeps the work alive)
CUTS = [
    ("arguments", "    row = cuda.blockIdx.x\n", ""),
    ("setup", "    cuda.syncthreads()\n", "    out[row, tid] = uint16(query[tid])\n"),
    # every accumulator and running sum kept, so none of the loop's work is dead code
    ("tiles", "    # Per warp: sums over lanes",
     "    out[row, tid] = uint16(" + " + ".join([f"acc[{i}]" for i in range(16)] + [f"running_sum[{g}]" for g in range(4)])
     + ")\n"),
]


def variant(cut: str, keep: str):
    from numba import cuda

    from metrale.kernels import attention_grouped

    kernel = attention_grouped.grouped_kernel(32)  # 128 dims
    source = textwrap.dedent(inspect.getsource(kernel.py_func))
    source = source.split("\n", 1)[1]  # drop the decorator
    at = source.index(cut) + (len(cut) if cut.endswith("\n") else 0)
    source = source[:at] + keep + "    return\n" + source[at:]
    namespace = dict(vars(attention_grouped))
    namespace["uint16"] = np.uint16
    namespace["word_count"] = 32
    exec(compile(source, "<probe>", "exec"), namespace)
    return cuda.jit(namespace["paged_attention_grouped_kernel"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--splits", type=int, default=16)
    parser.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()

    import cupy as cp
    from timing import graph_time

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import attention_grouped
    from metrale.kernels._device import device_view, numba_stream

    backend = CudaBackend()
    launch = numba_stream(backend.stream)
    rows, context, splits, heads, kv, d = args.rows, args.context, args.splits, 32, 8, 128
    blocks_per_seq = -(-context // 16)
    k = cp.asarray(np.random.default_rng(0).integers(0, 2**14, (rows * blocks_per_seq + 1, 16, kv, d)).astype(np.uint16))
    tables = cp.arange(1, rows * blocks_per_seq + 1, dtype=np.int32).reshape(rows, blocks_per_seq)
    seq_index = cp.arange(rows, dtype=np.int32)
    positions = cp.full(rows, context - 1, dtype=np.int32)
    q = cp.asarray(np.random.default_rng(1).standard_normal((rows, heads, d)).astype(np.float32))
    out = cp.zeros((rows, heads * d), dtype=np.uint16)
    acc = cp.zeros((rows, heads, splits, d), dtype=np.float32)
    best = cp.zeros((rows, heads, splits), dtype=np.float32)
    total = cp.zeros((rows, heads, splits), dtype=np.float32)
    grid = (rows, kv * attention_grouped.head_blocks(heads, kv), splits)
    variants = [(name, variant(cut, keep)) for name, cut, keep in CUTS]
    variants.append(("full", attention_grouped.grouped_kernel(d // 4)))
    for name, kernel in variants:

        def call(kernel=kernel):
            kernel[grid, attention_grouped.WARP * args.warps, launch](
                device_view(q), device_view(attention_grouped.as_rows(k)), device_view(attention_grouped.as_rows(k)),
                np.int32(16), np.int32(kv), device_view(tables),
                device_view(seq_index), device_view(positions), np.float32(d**-0.5), np.int32(0), device_view(acc),
                device_view(best), device_view(total), device_view(out),
            )

        us = graph_time(backend, call).median_us
        regs = list(kernel.get_regs_per_thread().values())
        local = list(kernel.get_local_mem_per_thread().values())
        print(f"{name:10s} {us:8.2f} us   registers {regs}  local bytes {local}")


if __name__ == "__main__":
    main()
