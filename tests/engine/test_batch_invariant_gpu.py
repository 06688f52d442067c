"""Batch-invariant mode on the GPU (docs/serving.rst, "Batch-invariant mode"): 32 prompts give the
same logits bits and greedy tokens alone and together, with chunked prefill and prefix-cache hits,
on Llama and Gemma-2 checkpoints whose heads the tensor-core prompt attention takes; a family with
MoE layers is refused with a typed error."""

from __future__ import annotations

import numpy as np
import pytest
from test_batch_invariant import differing, run

from metrale import SamplingParams
from metrale.errors import ConfigError

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(count=32, shared_prefix=0, seed=3):
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(3, 500, size=shared_prefix)]
    return [prefix + [int(t) for t in rng.integers(3, 500, size=int(n))] for n in rng.integers(1, 90, size=count)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("invariant_gpu")
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6)
    return {
        "llama": build_hf_checkpoint(LlamaForCausalLM, LlamaConfig(**base), root / "llama", seed=5),
        "gemma2": build_hf_checkpoint(Gemma2ForCausalLM, Gemma2Config(
            **base, sliding_window=16, query_pre_attn_scalar=64, attn_logit_softcapping=30.0,
            final_logit_softcapping=20.0), root / "gemma2", seed=6, zero_centred_norms=True),
    }


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("decode_rows_min_blocks", [None, 16])
def test_32_prompts_give_the_same_bits_alone_and_together_chunked_or_not(checkpoints, name, decode_rows_min_blocks,
                                                                          monkeypatch):
    # These checkpoints' 2 KV heads give the decode rows' form 64 blocks at 32 rows, fewer than a
    # device's multiprocessors: every decode row takes the prompt form. With 16 the rows alone
    # (2 blocks) still do, the rows together take the decode rows' form.
    from metrale.ops import selection

    monkeypatch.setattr(selection, "INVARIANT_DECODE_ROWS_MIN_BLOCKS", decode_rows_min_blocks)
    batch = prompts()
    # Eager steps, so every step's logits pass through the recording forward (a replayed graph's
    # do not); the decode graphs' tokens are checked on their own.
    options = dict(device="cuda", batch_invariant=True, enable_prefix_caching=False, params=GREEDY, cuda_graphs=False)
    tokens, alone = run(checkpoints[name], batch, alone=True, **options)
    together_tokens, together = run(checkpoints[name], batch, alone=False, **options)
    assert together_tokens == tokens
    graph_tokens, _ = run(checkpoints[name], batch, alone=False, **{**options, "cuda_graphs": True})
    assert graph_tokens == tokens
    assert not differing(alone, together)
    chunked_tokens, chunked = run(checkpoints[name], batch, alone=False, max_num_batched_tokens=64, **options)
    assert chunked_tokens == tokens and chunked.mixed_steps > 0
    assert not differing(alone, chunked)


def test_prefix_cache_hits_give_the_same_bits_on_the_gpu(checkpoints):
    batch = prompts(shared_prefix=48)
    options = dict(device="cuda", batch_invariant=True, params=GREEDY, cuda_graphs=False)
    tokens, alone = run(checkpoints["llama"], batch, alone=True, enable_prefix_caching=False, **options)
    hit_tokens, hits = run(checkpoints["llama"], batch, alone=False, repeat=2, max_num_batched_tokens=96, **options)
    assert hit_tokens == tokens
    assert not differing(alone, hits)


def test_a_model_with_an_op_the_mode_cannot_serve_on_the_gpu_is_refused(moe_checkpoints):
    """(This MoE checkpoint's attention heads are outside the tensor-core prompt kernel's sizes too:
    whichever such op it reaches first is named.)"""
    from metrale import LLM

    with pytest.raises(ConfigError, match="batch_invariant=True on the GPU serves (moe_|paged_attention)"):
        with LLM(moe_checkpoints["qwen3_moe"], device="cuda", batch_invariant=True, show_progress=False) as llm:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
