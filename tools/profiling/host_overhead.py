"""Host time of one decode step outside the model: ModelForward, batch layout, cache bookkeeping.

    python tools/profiling/host_overhead.py [--batch 1 32] [--context 500]

Runs on the CPU backend with the model's ``forward_batch`` replaced by one that returns zeros, so
the figure is the engine's own Python work per ``decode_batch`` call (the GPU backend adds its
graph-replay bookkeeping on top). Prints microseconds per step for each batch size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import host_time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    from metrale.entrypoints.llm import LLM
    from metrale.sequence import SequenceState

    llm = LLM("tiny-dense", device="cpu", max_model_len=args.context + args.steps + 64,
              max_num_seqs=max(args.batch) + 1, show_progress=False)
    vocab = llm.vocab_size

    def no_model(batch):
        return np.zeros((len(batch.logits_rows), vocab), np.float32)

    for size in args.batch:
        seqs = [SequenceState.from_prompt(list(range(1, args.context + 1))) for _ in range(size)]
        for seq in seqs:
            llm.forward.prefill(seq.tokens, seq)
        llm.model.forward_batch = no_model
        tokens = [1] * size

        def step() -> None:
            llm.forward.decode_batch(tokens, seqs)

        elapsed = host_time(step, warmup=5, repeats=1, calls=args.steps).median
        print(f"batch {size:3d}: {elapsed * 1e6:7.1f} us per decode step")
        del llm.model.forward_batch
        for seq in seqs:
            llm.cache.release(seq)


if __name__ == "__main__":
    main()
