"""``metrale bench``'s orchestration, with the GPU measurements replaced by stand-ins."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from metrale.benchmarks import latency as bench


class RecordingBar:
    """Stands in for the tqdm bar: records every stage description and the count reached."""

    def __init__(self, total: int, description: str) -> None:
        self.total, self.n, self.descriptions = total, 0, []

    def __enter__(self) -> "RecordingBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def set_description(self, text: str) -> None:
        self.descriptions.append(text)

    def update(self, count: int = 1) -> None:
        self.n += count


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """Every GPU-side measurement replaced; the 8B shape's Metrale run and the compiled
    transformers run fail, as a missing device feature would make them."""
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceProperties=lambda index: {"name": b"Test GPU"})
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4.0e12)
    monkeypatch.setattr(bench, "build_checkpoint", lambda shape, folder: folder)
    calls = []

    def metrale(shape, folder, options, bandwidth):
        calls.append(("metrale", shape))
        if shape == "llama-8b":
            raise RuntimeError("out of memory")
        return {"decode_b1": {"tok_s": 100.0, "achieved_GBps": 250.0, "fraction_of_floor": 0.1}}

    def hf(folder, options, compiled):
        calls.append(("hf", folder.name, compiled))
        if compiled:
            raise RuntimeError("torch.compile failed")
        return {"decode_b1": {"tok_s": 10.0}}

    monkeypatch.setattr(bench, "bench_metrale", metrale)
    monkeypatch.setattr(bench, "bench_hf", hf)
    monkeypatch.setattr(bench, "start_times", lambda folder, cache: {"cold_start_s": 9.0})
    bars = []
    monkeypatch.setattr(bench, "_progress", lambda total, text: bars.append(RecordingBar(total, text)) or bars[-1])
    return tmp_path, calls, bars


def test_every_stage_runs_and_failures_are_reported(stand_ins):
    tmp_path, calls, bars = stand_ins
    output = tmp_path / "bench.json"
    options = bench.BenchOptions(hf_compile=True, workdir=tmp_path / "work", output=output)
    results = bench.run(options)

    assert calls == [
        ("metrale", "llama-1b"), ("hf", "llama-1b", False), ("hf", "llama-1b", True),
        ("metrale", "llama-8b"), ("hf", "llama-8b", False), ("hf", "llama-8b", True),
    ]
    one, eight = results["llama-1b"], results["llama-8b"]
    assert one["metrale"]["cold_start_s"] == 9.0
    assert "cold_start_s" not in eight.get("metrale", {})  # its Metrale run failed before the probe
    # Each failure says where it was raised (here: the stand-ins above).
    assert eight["metrale_error"].startswith("RuntimeError: out of memory (at test_latency.py:")
    assert eight["metrale_error"].endswith(", in metrale)")
    assert one["hf_compiled_error"].startswith("RuntimeError: torch.compile failed (at test_latency.py:")
    assert json.loads(output.read_text())["llama-8b"]["hf_eager"] == {"decode_b1": {"tok_s": 10.0}}
    # Two shapes x (checkpoint, Metrale, start times, eager, compiled); the failed shape's skipped
    # stages are still counted, so the bar ends full.
    (bar,) = bars
    assert bar.total == 10 and bar.n == 10
    assert "llama-8b: transformers compiled" in bar.descriptions
    # The table renders what was measured and names what failed.
    rows = bench.table(results).splitlines()
    assert any(row.split()[:3] == ["llama-1b", "metrale", "decode_b1"] and "100.0" in row for row in rows)
    assert any(row.split()[:2] == ["llama-8b", "metrale"] and "out of memory" in row for row in rows)
    # Metrale against transformers, per metric both measured (100 against 10 tok/s).
    assert [row.split() for row in rows if "vs" in row.split()] == [
        ["llama-1b", "vs", "hf_eager", "decode_b1", "10.00x"]
    ]


def test_a_length_that_failed_is_named_in_the_table_beside_those_measured():
    results = {"device": "Test GPU", "copy_bandwidth_TBps": 4.0, "options": {"shapes": ["llama-8b"]}, "llama-8b": {
        "metrale": {"prefill_512": {"tok_s": 300.0}},
        "hf_eager": {"prefill_512": {"tok_s": 100.0},
                     "prefill_131072_error": "OutOfMemoryError: CUDA out of memory (at latency.py:1, in bench_hf)"}}}
    rows = [row.split() for row in bench.table(results).splitlines()]
    assert ["llama-8b", "hf_eager", "prefill_512", "tok/s", "100.0"] in rows
    assert any(row[:4] == ["llama-8b", "hf_eager", "prefill_131072_error", "OutOfMemoryError:"] for row in rows)
    assert ["llama-8b", "vs", "hf_eager", "prefill_512", "3.00x"] in rows


def test_every_shape_gets_its_start_times(stand_ins, monkeypatch):
    """Each family compiles kernels of its own: the cold and cached starts are probed per shape,
    each from empty caches."""
    tmp_path, calls, bars = stand_ins
    probed = []
    monkeypatch.setattr(bench, "start_times", lambda folder, cache: probed.append(folder.name) or {"cold_start_s": 7.0})
    options = bench.BenchOptions(shapes=("llama-1b", "qwen3-next-small"), hf=False, workdir=tmp_path / "work")
    results = bench.run(options)
    assert probed == ["llama-1b", "qwen3-next-small"]
    assert all(results[shape]["metrale"]["cold_start_s"] == 7.0 for shape in probed)
    assert bars[0].total == bars[0].n == 6


def test_without_transformers_only_metrale_runs(stand_ins):
    tmp_path, calls, bars = stand_ins
    options = bench.BenchOptions(shapes=("llama-1b",), hf=False, start_times=False, workdir=tmp_path / "work")
    results = bench.run(options)
    assert calls == [("metrale", "llama-1b")]
    assert set(results["llama-1b"]) == {"weight_GB", "build_s", "metrale"}
    assert bars[0].total == bars[0].n == 2


def test_batch_invariant_mode_is_timed_beside_the_default(stand_ins, monkeypatch):
    tmp_path, calls, bars = stand_ins
    monkeypatch.setattr(bench, "bench_batch_invariant", lambda shape, options, bandwidth: calls.append(
        ("invariant", shape)) or {"decode_b1": {"tok_s": 80.0}, "invariance": {"identical": 32, "of": 32}})
    options = bench.BenchOptions(shapes=("llama-1b",), hf=False, start_times=False, batch_invariant=True,
                                 workdir=tmp_path / "work")
    results = bench.run(options)
    assert calls == [("metrale", "llama-1b"), ("invariant", "llama-1b")]
    assert bars[0].total == bars[0].n == 3
    rows = [row.split() for row in bench.table(results).splitlines()]
    assert ["llama-1b", "metrale_batch_invariant", "identical", "32", "of", "32"] in rows
    # Its decode against the default's (80 against 100 tok/s).
    assert ["llama-1b", "batch_invariant", "vs", "bf16", "decode_b1", "0.80x"] in rows


def test_the_invariance_check_counts_prompts_whose_tokens_differ_when_batched(tmp_path, monkeypatch):
    """bench_batch_invariant runs the mode it measures, and counts a prompt as identical only when
    its greedy tokens alone and in the batch of all prompts agree (here a stand-in engine whose
    batched tokens differ for prompts of even length)."""
    import metrale.entrypoints.llm as llm_module

    made, timed = [], []

    class Output:
        def __init__(self, token_ids):
            self.token_ids = token_ids

    class FakeLLM:
        def __init__(self, folder, **options):
            made.append(options)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, prompts, params, use_tqdm=True):
            assert params.temperature == 0.0 and params.max_tokens == bench.INVARIANCE_TOKENS
            return [Output([len(p) % 7 + (len(prompts) > 1 and len(p) % 2 == 0)] * params.max_tokens)
                    for p in prompts]

    monkeypatch.setattr(llm_module, "LLM", FakeLLM)
    monkeypatch.setattr(bench, "bench_metrale", lambda *args, **options: timed.append(options) or {})
    result = bench.bench_batch_invariant("llama-1b", bench.BenchOptions(workdir=tmp_path), 4.0e12)
    assert timed == [{"batch_invariant": True}]
    assert [options["batch_invariant"] for options in made] == [True]
    import numpy as np

    lengths = np.random.default_rng(11).integers(16, 513, bench.INVARIANCE_PROMPTS)
    assert result["invariance"] == {"identical": int(np.sum(lengths % 2 == 1)), "of": bench.INVARIANCE_PROMPTS}
    assert 0 < result["invariance"]["identical"] < bench.INVARIANCE_PROMPTS


def test_weight_accounting_matches_the_models_parameters():
    """Every bf16 weight, counted against transformers' own parameter count (meta device)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

    for shape, config_class, model_class in (("llama-1b", LlamaConfig, LlamaForCausalLM),
                                             ("deepseek-v2-lite", DeepseekV2Config, DeepseekV2ForCausalLM)):
        with torch.device("meta"):
            model = model_class(config_class(**bench.SHAPES[shape]))
        params = sum(p.numel() for p in model.parameters())
        s = bench.SHAPES[shape]
        # The MoE routers are read as float32: twice their bf16 size.
        routers = s["hidden_size"] * s["n_routed_experts"] * (s["num_hidden_layers"] - s["first_k_dense_replace"]) \
            if shape in bench.MLA_SHAPES else 0
        assert bench.weight_bytes(shape) == 2 * (params + routers), shape


def test_hybrid_weight_and_state_accounting():
    """Qwen3-Next-like shape: bf16 weights at 2 bytes and the float32 ones at 4, against
    transformers' parameters (meta device); state read and written per sequence."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    s = bench.SHAPES["qwen3-next-small"]
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**s))
    float32_names = ("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight", "A_log", "dt_bias",
                     "linear_attn.norm.weight")
    params = sum(p.numel() for p in model.parameters())
    float32 = sum(p.numel() for n, p in model.named_parameters() if n.endswith(float32_names))
    assert bench.weight_bytes("qwen3-next-small") == 2 * params + 2 * float32
    assert bench.weight_bytes("qwen3-next-small", 1) < bench.weight_bytes("qwen3-next-small", 32)
    gdn_layers = 9
    state = 4 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3)
    assert bench.state_bytes_per_sequence("qwen3-next-small") == 2 * gdn_layers * state
    assert bench.kv_bytes_per_token("qwen3-next-small") == 2 * 2 * 3 * 2 * 256
    # FP8: a byte a value and a float32 scale a token's head.
    assert bench.kv_bytes_per_token("qwen3-next-small", fp8=True) == 2 * 3 * 2 * (256 + 4)
    assert bench.kv_bytes_per_token("llama-8b", fp8=True) == 2 * 32 * 8 * (128 + 4)
    # MLA: one latent row of 512 + 64 values a layer (FP8: its codes and one scale).
    assert bench.kv_bytes_per_token("deepseek-v2-lite") == 27 * 2 * 576
    assert bench.kv_bytes_per_token("deepseek-v2-lite", fp8=True) == 27 * (576 + 4)
    assert bench.state_bytes_per_sequence("llama-1b") == 0


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_moe_shapes_weight_accounting(shape):
    """Every weight of the routed-experts shapes against transformers' parameters (meta device):
    bf16 values at 2 bytes; Qwen3-MoE's routers, GPT-OSS's router biases and sinks held as
    float32 at 4. A decode step of one token reads only its chosen experts."""
    import torch

    config, model_class = bench.model_config(shape)
    with torch.device("meta"):
        model = model_class(config)
    params = sum(p.numel() for p in model.parameters())
    s = bench.SHAPES[shape]
    if shape == "gpt-oss-20b":
        float32 = s["num_hidden_layers"] * (s["num_local_experts"] + s["num_attention_heads"])
        per_expert = 2 * (3 * s["hidden_size"] * s["intermediate_size"] + 2 * s["intermediate_size"] + s["hidden_size"])
    else:
        float32 = s["num_hidden_layers"] * s["hidden_size"] * s["num_experts"]
        per_expert = 2 * 3 * s["hidden_size"] * s["moe_intermediate_size"]
    experts = s.get("num_local_experts", s.get("num_experts"))
    assert bench.weight_bytes(shape) == 2 * params + 2 * float32
    unread = experts - s["num_experts_per_tok"]
    assert bench.weight_bytes(shape) - bench.weight_bytes(shape, 1) == pytest.approx(
        per_expert * s["num_hidden_layers"] * unread)


def test_gpt_oss_sliding_layers_read_their_window_only():
    s = bench.SHAPES["gpt-oss-20b"]
    per_layer = 2 * s["num_key_value_heads"] * 2 * s["head_dim"]
    layers, window = s["num_hidden_layers"], s["sliding_window"]
    assert bench.kv_bytes_read("gpt-oss-20b", 100) == per_layer * layers * 100
    assert bench.kv_bytes_read("gpt-oss-20b", 512) == per_layer * (layers // 2) * (512 + window)
    assert bench.kv_bytes_read("llama-8b", 512) == 512 * bench.kv_bytes_per_token("llama-8b")


def test_a_decode_step_reads_only_the_chosen_experts():
    assert bench.expected_experts(64, 6, 1) == pytest.approx(6.0)
    assert bench.expected_experts(64, 6, 32) == pytest.approx(64 * (1 - (58 / 64) ** 32))
    one, many, every = (bench.weight_bytes("deepseek-v2-lite", b) for b in (1, 32, None))
    assert one < many < every
    s = bench.SHAPES["deepseek-v2-lite"]
    per_expert = 2 * 3 * s["hidden_size"] * s["moe_intermediate_size"]
    moe_layers = s["num_hidden_layers"] - s["first_k_dense_replace"]
    assert every - one == pytest.approx(per_expert * moe_layers * (64 - 6))
    assert bench.weight_bytes("llama-1b", 1) == bench.weight_bytes("llama-1b")


def test_prefill_flops_match_torchs_flop_counter(monkeypatch):
    """The matrix products of a small Llama-like shape counted by torch's FlopCounterMode (logits of
    the last token only), and the attention products: torch counts every (row, key) pair of the
    eager attention's batched products, the benchmark the causal ones."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    monkeypatch.setitem(bench.SHAPES, "tiny-llama", shape)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="eager")).eval()
    length = 40
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros((1, length), dtype=torch.long), logits_to_keep=1)
    counts = counter.get_flop_counts()["Global"]
    attention_all_pairs = sum(v for k, v in counts.items() if "bmm" in str(k))
    products = counter.get_total_flops() - attention_all_pairs
    per_pair = 4 * shape["num_attention_heads"] * shape["head_dim"] * shape["num_hidden_layers"]
    assert attention_all_pairs == per_pair * length * length
    ours = bench.prefill_flops("tiny-llama", length)
    causal = per_pair * length * (length + 1) / 2
    norms = 2 * (2 * shape["num_hidden_layers"] + 1) * shape["hidden_size"] * length  # norm weights, not counted by torch
    assert ours == pytest.approx(products + causal + norms, rel=1e-9)
    # A chunk after a cached prefix sees every cached key.
    assert bench.prefill_flops("tiny-llama", 8, 100) - bench.prefill_flops("tiny-llama", 8) == per_pair * 8 * 100


def test_the_steady_loop_step_skips_prefill_and_ragged_steps():
    # Mixed steps (0) and smaller rungs around the steady 32-row steps are left out; the median
    # of the intervals between consecutive 32-row replays remains.
    starts = [(0.0, 0), (1.0, 0), (1.5, 16), (2.0, 32)]
    time = 2.0
    for interval in [1.0, 1.2, 0.9, 1.1, 1.0, 5.0, 1.0, 1.0, 1.1]:
        time += interval
        starts.append((time, 32))
    starts += [(time + 0.7, 24), (time + 1.2, 8)]
    assert bench.steady_step_seconds(starts, 32) == pytest.approx(1.0)
    assert bench.steady_step_seconds(starts, 32, minimum=10) is None
    assert bench.steady_step_seconds(starts[:4], 32) is None


def test_the_cold_start_probe_empties_every_compilation_cache_first(tmp_path, monkeypatch):
    """The cold start runs with numba's, the sm_90a cubins' and CuPy's caches moved under the
    probe's folder and emptied; the cached start reuses what the cold one left."""
    import subprocess

    caches = tmp_path / "caches"
    (caches / "numba").mkdir(parents=True)
    (caches / "numba" / "left-over.nbi").write_text("stale")
    runs = []

    def probe(command, env, **_):
        runs.append((env, sorted(p.relative_to(caches).as_posix() for p in caches.rglob("*")) if caches.exists() else []))
        for variable in ("NUMBA_CACHE_DIR", "METRALE_KERNEL_CACHE", "CUPY_CACHE_DIR"):
            Path(env[variable]).mkdir(parents=True, exist_ok=True)
            (Path(env[variable]) / "entry").write_text("compiled")
        return subprocess.CompletedProcess(command, 0, stdout="1.5 4.0\n" if len(runs) == 1 else "0.5 1.0\n")

    monkeypatch.setattr(subprocess, "run", probe)
    times = bench.start_times(tmp_path / "model", caches)
    assert times == {"cold_start_s": 4.0, "cold_load_s": 1.5, "cached_start_s": 1.0, "cached_load_s": 0.5}
    (cold_env, cold_seen), (cached_env, cached_seen) = runs
    assert cold_seen == []
    assert {Path(cold_env[v]).parent for v in ("NUMBA_CACHE_DIR", "METRALE_KERNEL_CACHE", "CUPY_CACHE_DIR")} == {caches}
    assert len({cold_env[v] for v in ("NUMBA_CACHE_DIR", "METRALE_KERNEL_CACHE", "CUPY_CACHE_DIR")}) == 3
    assert cached_env == cold_env and len(cached_seen) == 6
