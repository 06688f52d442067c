"""The MoE family (Qwen3-MoE, Qwen2-MoE, Mixtral) on the cuda backend against the cpu backend
(``-m gpu``): logits within transformers' own bf16 error where routing agrees, CUDA-graph decode
giving the eager tokens."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import check_against_cpu_where_routing_agrees, load

from metrale import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def bf16_moe_checkpoint(request, tmp_path_factory):
    import torch

    from conftest import moe_configs
    from metrale.testing.hf import build_hf_checkpoint

    cls, config = moe_configs()[request.param]
    return build_hf_checkpoint(cls, config, tmp_path_factory.mktemp("bf16-moe") / request.param, seed=50,
                               dtype=torch.bfloat16)


def test_random_checkpoints_match_the_cpu_backend(bf16_moe_checkpoint):
    """Calibrated against transformers' own bf16 run of the same checkpoint."""
    ids = np.random.default_rng(3).integers(0, 128, 256).tolist()
    check_against_cpu_where_routing_agrees(bf16_moe_checkpoint, ids, bf16_moe_checkpoint.name, calibrate=True)


def test_graph_replayed_decode_gives_the_eager_tokens(bf16_moe_checkpoint):
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load(bf16_moe_checkpoint, "cuda", cuda_graphs=False).generate(prompts, params)
    graphed = load(bf16_moe_checkpoint, "cuda").generate(prompts, params)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed]
