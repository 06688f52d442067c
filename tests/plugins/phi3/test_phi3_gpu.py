"""The Phi-3 family on the cuda backend against the cpu backend (``-m gpu``): bf16 checkpoints'
logits within what bf16 costs transformers on the same checkpoints, the LongRoPE checkpoint in
both regimes, and CUDA-graph decode giving the eager tokens."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import check_calibrated, load, transformers_bf16_rows

from metrale import SamplingParams

from .conftest import ORIGINAL_CONTEXT, phi3_configs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bf16_phi3_checkpoints(tmp_path_factory):
    """The test checkpoints saved in bf16, as real checkpoints are: both backends then read the
    same weights and differ only in activation precision."""
    import torch

    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("bf16-phi3")
    return {name: build_hf_checkpoint(cls, config, root / name, seed=70, dtype=torch.bfloat16)
            for name, (cls, config) in phi3_configs().items()}


def check_bf16_against_cpu(path, ids, what, **options):
    """The cuda backend's logits against the cpu backend's, per position, within what bf16 costs
    transformers on the same checkpoint (:func:`gpu_checks.check_calibrated`)."""
    cpu = load(path, "cpu", **options).score(ids)
    gpu = load(path, "cuda", **options).score(ids)
    rows = np.abs(gpu - cpu).max(axis=1) / np.abs(cpu).max()
    check_calibrated(rows, transformers_bf16_rows(path, ids, cpu), what)


@pytest.mark.parametrize("name", ["phi3", "phi4_mini"])
def test_random_checkpoints_match_the_cpu_backend(bf16_phi3_checkpoints, name):
    """Positions past the plain checkpoint's sliding window, and past the LongRoPE checkpoint's
    pretraining context (both backends and transformers with the long factors)."""
    ids = np.random.default_rng(3).integers(0, 128, 120).tolist()
    check_bf16_against_cpu(bf16_phi3_checkpoints[name], ids, name)


def test_the_short_longrope_regime_matches_the_cpu_backend(bf16_phi3_checkpoints):
    ids = np.random.default_rng(4).integers(0, 128, ORIGINAL_CONTEXT).tolist()
    check_bf16_against_cpu(bf16_phi3_checkpoints["phi4_mini"], ids, "phi4_mini, short factors",
                                 max_model_len=ORIGINAL_CONTEXT)


@pytest.mark.parametrize("name", ["phi3", "phi4_mini"])
def test_graph_replayed_decode_gives_the_eager_tokens(bf16_phi3_checkpoints, name):
    path = bf16_phi3_checkpoints[name]
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load(path, "cuda", cuda_graphs=False).generate(prompts, params)
    graphed = load(path, "cuda").generate(prompts, params)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed]
