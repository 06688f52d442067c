"""Prompt attention on Hopper: the warpgroup kernel (``metrale.kernels.attention_hopper``, wgmma
and TMA) against the ``mma.sync`` kernel (``metrale.kernels.attention_mma``) and, where torch is
installed, torch's ``scaled_dot_product_attention`` (FlashAttention inside) on the same prompt.

Prints, per geometry, prompt length and cached prefix, the microseconds of each (CUDA events, the
median of several runs; the warpgroup kernel with and without its consumers taking turns at
their products, ``attention_hopper.PINGPONG``, and with and without each consumer's softmax
under its own products, ``attention_hopper.OVERLAP``, and with three consumer warpgroups,
"3wg", for the head sizes of ``attention_hopper.THREE_CONSUMER_FORMS``; "ti": with the grid's
tiles, not its heads, the fastest dimension, ``attention_hopper.HEADS_INNER``), their TFLOP/s (4 * d flops per visible (row, key)
pair and head, d the mean of the key and value sizes) and the largest difference between the two
Metrale kernels' outputs (bf16). Run from the repository root on an sm_90 GPU::

    python3 tools/sweeps/prompt_attention_sweep.py [--lengths 512,2048,8192,32768] [--prefix 0] \\
        [--geometries 32x8x128,32x8x64,16x16x192x128,8x4x256] [--block-size 16]
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
    parser.add_argument("--lengths", default="512,2048,8192,16384,32768", help="prompt lengths (rows)")
    parser.add_argument("--prefix", type=int, default=0, help="cached tokens before the prompt")
    parser.add_argument("--geometries", default="32x8x128,32x8x64,16x16x192x128,8x4x256",
                        help="heads x kv heads x head dim [x value dim], comma-separated")
    parser.add_argument("--block-size", type=int, default=16, help="rows of a cache page")
    parser.add_argument("--no-sdpa", action="store_true", help="skip torch's scaled_dot_product_attention")
    args = parser.parse_args()

    import cupy as cp

    from metrale.kernels import attention_hopper, attention_mma
    from metrale.kernels.bf16 import bf16_to_float32

    torch = None
    if not args.no_sdpa:
        try:
            import torch
        except ImportError:
            print("(torch is not installed: no scaled_dot_product_attention column)")
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    # (turns, overlap, three consumer warpgroups); the three-consumer forms only for the head sizes
    # whose registers hold them (attention_hopper.THREE_CONSUMER_FORMS).
    # "ti": the grid as (tiles, heads) rather than (heads, tiles) (attention_hopper.HEADS_INNER).
    variants = {"both": (True, True, False, True), "turns": (True, False, False, True),
                "overlap": (False, True, False, True), "overlap ti": (False, True, False, False),
                "plain": (False, False, False, True), "3wg": (False, True, True, True),
                "3wg ti": (False, True, True, False), "3wg plain": (False, False, True, True)}
    columns = (*variants, "mma", "sdpa")
    print(f"{'heads':>9} {'d/dv':>8} {'rows':>6} {'prefix':>6} "
          + " ".join(f"{name + ' us':>11} {'TFLOP/s':>8}" for name in columns) + f" {'max diff':>9}")
    geometries = [tuple(int(part) for part in geometry.split("x")) for geometry in args.geometries.split(",")]
    block_size = args.block_size
    for heads, kv_heads, head_dim, *value in geometries:
        value_dim = value[0] if value else head_dim
        for rows in (int(n) for n in args.lengths.split(",")):
            context = args.prefix + rows
            blocks = -(-context // block_size) + 1
            table = cp.asarray(rng.permutation(np.arange(1, blocks, dtype=np.int32))[None, :])
            q = cp.asarray(rng.standard_normal((rows, heads, head_dim)).astype(np.float32))
            k_cache = cp.asarray(rng.integers(0x3C00, 0x3F80, (blocks, block_size, kv_heads, head_dim)).astype(np.uint16)
                                 ^ rng.integers(0, 2, (blocks, block_size, kv_heads, head_dim)).astype(np.uint16) << 15)
            v_cache = cp.asarray(rng.integers(0x3C00, 0x3F80, (blocks, block_size, kv_heads, value_dim)).astype(np.uint16))
            seq_index = cp.zeros(rows, dtype=np.int32)
            positions = cp.arange(args.prefix, context, dtype=np.int32)
            starts = np.array([0, rows], np.int32)
            scale = head_dim**-0.5
            pairs = rows * args.prefix + rows * (rows + 1) / 2
            flops = 2 * (head_dim + value_dim) * heads * pairs
            outputs = {}
            times = {}
            with stream:
                if attention_hopper.supports(heads, kv_heads, head_dim, value_dim, block_size):
                    out = outputs["wgmma"] = cp.zeros((rows, heads * value_dim), dtype=np.uint16)
                    defaults = (attention_hopper.PINGPONG, attention_hopper.OVERLAP,
                                attention_hopper.THREE_CONSUMER_HEAD_DIMS, attention_hopper.HEADS_INNER)
                    for name, (turns, overlap, three, heads_inner) in variants.items():
                        if three and (head_dim, value_dim) not in attention_hopper.THREE_CONSUMER_FORMS:
                            continue
                        attention_hopper.PINGPONG, attention_hopper.OVERLAP = turns, overlap
                        attention_hopper.HEADS_INNER = heads_inner
                        attention_hopper.THREE_CONSUMER_HEAD_DIMS = frozenset({(head_dim, value_dim)} if three else ())
                        tiles = cp.asarray(attention_hopper.query_tiles(starts, head_dim, value_dim))
                        times[name] = cuda_event_time(lambda: attention_hopper.prefill_attention(
                            q, k_cache, v_cache, table, seq_index, positions, tiles, scale, None, out, stream), stream)
                    (attention_hopper.PINGPONG, attention_hopper.OVERLAP,
                     attention_hopper.THREE_CONSUMER_HEAD_DIMS, attention_hopper.HEADS_INNER) = defaults
                    # The output compared below: the default form's.
                    tiles = cp.asarray(attention_hopper.query_tiles(starts, head_dim, value_dim))
                    attention_hopper.prefill_attention(q, k_cache, v_cache, table, seq_index, positions, tiles, scale,
                                                       None, out, stream)
                out_mma = outputs["mma"] = cp.zeros((rows, heads * value_dim), dtype=np.uint16)
                mma_tiles = cp.asarray(attention_mma.query_tiles(starts))
                times["mma"] = cuda_event_time(lambda: attention_mma.prefill_attention(
                    q, k_cache, v_cache, table, seq_index, positions, mma_tiles, scale, None, out_mma, stream), stream)
            if torch is not None and args.prefix == 0:
                times["sdpa"] = sdpa_time(torch, q, k_cache, v_cache, table, rows, heads, kv_heads, scale)
            line = f"{heads:>4}/{kv_heads:<4} {head_dim:4d}/{value_dim:<3d} {rows:6d} {args.prefix:6d}"
            for name in columns:
                timed = times.get(name)
                line += (f" {timed.median_us:11.1f} {flops / timed.median / 1e12:8.1f}" if timed is not None
                         else f" {'-':>11} {'-':>8}")
            if "wgmma" in outputs:
                difference = np.abs(bf16_to_float32(cp.asnumpy(outputs["wgmma"]))
                                    - bf16_to_float32(cp.asnumpy(outputs["mma"]))).max()
                line += f" {difference:9.2e}"
            print(line, flush=True)


def sdpa_time(torch, q, k_cache, v_cache, table, rows, heads, kv_heads, scale):
    """torch's causal scaled_dot_product_attention over the same rows in bf16 ([1, heads, rows, d],
    the keys and values gathered from the pages once, outside the timing)."""
    import cupy as cp
    from timing import cuda_event_time

    slots = cp.asarray(table)[0]
    device = torch.device("cuda")
    keys = torch.as_tensor(cp.ascontiguousarray(k_cache[slots].reshape(-1, kv_heads, k_cache.shape[3])[:rows]),
                           device=device).view(torch.bfloat16)
    values = torch.as_tensor(cp.ascontiguousarray(v_cache[slots].reshape(-1, kv_heads, v_cache.shape[3])[:rows]),
                             device=device).view(torch.bfloat16)
    query = torch.as_tensor(q, device=device).to(torch.bfloat16).transpose(0, 1)[None]
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream, torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
        return cuda_event_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=scale, enable_gqa=heads != kv_heads), stream)


if __name__ == "__main__":
    main()
