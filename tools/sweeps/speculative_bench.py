"""Speculative decoding measured: what a verify costs, what an oracle drafter gains, what the
n-gram drafter accepts on the tiny models' held-out text.

Three parts (``--parts``, all by default):

* ``verify`` -- on a ``metrale bench`` shape (random weights; ``--shape``, or ``--checkpoint``),
  after a prompt of ``--context`` tokens, the median time of a decode step of one sequence (its
  CUDA graph where the engine has one) and of a verify of 1 + K rows for each K of ``--k`` (the
  forward and the sampling of every row; the drafts kept, so the context grows as decoding's
  does); the ratio is the verify's cost in decode steps. For a model with recurrent state
  (Qwen3-Next) also the same rows run as prompt rows, without the states kept per row: the
  difference is what keeping them costs, against recomputing the kept rows afterwards.
* ``oracle`` -- batch-1 greedy tok/s of ``generate`` on the same model without speculation and with
  a drafter that proposes the target's own greedy continuation (read from the run without, then
  from the speculative run's own output until a run follows it to the end), K the largest of
  ``--k``: the upper bound of what speculation can gain at that K.
* ``ngram`` -- for each model of ``--tiny``, prompts cut from the training corpus's held-out
  documents (``tools/checkpoints/tiny_corpus.py``), greedy ``--max-tokens`` tokens with and without n-gram
  speculation (K = 3), one prompt at a time: the mean tokens a sequence's verify produced (kept
  drafts plus the one the target adds), the drafts kept of those proposed, batch-1 tok/s both ways;
* ``mtp`` -- the same with the ``mtp`` drafter for each checkpoint of ``--mtp-models`` (a DeepSeek-V3
  one with a trained MTP module: ``tools/checkpoints/train_tiny_models.py --mtp-for`` on a copy of
  ``tiny-mla``).

Prints a table per part and writes every number to ``--output`` (JSON). Run from the repository
root::

    python3 tools/sweeps/speculative_bench.py [--shape llama-8b] [--k 1,2,3,4] [--context 512] [--steps 32] [--peaked]
                                              [--parts verify,oracle,ngram,mtp] [--mtp-models FOLDER]
                                              [--device cuda] [--output spec.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))  # tiny_corpus.py, the tiny models' text


def wall_time(function: Callable[[], Any], repeats: int, synchronize: Callable[[], None], warmup: int = 2) -> float:
    """Median seconds of ``function`` followed by ``synchronize`` (the device drained)."""
    for _ in range(warmup):
        function()
    synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def synchronizer(llm: Any) -> Callable[[], None]:
    stream = getattr(llm.backend, "stream", None)
    return stream.synchronize if stream is not None else (lambda: None)


def verify_costs(llm: Any, ks: list[int], context: int, steps: int) -> dict[str, float]:
    """Median seconds of a decode step and of a verify of 1 + K rows, each with its sampling; for
    a model with recurrent state also of the same rows run as prompt rows (``prompt_rows_kK``: no
    state kept per row), what keeping the states costs over a verify that would recompute the
    kept rows' recurrence afterwards."""
    import numpy as np

    from metrale.batch import Segment
    from metrale.params import SamplingParams
    from metrale.sequence import SequenceState

    rng = np.random.default_rng(0)
    prompt = rng.integers(1, llm.vocab_size, context).tolist()
    greedy = SamplingParams(temperature=0.0)
    sampler, forward, sync = llm.engine.sampler, llm.forward, synchronizer(llm)
    result = {}
    for k in [0, *ks]:
        seq = SequenceState.from_prompt(list(prompt))
        forward.prefill(seq.tokens, seq)
        token = [int(rng.integers(1, llm.vocab_size))]

        def decode() -> None:
            logits = forward.decode_batch(token, [seq])
            sampler.sample(logits, [greedy], [0], [0])

        def verify(k: int = k) -> None:
            rows = token + [int(t) for t in rng.integers(1, llm.vocab_size, k)]
            logits = forward.verify([rows], [seq])
            sampler.sample(logits, [greedy] * (k + 1), [0] * (k + 1), list(range(k + 1)))
            forward.verdict([seq], [k + 1], [k])

        result["decode" if k == 0 else f"verify_k{k}"] = wall_time(decode if k == 0 else verify, steps, sync)
        if k and llm.cache.state_slots is not None:
            # The same rows as prompt rows: no state kept per row (what a verify that recomputes the
            # kept rows' recurrence afterwards would run first).
            def prompt_rows(k: int = k) -> None:
                rows = token + [int(t) for t in rng.integers(1, llm.vocab_size, k)]
                logits = llm.model.run_segments([Segment(seq, rows, seq.num_cached, "all")])
                sampler.sample(logits, [greedy] * (k + 1), [0] * (k + 1), list(range(k + 1)))

            result[f"prompt_rows_k{k}"] = wall_time(prompt_rows, steps, sync)
        llm.cache.release(seq)
    return result


class OracleDrafter:
    """Proposes the continuation of ``script`` after a sequence's tokens when they are a prefix of
    it (the target's own greedy tokens), else nothing."""

    def __init__(self, scripts: list[list[int]]) -> None:
        self.scripts = scripts

    def propose(self, seqs: list[Any], limits: list[int]) -> list[list[int]]:
        out = []
        for seq, limit in zip(seqs, limits):
            tokens = list(seq.tokens)
            script = next((s for s in self.scripts if s[: len(tokens)] == tokens), None)
            out.append(script[len(tokens): len(tokens) + limit] if script is not None else [])
        return out


def oracle_manager(drafter: OracleDrafter) -> Any:
    from metrale import hookimpl
    from metrale.model.plugin_manager import get_plugin_manager

    class Plugin:
        METRALE_CONTRACT_VERSION = "1.2"

        @hookimpl
        def metrale_drafters(self) -> dict:
            return {"oracle": lambda config, model: drafter}

    manager = get_plugin_manager()
    manager.register(Plugin(), name="oracle-drafter")
    return manager


def timed_generate(llm: Any, prompts: list, params: Any) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def build_peaked_checkpoint(shape: str, folder: Path) -> Path:
    """A random-weight bf16 checkpoint of a Llama ``shape`` (as ``metrale bench`` builds it) whose
    attention output and down projections are zero and whose LM head is its embedding.

    Every layer then adds nothing to the residual stream, so the logits peak at the input token by
    a wide margin: greedy decoding repeats the last token, and a verify's rounding (other kernels
    for more rows) cannot part its tokens from plain decoding's. A step reads and computes exactly
    what it does on the plain random checkpoint."""
    import torch

    from metrale.benchmarks.latency import GDN_SHAPES, MLA_SHAPES, SHAPES

    if (folder / "config.json").exists():
        return folder
    if shape in MLA_SHAPES or shape in GDN_SHAPES:
        raise SystemExit(f"--peaked serves the Llama shapes, not {shape}")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def oracle_gain(folder: Path, options: dict, k: int, context: int, max_tokens: int,
                attempts: int = 4) -> dict[str, float]:
    """Batch-1 greedy tok/s without speculation and with the oracle drafter at ``k``.

    A verify's rows may round differently from decode steps (other kernels for more rows), so on
    random weights, whose top logits nearly tie, its greedy tokens can part from plain decoding's;
    the drafter would then have nothing to propose past that point. The script is therefore the
    speculative run's own output, run again (up to ``attempts`` runs) until the run follows it to
    the end; the last run is the one timed (on :func:`build_peaked_checkpoint`'s model one run
    suffices)."""
    import numpy as np

    from metrale import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(folder, **options)
    prompt = np.random.default_rng(1).integers(1, plain.vocab_size, context).tolist()
    timed_generate(plain, [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    (want,), plain_seconds = timed_generate(plain, [prompt], params)
    plain.close()
    drafter = OracleDrafter([prompt + want.token_ids])
    speculative = LLM(folder, plugin_manager=oracle_manager(drafter),
                      speculative_config={"method": "oracle", "num_speculative_tokens": k}, **options)
    timed_generate(speculative, [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    script = want.token_ids
    for attempt in range(1, attempts + 1):
        drafter.scripts = [prompt + list(script)]
        (got,), seconds = timed_generate(speculative, [prompt], params)
        if list(got.token_ids) == list(script):
            break
        script = got.token_ids
    speculative.close()
    agree = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b), len(got.token_ids))
    return {"k": k, "plain_tok_s": max_tokens / plain_seconds, "speculative_tok_s": max_tokens / seconds,
            "speed_up": plain_seconds / seconds, "tokens_agreeing": agree, "drafted": got.num_draft_tokens,
            "accepted": got.num_accepted_tokens, "runs": attempt}


def acceptance(name: str, options: dict, prompts: int, max_tokens: int, k: int = 3,
               method: str = "ngram") -> dict[str, float]:
    """Speculation with the ``method`` drafter on held-out text of the corpus the tiny models were
    trained on, one prompt at a time (batch 1): the mean tokens a sequence's verify produced (its
    kept drafts plus the one the target adds), the drafts kept, tok/s with and without."""
    import tiny_corpus

    from metrale import LLM, SamplingParams

    _, held_out = tiny_corpus.extract()
    texts = [doc[:400] for doc in held_out if len(doc) >= 400][:prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def one_by_one(llm: Any) -> tuple[list, float, int]:
        """The outputs, their seconds, and the sequences verified with drafts (after a warm-up)."""
        timed_generate(llm, texts[:1], params)  # graphs recorded, kernels compiled
        before = llm.engine.drafted_sequences
        outputs, seconds = [], 0.0
        for text in texts:
            (output,), elapsed = timed_generate(llm, [text], params)
            outputs.append(output)
            seconds += elapsed
        return outputs, seconds, llm.engine.drafted_sequences - before

    plain = LLM(name, **options)
    want, plain_seconds, _ = one_by_one(plain)
    plain.close()
    speculative = LLM(name, speculative_config={"method": method, "num_speculative_tokens": k}, **options)
    got, seconds, verifies = one_by_one(speculative)
    speculative.close()
    drafted = sum(o.num_draft_tokens for o in got)
    accepted = sum(o.num_accepted_tokens for o in got)
    generated = sum(len(o.token_ids) for o in got)
    return {"k": k, "prompts": len(texts), "verify_steps": verifies, "drafted": drafted, "accepted": accepted,
            "tokens_per_verify": (accepted + verifies) / verifies if verifies else 0.0,
            "acceptance": accepted / drafted if drafted else 0.0,
            "same_tokens": sum(a.token_ids == b.token_ids for a, b in zip(want, got)),
            "plain_tok_s": generated / plain_seconds, "speculative_tok_s": generated / seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b", help="a metrale bench shape (random weights)")
    parser.add_argument("--checkpoint", help="a checkpoint folder or embedded model instead of --shape")
    parser.add_argument("--peaked", action="store_true",
                        help="the oracle part runs on build_peaked_checkpoint's model of --shape (wide logit "
                             "margins: a verify keeps plain decoding's greedy tokens)")
    parser.add_argument("--k", default="1,2,3,4", help="draft counts (comma-separated)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32, help="timed steps per verify size")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated by the oracle and n-gram runs")
    parser.add_argument("--parts", default="verify,oracle,ngram")
    parser.add_argument("--mtp-models", help="checkpoints with an MTP module (comma-separated) for the mtp part: "
                                             "speculation with the mtp drafter on the same held-out text")
    parser.add_argument("--tiny", default="tiny-dense,tiny-mla,tiny-gdn", help="models of the n-gram part")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts of the n-gram part")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--output", help="write the numbers here (JSON)")
    args = parser.parse_args(argv)

    from metrale import LLM

    parts = set(args.parts.split(","))
    ks = [int(k) for k in args.k.split(",")]
    report: dict[str, Any] = {"device": args.device}
    if parts & {"verify", "oracle"}:
        if args.checkpoint:
            folder = args.checkpoint
        else:
            from metrale.benchmarks.latency import build_checkpoint

            folder = build_checkpoint(args.shape, Path(args.workdir) / args.shape)
        report["model"] = str(args.checkpoint or args.shape)
        length = args.context + (args.steps + 4) * (max(ks) + 1) + args.max_tokens + 64
        options = dict(device=args.device, show_progress=False, max_model_len=length, max_num_seqs=1)
    if "verify" in parts:
        llm = LLM(folder, **options)
        costs = verify_costs(llm, ks, args.context, args.steps)
        llm.close()
        report["verify_seconds"] = costs
        print(f"{report['model']}, context {args.context}: a decode step {1e3 * costs['decode']:.3f} ms")
        for k in ks:
            seconds = costs[f"verify_k{k}"]
            print(f"  verify of {k + 1} rows: {1e3 * seconds:8.3f} ms  ({seconds / costs['decode']:.2f} decode steps)")
            if f"prompt_rows_k{k}" in costs:
                plain = costs[f"prompt_rows_k{k}"]
                print(f"    as prompt rows, no row states: {1e3 * plain:8.3f} ms  (keeping them: "
                      f"{1e3 * (seconds - plain):+.3f} ms)")
    if "oracle" in parts:
        oracle_folder = folder
        if args.peaked:
            oracle_folder = build_peaked_checkpoint(args.shape, Path(args.workdir) / f"{args.shape}-peaked")
        gain = oracle_gain(oracle_folder, options, max(ks), args.context, args.max_tokens)
        gain["peaked"] = args.peaked
        report["oracle"] = gain
        print(f"oracle drafter, K = {gain['k']}: {gain['plain_tok_s']:.1f} tok/s without, "
              f"{gain['speculative_tok_s']:.1f} with ({gain['speed_up']:.2f}x); {gain['accepted']} of "
              f"{gain['drafted']} drafts kept, the first {gain['tokens_agreeing']} tokens as without; "
              f"{gain['runs']} run(s) to follow its script")
    drafters = [("ngram", name) for name in args.tiny.split(",") if name and "ngram" in parts]
    drafters += [("mtp", name) for name in (args.mtp_models or "").split(",") if name and "mtp" in parts]
    for method, name in drafters:
        numbers = acceptance(name, dict(device=args.device, show_progress=False), args.prompts, args.max_tokens,
                             method=method)
        report.setdefault(method, {})[name] = numbers
        print(f"{name}: {method} K = {numbers['k']}: {numbers['tokens_per_verify']:.2f} tokens a verify, "
              f"{numbers['accepted']} of {numbers['drafted']} drafts kept; {numbers['plain_tok_s']:.1f} tok/s "
              f"without, {numbers['speculative_tok_s']:.1f} with; {numbers['same_tokens']} of "
              f"{numbers['prompts']} outputs the same")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
