"""The MLA family on the cuda backend against the cpu backend (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import check_against_cpu_where_routing_agrees, held_out_ids, load

from metrale import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bf16_mla_checkpoints(tmp_path_factory):
    """The tiny DeepSeek-V2 / V3 checkpoints saved in bf16: both backends read the same weights."""
    import torch

    from conftest import build_mla_checkpoint, mla_configs

    root = tmp_path_factory.mktemp("bf16-mla")
    return {name: build_mla_checkpoint(cls, config, root / name, seed=20 + index, dtype=torch.bfloat16)
            for index, (name, (cls, config)) in enumerate(mla_configs().items())}


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_random_checkpoints_match_the_cpu_backend(bf16_mla_checkpoints, name):
    ids = np.random.default_rng(1).integers(0, 128, 256).tolist()
    check_against_cpu_where_routing_agrees(bf16_mla_checkpoints[name], ids, name)


def test_tiny_mla_matches_the_cpu_backend():
    llm = load("tiny-mla", "cpu")
    check_against_cpu_where_routing_agrees(llm.checkpoint.path, held_out_ids(llm), "tiny-mla")


def test_decode_on_the_gpu_continues_like_the_cpu(bf16_mla_checkpoints):
    """Prefill + absorbed decode on the device: greedy tokens agree with the cpu backend's
    wherever the cpu's top-2 margin is clear (checked through teacher-forced scores)."""
    path = bf16_mla_checkpoints["deepseek_v3"]
    prompt = np.random.default_rng(2).integers(0, 128, 20).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    gpu = load(path, "cuda").generate([prompt], params)[0].token_ids
    cpu_llm = load(path, "cpu")
    cpu = cpu_llm.generate([prompt], params)[0].token_ids
    for index, (a, b) in enumerate(zip(gpu, cpu)):
        if a != b:
            logits = cpu_llm.score(prompt + cpu[:index])[-1]
            top2 = np.sort(logits)[-2:]
            assert (top2[1] - top2[0]) / np.abs(logits).max() < 2e-2, f"parted at {index} without a near-tie"
            break


def test_graph_replayed_decode_gives_the_eager_tokens(bf16_mla_checkpoints):
    """The decode path of the MLA family records into CUDA graphs (no host synchronisation)."""
    path = bf16_mla_checkpoints["deepseek_v3"]
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load(path, "cuda", cuda_graphs=False).generate(prompts, params)
    llm = load(path, "cuda")
    assert llm.model.runner.graphs is not None
    graphs = llm.generate(prompts, params)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    assert llm.model.runner.graphs.rungs, "no decode graph was recorded"
