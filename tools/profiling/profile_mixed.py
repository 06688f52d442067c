"""Where a mixed step's time goes: host time to issue it, the step synchronised, and the host
functions that cost most (cProfile).

    python tools/profiling/profile_mixed.py [--shape qwen3-0.6b] [--batch 128] [--context 600] [--prompt 600]

Needs a CUDA device (and what ``metrale bench`` needs). ``--batch`` sequences of ``--context``
cached tokens decode while one prompt of ``--prompt`` tokens is prefilled in the same step
(``ModelForward.mixed_forward``, as the engine runs it when a request joins a running batch).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import numpy as np

BUSY_SECONDS = 0.1

BUSY_SOURCE = r"""
extern "C" __global__ void busy(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def gpu_time_without_host_gaps(stream, step, repeats: int) -> tuple[float, float]:
    """Median GPU time of ``step`` queued behind a kernel that keeps the GPU busy for
    ``BUSY_SECONDS``, so that its kernels run back to back whatever the host's pace, and the
    median host time taken to issue it meanwhile."""
    import cupy

    busy = cupy.RawKernel(BUSY_SOURCE, "busy")
    clock_hz = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0) * 1e3
    gpu, issued = [], []
    for _ in range(repeats):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        with stream:
            busy((1,), (1,), (np.int64(BUSY_SECONDS * clock_hz),))
            begin.record(stream)
            started = time.perf_counter()
            step()
            issued.append(time.perf_counter() - started)
            end.record(stream)
        end.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(begin, end) / 1e3)
    return statistics.median(gpu), statistics.median(issued)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", help="a bench shape, or qwen3-0.6b (the throughput run's)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    args = parser.parse_args()

    from metrale.benchmarks.latency import build_checkpoint
    from metrale.benchmarks.throughput import build_qwen3_checkpoint
    from metrale.entrypoints.llm import LLM
    from metrale.sequence import SequenceState

    build = build_qwen3_checkpoint if args.shape == "qwen3-0.6b" else lambda folder: build_checkpoint(args.shape, folder)
    folder = build(Path(args.workdir) / args.shape)
    llm = LLM(folder, device="cuda", max_model_len=args.context + args.prompt + 256, max_num_seqs=args.batch + 2,
              show_progress=False)
    backend = llm.backend
    rng = np.random.default_rng(0)
    seqs = [SequenceState.from_prompt(rng.integers(0, llm.vocab_size, args.context).tolist()) for _ in range(args.batch)]
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
    tokens = [1] * args.batch

    def mixed() -> None:
        prompt = rng.integers(0, llm.vocab_size, args.prompt).tolist()
        joining = SequenceState.from_prompt(prompt)
        llm.forward.mixed_forward(tokens, seqs, prompt, joining, 0, len(prompt), True)

    for _ in range(3):  # compile and allocate
        mixed()
    backend.synchronize()
    issued, whole = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        mixed()
        issued.append(time.perf_counter() - started)
        backend.synchronize()
        whole.append(time.perf_counter() - started)
    print(f"shape {args.shape} batch {args.batch} context {args.context} prompt {args.prompt}")
    print(f"mixed step issued (host): {1e3 * statistics.median(issued):8.3f} ms")
    print(f"mixed step synchronised:  {1e3 * statistics.median(whole):8.3f} ms")
    gpu_alone, issued_behind = gpu_time_without_host_gaps(backend.stream, mixed, args.steps)
    print(f"mixed step on the GPU, queued behind a busy kernel: {1e3 * gpu_alone:8.3f} ms "
          f"(issued meanwhile in {1e3 * issued_behind:.3f} ms; near the busy kernel's "
          f"{1e3 * BUSY_SECONDS:.0f} ms or above means the step waits for the GPU somewhere)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(4):
        mixed()
    backend.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    print(text.getvalue())


if __name__ == "__main__":
    main()
