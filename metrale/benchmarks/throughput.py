"""``metrale bench --throughput``: offline throughput of many requests, beside transformers.

The workload: ``num_requests`` requests (256 by default) with random prompts whose lengths, and
output lengths, are drawn uniformly from 100-1024 tokens (seeded), on a Qwen3-0.6B-shaped bf16
checkpoint with random weights. Every request generates exactly its output length (greedy,
end-of-sequence ignored). Metrale runs them through ``LLM.generate`` (continuous batching);
transformers through its own continuous batching (``ContinuousBatchingManager``, the machinery
behind ``generate_batch``, with each request's own ``max_new_tokens``), in the same process.
Reported: output tokens per second of wall time, and prompt plus output tokens per second.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.benchmarks.latency import failure

QWEN3_06B: dict[str, Any] = dict(  # Qwen3-0.6B
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)


@dataclass
class ThroughputOptions:
    num_requests: int = 256
    min_len: int = 100
    max_len: int = 1024
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    hf: bool = True
    #: Overlap scheduling (``EngineConfig.overlap_scheduling``) in Metrale's run.
    overlap: bool = True
    seed: int = 0
    workdir: Path = Path("/tmp/metrale-bench")
    output: Path | None = None


def build_qwen3_checkpoint(folder: Path) -> Path:
    """Save a random-weight bf16 Qwen3-0.6B-shaped checkpoint (built on the GPU)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B)).to(torch.bfloat16)
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
    if not (folder / "tokenizer.json").exists():
        write_word_tokenizer(folder / "tokenizer.json", QWEN3_06B["vocab_size"])
    return folder


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer of ``vocab_size`` words (``w0``, ``w1``, ...; token ``i`` decodes to `` wi``), so
    a served random-weight checkpoint streams text the way a real one does: every generated token
    is decoded, and every one adds text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"\u2581w{i}": i for i in range(vocab_size)}, unk_token="\u2581w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.save(str(path))


def workload(options: ThroughputOptions, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of the benchmark, fixed by ``options.seed``."""
    import numpy as np

    rng = np.random.default_rng(options.seed)
    prompt_lengths = rng.integers(options.min_len, options.max_len + 1, options.num_requests)
    output_lengths = rng.integers(options.min_len, options.max_len + 1, options.num_requests)
    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lengths]
    return prompts, [int(n) for n in output_lengths]


def _rates(prompts: list[list[int]], generated: int, seconds: float) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "output_tok_s": generated / seconds,
        "total_tok_s": (prompt_tokens + generated) / seconds,
    }


def bench_metrale(folder: Path, options: ThroughputOptions, prompts: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams

    started = time.perf_counter()
    llm = LLM(folder, device="cuda", max_model_len=2 * options.max_len + 16, max_num_seqs=options.max_num_seqs,
              max_num_batched_tokens=options.max_num_batched_tokens, overlap_scheduling=options.overlap,
              show_progress=True)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    llm.capture_graphs()
    capture_s = time.perf_counter() - started
    # Warm-up: compile every kernel path (prefill, mixed, batched) before the timed run.
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    calls_before, seconds_before = dict(llm.engine.calls), dict(llm.engine.seconds)
    overlapped_before = llm.engine.overlapped_steps
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    result = _rates(prompts, sum(len(o.token_ids) for o in outputs), seconds)
    errors = [o.error for o in outputs if o.error]
    result.update(
        load_s=load_s, capture_s=capture_s, failed=len(errors),
        preemptions=sum(o.num_preemptions for o in outputs),
        steps={k: v - calls_before.get(k, 0) for k, v in llm.engine.calls.items()},
        step_seconds={k: v - seconds_before.get(k, 0.0) for k, v in llm.engine.seconds.items()},
        overlap=llm.engine.overlap, overlapped_steps=llm.engine.overlapped_steps - overlapped_before,
    )
    result["step_shares"] = step_shares(result["steps"], result["step_seconds"], seconds)
    del llm
    return result


def bench_hf(folder: Path, options: ThroughputOptions, prompts: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=600) as manager:

        def run(batch: list[list[int]], limits: list[int], tag: str) -> int:
            ids = [manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n)
                   for i, (p, n) in enumerate(zip(batch, limits))]
            pending, generated = set(ids), 0
            while pending:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("the transformers generation thread stopped")
                    continue
                if result.is_finished() and result.request_id in pending:
                    pending.discard(result.request_id)
                    generated += len(result.generated_tokens)
            return generated

        run(prompts[:4], [4] * 4, "warmup")
        started = time.perf_counter()
        generated = run(prompts, lengths, "r")
        seconds = time.perf_counter() - started
    del model
    torch.cuda.empty_cache()
    return _rates(prompts, generated, seconds)


def run(options: ThroughputOptions) -> dict[str, Any]:
    options.workdir.mkdir(parents=True, exist_ok=True)
    folder = build_qwen3_checkpoint(options.workdir / "qwen3-0.6b")
    prompts, lengths = workload(options, QWEN3_06B["vocab_size"])
    results: dict[str, Any] = {
        "model": "qwen3-0.6b",
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
    }
    try:
        results["metrale"] = bench_metrale(folder, options, prompts, lengths)
    except Exception as error:  # report and go on with the baseline
        results["metrale_error"] = failure(error)
    if options.hf:
        try:
            results["hf_continuous_batching"] = bench_hf(folder, options, prompts, lengths)
        except Exception as error:
            results["hf_continuous_batching_error"] = failure(error)
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=2))
    return results


def step_shares(steps: dict[str, int], step_seconds: dict[str, float], seconds: float) -> dict[str, dict[str, float]]:
    """Per kind of step (contract method): how many ran, their share of the run's wall time and
    the milliseconds each took on average. The time outside steps (scheduling the next step,
    detokenizing, stop checks) is the share ``"between steps"``."""
    shares = {
        kind: {"steps": steps.get(kind, 0), "share": spent / seconds, "ms_per_step": 1e3 * spent / max(steps.get(kind, 0), 1)}
        for kind, spent in sorted(step_seconds.items()) if steps.get(kind, 0)
    }
    shares["between steps"] = {"steps": 0, "share": max(0.0, 1.0 - sum(v["share"] for v in shares.values())),
                               "ms_per_step": 0.0}
    return shares


def table(results: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    o = results["options"]
    lines = [f"{results['model']}: {o['num_requests']} requests, prompt and output lengths {o['min_len']}-{o['max_len']}"]
    header = f"{'engine':24} {'output tok/s':>13} {'total tok/s':>12} {'seconds':>8} {'output tokens':>14}"
    lines += [header, "-" * len(header)]
    for engine in ("metrale", "hf_continuous_batching"):
        data = results.get(engine)
        if data is None:
            if f"{engine}_error" in results:
                lines.append(f"{engine:24} error: {results[f'{engine}_error'][:80]}")
            continue
        lines.append(f"{engine:24} {data['output_tok_s']:13.1f} {data['total_tok_s']:12.1f} {data['seconds']:8.2f} "
                     f"{data['output_tokens']:14d}")
    ours, theirs = results.get("metrale"), results.get("hf_continuous_batching")
    if ours and theirs:
        lines.append(f"{'Metrale / transformers':24} {ours['output_tok_s'] / theirs['output_tok_s']:12.2f}x")
    if ours and ours.get("step_shares"):
        if ours.get("overlap"):
            lines += ["", f"overlap scheduling: {ours['overlapped_steps']} of {sum(ours['steps'].values())} steps queued "
                      "while the one before them ran"]
        lines += ["", f"{'Metrale step kind':24} {'steps':>8} {'time share':>11} {'ms per step':>12}"]
        for kind, share in ours["step_shares"].items():
            per_step = f"{share['ms_per_step']:12.2f}" if share["steps"] else ""
            lines.append(f"{kind:24} {share['steps'] or '':>8} {100 * share['share']:10.1f}% {per_step}".rstrip())
    return "\n".join(lines)
