"""The OLMo-2 family on the cuda backend against the cpu backend (``-m gpu``): logits within
transformers' own bf16 error, decode and mixed steps replayed from CUDA graphs giving the eager
tokens, the sharded whole-projection q/k norms on one GPU, LoRA adapters."""

from __future__ import annotations

import numpy as np
import olmo2_fixtures
import pytest
from gpu_checks import check_calibrated, load, transformers_bf16_rows

from metrale import LoRARequest, SamplingParams
from metrale.testing import max_relative_error

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_olmo2_checkpoints(tmp_path_factory):
    """The tiny OLMo-2 variants saved in bf16, as real checkpoints are: both backends then read the
    same weights and differ only in activation precision."""
    return olmo2_fixtures.build_olmo2_checkpoints(tmp_path_factory.mktemp("bf16-olmo2"), dtype="bfloat16")


@pytest.mark.parametrize("variant", olmo2_fixtures.VARIANTS)
def test_random_checkpoints_match_the_cpu_backend(bf16_olmo2_checkpoints, variant):
    """Calibrated against transformers' own bf16 run of the same checkpoint, and >= 99 % top-1
    agreement where the cpu's top-2 margin exceeds 2e-2 of the largest logit (random weights
    leave near-ties that bf16 flips)."""
    path = bf16_olmo2_checkpoints[variant]
    ids = np.random.default_rng(3).integers(0, 128, 256).tolist()
    cpu = load(path, "cpu").score(ids)
    gpu = load(path, "cuda").score(ids)
    scale = np.abs(cpu).max()
    rows = np.abs(gpu - cpu).max(axis=1) / scale
    check_calibrated(rows, transformers_bf16_rows(path, ids, cpu), variant)
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2e-2 * scale
    agreement = float((gpu.argmax(-1) == cpu.argmax(-1))[decided].mean())
    assert decided.mean() >= 0.5 and agreement >= 0.99, f"{variant}: top-1 agreement {agreement:.4f}"


@pytest.mark.parametrize("variant", olmo2_fixtures.VARIANTS)
def test_graph_replayed_decode_gives_the_eager_tokens(bf16_olmo2_checkpoints, variant):
    path = bf16_olmo2_checkpoints[variant]
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (3, 11, 30)]
    eager = load(path, "cuda", cuda_graphs=False).generate(prompts, GREEDY)
    graphed = load(path, "cuda").generate(prompts, GREEDY)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed]


def test_mixed_steps_replayed_from_graphs_give_the_eager_tokens(bf16_olmo2_checkpoints, monkeypatch):
    """Requests finishing at different steps, so waiting prompts join running decodes in mixed
    steps, which replay graphs recorded ahead."""
    path = bf16_olmo2_checkpoints["bias"]
    options = dict(block_size=4, max_num_seqs=5, max_num_batched_tokens=300)
    prompts = [np.random.default_rng(n).integers(1, 128, n).tolist() for n in (30, 3, 90, 11, 7, 200, 40, 5)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 14, 5, 9, 12, 6, 8, 4)]
    eager = load(path, "cuda", cuda_graphs=False, **options).generate(prompts, params)
    llm = load(path, "cuda", **options)
    llm.capture_graphs(mixed=True)
    graphs = llm.model.runner.graphs
    replays = []
    run_mixed = graphs.run_mixed
    monkeypatch.setattr(graphs, "run_mixed", lambda batch, feed=None: replays.append(1) or run_mixed(batch, feed))
    graphed = llm.generate(prompts, params)
    assert replays, "no mixed step replayed a graph"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_norms_on_one_gpu_score_as_the_whole_model(bf16_olmo2_checkpoints, size):
    """Ranks simulated on one GPU: the q/k norms joined over the ranks (with 4, each key head held
    by two ranks) give the whole model's logits."""
    from metrale.testing.conformance import check_tensor_parallel

    ids = np.random.default_rng(2).integers(0, 128, 120).tolist()
    for variant in olmo2_fixtures.VARIANTS:
        check_tensor_parallel(bf16_olmo2_checkpoints[variant], size, ids, tolerance=BF16_TOLERANCE, device="cuda")


def test_lora_on_the_gpu_scores_as_on_the_cpu(bf16_olmo2_checkpoints, tmp_path):
    from metrale.testing.hf import build_peft_adapter

    path = bf16_olmo2_checkpoints["plain"]
    build_peft_adapter(path, tmp_path / "adapter", seed=5, r=8, lora_alpha=16,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    request = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    ids = np.random.default_rng(4).integers(0, 128, 40).tolist()
    scores = {}
    for device in ("cpu", "cuda"):
        with load(path, device, enable_lora=True, max_lora_rank=8) as llm:
            scores[device] = (llm.score(ids, lora_request=request), llm.score(ids))
    # The adapted logits within what bf16 costs transformers with peft's adapter on the same weights:
    # the whole-projection q/k norms of OLMo-2 amplify the adapter's rounding beyond the fixed bound.
    cpu = scores["cpu"][0]
    rows = np.abs(scores["cuda"][0] - cpu).max(axis=1) / np.abs(cpu).max()
    check_calibrated(rows, peft_bf16_rows(path, tmp_path / "adapter", ids, cpu), "olmo2 lora")
    assert max_relative_error(scores["cuda"][0], scores["cuda"][1]) > 1e-2, "the adapter left the logits as they were"


def peft_bf16_rows(path, adapter, ids, cpu, device="cuda"):
    """Per position, the largest logit error of transformers' bf16 run of checkpoint ``path`` with
    peft's ``adapter`` against the float32 logits ``cpu``, relative to their largest magnitude."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return np.abs(logits - cpu).max(axis=1) / np.abs(cpu).max()
