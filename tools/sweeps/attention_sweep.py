"""GPU time of the decode attention kernels over batch sizes, contexts, warps and split counts.

    python tools/sweeps/attention_sweep.py [--head-dim 128] [--contexts 512,2048] [--warps 2,4,8]
    python tools/sweeps/attention_sweep.py --mma [--head-dim 64] [--rows 1,8] [--splits 1,2,4,8,16] [--stages 3,5]

Prints, for each batch size, context, split count and warps per block, the grouped kernel alone,
the staged kernel (:mod:`metrale.kernels.attention_staged`, four warps) alone, the combine
kernel alone (one per split count) and an empty kernel (the per-node cost of a graph), each
replayed from a CUDA graph (``timing.graph_time``); ``<- split_count`` marks the split count the
launcher picks. ``--mma`` times the tensor-core decode kernel
(:mod:`metrale.kernels.attention_decode_mma`) instead, at each split count, merging its own
splits (with counters) and followed by the combine kernel, marking the launcher's split count:
a decode row's attention is a chain of dependent reads (its table, its keys, the partials, the
merge) more than a stream of bytes at short contexts, so fewer splits may win there. ``--stages``
times each of those stage counts instead of the launcher's choice (``stages`` in the lines).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--rows", default="1,32", help="batch sizes (comma-separated)")
    parser.add_argument("--contexts", default="512,2048", help="cached tokens per row (comma-separated)")
    parser.add_argument("--warps", default="2,4,8", help="warps per block (comma-separated)")
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--mma", action="store_true",
                        help="the tensor-core decode kernel at each of --splits, merging its own splits and with the "
                             "combine kernel")
    parser.add_argument("--stages", default="",
                        help="with --mma: shared-memory stage counts to time (comma-separated; default the launcher's)")
    parser.add_argument("--compare", action="store_true",
                        help="time paged_attention_decode as the engine runs it (the registry's kernel, its split "
                             "choice, the combine) with the tensor-core kernel off and on, instead of the per-kernel "
                             "sweep")
    args = parser.parse_args()

    import cupy as cp
    from numba import cuda
    from timing import graph_time

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import attention_grouped, attention_staged
    from metrale.kernels._device import device_view, numba_stream

    @cuda.jit
    def empty_kernel(x):
        pass

    backend = CudaBackend()
    stream = backend.stream
    launch = numba_stream(stream)
    d, heads, kv = args.head_dim, args.heads, args.kv_heads
    dummy = cp.zeros(1, dtype=np.float32)
    print(f"empty kernel: {graph_time(backend, lambda: empty_kernel[1, 32, launch](device_view(dummy))).median_us:.2f} us")
    if args.compare:
        compare(args, backend)
        return
    if args.mma:
        sweep_mma(args, backend)
        return
    kernel = attention_grouped.grouped_kernel(d // 4)
    staged_kernel = attention_staged.staged_kernel(d // 4)
    for rows, context in [(r, int(c)) for r in map(int, args.rows.split(",")) for c in args.contexts.split(",")]:
        blocks_per_seq = -(-context // 16)
        cache_shape = (rows * blocks_per_seq + 1, 16, kv, d)
        k = cp.asarray(np.random.default_rng(0).integers(0, 2**15, cache_shape).astype(np.uint16) & 0x3FFF)
        v = k.copy()
        tables = cp.arange(1, rows * blocks_per_seq + 1, dtype=np.int32).reshape(rows, blocks_per_seq)
        seq_index = cp.arange(rows, dtype=np.int32)
        positions = cp.full(rows, context - 1, dtype=np.int32)
        q = cp.asarray(np.random.default_rng(1).standard_normal((rows, heads, d)).astype(np.float32))
        out = cp.zeros((rows, heads * d), dtype=np.uint16)
        kv_bytes = 2 * rows * context * kv * d * 2
        chosen = attention_grouped.split_count(rows, heads, kv, context)
        for splits in [int(s) for s in args.splits.split(",")]:
            acc = cp.zeros((rows, heads, splits, d), dtype=np.float32)
            best = cp.zeros((rows, heads, splits), dtype=np.float32)
            total = cp.zeros((rows, heads, splits), dtype=np.float32)
            grid = (rows, kv * attention_grouped.head_blocks(heads, kv), splits)

            def combine():
                attention_grouped.grouped_combine_kernel[(rows, heads), attention_grouped.COMBINE_THREADS, launch](
                    device_view(acc), device_view(best), device_view(total), device_view(out)
                )

            c = graph_time(backend, combine).median_us if splits > 1 else 0.0
            cells = []
            for warps in [int(w) for w in args.warps.split(",")]:

                def grouped():
                    kernel[grid, attention_grouped.WARP * warps, launch](
                        device_view(q), device_view(attention_grouped.as_rows(k)), device_view(attention_grouped.as_rows(v)),
                        np.int32(16), np.int32(kv),
                        device_view(tables), device_view(seq_index), device_view(positions), np.float32(d**-0.5),
                        np.int32(0), device_view(acc), device_view(best), device_view(total), device_view(out),
                    )

                g = graph_time(backend, grouped).median_us
                cells.append(f"{warps:2d} warps {g:7.2f} us ({kv_bytes / g / 1e3:5.0f} GB/s)")

            def staged():
                staged_kernel[grid, attention_staged.STAGED_THREADS, launch](
                    device_view(q), device_view(attention_grouped.as_rows(k)), device_view(attention_grouped.as_rows(v)),
                    np.int32(16), np.int32(kv),
                    device_view(tables), device_view(seq_index), device_view(positions), np.float32(d**-0.5),
                    np.int32(0), device_view(acc), device_view(best), device_view(total), device_view(out),
                )

            s = graph_time(backend, staged).median_us
            cells.append(f"staged {s:7.2f} us ({kv_bytes / s / 1e3:5.0f} GB/s)")
            mark = "  <- split_count" if splits == chosen else ""
            print(f"rows {rows:3d} context {context:5d} splits {splits:3d}: " + "  ".join(cells)
                  + f"  combine {c:6.2f} us{mark}")
    for name, compiled in (("grouped", kernel), ("staged", staged_kernel)):
        print(f"{name} kernel registers", compiled.get_regs_per_thread(), "local bytes",
              compiled.get_local_mem_per_thread(), "shared bytes", compiled.get_shared_mem_per_block())

def sweep_mma(args, backend) -> None:
    """The tensor-core decode kernel at each split count of ``--splits`` for every batch size and
    context: merging its own splits, and followed by the combine kernel; GB/s of the cache reads."""
    import cupy as cp
    from timing import graph_time

    from metrale.kernels import attention_decode_mma as mma

    d, heads, kv = args.head_dim, args.heads, args.kv_heads
    print(f"heads {heads} kv heads {kv} head dim {d}")
    for rows, context in [(r, int(c)) for r in map(int, args.rows.split(",")) for c in args.contexts.split(",")]:
        blocks_per_seq = -(-context // 16)
        cache_shape = (rows * blocks_per_seq + 1, 16, kv, d)
        k = cp.asarray(np.random.default_rng(0).integers(0, 2**15, cache_shape).astype(np.uint16) & 0x3FFF)
        v = k.copy()
        tables = cp.arange(1, rows * blocks_per_seq + 1, dtype=np.int32).reshape(rows, blocks_per_seq)
        seq_index = cp.arange(rows, dtype=np.int32)
        positions = cp.full(rows, context - 1, dtype=np.int32)
        q = cp.asarray(np.random.default_rng(1).standard_normal((rows, heads, d)).astype(np.float32))
        out = cp.zeros((rows, heads * d), dtype=np.uint16)
        counters = cp.zeros(max(1, mma.counter_count(rows, heads, kv)), dtype=np.int32)
        kv_bytes = 2 * rows * context * kv * d * 2
        chosen = mma.device_split_count(rows, heads, kv, d, context)
        for splits, stage_count in [(int(s), int(c) if c else None) for s in args.splits.split(",")
                                    for c in (args.stages.split(",") if args.stages else [""])]:
            mma.STAGES_OVERRIDE = stage_count
            space = (cp.zeros((rows, heads, splits, d), dtype=np.float32), cp.zeros((rows, heads, splits), dtype=np.float32),
                     cp.zeros((rows, heads, splits), dtype=np.float32))
            cells = []
            for label, merge in (("merged", counters), ("combined", None)):

                def run():
                    mma.decode_attention(q, k, v, tables, seq_index, positions, d**-0.5, None, space, out,
                                         backend.stream, merge)

                t = graph_time(backend, run).median_us
                cells.append(f"{label} {t:7.2f} us ({kv_bytes / t / 1e3:5.0f} GB/s)")
            used = mma.launch_stages(rows, heads, kv, d, splits, context, mma.multiprocessor_count())
            mark = "  <- split_count" if splits == chosen else ""
            print(f"rows {rows:3d} context {context:5d} splits {splits:3d} stages {used}: " + "  ".join(cells) + mark)
        mma.STAGES_OVERRIDE = None


def compare(args, backend) -> None:
    """``paged_attention_decode`` as the engine runs it (the registry's choice of kernel, its split
    count for the context as the engine's graphs size them, combine included) with the tensor-core
    kernel turned off (METRALE_DECODE_MMA=0: the CUDA-core kernels) and on; GB/s of the cache reads."""
    from dataclasses import replace
    from types import SimpleNamespace

    import cupy as cp
    from timing import graph_time

    from metrale.backends.cuda import CudaBackend

    backends = {choice: CudaBackend(environment=replace(backend.environment, decode_mma=choice == "mma"))
                for choice in ("cores", "mma")}
    d, heads, kv = args.head_dim, args.heads, args.kv_heads
    print(f"heads {heads} kv heads {kv} head dim {d}")
    for rows, context in [(r, int(c)) for r in map(int, args.rows.split(",")) for c in args.contexts.split(",")]:
        blocks_per_seq = -(-context // 16)
        cache_shape = (rows * blocks_per_seq + 1, 16, kv, d)
        k = cp.asarray(np.random.default_rng(0).integers(0, 2**15, cache_shape).astype(np.uint16) & 0x3FFF)
        v = k.copy()
        tables = cp.arange(1, rows * blocks_per_seq + 1, dtype=np.int32).reshape(rows, blocks_per_seq)
        batch = SimpleNamespace(block_tables=tables, seq_index=cp.arange(rows, dtype=np.int32),
                                positions=cp.full(rows, context - 1, dtype=np.int32), max_context=context, extras={})
        q = cp.asarray(np.random.default_rng(1).standard_normal((rows, heads, d)).astype(np.float32))
        out = cp.zeros((rows, heads * d), dtype=np.uint16)
        kv_bytes = 2 * rows * context * kv * d * 2
        cells = []
        for choice, chosen in backends.items():
            def run(ops=chosen.ops):
                ops.paged_attention_decode(q, k, v, batch, d**-0.5, None, out, 0)

            kernel = next(entry for entry, _ in chosen.ops.paged_attention_decode.kernels
                          if entry.when is None or entry.when(q, k, v, batch, d**-0.5, None, out, 0))
            t = graph_time(chosen, run).median_us
            cells.append(f"{choice} {t:8.2f} us {kv_bytes / t / 1e3:6.0f} GB/s ({kernel.name.split(' (')[0]})")
        print(f"rows {rows:3d} context {context:5d}: " + "   ".join(cells))
    for chosen in backends.values():
        chosen.close()


if __name__ == "__main__":
    main()
