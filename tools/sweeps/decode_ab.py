"""A decode step with the decode kernels the CUDA backend uses by default
(``metrale.ops.selection.default_decode_kernels``) and without them (a plugin here serves those ops
with the other built-in kernels), on ``metrale bench``'s random-weight shapes.

For each shape and batch size, both engines prefill the same prompts, then each times its decode
step as ``metrale bench`` does (the forward from its CUDA graph, the greedy device sampler, the
tokens read back; CUDA events, median of ``--steps``). The two engines' logits of the first step
are compared (the largest difference over the largest logit), and their greedy tokens over
``--check-steps`` steps (they may part at near ties: a fused kernel sums in another order, and
random weights give flat logits). ``--merge-splits`` has its tensor-core decode attention merge
its own splits instead of combining them in a kernel of their own, as the unfused engine does
(``metrale.ops.selection.merged_decode_attention_kernels``); ``--swiglu-epilogue`` has its fused MLP
gate in the gate/up kernel's epilogue (``metrale.ops.selection.decode_gemv_kernels`` with
``swiglu_epilogue``); both through a plugin of the fused engine. ``--unroll N`` pins its decode GEMV's
unroll (``metrale.kernels.decode_gemv.choose_unroll``); ``--independent NAME,...`` launches those
kernels in stream order, not dependently (``metrale.kernels._launch.INDEPENDENT``), in both
engines; ``--carveout P`` gives every dependently launched kernel the shared-memory carveout P
(``metrale.kernels._launch.SHARED_CARVEOUT``); ``--gemv-max-rows N`` has the fused engine's decode
GEMV serve ``linear``, ``linear_silu`` and ``rmsnorm_linear`` up to N rows (cuBLAS and the norm
kernel serve more by default). Run from the repository root::

    python3 tools/sweeps/decode_ab.py [--shapes llama-1b,llama-8b,deepseek-v2-lite,qwen3-next-small] [--batch 1,4,8]
                                      [--context 512] [--merge-splits] [--swiglu-epilogue] [--unroll 4]
                                      [--independent decode_gemv,rmsnorm_residual_words] [--carveout 100]
                                      [--gemv-max-rows 32 [--gemv-ops linear] [--gemv-max-columns 16384]]
                                      [--lt-gemm 64]
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import numpy as np

from metrale import hookimpl


class UnfusedDecodePlugin:
    """Serves the ops the default decode kernels serve with the other built-in kernels of those ops
    (each under its condition; a plugin's kernels are tried first), so the decode kernels are never
    chosen."""

    @hookimpl
    def metrale_register_ops(self, registry):  # type: ignore[no-untyped-def]
        from metrale.ops import Kernel
        from metrale.ops.builtin import builtin_registry
        from metrale.ops.selection import default_decode_kernels

        decode = {(kernel.op, kernel.name, kernel.condition) for kernel in default_decode_kernels()}
        for op in {op for op, _, _ in decode}:
            others = [k for k in builtin_registry().kernels_for(op, "cuda") if (k.op, k.name, k.condition) not in decode]

            def build(backend, others=others):  # type: ignore[no-untyped-def]
                built = [(kernel, kernel.build(backend)) for kernel in others]

                def serve(*args, **kwargs):  # type: ignore[no-untyped-def]
                    for kernel, function in built:
                        if kernel.when is None or kernel.when(*args, **kwargs):
                            return function(*args, **kwargs)
                    raise AssertionError(f"no built-in kernel of {op} serves the call")

                return serve

            registry.add_kernel(Kernel(op, "cuda", "the built-in kernels but the decode ones", build=build))


class FusedVariantsPlugin:
    """Adds ``kernels`` (variants the registry offers but does not register by default)."""

    def __init__(self, kernels) -> None:  # type: ignore[no-untyped-def]
        self.kernels = list(kernels)

    @hookimpl
    def metrale_register_ops(self, registry):  # type: ignore[no-untyped-def]
        for kernel in self.kernels:
            registry.add_kernel(kernel)


class WiderGemvPlugin:
    """Serves ``ops`` (of ``linear``, ``linear_silu`` and ``rmsnorm_linear``) with the decode GEMV
    up to ``max_rows`` rows and, when given, ``max_columns`` output columns (a plugin's kernels are
    tried first)."""

    def __init__(self, max_rows: int, ops: tuple[str, ...], max_columns: int | None = None) -> None:
        self.max_rows, self.ops, self.max_columns = max_rows, ops, max_columns

    @hookimpl
    def metrale_register_ops(self, registry):  # type: ignore[no-untyped-def]
        import dataclasses

        from metrale.ops.selection import decode_gemv_kernels

        limit = self.max_columns
        for kernel in decode_gemv_kernels(max_rows=self.max_rows):
            if kernel.op in self.ops:
                if limit is not None:
                    served = kernel.when

                    def narrow(*args, served=served, op=kernel.op, **kwargs):  # type: ignore[no-untyped-def]
                        weight = kwargs.get("weight", args[5] if op == "rmsnorm_linear" else args[1])
                        return weight.shape[0] <= limit and served(*args, **kwargs)

                    kernel = dataclasses.replace(kernel, when=narrow)
                registry.add_kernel(kernel)


class SplitFreeGemm:
    """The backend's ``gemm`` with bf16 products of at most ``max_rows`` rows through cuBLASLt
    without a separate split-K reduction (:class:`metrale.kernels.linear.CublasLtGemm`)."""

    def __init__(self, base, stream, max_rows: int) -> None:  # type: ignore[no-untyped-def]
        from metrale.kernels.linear import CublasLtGemm

        self.base, self.lt, self.max_rows = base, CublasLtGemm(stream), max_rows

    def __call__(self, x, weight, out):  # type: ignore[no-untyped-def]
        if x.dtype == np.uint16 and x.shape[0] <= self.max_rows:
            return self.lt(x, weight, out)
        return self.base(x, weight, out)

    def per_head(self, x, weight, out):  # type: ignore[no-untyped-def]
        return self.base.per_head(x, weight, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b,deepseek-v2-lite,qwen3-next-small")
    parser.add_argument("--batch", default="1,4,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--check-steps", type=int, default=16, help="greedy steps compared")
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--merge-splits", action="store_true",
                        help="the fused engine's decode attention merges its own splits")
    parser.add_argument("--swiglu-epilogue", action="store_true",
                        help="the fused engine's fused MLP gates in its gate/up kernel's epilogue")
    parser.add_argument("--unroll", type=int, choices=(4, 8),
                        help="the fused engine's decode GEMV unroll, whatever the shape")
    parser.add_argument("--independent", default="",
                        help="kernels (comma-separated names) launched in stream order, not dependently")
    parser.add_argument("--carveout", type=int, help="the shared-memory carveout (0-100) of dependent launches")
    parser.add_argument("--gemv-max-rows", type=int,
                        help="the fused engine's decode GEMV serves linear, linear_silu and rmsnorm_linear up to "
                             "this many rows (at most metrale.kernels.decode_gemv.MAX_ROWS)")
    parser.add_argument("--lt-gemm", type=int, default=0,
                        help="the fused engine's bf16 products of at most this many rows go through cuBLASLt "
                             "without a separate split-K reduction")
    parser.add_argument("--gemv-ops", default="linear,linear_silu,rmsnorm_linear",
                        help="the ops --gemv-max-rows widens (comma-separated)")
    parser.add_argument("--gemv-max-columns", type=int,
                        help="with --gemv-max-rows: only for weights of at most this many output rows")
    args = parser.parse_args()

    from metrale.benchmarks.latency import _cuda_time, build_checkpoint
    from metrale.entrypoints.llm import LLM
    from metrale.kernels import _launch, decode_gemv
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops.selection import FUSED_MLP_MAX_BYTES, decode_gemv_kernels, merged_decode_attention_kernels
    from metrale.params import SamplingParams
    from metrale.sequence import SequenceState

    _launch.INDEPENDENT = frozenset(name for name in args.independent.split(",") if name)
    _launch.SHARED_CARVEOUT = args.carveout
    batches = [int(b) for b in args.batch.split(",")]
    print(f"{'shape':>16} {'batch':>5} {'unfused ms':>10} {'fused ms':>9} {'speed-up':>8} {'logits diff':>11} "
          f"{'same tokens':>11}")
    for shape in args.shapes.split(","):
        folder = build_checkpoint(shape, Path(args.workdir) / shape)
        unfused_manager = get_plugin_manager()
        unfused_manager.register(UnfusedDecodePlugin(), name="unfused-decode")
        options = dict(device="cuda", max_model_len=args.context + args.steps + args.check_steps + 64,
                       max_num_seqs=max(batches) + 1, show_progress=False)
        fused_manager = get_plugin_manager()
        variants = merged_decode_attention_kernels() if args.merge_splits else []
        if args.swiglu_epilogue:
            variants += [kernel for kernel in decode_gemv_kernels(max_rows=1, max_mlp_bytes=FUSED_MLP_MAX_BYTES,
                                                                  swiglu_epilogue=True) if kernel.op == "rmsnorm_mlp"]
        if variants:
            fused_manager.register(FusedVariantsPlugin(variants), name="fused-variants")
        if args.gemv_max_rows:
            ops = tuple(op for op in args.gemv_ops.split(",") if op)
            fused_manager.register(WiderGemvPlugin(args.gemv_max_rows, ops, args.gemv_max_columns),
                                   name="wider-gemv")
        engines = {"unfused": LLM(folder, plugin_manager=unfused_manager, **options),
                   "fused": LLM(folder, plugin_manager=fused_manager, **options)}
        if args.lt_gemm:
            kernels = engines["fused"].backend.kernels
            kernels.gemm = SplitFreeGemm(kernels.gemm, engines["fused"].backend.stream, args.lt_gemm)

        @contextlib.contextmanager
        def kernels_of(name):
            # The unroll is read when a step runs eagerly or is recorded; replays keep it.
            saved = decode_gemv.choose_unroll
            if args.unroll and name == "fused":
                decode_gemv.choose_unroll = lambda *shape, **options: args.unroll
            try:
                yield
            finally:
                decode_gemv.choose_unroll = saved

        for name, llm in engines.items():
            with kernels_of(name):
                llm.capture_graphs(batches)
        for batch in batches:
            rng = np.random.default_rng(batch)
            prompts = [rng.integers(0, engines["fused"].vocab_size, args.context).tolist() for _ in range(batch)]
            greedy, seeds = [SamplingParams(temperature=0.0)] * batch, list(range(batch))
            times, tokens, first_logits = {}, {}, {}
            for name, llm in engines.items():
                with kernels_of(name):
                    seqs = [SequenceState.from_prompt(list(p)) for p in prompts]
                    for seq in seqs:
                        llm.forward.prefill(seq.tokens, seq)
                    step_tokens = [1] * batch
                    chosen = []
                    for step in range(args.check_steps):  # greedy decode, every token fed back
                        logits = llm.forward.decode_batch(step_tokens, seqs)
                        if step == 0:
                            first_logits[name] = np.asarray(llm.backend.to_numpy(logits), dtype=np.float32)
                        step_tokens = [int(t) for t in llm.engine.sampler.sample(logits, greedy, seeds, [0] * batch)]
                        chosen.append(step_tokens)
                    tokens[name] = chosen

                    def step() -> None:
                        logits = llm.forward.decode_batch(step_tokens, seqs)
                        llm.engine.sampler.sample(logits, greedy, seeds, [0] * batch)

                    times[name] = _cuda_time(step, repeats=args.steps, stream=llm.backend.stream)
                    for seq in seqs:
                        llm.cache.release(seq)
            same = sum(a == b for a, b in zip(tokens["unfused"], tokens["fused"]))
            difference = np.abs(first_logits["fused"] - first_logits["unfused"]).max()
            relative = difference / np.abs(first_logits["unfused"]).max()
            print(f"{shape:>16} {batch:>5} {1e3 * times['unfused']:10.3f} {1e3 * times['fused']:9.3f} "
                  f"{times['unfused'] / times['fused']:7.2f}x {relative:11.1e} {same:>5}/{args.check_steps} steps")
        for llm in engines.values():
            llm.close()


if __name__ == "__main__":
    main()
