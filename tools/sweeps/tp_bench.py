"""Tensor and expert parallelism measured: decode steps of one model on one GPU and split over
several, and the NCCL all-reduce alone.

On a ``metrale bench`` shape (random bf16 weights, no download), for each layout of
``--layouts`` (``tp1``, ``tp2``, ``tp2-ep``: tensor_parallel_size 1 or 2, the latter with expert
parallelism), ``--batches`` sequences after a prompt of ``--context`` tokens: the median time of a
decode step (its CUDA graph, rank 0's wait for every rank, the sampling of every row) measured
with CUDA events on rank 0's stream, tok/s and the speed-up over ``tp1``. Then, in two fresh
processes (one GPU each), the median time of one all-reduce of a decode step's ``[batch,
hidden]`` float32 rows, replayed from a CUDA graph of 64 of them; times the step's number of
all-reduces (two per layer and the embedding's), it gives their share of the TP=2 step. Prints a
table and writes everything to ``--output`` (JSON). Run from the repository root on a machine
with two GPUs::

    python3 tools/sweeps/tp_bench.py [--shape llama-8b] [--layouts tp1,tp2] [--batches 1,32]
                                     [--context 512] [--steps 32] [--output tp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LAYOUTS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
           "tp2-ep": dict(tensor_parallel_size=2, expert_parallel=True)}
#: All-reduces replayed in one graph by the collective's own measurement.
REPLAYED = 64


def decode_steps(folder: Path, layout: dict, batches: list[int], context: int, steps: int) -> dict[str, Any]:
    """Median decode step of each batch size for one layout."""
    import numpy as np

    from metrale.benchmarks.latency import _cuda_time
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams
    from metrale.sequence import SequenceState

    llm = LLM(folder, device="cuda", max_model_len=context + steps + 64, max_num_seqs=max(batches) + 1,
              show_progress=False, **layout)
    result: dict[str, Any] = {}
    try:
        llm.capture_graphs(batches, mixed=False)
        rng = np.random.default_rng(0)
        for batch in batches:
            seqs = [SequenceState.from_prompt(rng.integers(0, llm.vocab_size, context).tolist()) for _ in range(batch)]
            for seq in seqs:
                llm.forward.prefill(seq.tokens, seq)
            tokens = [int(t) for t in rng.integers(0, llm.vocab_size, batch)]
            greedy = [SamplingParams(temperature=0.0)] * batch

            def step() -> None:
                logits = llm.forward.decode_batch(tokens, seqs)
                llm.engine.sampler.sample(logits, greedy, list(range(batch)), [0] * batch)

            seconds = _cuda_time(step, repeats=steps, stream=llm.backend.stream)
            result[f"b{batch}"] = {"step_ms": seconds * 1e3, "tok_s": batch / seconds}
            for seq in seqs:
                llm.cache.release(seq)
    finally:
        llm.close()
    return result


def all_reduce_rank(rank: int, size: int, unique_id: tuple, rows_list: list[int], hidden: int,
                    output: str | None) -> None:
    """One rank of the all-reduce measurement (run in its own process, one GPU visible)."""
    import cupy
    import numpy as np

    from metrale.backends.parallel import NcclCommunicator

    communicator = NcclCommunicator(rank, size, unique_id)
    stream = cupy.cuda.Stream(non_blocking=True)
    times = {}
    with stream:
        for rows in rows_list:
            x = cupy.ones((rows, hidden), dtype=np.float32)
            communicator.all_reduce(x)
            stream.synchronize()
            stream.begin_capture()
            for _ in range(REPLAYED):
                communicator.all_reduce(x)
            graph = stream.end_capture()
            samples = []
            for _ in range(12):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                graph.launch(stream)
                stop.record(stream)
                stop.synchronize()
                samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / REPLAYED)
            times[rows] = float(np.median(samples[2:]))
    communicator.close()
    if output is not None:
        Path(output).write_text(json.dumps(times))


def all_reduce_times(size: int, rows_list: list[int], hidden: int) -> dict[str, float]:
    """Microseconds of one all-reduce of ``[rows, hidden]`` float32 over ``size`` GPUs."""
    from metrale.backends.parallel import nccl_unique_id, visible_cuda_devices

    devices = visible_cuda_devices()
    unique_id = nccl_unique_id()
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "times.json")
        processes = []
        for rank in range(size):
            spec = pickle.dumps((rank, size, unique_id, rows_list, hidden, output if rank == 0 else None))
            environment = dict(os.environ, CUDA_VISIBLE_DEVICES=devices[rank])
            process = subprocess.Popen([sys.executable, __file__, "--all-reduce-rank"], stdin=subprocess.PIPE,
                                       env=environment)
            assert process.stdin is not None
            process.stdin.write(spec)
            process.stdin.close()
            processes.append(process)
        for process in processes:
            if process.wait(300) != 0:
                raise RuntimeError(f"an all-reduce rank exited with code {process.returncode}")
        return {str(rows): us for rows, us in json.loads(Path(output).read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--layouts", default="tp1,tp2")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--all-reduce-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.all_reduce_rank:
        all_reduce_rank(*pickle.loads(sys.stdin.buffer.read()))
        return

    from metrale.benchmarks.latency import SHAPES, build_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {sorted(LAYOUTS)}")
    shape = SHAPES[args.shape]
    report: dict[str, Any] = {"shape": args.shape, "context": args.context, "layouts": {}}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = build_checkpoint(args.shape, Path(folder))
        for name in layouts:
            report["layouts"][name] = decode_steps(checkpoint, LAYOUTS[name], batches, args.context, args.steps)
            print(name, json.dumps(report["layouts"][name]), flush=True)
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    report["all_reduce_us"] = all_reduce_times(2, batches, hidden)
    report["all_reduces_per_step"] = 2 * layers + 1
    print(f"\n{args.shape}, context {args.context}")
    print("layout    batch   step ms    tok/s   vs tp1   all-reduce share")
    for name, result in report["layouts"].items():
        for batch in batches:
            row = result[f"b{batch}"]
            base = report["layouts"].get("tp1", {}).get(f"b{batch}")
            speedup = f"{base['step_ms'] / row['step_ms']:.2f}x" if base else "-"
            share = "-"
            if name != "tp1":
                spent = report["all_reduces_per_step"] * report["all_reduce_us"][str(batch)] / 1e3
                row["all_reduce_share"] = spent / row["step_ms"]
                share = f"{row['all_reduce_share']:.1%}"
            print(f"{name:8} {batch:6} {row['step_ms']:9.3f} {row['tok_s']:8.0f} {speedup:>8} {share:>18}")
    print("all-reduce alone (us): " + ", ".join(f"[{b}, {hidden}] {report['all_reduce_us'][str(b)]:.1f}"
                                                for b in batches))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
