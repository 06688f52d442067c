"""GPU time of a decode batch's routed experts over block-FP8 stacks: the routed-pair FP8 GEMV
against the path that dequantizes every expert into bf16 first.

    python tools/sweeps/fp8_routed_experts.py [--tokens 8,16,32,64] [--experts 64] [--hidden 2048] \
        [--width 1408] [--top-k 6]

The defaults are DeepSeek-V2-Lite's MoE layer. For each batch of tokens (each choosing ``top-k``
distinct experts at random) prints the microseconds a call of
:meth:`metrale.ops.cuda.CudaKernels.fp8_moe_experts_decode` (a routed pair a grid row, only the
chosen experts' codes read) and of :meth:`~metrale.ops.cuda.CudaKernels.quantized_moe_experts`
(every expert's stack dequantized into bf16, then the bf16 kernels) take (20 calls after 3, CUDA
events), whatever :data:`metrale.kernels.fp8_gemv.MAX_EXPERT_TOKENS` serves, and the routed form's
error against :func:`metrale.kernels.fp8_gemv.fp8_decode_experts_reference` (relative to the
largest output) for the batches listed in ``--check``.
"""

from __future__ import annotations

import argparse

import numpy as np


def block_fp8_stack(rows: int, inner: int, rng: np.random.Generator):
    """A stack of ``rows`` weight rows of ``inner`` values in the block FP8 format (128 x 128 scale
    blocks): codes of normal values times 100, scales between 1e-4 and 3e-4 (host arrays)."""
    from metrale.kernels.quantized import QuantizedWeight, float32_to_fp8_e4m3

    scales = rng.uniform(1e-4, 3e-4, size=(-(-rows // 128), -(-inner // 128))).astype(np.float32)
    codes = float32_to_fp8_e4m3(rng.normal(size=(rows, inner)).astype(np.float32) * 100)
    return QuantizedWeight("fp8", codes, scales, (128, 128), (rows, inner), activations="fp8_group")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8,16,32,64", help="decode batch sizes (comma-separated)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1408, help="each expert's intermediate size")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--check", default="32", help="batch sizes whose routed result is checked (comma-separated)")
    args = parser.parse_args()

    import cupy as cp

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import fp8_gemv

    backend = CudaBackend()
    rng = np.random.default_rng(5)
    experts, hidden, width, top_k = args.experts, args.hidden, args.width, args.top_k
    host_gate_up = block_fp8_stack(experts * 2 * width, hidden, rng)
    host_down = block_fp8_stack(experts * hidden, width, rng)
    gate_up, down = backend.quantized_weight(host_gate_up), backend.quantized_weight(host_down)
    backend.stream.synchronize()
    batches = [int(n) for n in args.tokens.split(",")]
    checked = {int(n) for n in args.check.split(",") if n}
    fp8_gemv.MAX_EXPERT_TOKENS = max(fp8_gemv.MAX_EXPERT_TOKENS, *batches)  # time the routed form at every size

    def timed(call, repeats: int = 20) -> float:
        for _ in range(3):
            call()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(backend.stream)
        for _ in range(repeats):
            call()
        end.record(backend.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1000 / repeats

    print(f"{experts} experts, hidden {hidden}, width {width}, {top_k} chosen a token; µs a call")
    for tokens in batches:
        x = rng.normal(size=(tokens, hidden)).astype(np.float32)
        chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
        weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
        rows, choices, weighed = cp.asarray(x), cp.asarray(chosen), cp.asarray(weights)
        routed = timed(lambda: backend.kernels.fp8_moe_experts_decode(rows, choices, weighed, gate_up, down))
        whole = timed(lambda: backend.kernels.quantized_moe_experts(rows, choices, weighed, gate_up, down))
        line = f"tokens {tokens:3}: routed pairs {routed:8.1f} µs | every expert dequantized {whole:8.1f} µs"
        if tokens in checked:
            out = cp.asnumpy(backend.kernels.fp8_moe_experts_decode(rows, choices, weighed, gate_up, down))
            want = fp8_gemv.fp8_decode_experts_reference(x, chosen, weights, host_gate_up, host_down)
            line += f" | routed error {float(np.abs(out - want).max() / np.abs(want).max()):.2e}"
        print(line)
    backend.close()


if __name__ == "__main__":
    main()
