"""tools/plot_bench.py: figures from bench JSON files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "plot_bench.py"


@pytest.fixture(scope="module")
def plot_bench():
    spec = importlib.util.spec_from_file_location("metrale_tools_plot_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCH = {
    "device": "Test GPU",
    "options": {"shapes": ["llama-1b", "llama-8b"]},
    "llama-1b": {
        "metrale": {"decode_b1": {"tok_s": 700.0}, "prefill_2048": {"tok_s": 139000.0}, "prefill_512": {"tok_s": 43000.0},
                    "prefill_512_after_8192": {"tok_s": 20000.0}, "load_s": 1.0},
        "hf_eager": {"prefill_512": {"tok_s": 44000.0}, "prefill_2048": {"tok_s": 157000.0}},
    },
    "llama-8b": {"metrale_error": "RuntimeError: out of memory"},
}


def test_prefill_series_keep_whole_prompts_only_and_sort_by_length(plot_bench):
    series = plot_bench.prefill_series(BENCH, "llama-1b")
    assert series == {"metrale": [(512, 43000.0), (2048, 139000.0)], "hf_eager": [(512, 44000.0), (2048, 157000.0)]}
    assert plot_bench.prefill_series(BENCH, "llama-8b") == {}


def test_the_script_writes_one_figure_per_measured_shape_and_the_throughput_bars(plot_bench, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    throughput = tmp_path / "throughput.json"
    throughput.write_text(json.dumps({"model": "qwen3-0.6b", "options": {"num_requests": 256},
                                      "metrale": {"output_tok_s": 6200.0},
                                      "hf_continuous_batching": {"output_tok_s": 650.0}}))
    written = plot_bench.main(["--bench", str(bench), "--throughput", str(throughput), "--out", str(tmp_path / "images")])
    assert [p.name for p in written] == ["prefill-llama-1b.png", "prefill-vs-transformers.png", "throughput.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_throughput_runs_with_and_without_overlap_get_a_bar_each(plot_bench, tmp_path):
    runs = [{"model": "qwen3-0.6b", "options": {"num_requests": 256}, "metrale": {"output_tok_s": 14500.0, "overlap": True}},
            {"model": "qwen3-0.6b", "metrale": {"output_tok_s": 12400.0, "overlap": False},
             "hf_continuous_batching": {"output_tok_s": 650.0}}]
    assert plot_bench.throughput_bars(runs) == [("Metrale", 14500.0), ("Metrale\n(overlap off)", 12400.0),
                                                ("transformers\n(continuous batching)", 650.0)]
    files = []
    for index, results in enumerate(runs):
        files.append(tmp_path / f"throughput{index}.json")
        files[-1].write_text(json.dumps(results))
    written = plot_bench.main(["--throughput", *map(str, files), "--out", str(tmp_path / "images")])
    assert [p.name for p in written] == ["throughput.png"] and written[0].stat().st_size > 5000


def test_speed_ups_over_transformers_come_from_lengths_both_measured(plot_bench):
    assert plot_bench.prefill_ratios(BENCH) == {"llama-1b": [(512, 43000.0 / 44000.0), (2048, 139000.0 / 157000.0)]}
    only_ours = {"options": {"shapes": ["x"]}, "x": {"metrale": {"prefill_512": {"tok_s": 1.0}}}}
    assert plot_bench.prefill_ratios(only_ours) == {}


def test_several_bench_files_give_one_speed_up_figure(plot_bench, tmp_path):
    other = {"device": "Test GPU", "options": {"shapes": ["deepseek-v2-lite"]},
             "deepseek-v2-lite": {"metrale": {"prefill_2048": {"tok_s": 31000.0}},
                                  "hf_eager": {"prefill_2048": {"tok_s": 25000.0}}}}
    files = []
    for index, results in enumerate((BENCH, other)):
        files.append(tmp_path / f"bench{index}.json")
        files[-1].write_text(json.dumps(results))
    written = plot_bench.main(["--bench", *map(str, files), "--out", str(tmp_path / "images")])
    assert [p.name for p in written] == ["prefill-llama-1b.png", "prefill-deepseek-v2-lite.png",
                                         "prefill-vs-transformers.png"]
    assert (tmp_path / "images" / "prefill-vs-transformers.png").stat().st_size > 5000


def test_the_script_needs_an_input(plot_bench, capsys):
    with pytest.raises(SystemExit):
        plot_bench.main(["--out", "/tmp/unused"])
    assert "give --bench, --throughput, --decode, --kernel-times and/or --speculative" in capsys.readouterr().err


def decode_run(device, **steps):
    """A bench file whose shapes decoded ``steps[shape] = {batch: (tok/s, fraction)}``."""
    run = {"device": device}
    for shape, batches in steps.items():
        run[shape] = {"metrale": {f"decode_b{b}": {"tok_s": t, "fraction_of_floor": f} for b, (t, f) in batches.items()}}
    return run


def test_decode_series_line_runs_up_by_shape_and_batch(plot_bench):
    before = decode_run("GPU", **{"llama-1b": {1: (671.0, 0.39), 32: (15966.0, 0.36)}})
    after = decode_run("GPU", **{"llama-1b": {1: (1000.0, 0.6)}, "llama-8b": {1: (230.0, 0.81)}})
    cases, values = plot_bench.decode_series([before, after])
    assert cases == [("llama-1b", 1), ("llama-1b", 32), ("llama-8b", 1)]
    assert values == [[(671.0, 0.39), (15966.0, 0.36), None], [(1000.0, 0.6), None, (230.0, 0.81)]]


def test_the_loop_series_takes_the_generation_loops_step(plot_bench):
    run = decode_run("GPU", **{"llama-1b": {1: (700.0, 0.42)}})
    run["llama-1b"]["metrale"]["decode_b1_loop"] = {"tok_s": 800.0, "fraction_of_floor": 0.48}
    older = decode_run("GPU", **{"llama-1b": {1: (650.0, 0.39)}})  # measured before the loop existed
    cases, values = plot_bench.decode_series([older, run], loop=True)
    assert cases == [("llama-1b", 1)] and values == [[None], [(800.0, 0.48)]]


def test_the_decode_figure_has_a_bar_per_run(plot_bench, tmp_path):
    files = []
    for name, rate in (("before", 671.0), ("after", 1000.0)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(decode_run("H200", **{"llama-1b": {1: (rate, rate / 1700)}})))
        files.append(str(path))
    written = plot_bench.main(["--decode", *files, "--decode-labels", "before,after", "--out", str(tmp_path / "images")])
    assert [p.name for p in written] == ["decode.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written[0].stat().st_size > 5000
    with pytest.raises(SystemExit):
        plot_bench.main(["--decode", *files, "--decode-labels", "one", "--out", str(tmp_path / "images")])


def test_decode_files_sharing_a_label_are_one_run(plot_bench, tmp_path, monkeypatch):
    shapes = {"llama-1b": (700.0, 0.4), "llama-8b": (186.0, 0.72), "deepseek-v2-lite": (206.0, 0.26)}
    files = []
    for shape, (rate, fraction) in shapes.items():
        path = tmp_path / f"{shape}.json"
        path.write_text(json.dumps(decode_run("H200", **{shape: {1: (rate, fraction)}})))
        files.append(str(path))
    seen = {}
    monkeypatch.setattr(plot_bench, "plot_decode",
                        lambda runs, labels, out, loop: seen.update(runs=runs, labels=labels, loop=loop))
    plot_bench.main(["--decode", *files, "--decode-labels", "before,before,after", "--out", str(tmp_path)])
    assert seen["labels"] == ["before", "after"] and seen["loop"] is False
    assert [sorted(k for k in run if k != "device") for run in seen["runs"]] == [["llama-1b", "llama-8b"],
                                                                                ["deepseek-v2-lite"]]


KERNEL_TIMES = """shape llama-1b batch 1 context 512: one decode graph replay, each kernel profiled on its own
3 kernels, 0.032 ms in all, 0.080 GB moved (2500 GB/s)
   # kernel                                                       grid       us   MB read    GB/s
   0 void decode_gemv                                      (256, 1, 1)     20.0     60.00    3000

kernel                                           calls  us/call  total us  share    GB/s
void decode_gemv                                     2     15.0      30.0  93.8%    2667
qkv_rope_cache_words                                 1      2.0       2.0   6.2%       0
"""


def test_kernel_groups_are_read_from_the_grouped_table(plot_bench, tmp_path):
    title, groups = plot_bench.kernel_groups(KERNEL_TIMES)
    assert title.startswith("shape llama-1b batch 1")
    assert groups == [("void decode_gemv", 30.0), ("qkv_rope_cache_words", 2.0)]  # not the per-kernel rows
    path = tmp_path / "times.txt"
    path.write_text(KERNEL_TIMES)
    assert plot_bench.plot_kernel_times([path], tmp_path) == tmp_path / "kernel-times.png"
    assert (tmp_path / "kernel-times.png").stat().st_size > 0
    empty = tmp_path / "empty.txt"
    empty.write_text("kernel_times: ncu failed\n")
    assert plot_bench.plot_kernel_times([empty], tmp_path / "none") is None


SPECULATIVE = {"model": "llama-8b", "verify_seconds": {"decode": 0.004, "verify_k2": 0.006, "verify_k1": 0.005},
               "oracle": {"k": 4, "speed_up": 3.5}}


def test_verify_costs_are_ratios_to_a_decode_step_by_draft_count(plot_bench):
    assert plot_bench.verify_costs(SPECULATIVE) == [(1, pytest.approx(1.25)), (2, pytest.approx(1.5))]
    assert plot_bench.verify_costs({"oracle": {"k": 4, "speed_up": 1.0}}) == []


def test_the_speculative_figure_is_written(plot_bench, tmp_path):
    first, second = tmp_path / "eager.json", tmp_path / "graphs.json"
    first.write_text(json.dumps({"model": "llama-8b", "verify_seconds": {"decode": 0.004, "verify_k1": 0.011}}))
    second.write_text(json.dumps(SPECULATIVE))
    written = plot_bench.main(["--speculative", str(first), str(second), "--speculative-labels", "eager,graphs",
                               "--out", str(tmp_path / "images")])
    assert written == [tmp_path / "images" / "speculative.png"] and written[0].stat().st_size > 1000
    with pytest.raises(SystemExit):
        plot_bench.main(["--speculative", str(first), "--speculative-labels", "a,b", "--out", str(tmp_path)])
