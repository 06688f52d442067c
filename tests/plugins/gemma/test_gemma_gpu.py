"""The Gemma family (Gemma-2, Gemma-3 text) on the cuda backend against the cpu backend
(``-m gpu``): logits within transformers' own bf16 error over prompts four times the sliding
window, CUDA-graph decode giving the eager tokens. Head dims 64 (Gemma-2, soft-capped) and 256
(Gemma-3, as the released models)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import check_calibrated_against_cpu, load

from metrale import SamplingParams

pytestmark = pytest.mark.gpu


def gpu_configs():
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    base = dict(vocab_size=512, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                sliding_window=64, num_hidden_layers=4)
    return {
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**base, hidden_size=256, intermediate_size=512, head_dim=64,
                                                   query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                                                   final_logit_softcapping=30.0)),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**base, hidden_size=512, intermediate_size=1024, head_dim=256,
                                                       query_pre_attn_scalar=256, sliding_window_pattern=2)),
    }


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def bf16_gemma_checkpoint(request, tmp_path_factory):
    import torch

    from metrale.testing.hf import build_hf_checkpoint

    cls, config = gpu_configs()[request.param]
    return build_hf_checkpoint(cls, config, tmp_path_factory.mktemp("bf16-gemma") / request.param, seed=70,
                               dtype=torch.bfloat16, zero_centred_norms=True)


def test_random_checkpoints_match_the_cpu_backend(bf16_gemma_checkpoint):
    ids = np.random.default_rng(3).integers(0, 512, 256).tolist()
    check_calibrated_against_cpu(bf16_gemma_checkpoint, ids, bf16_gemma_checkpoint.name)


def test_graph_replayed_decode_gives_the_eager_tokens(bf16_gemma_checkpoint):
    prompts = [np.random.default_rng(n).integers(0, 512, n).tolist() for n in (3, 40, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load(bf16_gemma_checkpoint, "cuda", cuda_graphs=False).generate(prompts, params)
    graphed = load(bf16_gemma_checkpoint, "cuda").generate(prompts, params)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed]
