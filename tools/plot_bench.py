"""Plots of ``metrale bench`` results for the documentation (matplotlib).

* ``prefill-<shape>.png`` -- prefill tok/s against the prompt length for Metrale and each
  transformers run of a ``metrale bench`` JSON file;
* ``prefill-vs-transformers.png`` -- Metrale's prefill speed over transformers eager's, per
  shape and prompt length, across every ``--bench`` file given (one bar group per shape);
* ``throughput.png`` -- output tok/s of Metrale and transformers from ``metrale bench
  --throughput`` JSON files (several: one bar per engine and file, Metrale's runs labelled by
  whether overlap scheduling was on);
* ``decode.png`` -- Metrale's decode tok/s and fraction of the bandwidth floor per shape and
  batch size, one bar per run: the ``--decode`` files with the same label in ``--decode-labels``
  (before and after a change, say) are one run, their shapes together;
* ``kernel-times.png`` -- where a decode step's kernel time goes, one stacked bar per
  ``tools/profiling/kernel_times.py`` output (``--kernel-times``): its largest kernel groups, the rest as
  one part;
* ``speculative.png`` -- from ``tools/sweeps/speculative_bench.py`` JSON files (``--speculative``, labelled
  by ``--speculative-labels``): a verify's cost in decode steps against its draft count K, one line
  per file, and the oracle drafter's batch-1 speed-up, one bar per file that has one.

Run from the repository root::

    python3 tools/plot_bench.py --bench bench.json [more.json ...] --throughput throughput.json [more.json ...] --out docs/images
    python3 tools/plot_bench.py --decode a-1b.json a-8b.json b-1b.json b-8b.json --decode-labels before,before,after,after
    python3 tools/plot_bench.py --kernel-times docs/data/kernel-times-*-batch1.txt
    python3 tools/plot_bench.py --speculative eager.json graphs.json --speculative-labels eager,graphs
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ENGINES = {"metrale": "Metrale", "hf_eager": "transformers (eager)", "hf_compiled": "transformers (compiled)"}


def save(figure: Any, path: Path) -> None:
    """Write ``figure`` to ``path`` (PNG) and free it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


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
        save(figure, path)
        written.append(path)
    return written


def prefill_ratios(results: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Per shape: ``(prompt length, Metrale tok/s / transformers eager tok/s)`` where both were
    measured, sorted by length."""
    ratios = {}
    for shape in results.get("options", {}).get("shapes", []):
        series = prefill_series(results, shape)
        ours, theirs = dict(series.get("metrale", [])), dict(series.get("hf_eager", []))
        points = [(length, ours[length] / theirs[length]) for length in sorted(ours) if theirs.get(length)]
        if points:
            ratios[shape] = points
    return ratios


def plot_ratios(runs: list[dict[str, Any]], out: Path) -> Path | None:
    """Grouped bars of Metrale's prefill speed over transformers eager's, per shape and prompt
    length, over every run given; None when no run measured both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios: dict[str, list[tuple[int, float]]] = {}
    for results in runs:
        ratios.update(prefill_ratios(results))
    if not ratios:
        return None
    lengths = sorted({length for points in ratios.values() for length, _ in points})
    width = 0.8 / len(lengths)
    figure, axes = plt.subplots(figsize=(1.6 + 1.4 * len(ratios), 4))
    for index, length in enumerate(lengths):
        positions, heights = [], []
        for group, points in enumerate(ratios.values()):
            value = dict(points).get(length)
            if value is not None:
                positions.append(group + (index - (len(lengths) - 1) / 2) * width)
                heights.append(value)
        drawn = axes.bar(positions, heights, width, label=f"{length} tokens")
        axes.bar_label(drawn, fmt="%.2f", fontsize=8)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(ratios)), list(ratios))
    axes.set_ylabel("Metrale / transformers eager, prefill tok/s")
    axes.set_title(f"Prefill speed-up on {runs[0].get('device', 'the GPU')}")
    highest = max(value for points in ratios.values() for _, value in points)
    axes.set_ylim(0, highest * 1.25)  # room for the legend above the bars
    axes.legend(loc="upper center", ncol=len(lengths), fontsize=8)
    path = out / "prefill-vs-transformers.png"
    save(figure, path)
    return path


def throughput_bars(runs: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """``(label, output tok/s)`` of every engine of every throughput run, in order."""
    bars = []
    for results in runs:
        ours = results.get("metrale")
        if isinstance(ours, dict) and "output_tok_s" in ours:
            label = "Metrale" if "overlap" not in ours else (
                "Metrale" + ("" if ours["overlap"] else "\n(overlap off)"))
            bars.append((label, float(ours["output_tok_s"])))
        theirs = results.get("hf_continuous_batching")
        if isinstance(theirs, dict) and "output_tok_s" in theirs:
            bars.append(("transformers\n(continuous batching)", float(theirs["output_tok_s"])))
    return bars


def plot_throughput(runs: dict[str, Any] | list[dict[str, Any]], out: Path) -> Path | None:
    """Bars of output tok/s per engine of one or more throughput runs; None when they measured
    nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [runs] if isinstance(runs, dict) else list(runs)
    bars = throughput_bars(runs)
    if not bars:
        return None
    figure, axes = plt.subplots(figsize=(max(5, 1.8 * len(bars)), 4))
    labels, rates = zip(*bars)
    colours = ["tab:orange" if label.startswith("transformers") else "tab:blue" if "off" not in label else "tab:cyan"
               for label in labels]
    drawn = axes.bar(range(len(bars)), rates, color=colours, tick_label=labels)
    axes.bar_label(drawn, fmt="%.0f")
    axes.set_ylabel("output tok/s")
    options = runs[0].get("options", {})
    axes.set_title(f"{runs[0].get('model', '')}: {options.get('num_requests', '?')} requests")
    path = out / "throughput.png"
    save(figure, path)
    return path


def decode_series(runs: list[dict[str, Any]], loop: bool = False,
                  ) -> tuple[list[tuple[str, int]], list[list[tuple[float, float] | None]]]:
    """``(cases, values)``: every (shape, batch) Metrale decoded in any run, in the runs' order,
    and per run, per case, ``(tok/s, fraction of the floor)`` or None where it has none: of the
    one-step-at-a-time ``decode_bN``, or with ``loop`` of ``decode_bN_loop`` (the step as
    ``LLM.generate`` runs it)."""
    cases: list[tuple[str, int]] = []
    for results in runs:
        for shape, entry in results.items():
            ours = entry.get("metrale") if isinstance(entry, dict) else None
            if not isinstance(ours, dict):
                continue
            for key in ours:
                match = re.fullmatch(r"decode_b(\d+)", key)
                if match and (shape, int(match.group(1))) not in cases:
                    cases.append((shape, int(match.group(1))))
    values = []
    for results in runs:
        row: list[tuple[float, float] | None] = []
        for shape, batch in cases:
            step = results.get(shape, {}).get("metrale", {}).get(f"decode_b{batch}" + ("_loop" if loop else ""))
            row.append((float(step["tok_s"]), float(step["fraction_of_floor"])) if step else None)
        values.append(row)
    return cases, values


def plot_decode(runs: list[dict[str, Any]], labels: list[str], out: Path, loop: bool = False) -> Path | None:
    """Two panels of bars, one group per (shape, batch) and one bar per run: decode tok/s (log
    scale) and the fraction of the bandwidth floor (of the generation loop's step with ``loop``,
    :func:`decode_series`); None when no run decoded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases, values = decode_series(runs, loop)
    if not cases:
        return None
    width_inches = min(18.0, 2.0 + len(cases) * max(1.4, 0.6 * len(runs)))
    figure, (rate_axes, floor_axes) = plt.subplots(2, 1, figsize=(width_inches, 7), sharex=True)
    width = 0.8 / len(runs)
    for index, (label, row) in enumerate(zip(labels, values)):
        positions = [case + (index - (len(runs) - 1) / 2) * width for case in range(len(cases))]
        rates = [v[0] if v else 0.0 for v in row]
        floors = [100 * v[1] if v else 0.0 for v in row]
        drawn = rate_axes.bar(positions, rates, width, label=label)
        rate_axes.bar_label(drawn, labels=[f"{r:,.0f}" if r else "" for r in rates], fontsize=7)
        drawn = floor_axes.bar(positions, floors, width, label=label)
        floor_axes.bar_label(drawn, labels=[f"{f:.0f} %" if f else "" for f in floors], fontsize=7)
    rate_axes.set_yscale("log")
    rate_axes.set_ylabel("decode tok/s")
    floor_axes.set_ylabel("of the bandwidth floor (%)")
    floor_axes.set_ylim(0, 100)
    floor_axes.set_xticks(range(len(cases)), [f"{shape}\nbatch {batch}" for shape, batch in cases], fontsize=8)
    rate_axes.legend()
    rate_axes.set_title(f"Decode on {runs[-1].get('device', 'the GPU')}"
                        + (" (the step as LLM.generate runs it)" if loop else ""))
    path = out / ("decode-loop.png" if loop else "decode.png")
    save(figure, path)
    return path


def kernel_groups(text: str) -> tuple[str, list[tuple[str, float]]]:
    """The title line and the grouped table of a ``tools/profiling/kernel_times.py`` output: ``(kernel
    name, total µs)`` per group, largest first (a row ends in calls, µs a call, total µs, share
    and GB/s; the name is everything before them)."""
    lines = text.splitlines()
    title = lines[0] if lines else ""
    groups = []
    table = False
    for line in lines:
        if line.startswith("kernel ") and "calls" in line:
            table = True
            continue
        fields = line.split()
        if table and len(fields) >= 6 and fields[-2].endswith("%"):
            groups.append((" ".join(fields[:-5]), float(fields[-3])))
    return title, sorted(groups, key=lambda group: -group[1])


def plot_kernel_times(paths: list[Path], out: Path, parts: int = 7) -> Path | None:
    """One stacked horizontal bar per file: its ``parts`` largest kernel groups and the rest, µs
    per step; None when no file holds a grouped table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in paths:
        title, groups = kernel_groups(path.read_text())
        if groups:
            label = title.split(":")[0].replace("shape ", "").replace(" context", ", context")
            runs.append((label, groups[:parts] + [("the rest", sum(total for _, total in groups[parts:]))]))
    if not runs:
        return None
    figure, axes = plt.subplots(figsize=(15, 1.6 + 0.9 * len(runs)))
    colours: dict[str, Any] = {}
    palette = plt.get_cmap("tab20")
    for index, (label, groups) in enumerate(runs):
        left = 0.0
        for name, total in groups:
            short = name.replace("void ", "").split("::")[-1].split("[")[0]
            colour = colours.setdefault(short, palette(len(colours) % 20))
            axes.barh(index, total, left=left, color=colour, label=short)
            if total > 40:
                axes.text(left + total / 2, index, f"{total:.0f}", ha="center", va="center", fontsize=7)
            left += total
    handles, names = axes.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.set_yticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("µs of kernel time per decode step (each kernel on its own, Nsight Compute)")
    axes.set_title("Where a decode step's kernel time goes")
    path = out / "kernel-times.png"
    save(figure, path)
    return path


def verify_costs(report: dict[str, Any]) -> list[tuple[int, float]]:
    """``(K, verify seconds / decode seconds)`` of a ``tools/sweeps/speculative_bench.py`` report, by K."""
    seconds = report.get("verify_seconds", {})
    decode = seconds.get("decode")
    if not decode:
        return []
    return sorted((int(name.removeprefix("verify_k")), value / decode)
                  for name, value in seconds.items() if name.startswith("verify_k"))


def plot_speculative(reports: list[dict[str, Any]], labels: list[str], out: Path) -> Path | None:
    """A verify's cost in decode steps by K (a line per report) and the oracle's speed-up (a bar
    per report with one); None when no report holds either."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [(label, verify_costs(report)) for label, report in zip(labels, reports)]
    lines = [(label, points) for label, points in lines if points]
    bars = [(label, float(report["oracle"]["speed_up"]), int(report["oracle"]["k"]))
            for label, report in zip(labels, reports) if "oracle" in report]
    if not lines and not bars:
        return None
    figure, (cost_axes, gain_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in lines:
        cost_axes.plot([k for k, _ in points], [ratio for _, ratio in points], marker="o", label=label)
    cost_axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    cost_axes.set_xlabel("drafts K (a verify of K + 1 rows)")
    cost_axes.set_ylabel("verify time / decode step time")
    cost_axes.set_title("What a verify costs")
    cost_axes.set_ylim(bottom=0)
    if lines:
        cost_axes.set_xticks(sorted({k for _, points in lines for k, _ in points}))
        cost_axes.legend(fontsize=8)
    for index, (label, gain, k) in enumerate(bars):
        gain_axes.bar(index, gain)
        gain_axes.text(index, gain, f"{gain:.2f}x", ha="center", va="bottom", fontsize=8)
    gain_axes.set_xticks(range(len(bars)), [f"{label}\nK = {k}" for label, _, k in bars], fontsize=8)
    gain_axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    gain_axes.set_ylabel("batch-1 tok/s with the oracle / without")
    gain_axes.set_title("Oracle drafter's gain")
    title = reports[0].get("model", "") if reports else ""
    figure.suptitle(f"Speculative decoding, {title}")
    path = out / "speculative.png"
    save(figure, path)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description="plot metrale bench results")
    parser.add_argument("--bench", type=Path, nargs="+", help="JSON files of metrale bench")
    parser.add_argument("--throughput", type=Path, nargs="+", help="JSON files of metrale bench --throughput")
    parser.add_argument("--decode", type=Path, nargs="+", help="JSON files of metrale bench, one bar each in decode.png")
    parser.add_argument("--decode-labels", help="comma-separated labels of the --decode files (default: their names)")
    parser.add_argument("--decode-loop", action="store_true",
                        help="plot decode_bN_loop (the step as LLM.generate runs it) into decode-loop.png")
    parser.add_argument("--kernel-times", type=Path, nargs="+", help="outputs of tools/profiling/kernel_times.py")
    parser.add_argument("--speculative", type=Path, nargs="+", help="JSON files of tools/sweeps/speculative_bench.py")
    parser.add_argument("--speculative-labels", help="comma-separated labels of the --speculative files")
    parser.add_argument("--out", type=Path, default=Path("docs/images"), help="folder of the images")
    args = parser.parse_args(argv)
    if all(value is None for value in (args.bench, args.throughput, args.decode, args.kernel_times, args.speculative)):
        parser.error("give --bench, --throughput, --decode, --kernel-times and/or --speculative")
    spec_labels = (args.speculative_labels.split(",") if args.speculative_labels
                   else [p.stem for p in args.speculative or []])
    if args.speculative is not None and len(spec_labels) != len(args.speculative):
        parser.error(f"--speculative-labels names {len(spec_labels)} runs, --speculative gives {len(args.speculative)}")
    labels = args.decode_labels.split(",") if args.decode_labels else [p.stem for p in args.decode or []]
    if args.decode is not None and len(labels) != len(args.decode):
        parser.error(f"--decode-labels names {len(labels)} runs, --decode gives {len(args.decode)}")
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if args.bench is not None:
        runs = [json.loads(path.read_text()) for path in args.bench]
        for results in runs:
            written += plot_prefill(results, args.out)
        path = plot_ratios(runs, args.out)
        written += [path] if path else []
    if args.throughput is not None:
        path = plot_throughput([json.loads(path.read_text()) for path in args.throughput], args.out)
        written += [path] if path else []
    if args.decode is not None:
        merged: dict[str, dict[str, Any]] = {}  # a run per label, its files' shapes together
        for label, path in zip(labels, args.decode):
            merged.setdefault(label, {}).update(json.loads(path.read_text()))
        path = plot_decode(list(merged.values()), list(merged), args.out, args.decode_loop)
        written += [path] if path else []
    if args.kernel_times is not None:
        path = plot_kernel_times(args.kernel_times, args.out)
        written += [path] if path else []
    if args.speculative is not None:
        path = plot_speculative([json.loads(path.read_text()) for path in args.speculative], spec_labels, args.out)
        written += [path] if path else []
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
