"""The batch-invariant product (:mod:`metrale.kernels.linear_invariant` and the decode GEMV that
takes decode rows under the mode) beside cuBLAS on the Llama-8B shape's projections and LM head:
milliseconds a call, the weights' GB/s and TFLOP/s, by row count.

    python3 tools/sweeps/invariant_linear_sweep.py [--rows 1,32,64,512,2048] [--tilings 8,1,1,4,4 2,4,4,4,3]

``--tilings`` times other tilings of the tiled kernel beside the launcher's (each
``warps_n,warps_m,column_tiles,row_tiles,stages``; every tiling sums in the same order, so any
may replace :data:`~metrale.kernels.linear_invariant.NARROW` or
:data:`~metrale.kernels.linear_invariant.WIDE`).

Needs a CUDA device.
"""

from __future__ import annotations

import argparse

#: (N, K) of the 8B shape's q/k/v, o, gate/up and down projections and its LM head.
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
#: Bytes of weight copies a shape's calls cycle through (several times the L2 cache).
COPIES_BYTES = 256 * 2**20
REPLAYS = 3


def main(argv: list[str] | None = None) -> int:
    import cupy as cp
    import numpy as np

    from metrale.kernels import decode_gemv as dg
    from metrale.kernels import linear_invariant as li
    from metrale.kernels.linear import CublasGemm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,64,512,2048", help="row counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tilings", nargs="*", default=[], help="other tilings to time, e.g. 8,1,1,4,4")
    args = parser.parse_args(argv)
    stream = cp.cuda.Stream(non_blocking=True)
    gemm = CublasGemm(stream)
    rng = np.random.default_rng(0)
    multiprocessors = dg.multiprocessor_count()

    def bits(shape):
        return cp.asarray((rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))

    def timed(call, weights) -> float:
        """Milliseconds a call of ``call(weight)``, replayed from a CUDA graph of ``--repeats`` calls
        over the copies of the weight in turn (timed launch by launch, the host's launch overhead
        would be the figure of the small products; the copies keep a weight from the L2 cache)."""
        with stream:
            for weight in weights[:2]:
                call(weight)
            stream.synchronize()
            stream.begin_capture()
            for index in range(args.repeats):
                call(weights[index % len(weights)])
            graph = stream.end_capture()
            graph.launch(stream)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(REPLAYS):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / (REPLAYS * args.repeats)

    for n, k in SHAPES:
        weights = [bits((n, k)) for _ in range(-(-COPIES_BYTES // (n * k * 2)))]
        for m in (int(r) for r in args.rows.split(",")):
            x = bits((m, k))
            out = cp.empty((m, n), np.float32)
            shape = li.partial_shape(m, n, multiprocessors)
            partial = None if shape is None else cp.empty(shape, np.float32)
            tiled = timed(lambda weight: li.invariant_linear(x, weight, out, stream, partial=partial,
                                                             multiprocessors=multiprocessors), weights)
            for text in args.tilings:
                tiling = tuple(int(value) for value in text.split(","))
                other = timed(lambda weight: li.invariant_linear(x, weight, out, stream, partial=partial,
                                                                 multiprocessors=multiprocessors, tiling=tiling),
                              weights)
                print(f"   tiling {text} M={m}: {other:.4f} ms ({n * k * 2 / (other * 1e-3) / 1e9:.0f} GB/s, "
                      f"{2 * m * n * k / (other * 1e-3) / 1e12:.0f} TFLOP/s)")
            blas = timed(lambda weight: gemm(x, weight, out), weights)
            if dg.supports(m, k, dg.PLAIN):
                split = li.split_of(n, multiprocessors)
                decoded = timed(lambda weight: dg.decode_gemv(dg.PLAIN, x, weight, out, stream, split=split), weights)
                print(f"   decode GEMV M={m}: {decoded:.4f} ms ({n * k * 2 / (decoded * 1e-3) / 1e9:.0f} GB/s)")
            print(f"N={n:6d} K={k:5d} M={m:4d}: invariant {tiled:.4f} ms ({n * k * 2 / (tiled * 1e-3) / 1e9:.0f} GB/s, "
                  f"{2 * m * n * k / (tiled * 1e-3) / 1e12:.0f} TFLOP/s), cuBLAS {blas:.4f} ms, ratio {tiled / blas:.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
