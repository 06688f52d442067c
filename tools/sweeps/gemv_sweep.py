"""Decode projections on the GPU: the fused decode GEMV kernels (``metrale.kernels.decode_gemv``:
the norm or the SwiGLU gate computed in the projection's kernel) against the unfused kernels (the
norm kernel, cuBLAS, the gate kernel, cuBLAS).

Prints, per model shape, part of a layer (the norm and the qkv projection; the o projection; the
norm and the MLP, and its two kernels alone) or the final norm and the LM head, and row count,
the microseconds of each path (CUDA-graph replay, so no launch overhead on the host; every kernel
of the part counted) and the weight bytes read per microsecond (GB/s; the floor is the weights
read once). Each graph cycles through enough copies of a layer's weights (at least 256 MB of each
projection's; the LM head is larger than the L2 alone) that they come from memory, not from the
50 MB L2, as they do in a model's step. "dependent" times the fused path launched with
programmatic dependent launch (:mod:`metrale.kernels._launch`: each kernel starts its weight
loads while the one ahead ends; "fused" launches as ``METRALE_DEPENDENT_LAUNCH`` says); "unroll 8"
with twice the weight words in flight per lane. "mlp epi" is the norm and the MLP with the SwiGLU
gate in the gate/up kernel's epilogue (``decode_gemv.RMSNORM_SWIGLU``, then a plain down
kernel), "gu epi" and "down plain" its two kernels.
``--splits`` adds the fused path at each given split (warps per tile of 16 columns) besides the
launcher's choice. Run from the repository root::

    python3 tools/sweeps/gemv_sweep.py [--shapes llama-1b,llama-8b] [--rows 1,2,4,8,16,32] [--splits 1,2,4,8]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import graph_time  # noqa: E402

# hidden, intermediate, q heads, kv heads, head dim, vocabulary
SHAPES = {"llama-1b": (2048, 8192, 32, 8, 64, 128256), "llama-8b": (4096, 14336, 32, 8, 128, 128256)}
CALLS_PER_GRAPH = 20
ROTATION_BYTES = 256 * 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b", help="model shapes, comma-separated")
    parser.add_argument("--rows", default="1,2,4,8", help="decode rows, comma-separated")
    parser.add_argument("--splits", default="", help="splits to time besides the launcher's, comma-separated")
    args = parser.parse_args()

    import cupy as cp

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import _launch
    from metrale.kernels import decode_gemv as dg

    backend = CudaBackend()
    # The unfused path: the kernels themselves, not the op table (which serves decode rows with
    # the decode GEMV by default).
    ops, stream = backend.kernels, backend.stream
    rng = np.random.default_rng(0)
    bf16 = np.uint16
    splits = [int(s) for s in args.splits.split(",") if s]
    unroll = [None]  # the launcher's choice (choose_unroll), as the fused paths launch

    def gemv(*arguments, **options):
        return dg.decode_gemv(*arguments, unroll=unroll[0], **options)

    header = (f"{'shape':>9} {'projection':>10} {'rows':>4} {'unfused us':>10} {'GB/s':>5} {'fused us':>9} {'GB/s':>5} "
              f"{'speed-up':>8} {'dependent us':>12} {'unroll 8 us':>11}")
    print(header + "".join(f" {'split ' + str(s) + ' us':>11}" for s in splits))
    for name in args.shapes.split(","):
        hidden, inter, heads, kv_heads, head_dim, vocab = SHAPES[name]
        qkv_rows = (heads + 2 * kv_heads) * head_dim
        shapes = {"qkv": (qkv_rows, hidden), "o": (hidden, heads * head_dim), "gate_up": (2 * inter, hidden),
                  "down": (hidden, inter)}
        head = (vocab, hidden)  # read once a step: one copy of it
        smallest = 2 * min(a * b for a, b in shapes.values())
        copies = max(1, min(CALLS_PER_GRAPH, -(-ROTATION_BYTES // smallest)))
        with backend.activate():
            # bf16 bits of values in [1/128, 1): products stay finite at any size.
            def weight(columns: int, inner: int) -> cp.ndarray:
                return cp.asarray(rng.integers(0x3C00, 0x3F80, (columns, inner), dtype=np.uint16))

            layers = [{key: weight(*shape) for key, shape in shapes.items()} for _ in range(copies)]
            head_weight = weight(*head)
            for layer in layers:
                layer["head"] = head_weight
            norm = cp.asarray(rng.integers(0x3C00, 0x3F80, hidden, dtype=np.uint16))
        for rows in (int(r) for r in args.rows.split(",")):
            with backend.activate():
                x32 = cp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
                residual = cp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
                summed = cp.empty((rows, hidden), np.float32)
                o_in = cp.asarray(rng.integers(0x3C00, 0x3F80, (rows, heads * head_dim), dtype=np.uint16))
                outs = {key: cp.empty((rows, shape[0]), bf16 if key == "gate_up" else np.float32)
                        for key, shape in {**shapes, "head": head}.items()}
                outs["act"] = cp.empty((rows, inter), bf16)  # the SwiGLU epilogue's output

            def cycled(body):
                """A call that takes the next copy of the weights each time."""
                turn = itertools.cycle(layers)
                return lambda **kw: body(next(turn), **kw)

            def norm_then(key):
                """The unfused and fused paths of the norm and the projection ``key``."""

                def unfused(w):
                    ops.linear(ops.rmsnorm_residual(x32, residual, norm, 1e-5)[0], w[key])

                def fused(w, split=None):
                    gemv(dg.RMSNORM, x32, w[key], outs[key], stream, residual=residual, norm_weight=norm,
                         summed=summed, eps=1e-5, split=split)

                return unfused, fused

            unfused_qkv, fused_qkv = norm_then("qkv")
            unfused_head, fused_head = norm_then("head")
            fused_gate_up = norm_then("gate_up")[1]  # its output is bf16, as the down kernel takes it

            def unfused_gate_up(w):
                h, _ = ops.rmsnorm_residual(x32, residual, norm, 1e-5)
                ops.gemm(ops.as_bf16(h), w["gate_up"], cp.empty((rows, w["gate_up"].shape[0]), bf16))

            def unfused_down(w):
                ops.linear(ops.silu_and_mul(outs["gate_up"]), w["down"])

            def fused_down(w, split=None):
                gemv(dg.SILU, outs["gate_up"], w["down"], outs["down"], stream, split=split)

            def unfused_o(w):
                ops.linear(o_in, w["o"])

            def fused_o(w, split=None):
                gemv(dg.PLAIN, o_in, w["o"], outs["o"], stream, split=split)

            def unfused_mlp(w):
                h, _ = ops.rmsnorm_residual(x32, residual, norm, 1e-5)
                ops.linear(ops.linear_silu(h, w["gate_up"]), w["down"])

            def fused_mlp(w, split=None):
                fused_gate_up(w, split)
                fused_down(w, split)

            def gate_up_epilogue(w, split=None):
                gemv(dg.RMSNORM_SWIGLU, x32, w["gate_up"], outs["act"], stream, residual=residual, norm_weight=norm,
                     summed=summed, eps=1e-5, split=split)

            def down_plain(w, split=None):
                gemv(dg.PLAIN, outs["act"], w["down"], outs["down"], stream, split=split)

            def mlp_epilogue(w, split=None):
                gate_up_epilogue(w, split)
                down_plain(w, split)

            cases = {"norm+qkv": (unfused_qkv, fused_qkv, [("qkv", dg.RMSNORM, hidden)]),
                     "o": (unfused_o, fused_o, [("o", dg.PLAIN, heads * head_dim)]),
                     "norm+mlp": (unfused_mlp, fused_mlp, [("gate_up", dg.RMSNORM, hidden), ("down", dg.SILU, inter)]),
                     "norm+head": (unfused_head, fused_head, [("head", dg.RMSNORM, hidden)]),
                     # the MLP's two kernels alone
                     "gate_up": (unfused_gate_up, fused_gate_up, [("gate_up", dg.RMSNORM, hidden)]),
                     "down": (unfused_down, fused_down, [("down", dg.SILU, inter)]),
                     # the MLP with the gate in the gate/up kernel's epilogue, and its two kernels
                     "mlp epi": (unfused_mlp, mlp_epilogue, [("gate_up", dg.RMSNORM_SWIGLU, hidden),
                                                             ("down", dg.PLAIN, inter)]),
                     "gu epi": (unfused_gate_up, gate_up_epilogue, [("gate_up", dg.RMSNORM_SWIGLU, hidden)]),
                     "down plain": (unfused_down, down_plain, [("down", dg.PLAIN, inter)])}
            for key, (unfused, fused, parts) in cases.items():
                megabytes = 2 * sum(np.prod({**shapes, "head": head}[part]) for part, _, _ in parts) / 1e6
                before = graph_time(backend, cycled(unfused), calls_per_graph=CALLS_PER_GRAPH)
                cells = [f"{'-':>9} {'-':>5} {'-':>8} {'-':>12} {'-':>11}"] + [f" {'-':>11}"] * len(splits)
                if all(dg.supports(rows, inner, mode) for _, mode, inner in parts):
                    after = graph_time(backend, cycled(fused), calls_per_graph=CALLS_PER_GRAPH)
                    enabled, _launch.ENABLED = _launch.ENABLED, not _launch.ENABLED
                    try:
                        other = graph_time(backend, cycled(fused), calls_per_graph=CALLS_PER_GRAPH)
                    finally:
                        _launch.ENABLED = enabled
                    dependent = other if not enabled else after
                    unroll[0] = dg.UNROLLS[-1]
                    try:
                        wide = graph_time(backend, cycled(fused), calls_per_graph=CALLS_PER_GRAPH)
                    finally:
                        unroll[0] = None
                    cells = [f"{after.median_us:9.1f} {megabytes / after.median * 1e-3:5.0f} "
                             f"{before.median / after.median:7.2f}x {dependent.median_us:12.1f} {wide.median_us:11.1f}"]
                    for split in splits:
                        timing = graph_time(backend, cycled(lambda w, s=split: fused(w, split=s)),
                                            calls_per_graph=CALLS_PER_GRAPH)
                        cells.append(f" {timing.median_us:11.1f}")
                print(f"{name:>9} {key:>10} {rows:>4} {before.median_us:10.1f} "
                      f"{megabytes / before.median * 1e-3:5.0f} " + "".join(cells))


if __name__ == "__main__":
    main()
