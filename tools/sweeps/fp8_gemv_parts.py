"""Where a one-row FP8 decode GEMV's time goes beyond its bytes, on the Llama-8B projections.

    python tools/sweeps/fp8_gemv_parts.py [--copies 8]

For each projection (q/k/v and gate/up with the norm in the prologue, as ``rmsnorm_linear`` and
``rmsnorm_mlp`` launch them; o and down without) prints the microseconds a launch of
:func:`metrale.kernels.fp8_gemv.fp8_gemv` takes at one row, beside the bf16 decode GEMV of the same
shape and prologue (:func:`metrale.kernels.decode_gemv.decode_gemv`) and the time the code bytes
take at the bf16 GEMV's rate on the largest shape; then the FP8 kernel with parts of its source
taken out (:data:`PARTS`: the norm's first pass, the input's quantization, the codes' conversion,
the split's reduction barriers), to show what each costs (those kernels compute wrong results and
are never served). Each kernel is launched 20 times in a CUDA graph, dependently as the engine
launches them, cycling through ``--copies`` copies of the weight so that it comes from memory
rather than the L2 cache. Each projection is also timed at every split of a column tile over
warps the kernel has (the launcher picks the smallest that gives each multiprocessor a block's
worth of warps), and at each step length (:data:`UNROLLS`). Run from the repository root.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

#: (name, K, N, norm prologue, gated): the 8B shape's projections as the decode step launches them.
PROJECTIONS = [("qkv", 4096, 6144, True, False), ("o", 4096, 4096, False, False),
               ("gate_up", 4096, 28672, True, True), ("down", 14336, 4096, False, False)]

#: Pieces of 64 inner positions a warp's step loads, each timed (the kernel's template UNROLL).
UNROLLS = (2, 4, 8)

#: Parts of the FP8 GEMV's source taken out: (name, [(text, replacement)]).
PARTS = [
    ("without the norm's sum of squares", [
        ("                for (int k = tid; k < quads; k += THREADS) {",
         "                for (int k = tid; k < 0; k += THREADS) {")]),
    ("without the input's quantization", [
        ("            for (int c = tid; c < stride; c += THREADS) {",
         "            for (int c = tid; c < 0; c += THREADS) {")]),
    ("without the codes' conversion", [
        ("                fp8_pairs(upper[u], a_upper);\n                fp8_pairs(lower[u], a_lower);",
         "                a_upper[0] = upper[u].x; a_upper[1] = upper[u].y; a_upper[2] = upper[u].z; "
         "a_upper[3] = upper[u].w; a_upper[4] = upper[u].x; a_upper[5] = upper[u].y; a_upper[6] = upper[u].z; "
         "a_upper[7] = upper[u].w;\n"
         "                a_lower[0] = lower[u].x; a_lower[1] = lower[u].y; a_lower[2] = lower[u].z; "
         "a_lower[3] = lower[u].w; a_lower[4] = lower[u].x; a_lower[5] = lower[u].y; a_lower[6] = lower[u].z; "
         "a_lower[7] = lower[u].w;")]),
    ("without the split's barriers", [
        ("                    reduce[(warp * ROW_TILES + t) * 32 + lane] = mine;\n                }\n"
         "                __syncthreads();",
         "                    reduce[(warp * ROW_TILES + t) * 32 + lane] = mine;\n                }\n"),
        ("                }\n                __syncthreads();\n            }\n            if (SWIGLU && part == 0",
         "                }\n            }\n            if (SWIGLU && part == 0")]),
]


def edited_source(source: str, edits: list[tuple[str, str]], name: str) -> str:
    """``source`` with each ``(text, replacement)`` made; each text must occur exactly once."""
    for text, replacement in edits:
        if source.count(text) != 1:
            raise SystemExit(f"fp8_gemv_parts: the kernel's source no longer has the text of {name!r} exactly once")
        source = source.replace(text, replacement)
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="copies of each weight cycled through (default: 8)")
    args = parser.parse_args()

    import cupy as cp
    from quantized_gemv_sweep import timed

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import decode_gemv, fp8_gemv
    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.bf16 import float32_to_bf16
    from metrale.kernels.quantized import quantize_fp8_per_channel

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    multiprocessors = decode_gemv.multiprocessor_count()
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, one row, {args.copies} weight copies",
          flush=True)
    shapes = []
    for name, inner, columns, norm, gated in PROJECTIONS:
        host = rng.normal(size=(columns, inner)).astype(np.float32) * 0.02
        fp8 = [backend.quantized_weight(quantize_fp8_per_channel(host, "fp8_token")) for _ in range(args.copies)]
        bf16 = [cp.asarray(float32_to_bf16(host)) for _ in range(args.copies)]
        x_host = rng.normal(size=(1, inner)).astype(np.float32)
        x = cp.asarray(x_host)
        x_bf16 = cp.asarray(float32_to_bf16(x_host))  # the bf16 kernel's plain modes read bf16 rows
        residual = cp.asarray(rng.normal(size=(1, inner)).astype(np.float32))
        gain = cp.asarray(float32_to_bf16(rng.uniform(0.5, 1.5, size=inner).astype(np.float32)))
        summed = cp.empty((1, inner), np.float32)
        width = columns // 2 if gated else columns
        out = cp.empty((1, width), np.uint16 if gated else np.float32)
        out_bf16 = cp.empty((1, width), np.uint16) if gated else cp.empty((1, columns), np.float32)
        backend.stream.synchronize()
        norm_arguments: dict[str, Any] = dict(residual=residual, norm_weight=gain, summed=summed) if norm else {}

        def launch_fp8(s: Any, c: int, weights: list = fp8, kw: dict = norm_arguments, xs: Any = x, o: Any = out,
                       g: bool = gated, split: int | None = None, unroll: int = fp8_gemv.UNROLL) -> None:
            fp8_gemv.fp8_gemv(xs, weights[c], o, s, multiprocessors=multiprocessors, swiglu=g, split=split,
                              unroll=unroll, **kw)

        mode = {(True, True): decode_gemv.RMSNORM_SWIGLU, (True, False): decode_gemv.RMSNORM,
                (False, True): decode_gemv.PLAIN_SWIGLU, (False, False): decode_gemv.PLAIN}[(norm, gated)]

        def launch_bf16(s: Any, c: int, weights: list = bf16, kw: dict = norm_arguments, xs: Any = x if norm else x_bf16,
                        o: Any = out_bf16, m: int = mode) -> None:
            decode_gemv.decode_gemv(m, xs, weights[c], o, s, **kw)

        shapes.append((name, inner, columns, launch_fp8))
        fp8_us, bf16_us = timed(launch_fp8, args.copies), timed(launch_bf16, args.copies)
        megabytes = inner * columns / 1e6
        print(f"{name:8} {inner:5} x {columns:5} {'norm ' if norm else '     '}fp8 {fp8_us:6.1f} us "
              f"({megabytes / fp8_us:5.2f} TB/s of codes)  bf16 {bf16_us:6.1f} us ({2 * megabytes / bf16_us:5.2f} TB/s)",
              flush=True)
        chosen = qg.plan(columns, multiprocessors)[0]
        splits = []
        for split in qg.SPLITS:
            us = timed(lambda s, c, k=split: launch_fp8(s, c, split=k), args.copies)
            splits.append(f"{split}{'*' if split == chosen else ''} {us:6.1f}")
        print(f"{'':8} fp8 by split (warps a column tile; * the launcher's): " + "  ".join(splits) + " us", flush=True)
        unrolls = []
        for unroll in UNROLLS:
            us = timed(lambda s, c, k=unroll: launch_fp8(s, c, unroll=k), args.copies)
            unrolls.append(f"{unroll}{'*' if unroll == fp8_gemv.UNROLL else ''} {us:6.1f}")
        print(f"{'':8} fp8 by unroll (64-position pieces a warp loads a step): " + "  ".join(unrolls) + " us",
              flush=True)
    original = fp8_gemv.KERNELS
    try:
        for part, edits in PARTS:
            fp8_gemv.KERNELS = edited_source(original, edits, part)
            fp8_gemv._modules.clear()
            times = [f"{name} {timed(launch, args.copies):6.1f}" for name, _, _, launch in shapes]
            print(f"{part:36}: " + "  ".join(times) + " us", flush=True)
    finally:
        fp8_gemv.KERNELS = original
        fp8_gemv._modules.clear()
    backend.close()


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # quantized_gemv_sweep's timing
    main()
