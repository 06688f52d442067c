"""Plots of ``metrale bench`` results for the documentation (matplotlib).

* ``prefill-<shape>.png`` -- prefill tok/s against the prompt length for Metrale and each
  transformers run of a ``metrale bench`` JSON file;
* ``throughput.png`` -- output tok/s of Metrale and transformers from a ``metrale bench
  --throughput`` JSON file.

Run from the repository root::

    python3 tools/plot_bench.py --bench bench.json --throughput throughput.json --out docs/images
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ENGINES = {"metrale": "Metrale", "hf_eager": "transformers (eager)", "hf_compiled": "transformers (compiled)"}


def prefill_series(results: dict[str, Any], shape: str) -> dict[str, list[tuple[int, float]]]:
    """Per engine of ``shape``: ``(prompt length, tok/s)`` of every whole-prompt prefill, sorted."""
    entry = results.get(shape, {})
    series = {}
    for engine in ENGINES:
        points = sorted(
            (int(match.group(1)), float(value["tok_s"]))
            for key, value in (entry.get(engine) or {}).items()
            if (match := re.fullmatch(r"prefill_(\d+)", key)) and isinstance(value, dict) and value.get("tok_s")
        )
        if points:
            series[engine] = points
    return series


def plot_prefill(results: dict[str, Any], out: Path) -> list[Path]:
    """One figure per shape with prefill measurements; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for shape in results.get("options", {}).get("shapes", []):
        series = prefill_series(results, shape)
        if not series:
            continue
        figure, axes = plt.subplots(figsize=(6, 4))
        for engine, points in series.items():
            lengths, rates = zip(*points)
            axes.plot(lengths, rates, marker="o", label=ENGINES[engine])
        axes.set_xscale("log", base=2)
        axes.set_xlabel("prompt tokens")
        axes.set_ylabel("prefill tok/s")
        axes.set_title(f"{shape} prefill on {results.get('device', 'the GPU')}")
        axes.grid(True, alpha=0.3)
        axes.legend()
        path = out / f"prefill-{shape}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def plot_throughput(results: dict[str, Any], out: Path) -> Path | None:
    """Bars of output tok/s per engine of a throughput run; None when it measured nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(label, results[key]["output_tok_s"]) for key, label in
            (("metrale", "Metrale"), ("hf_continuous_batching", "transformers\n(continuous batching)"))
            if isinstance(results.get(key), dict) and "output_tok_s" in results[key]]
    if not bars:
        return None
    figure, axes = plt.subplots(figsize=(5, 4))
    labels, rates = zip(*bars)
    drawn = axes.bar(labels, rates, color=["tab:blue", "tab:orange"][: len(bars)])
    axes.bar_label(drawn, fmt="%.0f")
    axes.set_ylabel("output tok/s")
    options = results.get("options", {})
    axes.set_title(f"{results.get('model', '')}: {options.get('num_requests', '?')} requests")
    path = out / "throughput.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description="plot metrale bench results")
    parser.add_argument("--bench", type=Path, help="JSON file of metrale bench")
    parser.add_argument("--throughput", type=Path, help="JSON file of metrale bench --throughput")
    parser.add_argument("--out", type=Path, default=Path("docs/images"), help="folder of the images")
    args = parser.parse_args(argv)
    if args.bench is None and args.throughput is None:
        parser.error("give --bench and/or --throughput")
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if args.bench is not None:
        written += plot_prefill(json.loads(args.bench.read_text()), args.out)
    if args.throughput is not None:
        path = plot_throughput(json.loads(args.throughput.read_text()), args.out)
        written += [path] if path else []
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
