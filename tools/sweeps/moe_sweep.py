"""Routed experts of a prompt on the GPU: the grouped tensor-core kernels
(``metrale.kernels.moe_grouped``) by tiling, against the host-sorted cuBLAS product chain
(``metrale.layers.experts.grouped_on_host``) on the same rows.

Prints, per expert shape and token count, the microseconds of the alignment alone and of the
whole grouped path (graph replay, no launch overhead) for each tiling, its TFLOP/s (``2 N k (2I H
+ I H)`` flops: padding rows not counted), and the host-sorted chain's microseconds (CUDA events;
it reads the routing to the host, so it cannot be captured). Run from the repository root::

    python3 tools/sweeps/moe_sweep.py [--shapes deepseek-v2-lite,qwen3-next] [--tokens 300,2048]
                                      [--tilings 64x128x2x2x3,128x128x4x2x3]

A shape is a name above or ``HxIxExk``; a tiling is ``block_m x block_n x warps_m x warps_n x stages``
with an optional ``x block_k`` (32 or 64).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import cuda_event_time, graph_time  # noqa: E402

SHAPES = {"deepseek-v2-lite": (2048, 1408, 64, 6), "qwen3-next": (2048, 512, 128, 10)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v2-lite,qwen3-next", help="expert shapes, comma-separated")
    parser.add_argument("--tokens", default="300,2048", help="tokens per batch, comma-separated")
    parser.add_argument("--tilings", default="64x128x2x2x3,64x128x2x2x4,128x128x4x2x3,64x256x2x4x3",
                        help="tilings to time, comma-separated")
    parser.add_argument("--no-chain", action="store_true", help="skip the host-sorted cuBLAS chain")
    args = parser.parse_args()

    import cupy as cp

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import moe_grouped
    from metrale.layers.experts import StackedExperts, grouped_on_host
    from metrale.layers.mlp import MlpWeights

    backend = CudaBackend()
    stream = backend.stream
    rng = np.random.default_rng(0)
    tilings = [moe_grouped.Tiling(*(int(part) for part in tiling.split("x"))) for tiling in args.tilings.split(",")]
    print(f"{'shape':>22} {'tokens':>6} {'tiling':>16} {'align us':>9} {'grouped us':>11} {'TFLOP/s':>8} {'chain us':>9}")
    for name in args.shapes.split(","):
        hidden, inter, num_experts, top_k = SHAPES.get(name) or tuple(int(part) for part in name.split("x"))
        with backend.activate():
            # bf16 bits of values in [1/128, 1): products stay finite at any size.
            gate_up = cp.asarray(rng.integers(0x3C00, 0x3F80, (num_experts * 2 * inter, hidden), dtype=np.uint16))
            down = cp.asarray(rng.integers(0x3C00, 0x3F80, (num_experts * hidden, inter), dtype=np.uint16))
        experts = StackedExperts(gate_up, down, [
            MlpWeights(gate_up[2 * inter * e : 2 * inter * (e + 1)], down[hidden * e : hidden * (e + 1)])
            for e in range(num_experts)
        ])
        for tokens in (int(n) for n in args.tokens.split(",")):
            pairs = tokens * top_k
            flops = 2 * pairs * (2 * inter * hidden + inter * hidden)
            with backend.activate():
                x = cp.asarray(rng.integers(0x3C00, 0x3F80, (tokens, hidden), dtype=np.uint16))
                chosen = cp.asarray(np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32))
                weights = cp.asarray(rng.random((tokens, top_k)).astype(np.float32))
            chain = None
            if not args.no_chain:
                with backend.activate():
                    chain = cuda_event_time(lambda: grouped_on_host(backend, experts, x, chosen, weights), stream,
                                            repeats=5, warmup=1)
            for tiling in tilings:
                tiles = moe_grouped.max_tiles(pairs, num_experts, tiling.block_m)
                rows = tiles * tiling.block_m
                with backend.activate():
                    scratch = (cp.empty(rows, np.int32), cp.empty(tiles, np.int32), cp.empty((rows, inter), np.uint16),
                               cp.empty((pairs, hidden), np.float32), cp.empty((tokens, hidden), np.float32))

                def grouped(tiling=tiling, scratch=scratch):
                    moe_grouped.grouped_experts(x, chosen, weights, gate_up, down, *scratch, stream=stream, tiling=tiling)

                def align(tiling=tiling, scratch=scratch):
                    moe_grouped.align(chosen, num_experts, scratch[0], scratch[1], tiling.block_m, stream)

                whole = graph_time(backend, grouped, calls_per_graph=5, repeats=5, warmup=1)
                alone = graph_time(backend, align, calls_per_graph=5, repeats=5, warmup=1)
                shape = f"{hidden}x{inter}x{num_experts}x{top_k}"
                label = "x".join(str(v) for v in tiling)
                chain_us = f"{chain.median_us:9.1f}" if chain is not None else f"{'-':>9}"
                print(f"{shape:>22} {tokens:6d} {label:>16} {alone.median_us:9.1f} {whole.median_us:11.1f} "
                      f"{flops / whole.median / 1e12:8.1f} {chain_us}")
    backend.close()


if __name__ == "__main__":
    main()
