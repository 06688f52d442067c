"""The GPT-NeoX family on the CUDA backend (``-m gpu``): bf16 checkpoints against the CPU backend,
and decode steps replayed from CUDA graphs against eager ones."""

from __future__ import annotations

import numpy as np
import pytest
from metrale import LLM, SamplingParams
from metrale.testing import max_relative_error

from gpt_neox_checkpoints import build_gpt_neox_checkpoint

pytestmark = pytest.mark.gpu

#: Bound on ``max|gpu - cpu| / max|cpu|`` of the logits: both backends read the same bf16 weights;
#: the GPU rounds matrix-product inputs (normed rows, activations, attention outputs) and the KV
#: cache to bf16 where the CPU keeps float32.
BF16_TOLERANCE = 2e-2

#: Heads of 64 dims as in Pythia (rotary_pct 0.25 rotates 16 of them), a context of 512.
GPU_SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_attention_heads=2,
                 num_hidden_layers=4, max_position_embeddings=512)
VARIANTS = ("parallel", "sequential")


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    """Saved in bf16, as real checkpoints are: both backends then read the same weights and
    differ only in activation precision."""
    import torch

    root = tmp_path_factory.mktemp("gpt_neox_bf16")
    return {
        name: build_gpt_neox_checkpoint(name, root / name, seed=index, dtype=torch.bfloat16, **GPU_SIZES)
        for index, name in enumerate(VARIANTS)
    }


def load(path, device, **options):
    return LLM(path, device=device, show_progress=False, **options)


def prompts_of(lengths, vocab=GPU_SIZES["vocab_size"]):
    return [np.random.default_rng(n).integers(0, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_the_cpu_backend(bf16_checkpoints, name):
    """bf16 tolerance on the logits of 256 positions, and >= 99% top-1 agreement over the
    positions whose top-2 margin (on the CPU) exceeds twice the largest logit error: random
    weights leave near-ties that bf16 rounding flips, and those say nothing about the family."""
    path = bf16_checkpoints[name]
    [ids] = prompts_of([256])
    cpu = load(path, "cpu").score(ids)
    gpu = load(path, "cuda").score(ids)
    error = max_relative_error(gpu, cpu)
    assert error <= BF16_TOLERANCE, f"{name}: relative error {error:.3g}"
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(gpu - cpu).max()
    assert decided.mean() >= 0.5, f"{name}: only {int(decided.sum())} of {len(ids)} positions are decided"
    agreement = float((gpu.argmax(-1) == cpu.argmax(-1))[decided].mean())
    assert agreement >= 0.99, f"{name}: top-1 agreement {agreement:.4f} over the decided positions"


@pytest.mark.parametrize("name", VARIANTS)
def test_gpu_greedy_follows_the_cpu_until_a_near_tie(bf16_checkpoints, name):
    path = bf16_checkpoints[name]
    [prompt] = prompts_of([20])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    gpu = load(path, "cuda").generate([prompt], params)[0].token_ids
    cpu_llm = load(path, "cpu")
    cpu = cpu_llm.generate([prompt], params)[0].token_ids
    for index, (a, b) in enumerate(zip(gpu, cpu)):
        if a != b:
            logits = cpu_llm.score(prompt + cpu[:index])[-1]
            top2 = np.sort(logits)[-2:]
            assert (top2[1] - top2[0]) / np.abs(logits).max() < BF16_TOLERANCE, f"parted at {index} without a near-tie"
            break


@pytest.mark.parametrize("name", VARIANTS)
def test_graph_replayed_decode_gives_the_eager_tokens(bf16_checkpoints, name):
    """The family's decode steps are recorded into CUDA graphs (every op graph-safe, no host
    reads) and replay to the tokens of eager steps."""
    path = bf16_checkpoints[name]
    prompts = prompts_of((3, 11, 30))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load(path, "cuda", cuda_graphs=False).generate(prompts, params)
    llm = load(path, "cuda", cuda_graphs=True)
    assert llm.model.runner.graphs is not None, "CUDA graphs are off for this model"
    graphs = llm.generate(prompts, params)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    assert llm.model.runner.graphs.rungs, "no decode graph was recorded"
