"""Decode projections on the GPU: the fused decode GEMV kernels (``metrale.kernels.decode_gemv``:
the norm or the SwiGLU gate computed in the projection's kernel) against the unfused ops the
CUDA backend runs today (the norm kernel, cuBLAS, the gate kernel, cuBLAS).

Prints, per model shape, part of a layer (the norm and the qkv projection; the o projection; the
norm and the MLP) and row count, the microseconds of each path (CUDA-graph replay, so no launch
overhead on the host; every kernel of the part counted) and the
weight bytes read per microsecond (GB/s; the floor is the weights read once). Run from the
repository root::

    python3 tools/gemv_sweep.py [--shapes llama-1b,llama-8b] [--rows 1,2,4,8]
"""

from __future__ import annotations

import argparse

import numpy as np
from timing import graph_time

# hidden, intermediate, q heads, kv heads, head dim
SHAPES = {"llama-1b": (2048, 8192, 32, 8, 64), "llama-8b": (4096, 14336, 32, 8, 128)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b", help="model shapes, comma-separated")
    parser.add_argument("--rows", default="1,2,4,8", help="decode rows, comma-separated")
    args = parser.parse_args()

    import cupy as cp

    from metrale.cuda_backend import CudaBackend
    from metrale.kernels import decode_gemv as dg

    backend = CudaBackend()
    ops, stream = backend.ops, backend.stream
    rng = np.random.default_rng(0)
    bf16 = np.uint16
    print(f"{'shape':>9} {'projection':>12} {'rows':>4} {'unfused us':>10} {'fused us':>9} {'unfused GB/s':>12} "
          f"{'fused GB/s':>10} {'speed-up':>8}")
    for name in args.shapes.split(","):
        hidden, inter, heads, kv_heads, head_dim = SHAPES[name]
        qkv_rows = (heads + 2 * kv_heads) * head_dim
        with backend.activate():
            # bf16 bits of values in [1/128, 1): products stay finite at any size.
            def weight(columns: int, inner: int) -> cp.ndarray:
                return cp.asarray(rng.integers(0x3C00, 0x3F80, (columns, inner), dtype=np.uint16))

            weights = {"qkv": weight(qkv_rows, hidden), "o": weight(hidden, heads * head_dim),
                       "gate_up": weight(2 * inter, hidden), "down": weight(hidden, inter)}
            norm = cp.asarray(rng.integers(0x3C00, 0x3F80, hidden, dtype=np.uint16))
        for rows in (int(r) for r in args.rows.split(",")):
            with backend.activate():
                x32 = cp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
                residual = cp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
                summed = cp.empty((rows, hidden), np.float32)
                o_in = cp.asarray(rng.integers(0x3C00, 0x3F80, (rows, heads * head_dim), dtype=np.uint16))
                outs = {key: cp.empty((rows, w.shape[0]), bf16 if key == "gate_up" else np.float32)
                        for key, w in weights.items()}

            def unfused_mlp() -> None:
                h, _ = ops.rmsnorm_residual(x32, residual, norm, 1e-5)
                ops.linear(ops.linear_silu(h, weights["gate_up"]), weights["down"])

            def fused_mlp() -> None:
                dg.decode_gemv(dg.RMSNORM, x32, weights["gate_up"], outs["gate_up"], stream, residual=residual,
                               norm_weight=norm, summed=summed, eps=1e-5)
                dg.decode_gemv(dg.SILU, outs["gate_up"], weights["down"], outs["down"], stream)

            cases = {
                "norm+qkv": (lambda: ops.linear(ops.rmsnorm_residual(x32, residual, norm, 1e-5)[0], weights["qkv"]),
                             lambda: dg.decode_gemv(dg.RMSNORM, x32, weights["qkv"], outs["qkv"], stream,
                                                    residual=residual, norm_weight=norm, summed=summed, eps=1e-5),
                             [("qkv", dg.RMSNORM, hidden)]),
                "o": (lambda: ops.linear(o_in, weights["o"]),
                      lambda: dg.decode_gemv(dg.PLAIN, o_in, weights["o"], outs["o"], stream),
                      [("o", dg.PLAIN, heads * head_dim)]),
                "norm+mlp": (unfused_mlp, fused_mlp, [("gate_up", dg.RMSNORM, hidden), ("down", dg.SILU, inter)]),
            }
            for key, (unfused, fused, parts) in cases.items():
                megabytes = sum(weights[part].nbytes for part, _, _ in parts) / 1e6
                before = graph_time(backend, unfused)
                if all(dg.supports(rows, inner, mode) for _, mode, inner in parts):
                    after = graph_time(backend, fused)
                    fused_cells = (f"{after.median_us:9.1f}", f"{megabytes / after.median * 1e-3:10.0f}",
                                   f"{before.median / after.median:7.2f}x")
                else:
                    fused_cells = (f"{'-':>9}", f"{'-':>10}", f"{'-':>8}")
                print(f"{name:>9} {key:>12} {rows:>4} {before.median_us:10.1f} {fused_cells[0]} "
                      f"{megabytes / before.median * 1e-3:12.0f} {fused_cells[1]} {fused_cells[2]}")


if __name__ == "__main__":
    main()
