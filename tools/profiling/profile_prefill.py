"""Where a prompt's prefill time goes: each op's GPU time and the gaps between ops.

    python tools/profiling/profile_prefill.py [--shapes llama-1b,llama-8b] [--length 2048] [--quantization FORMAT]

Needs a CUDA device (and what ``metrale bench`` needs). For each shape it prints the whole
prefill of one ``--length``-token prompt (CUDA events, as ``metrale bench`` times it), then one
prefill with every op of the backend's op table wrapped: CUDA events recorded on the stream
before and after each op call. An op's figure is the time between its two events, its GPU time
when the GPU is kept busy. An op that calls others through the table (a fused op served by its
parts) holds their time: their lines say "in OP", and its own line says how much of its time was
outside them (work of its own, such as a product it runs directly). The time from one outermost
op's end to the next one's start is charged to a "gap after OP" line: work queued outside the op
table (array glue in the model code) or the GPU waiting for the host; "gap after (start)" is the
time before the first op, the host preparing the step. The host clock of the whole call (the GPU left to finish after it) and of
each op's calls say where the host is the bound; ``--cprofile`` adds the host functions that
cost most in one more prefill. ``--quantization`` loads each shape in a format of ``metrale bench
--quantization`` (online, or its checkpoint written from the bf16 one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import cuda_event_time, host_time  # noqa: E402


def op_lines(calls: list[tuple[int, str, int | None, float, float]], traced: float,
             host_ms: dict[str, float] | None = None) -> list[tuple[float, str]]:
    """``(milliseconds, label)`` lines, largest first, of a traced run of ``traced`` milliseconds
    from its op calls ``(call, name, outer call or None, start, stop)`` (milliseconds from the
    run's start): each op's calls (an op called by another one "in" that op; an op that called
    others with the time it spent outside them), and the gaps from one outermost call's end to
    the next one's start ("gap after (start)" before the first; the last one's runs to
    ``traced``). ``host_ms``: each outermost op's host milliseconds."""
    host_ms = host_ms or {}
    names = {call: name for call, name, _, _, _ in calls}
    inner_ms: dict[int, float] = defaultdict(float)
    for _, _, outer, start, stop in calls:
        if outer is not None:
            inner_ms[outer] += stop - start
    op_ms: dict[tuple[str, str | None], list[float]] = defaultdict(list)
    outside_ms: dict[tuple[str, str | None], float] = defaultdict(float)
    for call, name, outer, start, stop in calls:
        key = (name, names.get(outer) if outer is not None else None)
        op_ms[key].append(stop - start)
        outside_ms[key] += stop - start - inner_ms.get(call, 0.0)
    gap_ms: dict[str, float] = defaultdict(float)
    previous_name, previous_stop = "(start)", 0.0
    for _, name, _, start, stop in sorted((call for call in calls if call[2] is None), key=lambda call: call[3]):
        gap_ms[previous_name] += start - previous_stop
        previous_name, previous_stop = name, stop
    gap_ms[previous_name] += traced - previous_stop
    lines = []
    for (name, outer), values in op_ms.items():
        total = sum(values)
        label = f"{name}{f' in {outer}' if outer else ''} ({len(values)} calls, median {statistics.median(values) * 1e3:.1f} us"
        if outer is None and name in host_ms:
            label += f", host {host_ms[name]:.2f} ms"
        if abs(outside_ms[(name, outer)] - total) > 1e-9:
            label += f"; {outside_ms[(name, outer)]:.2f} ms outside the ops it calls"
        lines.append((total, label + ")"))
    lines += [(ms, f"gap after {name}") for name, ms in gap_ms.items() if ms > 0.01]
    return sorted(lines, reverse=True)


def profile(shape: str, length: int, workdir: Path, cprofile: bool = False, quantization: str | None = None) -> None:
    import cupy

    from metrale.benchmarks.latency import build_checkpoint, prefill_flops
    from metrale.entrypoints.llm import LLM
    from metrale.sequence import SequenceState

    folder, online = build_checkpoint(shape, workdir / shape), None
    if quantization:
        from metrale.benchmarks.quantized import checkpoint_in_format

        folder, online = checkpoint_in_format(folder, workdir, quantization)
    llm = LLM(folder, device="cuda", max_model_len=length + 64, max_num_seqs=2, show_progress=False,
              quantization=online)
    backend = llm.backend
    stream = backend.stream
    prompt = np.random.default_rng(0).integers(0, llm.vocab_size, length).tolist()

    def prefill() -> None:
        seq = SequenceState.from_prompt(prompt)
        llm.forward.prefill(prompt, seq)
        llm.cache.release(seq)

    whole = cuda_event_time(prefill, stream, warmup=1, repeats=5)
    # The host's share: the same call timed on the host clock, the GPU left to finish after.
    host = host_time(prefill, warmup=1, repeats=5, synchronize=backend.synchronize)
    ops = backend.ops
    names = ops.names()
    originals = {name: getattr(ops, name) for name in names}
    marks: list[tuple[int, str, int | None, Any, Any]] = []
    host_ms: dict[str, float] = defaultdict(float)
    running: list[int] = []  # the op calls under way, outermost first
    count = [0]

    def recording(name: str, function: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            call, outer = count[0], running[-1] if running else None
            count[0] += 1
            start.record(stream)
            started = time.perf_counter()
            running.append(call)
            try:
                result = function(*a, **k)
            finally:
                running.pop()
            if outer is None:
                host_ms[name] += 1e3 * (time.perf_counter() - started)
            stop.record(stream)
            marks.append((call, name, outer, start, stop))
            return result

        return wrapper

    for name, function in originals.items():
        setattr(ops, name, recording(name, function))
    first = cupy.cuda.Event()
    first.record(stream)
    prefill()
    last = cupy.cuda.Event()
    last.record(stream)
    last.synchronize()
    for name, function in originals.items():
        setattr(ops, name, function)

    timed = [(call, name, outer, cupy.cuda.get_elapsed_time(first, start), cupy.cuda.get_elapsed_time(first, stop))
             for call, name, outer, start, stop in marks]
    traced = cupy.cuda.get_elapsed_time(first, last)
    flops = prefill_flops(shape, length)
    label = f"{shape} ({quantization})" if quantization else shape
    print(f"== {label}: prefill of {length} tokens {whole.median * 1e3:.2f} ms ({length / whole.median:,.0f} tok/s, "
          f"{flops / whole.median / 1e12:.0f} TFLOP/s); host {host.median * 1e3:.2f} ms; traced run {traced:.2f} ms "
          f"over {len(marks)} op calls")
    for ms, label in op_lines(timed, traced, host_ms):
        print(f"{ms:9.2f} ms {100 * ms / traced:5.1f} %  {label}")
    if cprofile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        prefill()
        profiler.disable()
        backend.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--cprofile", action="store_true", help="also the costliest host functions of one prefill")
    parser.add_argument("--quantization", default=None, metavar="FORMAT",
                        help="load each shape in this format of metrale bench --quantization (fp8, w4a16, ...)")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        profile(shape, args.length, Path(args.workdir), args.cprofile, args.quantization)


if __name__ == "__main__":
    main()
