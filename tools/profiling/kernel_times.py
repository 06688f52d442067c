"""Every kernel of one decode step's CUDA graph, timed by Nsight Compute: the kernels in graph
order with their GPU time and DRAM bytes, then grouped by kernel name.

    python3 tools/profiling/kernel_times.py [--shape llama-1b] [--batch 1] [--context 512] [--batch-invariant] \
        [--quantization FORMAT] [--ncu PATH]

Needs a CUDA device, ``ncu`` (Nsight Compute; ``--ncu`` or on ``PATH``, else
``/usr/local/cuda/bin/ncu``) and what ``metrale bench`` needs. The tool runs itself under ``ncu``
with profiling off, builds the shape's random-weight checkpoint, prefills ``batch`` prompts of
``context`` tokens, captures the decode graphs, warms the step up, and turns profiling on for one
replay of the decode graph (``--graph-profiling node``: each kernel node is profiled on its own,
so the times are the kernels' own, without the overlap dependent launches give inside the graph;
caches and clocks are left as they run, ``--cache-control none --clock-control none``, so a
kernel finds in L2 what the kernels before it left there, as in the graph). ``--quantization``
loads the shape in a format of ``metrale bench --quantization`` (online, or its checkpoint written
from the bf16 one). Where
:mod:`profile_decode` times ops, this times the kernels that serve them: its achieved GB/s is
measured (DRAM bytes over time), not counted from the arguments.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
#: Base units of the metrics' values as ncu may print them.
SCALES = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3,
          "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_report(text: str) -> list[dict]:
    """The kernels of an ``ncu --csv`` report in launch order: name, seconds, bytes read and
    written. Values are scaled by their unit column; a kernel missing a metric gets 0."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(lines):
        entry = kernels.setdefault(row["ID"], {"name": row["Kernel Name"], "seconds": 0.0, "read": 0.0,
                                              "written": 0.0, "grid": row.get("Grid Size", ""),
                                              "block": row.get("Block Size", "")})
        value = float(row["Metric Value"].replace(",", "") or 0) * SCALES.get(row["Metric Unit"], 1.0)
        field = {"gpu__time_duration.sum": "seconds", "dram__bytes_read.sum": "read",
                 "dram__bytes_write.sum": "written"}.get(row["Metric Name"])
        if field:
            entry[field] = value
    return [kernels[key] for key in sorted(kernels, key=int)]


def short_name(name: str) -> str:
    """A kernel's name without its template or parameter list (numba's mangled names kept whole)."""
    return name.split("(")[0].split("<")[0]


def report(kernels: list[dict], out=sys.stdout) -> None:
    total = sum(k["seconds"] for k in kernels)
    moved = sum(k["read"] + k["written"] for k in kernels)
    print(f"{len(kernels)} kernels, {total * 1e3:.3f} ms in all, {moved / 1e9:.3f} GB moved "
          f"({moved / total / 1e9 if total else 0:.0f} GB/s)", file=out)
    print(f"{'#':>4} {'kernel':48} {'grid':>16} {'us':>8} {'MB read':>9} {'GB/s':>7}", file=out)
    for index, kernel in enumerate(kernels):
        rate = (kernel["read"] + kernel["written"]) / kernel["seconds"] / 1e9 if kernel["seconds"] else 0.0
        print(f"{index:4d} {short_name(kernel['name'])[:48]:48} {kernel['grid'][:16]:>16} "
              f"{kernel['seconds'] * 1e6:8.1f} {kernel['read'] / 1e6:9.2f} {rate:7.0f}", file=out)
    groups: dict[str, list[dict]] = defaultdict(list)
    for kernel in kernels:
        groups[short_name(kernel["name"])].append(kernel)
    print(f"\n{'kernel':48} {'calls':>5} {'us/call':>8} {'total us':>9} {'share':>6} {'GB/s':>7}", file=out)
    for name, members in sorted(groups.items(), key=lambda item: -sum(k["seconds"] for k in item[1])):
        seconds = sum(k["seconds"] for k in members)
        rate = sum(k["read"] + k["written"] for k in members) / seconds / 1e9 if seconds else 0.0
        print(f"{name[:48]:48} {len(members):5d} {seconds / len(members) * 1e6:8.1f} {seconds * 1e6:9.1f} "
              f"{seconds / total if total else 0:6.1%} {rate:7.0f}", file=out)


def profiled_step(args: argparse.Namespace) -> None:
    """Under ncu: build, prefill, capture, warm up, then one profiled replay of the decode graph."""
    import cupy
    import numpy as np

    from metrale.benchmarks.latency import build_checkpoint
    from metrale.entrypoints.llm import LLM
    from metrale.sequence import SequenceState

    folder, online = build_checkpoint(args.shape, Path(args.workdir) / args.shape), None
    if args.quantization:
        from metrale.benchmarks.quantized import checkpoint_in_format

        folder, online = checkpoint_in_format(folder, Path(args.workdir), args.quantization)
    llm = LLM(folder, device="cuda", max_model_len=args.context + 256, max_num_seqs=args.batch + 1, show_progress=False,
              batch_invariant=args.batch_invariant, quantization=online)
    rng = np.random.default_rng(0)
    seqs = [SequenceState.from_prompt(rng.integers(0, llm.vocab_size, args.context).tolist()) for _ in range(args.batch)]
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
    llm.capture_graphs([args.batch])
    for _ in range(3):
        llm.forward.decode_batch([1] * args.batch, seqs)
    llm.backend.synchronize()
    runner = llm.model.runner.graphs
    graph = runner.rungs[runner.rung_size(args.batch)].graphs[(runner.context_bucket(args.context + 1), False)]
    stream = llm.backend.stream
    cupy.cuda.profiler.start()
    graph.launch(stream=stream)
    stream.synchronize()
    cupy.cuda.profiler.stop()
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--batch-invariant", action="store_true", help="the step of batch_invariant=True")
    parser.add_argument("--quantization", default=None, metavar="FORMAT",
                        help="a format of metrale bench --quantization (fp8, w4a16, ...)")
    parser.add_argument("--ncu", default=None, help="the Nsight Compute command line tool")
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)  # the run under ncu
    args = parser.parse_args()
    if args.profiled:
        profiled_step(args)
        return
    ncu = args.ncu or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists() and not shutil.which(ncu):
        sys.exit(f"kernel_times: no ncu at {ncu} (pass --ncu)")
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "ncu.csv"
        command = [ncu, "--profile-from-start", "off", "--graph-profiling", "node", "--metrics", ",".join(METRICS),
                   "--cache-control", "none", "--clock-control", "none", "--csv", "--print-units", "base",
                   "--log-file", str(log), sys.executable, os.path.abspath(__file__), "--profiled",
                   "--shape", args.shape, "--batch", str(args.batch), "--context", str(args.context),
                   "--workdir", args.workdir, *(["--batch-invariant"] if args.batch_invariant else []),
                   *(["--quantization", args.quantization] if args.quantization else [])]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode or not log.exists():
            sys.exit(f"kernel_times: ncu failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        kernels = parse_report(log.read_text())
    mode = (", batch_invariant=True" if args.batch_invariant else "") + (
        f", {args.quantization}" if args.quantization else "")
    print(f"shape {args.shape} batch {args.batch} context {args.context}{mode}: one decode graph replay, each kernel "
          "profiled on its own (ncu --graph-profiling node)")
    report(kernels)


if __name__ == "__main__":
    main()
