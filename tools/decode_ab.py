"""A decode step with and without the fused decode kernels (``metrale.ops.builtin.
decode_gemv_kernels``, ``moe_decode_kernels`` and ``gdn_decode_kernels``, registered by a plugin
here), on ``metrale bench``'s random-weight shapes.

For each shape and batch size, both engines prefill the same prompts, then each times its decode
step as ``metrale bench`` does (the forward from its CUDA graph, the greedy device sampler, the
tokens read back; CUDA events, median of ``--steps``), and the two engines' greedy tokens over
``--check-steps`` steps are compared (they may part at near ties: a fused kernel sums in another
order). Run from the repository root::

    python3 tools/decode_ab.py [--shapes llama-1b,llama-8b,deepseek-v2-lite,qwen3-next-small] [--batch 1,4,8]
                               [--context 512]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from metrale import hookimpl


class DecodeKernelsPlugin:
    """Registers the fused decode kernels (a plugin, as a third party would)."""

    @hookimpl
    def metrale_register_ops(self, registry):  # type: ignore[no-untyped-def]
        from metrale.ops.builtin import decode_gemv_kernels, gdn_decode_kernels, moe_decode_kernels

        for kernel in decode_gemv_kernels() + moe_decode_kernels() + gdn_decode_kernels():
            registry.add_kernel(kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b,deepseek-v2-lite,qwen3-next-small")
    parser.add_argument("--batch", default="1,4,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--check-steps", type=int, default=16, help="greedy steps compared")
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    args = parser.parse_args()

    from metrale.api import LLM
    from metrale.bench import _cuda_time, build_checkpoint
    from metrale.params import SamplingParams
    from metrale.plugin_manager import get_plugin_manager
    from metrale.sequence import SequenceState

    batches = [int(b) for b in args.batch.split(",")]
    print(f"{'shape':>16} {'batch':>5} {'before ms':>9} {'fused ms':>9} {'speed-up':>8} {'same tokens':>11}")
    for shape in args.shapes.split(","):
        folder = build_checkpoint(shape, Path(args.workdir) / shape)
        fused_manager = get_plugin_manager()
        fused_manager.register(DecodeKernelsPlugin(), name="decode-kernels")
        options = dict(device="cuda", max_model_len=args.context + args.steps + args.check_steps + 64,
                       max_num_seqs=max(batches) + 1, show_progress=False)
        engines = {"cuBLAS": LLM(folder, **options), "fused": LLM(folder, plugin_manager=fused_manager, **options)}
        for llm in engines.values():
            llm.capture_graphs(batches)
        for batch in batches:
            rng = np.random.default_rng(batch)
            prompts = [rng.integers(0, engines["cuBLAS"].vocab_size, args.context).tolist() for _ in range(batch)]
            greedy, seeds = [SamplingParams(temperature=0.0)] * batch, list(range(batch))
            times, tokens = {}, {}
            for name, llm in engines.items():
                seqs = [SequenceState.from_prompt(list(p)) for p in prompts]
                for seq in seqs:
                    llm.forward.prefill(seq.tokens, seq)
                step_tokens = [1] * batch
                chosen = []
                for _ in range(args.check_steps):  # greedy decode, every token fed back
                    logits = llm.forward.decode_batch(step_tokens, seqs)
                    step_tokens = [int(t) for t in llm.engine.sampler.sample(logits, greedy, seeds, [0] * batch).tokens()]
                    chosen.append(step_tokens)
                tokens[name] = chosen

                def step() -> None:
                    logits = llm.forward.decode_batch(step_tokens, seqs)
                    llm.engine.sampler.sample(logits, greedy, seeds, [0] * batch)

                times[name] = _cuda_time(step, repeats=args.steps, stream=llm.backend.stream)
                for seq in seqs:
                    llm.cache.release(seq)
            same = sum(a == b for a, b in zip(tokens["cuBLAS"], tokens["fused"]))
            print(f"{shape:>16} {batch:>5} {1e3 * times['cuBLAS']:9.3f} {1e3 * times['fused']:9.3f} "
                  f"{times['cuBLAS'] / times['fused']:7.2f}x {same:>5}/{args.check_steps} steps")
        for llm in engines.values():
            llm.close()


if __name__ == "__main__":
    main()
