"""A fresh process's first answer and a checkpoint's load, timed.

``start``: ``metrale generate --device cuda`` (by default on the embedded ``tiny-dense`` model, as
the README's first command runs it) in fresh processes: first with every compilation cache empty
(numba's, the sm_90a cubins', CuPy's, all moved under a scratch folder), then again with the
caches that run left. ``--profile`` writes each run's ``cProfile`` statistics next to the report.

``load``: the seconds ``LLM(...)`` takes to load a checkpoint folder (or a ``metrale bench`` shape,
written first), in one process, ``--repeats`` times (the first pays for the kernels it compiles).

    python3 tools/profiling/first_start.py start --repeats 2
    python3 tools/profiling/first_start.py load --shape deepseek-v2-lite --workdir /tmp/mb
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The compilation caches a fresh process fills, each as the environment variable that moves it
#: (as ``metrale bench``'s start probe moves them).
CACHES = {"NUMBA_CACHE_DIR": "numba", "METRALE_KERNEL_CACHE": "kernels", "CUPY_CACHE_DIR": "cupy"}


def generate_command(model: str, profile_to: Path | None) -> list[str]:
    prefix = [sys.executable, "-m", "cProfile", "-o", str(profile_to)] if profile_to else [sys.executable]
    return [*prefix, "-m", "metrale", "generate", "--model", model, "--device", "cuda", "--max-tokens", "8",
            "--no-progress", "Return the"]


def time_starts(model: str, repeats: int, scratch: Path, profile_dir: Path | None) -> dict[str, list[float]]:
    """Seconds of each ``metrale generate`` run: ``cold`` with empty caches (emptied before each
    of the ``repeats``), ``warm`` right after with the caches the cold run left."""
    env = {**os.environ, **{variable: str(scratch / name) for variable, name in CACHES.items()}}
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    for repeat in range(repeats):
        shutil.rmtree(scratch, ignore_errors=True)
        for label in ("cold", "warm"):
            profile_to = profile_dir / f"{label}-{repeat}.prof" if profile_dir else None
            started = time.perf_counter()
            result = subprocess.run(generate_command(model, profile_to), env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - started
            if result.returncode:
                raise SystemExit(f"metrale generate failed ({label}):\n{result.stderr[-3000:]}")
            times[label].append(seconds)
            print(f"{label} start {repeat + 1}: {seconds:.2f} s, printed {result.stdout.strip()[:60]!r}", flush=True)
    return times


def time_loads(folder: Path, repeats: int) -> list[float]:
    from metrale import LLM

    seconds = []
    for repeat in range(repeats):
        started = time.perf_counter()
        with LLM(folder, device="cuda", max_model_len=1024, max_num_seqs=2, show_progress=False) as llm:
            llm.backend.synchronize()
            seconds.append(time.perf_counter() - started)
        print(f"load {repeat + 1}: {seconds[-1]:.2f} s", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    start = sub.add_parser("start", help="cold and warm starts of metrale generate")
    start.add_argument("--model", default="tiny-dense", help="a folder or an embedded model (default: tiny-dense)")
    start.add_argument("--repeats", type=int, default=1)
    start.add_argument("--profile", type=Path, help="write each run's cProfile statistics into this folder")
    load = sub.add_parser("load", help="load times of a checkpoint")
    where = load.add_mutually_exclusive_group(required=True)
    where.add_argument("--folder", type=Path, help="a checkpoint folder")
    where.add_argument("--shape", help="a metrale bench shape (its random checkpoint written under --workdir)")
    load.add_argument("--workdir", type=Path, default=Path("/tmp/metrale-bench"))
    load.add_argument("--repeats", type=int, default=2)
    for command in (start, load):
        command.add_argument("--output", type=Path, help="write the times as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats takes a positive number")

    if args.what == "start":
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="metrale-start-") as scratch:
            result: dict = time_starts(args.model, args.repeats, Path(scratch) / "caches", args.profile)
    else:
        folder = args.folder
        if folder is None:
            from metrale.benchmarks.latency import build_checkpoint

            folder = build_checkpoint(args.shape, args.workdir / args.shape)
        result = {"load_s": time_loads(folder, args.repeats)}
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
