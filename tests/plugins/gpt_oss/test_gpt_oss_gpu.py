"""The GPT-OSS family on the cuda backend against the cpu backend (``-m gpu``): logits within
transformers' own bf16 error (bf16 experts where routing agrees; MXFP4 experts against
transformers' bf16 run of the dequantized weights), decode steps recorded into CUDA graphs and
giving the eager tokens up to near-ties. Heads of 64 dims, as the released models."""

from __future__ import annotations

import numpy as np
import pytest
from gpt_oss_mxfp4 import write_mxfp4_twins
from gpu_checks import (
    check_against_cpu_where_routing_agrees,
    check_calibrated,
    check_tokens_part_only_at_near_ties,
    load,
    transformers_bf16_rows,
)

from metrale import SamplingParams

pytestmark = pytest.mark.gpu

VOCAB = 512


def gpu_config():
    from transformers import GptOssConfig, GptOssForCausalLM

    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 256, "rope_theta": 150000.0}
    return GptOssForCausalLM, GptOssConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=4, sliding_window=64,
        max_position_embeddings=1024, rope_parameters=yarn)


@pytest.fixture(scope="module")
def bf16_gpt_oss_checkpoint(tmp_path_factory):
    import torch

    from metrale.testing.hf import build_hf_checkpoint

    cls, config = gpu_config()
    return build_hf_checkpoint(cls, config, tmp_path_factory.mktemp("bf16-gpt-oss") / "gpt_oss", seed=70,
                               dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss_twins(tmp_path_factory):
    """``(quantized, dequantized)`` of a float32 checkpoint of the same shape (gpt_oss_mxfp4)."""
    from metrale.testing.hf import build_hf_checkpoint

    cls, config = gpu_config()
    root = tmp_path_factory.mktemp("mxfp4-gpt-oss")
    source = build_hf_checkpoint(cls, config, root / "source", seed=71)
    write_mxfp4_twins(source, root / "mxfp4", root / "dequantized")
    return root / "mxfp4", root / "dequantized"


def test_random_checkpoints_match_the_cpu_backend(bf16_gpt_oss_checkpoint):
    """Calibrated against transformers' own bf16 run of the same checkpoint."""
    ids = np.random.default_rng(3).integers(0, VOCAB, 256).tolist()
    check_against_cpu_where_routing_agrees(bf16_gpt_oss_checkpoint, ids, "gpt_oss bf16", calibrate=True)


def test_mxfp4_experts_match_the_cpu_backend(mxfp4_gpt_oss_twins):
    """The MXFP4 checkpoint on both backends (the cpu's is exactly transformers' float32 run of the
    dequantized weights), held to what bf16 costs transformers on those weights."""
    quantized, dequantized = mxfp4_gpt_oss_twins
    ids = np.random.default_rng(4).integers(0, VOCAB, 256).tolist()
    cpu = load(quantized, "cpu").score(ids)
    gpu = load(quantized, "cuda").score(ids)
    rows = np.abs(gpu - cpu).max(axis=1) / np.abs(cpu).max()
    check_calibrated(rows, transformers_bf16_rows(dequantized, ids, cpu), "gpt_oss mxfp4")


@pytest.mark.parametrize("which", ["bf16", "mxfp4"])
def test_graph_replayed_decode_gives_the_eager_tokens(bf16_gpt_oss_checkpoint, mxfp4_gpt_oss_twins, which):
    path = bf16_gpt_oss_checkpoint if which == "bf16" else mxfp4_gpt_oss_twins[0]
    prompts = [np.random.default_rng(n).integers(0, VOCAB, n).tolist() for n in (3, 40, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager_llm = load(path, "cuda", cuda_graphs=False)
    eager = [o.token_ids for o in eager_llm.generate(prompts, params)]
    graphed_llm = load(path, "cuda")
    graphed = [o.token_ids for o in graphed_llm.generate(prompts, params)]
    # A replayed step runs at its graph's shape (padded rows, the cache's block-table width), where
    # kernels may split their sums unlike the eager step: the runs may part only at a near-tie.
    check_tokens_part_only_at_near_ties(eager_llm, prompts, graphed, eager, f"gpt_oss {which}")
    graphs = graphed_llm.model.runner.graphs
    assert graphs is not None and graphs.disabled is None, "decode steps were not recorded into CUDA graphs"
