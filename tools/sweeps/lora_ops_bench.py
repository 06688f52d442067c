"""The pieces of an adapted projection timed alone: per projection of a decoder layer (q/k/v,
o, gate/up, down) the base model's product, the product with the LoRA stack's extended weight
(every slot's ``A`` rows appended), ``lora_expand`` after it, the two together, and
``lora_linear`` (the path of steps past FOLDED_ROWS rows) after the base product.

    python tools/sweeps/lora_ops_bench.py [--shape llama-8b] [--rows 32] [--slots 4] [--rank 16]
                                          [--device cuda] [--mix random] [--output ops.json]

On the GPU each piece is recorded into a CUDA graph of 20 back-to-back calls and replayed
between CUDA events (the GPU time per call, without launch overhead); on the CPU the host clock
times the NumPy references (for checking the tool, not for numbers). Prints microseconds per
piece and projection and the sums over one layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import graph_time, host_time  # noqa: E402

#: (in, outputs of the fused projections, SwiGLU after it) of a layer's projections per shape.
SHAPES = {
    "llama-8b": {"qkv": (4096, (4096, 1024, 1024), False), "o": (4096, (4096,), False),
                 "gate_up": (4096, (14336, 14336), True), "down": (14336, (4096,), False)},
    "llama-1b": {"qkv": (2048, (2048, 512, 512), False), "o": (2048, (2048,), False),
                 "gate_up": (2048, (8192, 8192), True), "down": (8192, (2048,), False)},
    "tiny": {"qkv": (64, (64, 32, 32), False), "o": (64, (64,), False),
             "gate_up": (64, (96, 96), True), "down": (96, (64,), False)},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--mix", default="random", choices=("random", "one", "even"),
                        help="the rows' slots: random (the base model too), all of slot 1, or the slots in turn")
    parser.add_argument("--output", help="write the numbers here (JSON)")
    args = parser.parse_args(argv)

    from metrale.backends.devices import get_backend
    from metrale.kernels.lora_tiles import adapter_tiles
    from metrale.ops import build_op_registry

    backend = get_backend(args.device)
    backend.use_ops(build_op_registry())
    ops, xp = backend.ops, backend.xp
    rng = np.random.default_rng(0)
    pieces: dict[str, dict[str, float]] = {}
    for name, (inner, outs, swiglu) in SHAPES[args.shape].items():
        out, width = sum(outs), len(outs) * args.rank
        a = (rng.standard_normal((args.slots, width, inner)) * 0.02).astype(np.float32)
        weight = (rng.standard_normal((out, inner)) * 0.02).astype(np.float32)
        base = backend.weight(weight)
        extended = backend.weight(np.concatenate([weight, a.reshape(-1, inner)]))
        a_rows = backend.weight(a)
        b = backend.weight((rng.standard_normal((out, args.slots * width)) * 0.02).astype(np.float32))
        x = backend.weight(rng.standard_normal((args.rows, inner)).astype(np.float32))
        host_slots = {"random": rng.integers(0, args.slots + 1, args.rows),
                      "one": np.ones(args.rows), "even": np.arange(args.rows) % args.slots + 1}[args.mix].astype(np.int32)
        slots, tiles = xp.asarray(host_slots), xp.asarray(adapter_tiles(host_slots))
        with backend.activate():
            ext = ops.linear(x, extended)
            y = ops.linear(x, base)
            calls = {
                "base": (lambda: ops.linear_silu(x, base)) if swiglu else (lambda: ops.linear(x, base)),
                "extended product": lambda: ops.linear(x, extended),
                "lora_expand": lambda: ops.lora_expand(ext, b, slots, tiles, width, None, swiglu),
                "extended product + lora_expand": lambda: ops.lora_expand(ops.linear(x, extended), b, slots, tiles,
                                                                          width, None, swiglu),
                "lora_linear": lambda: ops.lora_linear(y, x, a_rows, b, slots),
            }
            for piece, call in calls.items():
                if args.device == "cuda":
                    timing = graph_time(backend, call, calls_per_graph=20, repeats=10)
                else:
                    timing = host_time(call, repeats=3, warmup=1)
                pieces.setdefault(piece, {})[name] = statistics.median(timing.samples) * 1e6
    report = {"device": args.device, "shape": args.shape, "rows": args.rows, "slots": args.slots, "rank": args.rank,
              "mix": args.mix,
              "microseconds": pieces,
              "layer_microseconds": {piece: sum(values.values()) for piece, values in pieces.items()}}
    for piece, values in pieces.items():
        print(f"{piece:32s} " + " ".join(f"{name} {us:8.2f}" for name, us in values.items())
              + f"   layer {report['layer_microseconds'][piece]:8.2f} us")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
