"""``metrale bench --throughput``: its workload and orchestration, measurements replaced."""

from __future__ import annotations

import json

import pytest

from metrale.benchmarks import throughput as bench_throughput
from metrale.benchmarks.throughput import ThroughputOptions


def test_workload_is_seeded_and_in_range():
    options = ThroughputOptions(num_requests=64, min_len=100, max_len=1024)
    prompts, lengths = bench_throughput.workload(options, vocab_size=500)
    again, lengths_again = bench_throughput.workload(options, vocab_size=500)
    assert prompts == again and lengths == lengths_again
    assert len(prompts) == len(lengths) == 64
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in lengths)
    assert all(0 <= t < 500 for p in prompts for t in p)
    assert len({len(p) for p in prompts}) > 32  # drawn, not constant


def test_run_reports_both_engines_and_a_failing_baseline(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_throughput, "build_qwen3_checkpoint", lambda folder: folder)
    seen = {}

    def metrale(folder, options, prompts, lengths):
        seen["metrale"] = (len(prompts), sum(lengths))
        return bench_throughput._rates(prompts, sum(lengths), 10.0)

    def hf(folder, options, prompts, lengths):
        seen["hf"] = (len(prompts), sum(lengths))
        return bench_throughput._rates(prompts, sum(lengths), 40.0)

    monkeypatch.setattr(bench_throughput, "bench_metrale", metrale)
    monkeypatch.setattr(bench_throughput, "bench_hf", hf)
    output = tmp_path / "out.json"
    options = ThroughputOptions(num_requests=8, workdir=tmp_path, output=output)
    results = bench_throughput.run(options)
    assert seen["metrale"] == seen["hf"] and seen["metrale"][0] == 8  # the same workload for both
    assert json.loads(output.read_text())["metrale"]["output_tokens"] == seen["metrale"][1]
    text = bench_throughput.table(results)
    assert "4.00x" in text and "hf_continuous_batching" in text

    def broken(*args):
        raise RuntimeError("no paged attention")

    monkeypatch.setattr(bench_throughput, "bench_hf", broken)
    results = bench_throughput.run(options)
    error = results["hf_continuous_batching_error"]
    assert error.startswith("RuntimeError: no paged attention (at test_throughput.py:") and error.endswith(", in broken)")
    assert "error: RuntimeError: no paged attention" in bench_throughput.table(results)


def test_step_shares_split_the_run_by_step_kind():
    shares = bench_throughput.step_shares({"decode_batch": 100, "mixed_forward": 10, "prefill_chunk": 0},
                                          {"decode_batch": 5.0, "mixed_forward": 3.0, "prefill_chunk": 0.0}, 10.0)
    assert shares["decode_batch"] == {"steps": 100, "share": 0.5, "ms_per_step": 50.0}
    assert shares["mixed_forward"] == {"steps": 10, "share": 0.3, "ms_per_step": 300.0}
    assert "prefill_chunk" not in shares
    assert shares["between steps"]["share"] == pytest.approx(0.2)
    results = {"model": "m", "options": {"num_requests": 1, "min_len": 1, "max_len": 2},
               "metrale": {**bench_throughput._rates([[1]], 110, 10.0), "step_shares": shares}}
    text = bench_throughput.table(results)
    assert "decode_batch" in text and "50.0%" in text and "between steps" in text and "20.0%" in text
