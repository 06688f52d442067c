"""The quantized decode GEMV (``metrale.kernels.quantized_gemv``) against the bf16 decode GEMV on
the Llama-8B projection shapes: FP8 per channel with per-token inputs, INT4 weight-only (groups of
128) and INT8 per channel with per-token inputs, at 1, 8 and 32 rows (bf16 at 1 row). With
``--tensor-cores``, at more than one row also bf16 through cuBLASLt (``bf16-lt``) and the FP8
weights on FP8 tensor cores as the prompt path runs them (``fp8-tc``: the rows quantized to FP8
codes, cuBLASLt's FP8 product, the rows and columns scaled). FP8 also through
``metrale.kernels.fp8_gemv`` (``fp8-gemv-uN``: its loads N pieces of 64 codes ahead), INT4
through ``metrale.kernels.int4_gemv`` (``int4-gemv-mM-uN``: M column tiles of 16 a warp, N pieces
of 128 codes a step; ``*`` marks the launcher's default).

Each kernel is recorded 20 times into a CUDA graph and the graph replayed; the microseconds per
launch and the code bytes read per microsecond (GB/s) are printed. ``--copies N`` cycles the
launches through N copies of each weight so that they come from memory rather than the 50 MB L2
(with 1, the default, a weight under the L2's size is served from it after the first launch).
``--baseline FILE`` also times another build's ``quantized_gemv.py`` (a copy of the module file,
e.g. ``git show REV:kernels/quantized_gemv.py > /tmp/old.py``) and prints its time before this
build's, with the largest difference of their outputs. Run from the repository root::

    python3 tools/sweeps/quantized_gemv_sweep.py [--rows 1,8,32] [--copies 1] [--baseline FILE] [--tensor-cores]
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

import numpy as np

#: (K, N): the 8B shape's qkv, o, gate_up and down projections.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
#: (column tiles a warp takes at once, pieces it loads a step) of the 4-bit GEMV timed.
INT4_TILINGS = [(1, 4), (1, 2), (2, 2), (2, 1), (4, 1)]


def timed(launch: Any, copies: int, reps: int = 200) -> float:
    """Microseconds per launch of ``launch(stream, copy)`` replayed from a graph of 20 launches."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for copy in range(min(copies, 2)):
            launch(stream, copy)
        stream.synchronize()
        stream.begin_capture()
        for i in range(20):
            launch(stream, i % copies)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(reps // 20):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1000 / (reps // 20 * 20)


def host_weights(rng: np.random.Generator, columns: int, inner: int) -> list[tuple[str, float, Any]]:
    """(label, code bytes per weight, host QuantizedWeight) of each format timed."""
    from metrale.kernels.quantized import QuantizedWeight, pack_nibbles, quantize_fp8_per_channel

    return [
        ("fp8", 1.0, quantize_fp8_per_channel(rng.normal(size=(columns, inner)).astype(np.float32) * 0.02, "fp8_token")),
        ("int4", 0.5, QuantizedWeight("int4", pack_nibbles(rng.integers(0, 16, size=(columns, inner), dtype=np.uint8)),
                                      rng.uniform(1e-3, 3e-3, size=(columns, inner // 128)).astype(np.float32),
                                      (1, 128), (columns, inner))),
        ("int8", 1.0, QuantizedWeight("int8", rng.integers(0, 256, size=(columns, inner), dtype=np.uint8),
                                      rng.uniform(1e-3, 3e-3, size=(columns, 1)).astype(np.float32), (1, inner),
                                      (columns, inner), activations="int8_token")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", help="rows of the product (default: 1,8,32)")
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight cycled through (default: 1)")
    parser.add_argument("--baseline", default=None, metavar="FILE", help="another build's quantized_gemv.py")
    parser.add_argument("--tensor-cores", action="store_true",
                        help="also bf16 through cuBLASLt and FP8 on FP8 tensor cores at more than one row")
    args = parser.parse_args()

    import cupy as cp

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import decode_gemv, fp8_gemv, int4_gemv
    from metrale.kernels import quantized_gemv as current
    from metrale.kernels.bf16 import float32_to_bf16
    from metrale.kernels.linear import CublasLtGemm

    products: dict[int, Any] = {}

    def lt(stream: Any) -> Any:
        """cuBLASLt bound to the stream a timing runs on."""
        if stream.ptr not in products:
            products[stream.ptr] = CublasLtGemm(stream)
        return products[stream.ptr]

    builds = [("this", current)]
    if args.baseline:
        spec = importlib.util.spec_from_file_location("quantized_gemv_baseline", args.baseline)
        assert spec is not None and spec.loader is not None
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
        builds.insert(0, ("baseline", baseline))
    backend = CudaBackend()
    multiprocessors = decode_gemv.multiprocessor_count()
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for inner, columns in SHAPES:
            x = cp.asarray(rng.normal(size=(rows, inner)).astype(np.float32))
            out = cp.empty((rows, columns), np.float32)
            line = [f"rows={rows:2d} K={inner:5d} N={columns:5d}"]
            if rows == 1:
                dense = [cp.asarray(rng.integers(0, 2**16, size=(columns, inner), dtype=np.uint16) & 0x3FFF)
                         for _ in range(args.copies)]
                us = timed(lambda s, c, d=dense: decode_gemv.decode_gemv(decode_gemv.PLAIN_F32, x, d[c], out, s),
                           args.copies)
                line.append(f"bf16 {us:6.1f}us {columns * inner * 2 / us / 1e3:5.0f}GB/s")
            elif args.tensor_cores:
                dense = [cp.asarray(rng.integers(0, 2**16, size=(columns, inner), dtype=np.uint16) & 0x3FFF)
                         for _ in range(args.copies)]
                x_bf16 = cp.asarray(float32_to_bf16(cp.asnumpy(x)))
                us = timed(lambda s, c, d=dense: lt(s)(x_bf16, d[c], out), args.copies)
                line.append(f"bf16-lt {us:6.1f}us {columns * inner * 2 / us / 1e3:5.0f}GB/s")
                del dense
            for label, per_weight, host in host_weights(rng, columns, inner):
                weights = [backend.quantized_weight(host) for _ in range(args.copies)]
                staged_shape, scales_shape = current.workspace_shapes(rows, host)
                workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
                results = []
                for _, module in builds:
                    us = timed(lambda s, c, m=module, w=weights: m.quantized_gemv(x, w[c], out, s,
                                                                                 multiprocessors=multiprocessors,
                                                                                 workspace=workspace), args.copies)
                    results.append((us, cp.asnumpy(out).copy()))
                us = results[-1][0]
                text = f"{label} {us:6.1f}us {columns * inner * per_weight / us / 1e3:5.0f}GB/s"
                if len(results) == 2:
                    (before, y_before), (_, y_now) = results
                    difference = np.abs(y_before - y_now).max() / (np.abs(y_before).max() + 1e-30)
                    text = f"{label} {before:6.1f}->{us:6.1f}us {columns * inner * per_weight / us / 1e3:5.0f}GB/s " \
                           f"d={difference:.1e}"
                line.append(text)
                if fp8_gemv.serves(rows, host):
                    for unroll in (fp8_gemv.UNROLL, 2):
                        us = timed(lambda s, c, w=weights, u=unroll: fp8_gemv.fp8_gemv(
                            x, w[c], out, s, multiprocessors=multiprocessors, workspace=workspace, unroll=u),
                            args.copies)
                        line.append(f"fp8-gemv-u{unroll} {us:6.1f}us {columns * inner * per_weight / us / 1e3:5.0f}GB/s")
                if int4_gemv.serves(rows, host):
                    staged = cp.empty(int4_gemv.workspace_shape(rows, host), np.uint32)
                    chosen = int4_gemv.warp_tiling(rows)
                    for tiles, unroll in INT4_TILINGS:
                        us = timed(lambda s, c, w=weights, m=tiles, u=unroll: int4_gemv.int4_gemv(
                            x, w[c], out, s, multiprocessors=multiprocessors, workspace=staged, unroll=u,
                            weight_tiles=m), args.copies)
                        mark = "*" if (tiles, unroll) == chosen else ""
                        line.append(f"int4-gemv-m{tiles}-u{unroll}{mark} {us:6.1f}us "
                                    f"{columns * inner * per_weight / us / 1e3:5.0f}GB/s")
                if args.tensor_cores and rows > 1 and current.fp8_tensor_core_path(host):
                    codes = cp.empty((rows, inner), np.uint8)
                    row_scales = cp.empty((rows,), np.float32)
                    column_scales = [cp.ascontiguousarray(w.scales[:, 0]) for w in weights]

                    def fp8_product(s: Any, c: int, w: Any = weights) -> None:
                        current.quantize_rows_fp8(x, w[c], codes, row_scales, s)
                        lt(s).fp8(codes, w[c].codes, out)
                        current.scale_product(out, row_scales, column_scales[c], s)

                    try:
                        us = timed(fp8_product, args.copies)
                        line.append(f"fp8-tc {us:6.1f}us {columns * inner * per_weight / us / 1e3:5.0f}GB/s")
                    except Exception as error:  # no FP8 algorithm for the shape, or an older GPU
                        line.append(f"fp8-tc: {type(error).__name__}: {error}")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
