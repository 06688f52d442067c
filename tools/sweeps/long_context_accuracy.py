"""A long prompt's last-position logits: Metrale's bf16 prefill and transformers' bf16 forward, each
against transformers' float32 forward of the same random-weight checkpoint (the one
``metrale bench`` writes for the shape).

Metrale passes when its error is within transformers' own bf16 error: at most ``--margin`` times
it (the two bf16 computations round differently, so neither bounds the other exactly). Each
error is the largest absolute logit difference over the largest float32 logit; the top token's
agreement with float32 is reported too. The times are of one call each, Metrale's its first (its
kernels compiled in it).

    python3 tools/sweeps/long_context_accuracy.py --shape llama-8b --length 131072

Needs a CUDA device with room for the float32 model (32 GB for the 8B shape) and its activations
at the prompt's length, torch and transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path


def metrale_logits(folder: Path, prompt: list[int]):
    import numpy as np

    from metrale.entrypoints.llm import LLM
    from metrale.sequence import SequenceState

    # Only the prompt's forward runs (no token is generated): a context of its length is enough,
    # and a 131,072-token prompt fits a checkpoint of that many positions.
    with LLM(folder, device="cuda", max_model_len=len(prompt), max_num_seqs=1, show_progress=False) as llm:
        seq = SequenceState.from_prompt(prompt)
        started = time.perf_counter()
        logits = llm.backend.to_numpy(llm.forward.prefill(prompt, seq))
        seconds = time.perf_counter() - started
        llm.cache.release(seq)
    return np.asarray(logits, dtype=np.float32).reshape(-1), seconds


#: The float32 forward's attention: PyTorch's memory-efficient SDPA kernel over the key and value
#: heads repeated for their query heads, causal, no mask built. At 131,072 tokens transformers' own
#: SDPA path in float32 falls back to the math kernel (grouped heads), whose scores alone take 64 GiB.
FLOAT32_ATTENTION = "metrale_float32_efficient"


def efficient_float32_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if query.is_cuda else SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_float32_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(FLOAT32_ATTENTION, efficient_float32_attention)
    AttentionMaskInterface.register(FLOAT32_ATTENTION, lambda *args, **kwargs: None)  # causal in the kernel


def chunk_mlps(model, tokens: int = 8192) -> None:
    """Each MLP of ``model`` over ``tokens`` tokens at a time (a token's output is its own): the
    float32 activations of a 131,072-token prompt then fit beside the 8B shape's weights."""
    import torch

    for layer in model.model.layers:
        whole = layer.mlp.forward
        layer.mlp.forward = lambda x, whole=whole: torch.cat([whole(part) for part in x.split(tokens, dim=1)], dim=1)


def transformers_logits(folder: Path, prompt: list[int], dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    attention = "sdpa"
    if dtype == torch.float32:
        register_float32_attention()
        attention = FLOAT32_ATTENTION
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention).to("cuda").eval()
    if dtype == torch.float32:
        chunk_mlps(model)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        started = time.perf_counter()
        logits = model(ids, logits_to_keep=1).logits[0, -1].float().cpu().numpy()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    del model, ids
    gc.collect()
    torch.cuda.empty_cache()
    return logits, seconds


def release_device_memory() -> None:
    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from metrale.benchmarks.latency import SHAPES, build_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--length", type=int, default=131072, help="prompt tokens (default: 131072)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/metrale-bench"),
                        help="where the checkpoint is written (as metrale bench writes it)")
    parser.add_argument("--margin", type=float, default=1.25,
                        help="Metrale's error may be at most this times transformers' bf16 error (default: 1.25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    folder = build_checkpoint(args.shape, args.workdir / args.shape)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(args.seed).integers(0, vocab, args.length).tolist()

    ours, our_seconds = metrale_logits(folder, prompt)
    release_device_memory()
    bf16, bf16_seconds = transformers_logits(folder, prompt, "bfloat16")
    reference, reference_seconds = transformers_logits(folder, prompt, "float32")

    scale = float(np.abs(reference).max())
    ours_error = float(np.abs(ours - reference).max() / scale)
    bf16_error = float(np.abs(bf16 - reference).max() / scale)
    result = {
        "shape": args.shape, "length": args.length,
        "metrale_error": ours_error, "transformers_bf16_error": bf16_error, "ratio": ours_error / bf16_error,
        "metrale_top_token_agrees": bool(ours.argmax() == reference.argmax()),
        "transformers_bf16_top_token_agrees": bool(bf16.argmax() == reference.argmax()),
        "one_call_seconds": {"metrale": our_seconds, "transformers_bf16": bf16_seconds,
                             "transformers_float32": reference_seconds},
        "passed": ours_error <= args.margin * bf16_error,
    }
    print(json.dumps(result, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
