"""LoRA decode measured: a decode step of a batch whose rows mix several adapters, against the
same batch on the base model.

On a ``metrale bench`` shape (random weights), ``--adapters`` random PEFT adapters of rank
``--rank`` on all seven projections (written in PEFT's format, no PEFT needed), and ``--batch``
sequences after a prompt of ``--context`` tokens: the median time of a decode step (its CUDA graph,
and the sampling of every row) with every row on the base model, with every row on one adapter,
and with the rows spread over all the adapters in turn. Prints the steps and their ratios to the
base model's, and writes them to ``--output`` (JSON). Run from the repository root::

    python3 tools/sweeps/lora_bench.py [--shape llama-8b] [--batch 32] [--adapters 4] [--rank 16] [--context 512]
                                       [--steps 32] [--rounds 3] [--expand-rows 8] [--expand-split 4]
                                       [--no-expand-dependent]
                                       [--output lora.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speculative_bench import synchronizer, wall_time  # noqa: E402

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) of
    ``rank`` on every projection of the dense model of ``config`` (its config.json)."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    sizes = {"q_proj": (config["num_attention_heads"] * head_dim, hidden),
             "k_proj": (config["num_key_value_heads"] * head_dim, hidden),
             "v_proj": (config["num_key_value_heads"] * head_dim, hidden),
             "o_proj": (hidden, config["num_attention_heads"] * head_dim),
             "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                out, inner = sizes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, inner)) / np.sqrt(inner)).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((out, rank))).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(sum(PROJECTIONS.values(), ())),
        "bias": "none", "task_type": "CAUSAL_LM"}))
    return folder


def decode_steps(llm: Any, requests: list, batch: int, context: int, steps: int, rounds: int = 1) -> dict[str, Any]:
    """Median seconds of a decode step of ``batch`` sequences: on the base model, on one adapter,
    and spread over ``requests`` in turn; the three are timed one after another in each of
    ``rounds`` rounds (``"rounds"``: each round's three), and each is the median over the rounds
    (a drift of the GPU's clocks then shows in every mode alike)."""
    import numpy as np

    from metrale.params import SamplingParams
    from metrale.sequence import SequenceState

    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0)
    sampler, forward, sync = llm.engine.sampler, llm.forward, synchronizer(llm)
    modes = {}
    for name, assignment in (("base", [None] * batch), ("one_adapter", [requests[0]] * batch),
                             ("mixed", [requests[i % len(requests)] for i in range(batch)])):
        seqs = []
        for lora in assignment:
            seq = SequenceState.from_prompt(rng.integers(1, llm.vocab_size, context).tolist())
            seq.adapter_slot = None if lora is None else llm.lora.acquire(lora)
            forward.prefill(seq.tokens, seq)
            seqs.append(seq)
        modes[name] = (seqs, [int(t) for t in rng.integers(1, llm.vocab_size, batch)])

    def step_of(seqs: list, tokens: list[int]) -> Any:
        def step() -> None:
            logits = forward.decode_batch(tokens, seqs)
            sampler.sample(logits, [greedy] * batch, [0] * batch, list(range(batch)))

        return step

    timed: list[dict[str, float]] = []
    for _ in range(rounds):
        timed.append({name: wall_time(step_of(*mode), steps, sync) for name, mode in modes.items()})
    for seqs, _ in modes.values():
        for seq in seqs:
            llm.cache.release(seq)
            if seq.adapter_slot is not None:
                llm.lora.release(seq.adapter_slot)
    result: dict[str, Any] = {name: float(np.median([t[name] for t in timed])) for name in modes}
    result["rounds"] = timed
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b", help="a metrale bench shape (random weights, dense)")
    parser.add_argument("--checkpoint", help="a dense checkpoint folder or embedded model instead of --shape")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three modes, timed in turn")
    parser.add_argument("--expand-dependent", action=argparse.BooleanOptionalAction, default=None,
                        help="launch the CUDA expand as a programmatic dependent or not (default: kernels/lora.py "
                        "EXPAND_DEPENDENT)")
    parser.add_argument("--output", help="write the numbers here (JSON)")
    args = parser.parse_args(argv)
    from metrale.kernels import lora as lora_kernels

    if args.expand_dependent is not None:
        lora_kernels.EXPAND_DEPENDENT = args.expand_dependent

    from metrale import LLM, LoRARequest
    from metrale.benchmarks.latency import build_checkpoint
    from metrale.entrypoints.llm import resolve_model_path

    if args.checkpoint:
        folder, args.shape = resolve_model_path(args.checkpoint), Path(args.checkpoint).name
    else:
        folder = Path(build_checkpoint(args.shape, Path(args.workdir) / args.shape))
    config = json.loads((folder / "config.json").read_text())
    requests = [LoRARequest(f"adapter-{i}", i + 1, write_adapter(Path(args.workdir) / f"lora-{args.shape}-{i}",
                                                                    config, args.rank, i))
                for i in range(args.adapters)]
    length = args.context + args.steps * args.rounds + 64  # each step of each round adds a token
    # The three modes' sequences are cached together (16-token blocks).
    llm = LLM(folder, device=args.device, show_progress=False, enable_lora=True, max_loras=args.adapters,
              max_lora_rank=args.rank, max_num_seqs=args.batch, max_model_len=length, enable_prefix_caching=False,
              block_size=16, num_blocks=3 * args.batch * (-(-length // 16) + 1))
    for request in requests:
        llm.lora.resolve(request)
    seconds = decode_steps(llm, requests, args.batch, args.context, args.steps, args.rounds)
    llm.close()
    rounds = seconds.pop("rounds")
    report = {"device": args.device, "shape": args.shape, "batch": args.batch, "adapters": args.adapters,
              "rank": args.rank, "context": args.context, "expand_rows": lora_kernels.EXPAND_ROWS,
              "expand_dependent": lora_kernels.EXPAND_DEPENDENT, "step_seconds": seconds, "rounds": rounds,
              "ratio_one_adapter": seconds["one_adapter"] / seconds["base"], "ratio_mixed": seconds["mixed"] / seconds["base"]}
    print(f"{args.shape}, batch {args.batch}, context {args.context}: base step {1e3 * seconds['base']:.3f} ms; "
          f"one adapter {1e3 * seconds['one_adapter']:.3f} ms ({report['ratio_one_adapter']:.2f}x); "
          f"{args.adapters} rank-{args.rank} adapters mixed {1e3 * seconds['mixed']:.3f} ms ({report['ratio_mixed']:.2f}x)")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
