"""The MLA family on the cuda backend against the cpu backend (``-m gpu``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_model_gpu import TOOLS, load

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


def scored_with_routes(path, device, ids):
    """Teacher-forced logits and, per MoE layer, each position's chosen experts (sorted)."""
    llm = load(path, device)
    routes = []
    route = llm.model.route

    def recording(moe, h):
        chosen, weights = route(moe, h)
        routes.append(np.sort(llm.backend.to_numpy(chosen).astype(np.int64), axis=1))
        return chosen, weights

    llm.model.route = recording
    return llm.score(ids), routes


def transformers_bf16_rows(path, ids, cpu):
    """Per position, the largest logit error of transformers' own bf16 run on the GPU against the
    float32 logits ``cpu``, relative to their largest magnitude: what bf16 costs the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return np.abs(logits - cpu).max(axis=1) / np.abs(cpu).max()


def check_against_cpu_where_routing_agrees(path, ids, what, calibrate=False):
    """bf16 tolerance and >= 99% top-1 agreement on the positions whose experts agree.

    Routing is discontinuous (docs/families.rst, "Routed experts"): where bf16 rounding flips an expert choice the
    position's output legitimately differs, so those positions (at most 5 %) are left out;
    everywhere else the error must be bf16 rounding: at most 2e-2 (relative to the largest
    logit) at 99 % of those positions and 5e-2 at any, since the random DeepSeek-V3 shape
    sharpens attention (its YaRN mscale multiplies the softmax scale by 1.67) and so bf16 noise.
    With ``calibrate`` the bound is instead what bf16 costs transformers on the same checkpoint:
    the median and the 99th percentile of the error over all positions may exceed those of
    transformers' own bf16 run by at most 25 %.
    Agreement counts those positions whose top-2 margin on the cpu exceeds 2e-2 of the largest
    logit (at least half of them): random weights leave many near-ties that bf16 flips."""
    cpu, cpu_routes = scored_with_routes(path, "cpu", ids)
    gpu, gpu_routes = scored_with_routes(path, "cuda", ids)
    same_route = np.all([(a == b).all(axis=1) for a, b in zip(cpu_routes, gpu_routes)], axis=0)
    scale = np.abs(cpu).max()
    rows = np.abs(gpu - cpu).max(axis=1) / scale
    error = float(rows[same_route].max())
    typical = float(np.percentile(rows[same_route], 99))
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    counted = same_route & ((top2[:, 1] - top2[:, 0]) > 2e-2 * scale)
    agreement = float((gpu.argmax(-1) == cpu.argmax(-1))[counted].mean())
    print(f"{what}: {int((~same_route).sum())} of {len(ids)} positions routed differently; relative error "
          f"{typical:.3g} (99th percentile) / {error:.3g} (max) where routing agrees ({rows.max():.3g} overall); "
          f"top-1 agreement {agreement:.4f} over {int(counted.sum())} positions")
    assert same_route.mean() >= 0.95, f"{what}: routing differs at {int((~same_route).sum())} positions"
    if calibrate:
        reference = transformers_bf16_rows(path, ids, cpu)
        ours = [float(np.percentile(rows, p)) for p in (50, 99)]
        theirs = [float(np.percentile(reference, p)) for p in (50, 99)]
        print(f"{what}: error over all positions, median / 99th percentile: {ours[0]:.3g} / {ours[1]:.3g}; "
              f"transformers bf16: {theirs[0]:.3g} / {theirs[1]:.3g}")
        assert ours[0] <= 1.25 * theirs[0] and ours[1] <= 1.25 * theirs[1], f"{what}: {ours} against {theirs}"
    else:
        assert typical <= 2e-2 and error <= 5e-2, f"{what}: relative error {typical:.3g} / {error:.3g}"
    assert counted.sum() >= 0.5 * len(ids) and agreement >= 0.99, f"{what}: top-1 agreement {agreement:.4f}"


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_random_checkpoints_match_the_cpu_backend(bf16_mla_checkpoints, name):
    ids = np.random.default_rng(1).integers(0, 128, 256).tolist()
    check_against_cpu_where_routing_agrees(bf16_mla_checkpoints[name], ids, name)


def test_tiny_mla_matches_the_cpu_backend():
    sys.path.insert(0, str(TOOLS))
    try:
        import tiny_corpus
    finally:
        sys.path.remove(str(TOOLS))
    llm = load("tiny-mla", "cpu")
    _, held_out = tiny_corpus.extract()
    ids: list[int] = []
    for text in held_out:
        ids += llm.encode(text)
        if len(ids) >= 256:
            break
    check_against_cpu_where_routing_agrees(llm.checkpoint.path, ids[:256], "tiny-mla")


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
