"""Where the offline throughput run's time goes, step by step: every decode and mixed step of
``metrale bench --throughput``'s workload timed (host time to issue it, then synchronised), mixed
steps grouped by the length of the prompt chunk they carry, and the host functions that cost most
inside mixed steps (cProfile, enabled only while a mixed step is issued).

    python tools/profiling/profile_throughput.py [--num-requests 256] [--max-num-seqs 128]

Needs a CUDA device (and what ``metrale bench --throughput`` needs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--no-cprofile", action="store_true", help="time the steps only")
    args = parser.parse_args()

    from metrale.benchmarks.throughput import QWEN3_06B, ThroughputOptions, build_qwen3_checkpoint, workload
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams

    options = ThroughputOptions(num_requests=args.num_requests, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, hf=False)
    folder = build_qwen3_checkpoint(Path(args.workdir) / "qwen3-0.6b")
    prompts, lengths = workload(options, QWEN3_06B["vocab_size"])
    llm = LLM(folder, device="cuda", max_model_len=2 * options.max_len + 16, max_num_seqs=options.max_num_seqs,
              max_num_batched_tokens=options.max_num_batched_tokens, show_progress=False)
    llm.capture_graphs()
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    forward, backend = llm.forward, llm.backend
    records: list[tuple[str, int, int, float, float]] = []  # kind, decode rows, prompt rows, issued s, synced s
    profiler = cProfile.Profile()
    run = forward.run  # every engine step's one contract call goes through it

    def timed(method, step, **arguments):
        if method not in ("decode_batch", "mixed_forward"):
            return run(method, step, **arguments)
        mixed = method == "mixed_forward"
        if mixed and not args.no_cprofile:
            profiler.enable()
        started = time.perf_counter()
        out = run(method, step, **arguments)
        issued = time.perf_counter() - started
        backend.synchronize()
        synced = time.perf_counter() - started
        if mixed and not args.no_cprofile:
            profiler.disable()
        rows = len(arguments["decode_seqs"] if mixed else arguments["seqs"])
        records.append(("mixed" if mixed else "decode", rows, arguments["chunk_len"] if mixed else 0, issued, synced))
        return out

    forward.run = timed
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{generated} tokens in {seconds:.2f} s: {generated / seconds:,.0f} output tok/s "
          f"(steps synchronised{'' if args.no_cprofile else ', mixed steps under cProfile'})")
    for kind in ("decode", "mixed"):
        rows = [r for r in records if r[0] == kind]
        if not rows:
            continue
        issued = [r[3] for r in rows]
        synced = [r[4] for r in rows]
        print(f"{kind}: {len(rows)} steps, {sum(synced):.2f} s; issued median {1e3 * statistics.median(issued):.2f} ms, "
              f"synchronised median {1e3 * statistics.median(synced):.2f} ms, max {1e3 * max(synced):.2f} ms")
    mixed = [r for r in records if r[0] == "mixed"]
    if mixed:
        edges = [0, 128, 256, 512, 768, 1024, 4096]
        for low, high in zip(edges, edges[1:]):
            bucket = [r for r in mixed if low < r[2] <= high]
            if bucket:
                print(f"  prompt rows {low + 1:5d}-{high:5d}: {len(bucket):4d} steps, issued "
                      f"{1e3 * statistics.median(r[3] for r in bucket):7.2f} ms, synchronised "
                      f"{1e3 * statistics.median(r[4] for r in bucket):7.2f} ms, decode rows "
                      f"{statistics.median(r[1] for r in bucket):.0f}")
        first = [1e3 * r[4] for r in mixed[:10]]
        print("  first ten mixed steps, ms:", " ".join(f"{t:.1f}" for t in first))
    between = seconds - sum(r[4] for r in records)
    print(f"outside the model's steps (scheduling, sampling, stop checks): {between:.2f} s")
    if not args.no_cprofile and mixed:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(45)
        print(text.getvalue())


if __name__ == "__main__":
    main()
