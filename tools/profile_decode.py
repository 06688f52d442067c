"""Where a decode step's time goes: host overhead, graph replay, and each op run eagerly.

    python tools/profile_decode.py [--shape llama-1b] [--batch 1] [--context 512]

Needs a CUDA device (and what ``metrale bench`` needs). Prints a table: the whole step through
``ModelForward.decode_batch`` (host clock, synchronised), the bare graph replay (CUDA events),
and the eager per-op times (CUDA events around every op of one forward, summed by op).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    args = parser.parse_args()

    import cupy

    from metrale.api import LLM
    from metrale.bench import build_checkpoint
    from metrale.sequence import SequenceState

    folder = build_checkpoint(args.shape, Path(args.workdir) / args.shape)
    llm = LLM(folder, device="cuda", max_model_len=args.context + 256, max_num_seqs=args.batch + 1, show_progress=False)
    stream = llm.backend.stream
    rng = np.random.default_rng(0)
    seqs = [SequenceState.from_prompt(rng.integers(0, llm.vocab_size, args.context).tolist()) for _ in range(args.batch)]
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
    tokens = [1] * args.batch
    for _ in range(3):
        llm.forward.decode_batch(tokens, seqs)
    llm.backend.synchronize()

    steps = []
    for _ in range(30):
        started = time.perf_counter()
        llm.forward.decode_batch(tokens, seqs)
        llm.backend.synchronize()
        steps.append(time.perf_counter() - started)
    runner = llm.backend.graph_runner(llm.model)
    rung = runner.rungs[runner.rung_size(args.batch)]
    replays = []
    for _ in range(30):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        rung.graph.launch(stream=stream)
        stop.record(stream)
        stop.synchronize()
        replays.append(cupy.cuda.get_elapsed_time(start, stop))

    totals: dict[str, list[float]] = defaultdict(list)
    ops = llm.backend.ops

    def timed(name, function):
        def wrapper(*a, **k):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            out = function(*a, **k)
            stop.record(stream)
            stop.synchronize()
            totals[name].append(cupy.cuda.get_elapsed_time(start, stop))
            return out

        return wrapper

    for name in ("embedding", "rmsnorm_residual", "linear", "qkv_rope_cache", "paged_attention", "silu_and_mul"):
        setattr(ops, name, timed(name, getattr(ops, name)))
    llm.backend.cuda_graphs = False
    llm.backend._runners.clear()
    for _ in range(2):
        totals.clear()
        llm.forward.decode_batch(tokens, seqs)
    print(f"shape {args.shape} batch {args.batch} context {args.context}")
    print(f"whole step (host clock): {1e3 * statistics.median(steps):8.3f} ms")
    print(f"graph replay (events):   {statistics.median(replays):8.3f} ms")
    for name, values in sorted(totals.items(), key=lambda item: -sum(item[1])):
        print(f"eager {name:18} {sum(values):8.3f} ms over {len(values):3d} calls ({statistics.median(values) * 1e3:7.1f} us median)")


if __name__ == "__main__":
    main()
