"""The Gated DeltaNet prompt rule on the GPU: the chunked tensor-core kernel
(``metrale.kernels.gated_delta_chunked``) against the CUDA-core recurrence
(``metrale.kernels.gated_delta.prompt_rule_kernel``) on the same segments.

Prints, per head geometry, prompt length and prompt count, the microseconds of each (CUDA events,
one layer), the state columns per block the chunked launcher picks, and the chunked kernel's
largest difference from the recurrence over the largest output. Run from the repository root::

    python3 tools/sweeps/gdn_prompt_sweep.py [--lengths 512,2048,8192] [--prompts 1,4] [--geometries 32x128x128,16x64x64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import cuda_event_time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192", help="tokens per prompt")
    parser.add_argument("--prompts", default="1,4", help="prompts per launch, comma-separated")
    parser.add_argument("--geometries", default="32x128x128,16x64x64", help="heads x d_k x d_v, comma-separated")
    args = parser.parse_args()

    import cupy as cp

    from metrale.kernels import gated_delta, gated_delta_chunked

    stream = cp.cuda.Stream(non_blocking=True)
    multiprocessors = cp.cuda.Device().attributes["MultiProcessorCount"]
    rng = np.random.default_rng(0)
    print(f"{'heads':>5} {'d_k':>4} {'d_v':>4} {'tokens':>6} {'prompts':>7} {'columns':>7} {'chunked us':>11} "
          f"{'cuda-core us':>13} {'speedup':>8} {'difference':>10}")
    for heads, key_dim, value_dim in (tuple(int(part) for part in geometry.split("x")) for geometry in
                                      args.geometries.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            for prompts in (int(n) for n in args.prompts.split(",")):
                tokens = length * prompts
                k = rng.standard_normal((tokens, heads, key_dim)).astype(np.float32)
                k /= np.linalg.norm(k, axis=-1, keepdims=True)
                q = k[rng.permutation(tokens)] * np.float32(key_dim**-0.5)
                arrays = [cp.asarray(a) for a in (
                    q, k, rng.standard_normal((tokens, heads, value_dim)).astype(np.float32),
                    -rng.uniform(0, 0.5, (tokens, heads)).astype(np.float32),
                    rng.uniform(0, 1, (tokens, heads)).astype(np.float32))]
                state = cp.asarray((0.1 * rng.standard_normal((prompts, heads, key_dim, value_dim))).astype(np.float32))
                slots = cp.arange(prompts, dtype=np.int32)
                starts = cp.arange(0, tokens + 1, length, dtype=np.int32)
                chunked_out, core_out = (cp.empty((tokens, heads, value_dim), dtype=np.float32) for _ in range(2))
                cp.cuda.Device().synchronize()
                # Each call continues from the state the last one left; the time does not depend on it.
                with stream:
                    chunked = cuda_event_time(lambda: gated_delta_chunked.prompt_rule(
                        *arrays, state, slots, starts, chunked_out, stream), stream)
                    core = cuda_event_time(lambda: gated_delta.prompt_rule(
                        *arrays, state, slots, starts, core_out, stream), stream, repeats=3, warmup=1)
                    # Both from the same state, for the difference.
                    saved = state.copy()
                    gated_delta_chunked.prompt_rule(*arrays, state, slots, starts, chunked_out, stream)
                    state[...] = saved
                    gated_delta.prompt_rule(*arrays, state, slots, starts, core_out, stream)
                stream.synchronize()
                difference = float(cp.abs(chunked_out - core_out).max() / cp.abs(core_out).max())
                columns = gated_delta_chunked.block_columns(prompts * heads, value_dim, multiprocessors)
                print(f"{heads:5d} {key_dim:4d} {value_dim:4d} {length:6d} {prompts:7d} {columns:7d} "
                      f"{chunked.median_us:11.1f} {core.median_us:13.1f} {core.median / chunked.median:7.1f}x "
                      f"{difference:10.2e}")


if __name__ == "__main__":
    main()
