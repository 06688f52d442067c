"""Tensor parallelism on GPUs (``-m gpu``). On one GPU: every family's sharded kernels, two and
four ranks simulated on threads (their collectives through host copies), score as the whole model
within bf16 noise. On a machine with two: a model split over both devices (one worker process,
NCCL collectives on the ranks' streams, captured into the decode graphs) scores as the same model
on one, its greedy generation gives the one-GPU tokens up to near-ties, and a lost or failing
worker fails the step with RankError instead of leaving rank 0 waiting on its device."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.errors import RankError
from metrale.testing import max_relative_error

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2
#: Top-2 margin, relative to the row's largest |logit|, below which bf16 rounding may flip the pick.
MARGIN = 2e-2


@pytest.fixture(scope="module")
def two_gpus():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("tensor parallelism on GPUs needs two devices")


def prompt(length, seed):
    return np.random.default_rng(seed).integers(1, 120, length).tolist()


def check_scores(split, whole, ids, what):
    """bf16 tolerance on the logits and >= 99 % top-1 agreement where the one-GPU top-2 margin
    exceeds twice the largest difference."""
    error = max_relative_error(split, whole)
    top2 = np.sort(whole, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(split - whole).max()
    agreement = float((split.argmax(-1) == whole.argmax(-1))[decided].mean())
    print(f"{what}: relative error {error:.3g}, agreement {agreement:.4f} over {int(decided.sum())} of {len(ids)}")
    assert error <= BF16_TOLERANCE, f"{what}: relative error {error:.3g}"
    assert decided.mean() >= 0.5 and agreement >= 0.99, f"{what}: agreement {agreement:.4f}"


def greedy_tokens(llm, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def check_greedy(whole, split_tokens, whole_tokens, prompts):
    """Equal tokens, or a first difference right after a near-tie of the one-GPU run."""
    for ids, got, want in zip(prompts, split_tokens, whole_tokens):
        index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if index is None:
            continue
        logits = whole.score(ids + want[:index])[-1]
        top2 = np.sort(logits)[-2:]
        margin = float(top2[1] - top2[0]) / float(np.abs(logits).max())
        assert margin < MARGIN, f"tokens part at {index} although the top-2 margin is {margin:.3g}"


@pytest.mark.parametrize("family, size, expert_parallel", [
    ("llama", 2, False), ("qwen3", 4, False), ("deepseek_v3", 2, False), ("deepseek_v3", 4, True), ("gdn", 2, False),
])
def test_sharded_kernels_on_one_gpu_score_as_the_whole_model(dense_checkpoints, mla_checkpoints, gdn_checkpoint,
                                                            family, size, expert_parallel):
    from metrale.testing.conformance import check_tensor_parallel

    path = {"llama": dense_checkpoints["llama"], "qwen3": dense_checkpoints["qwen3"],
            "deepseek_v3": mla_checkpoints["deepseek_v3"], "gdn": gdn_checkpoint}[family]
    worst = check_tensor_parallel(path, size, prompt(120, seed=2), expert_parallel=expert_parallel,
                                  tolerance=BF16_TOLERANCE, device="cuda")
    print(f"{family} over {size} ranks{' (expert parallel)' if expert_parallel else ''}: relative error {worst:.3g}")


@pytest.mark.usefixtures("two_gpus")
@pytest.mark.parametrize("family, options", [
    ("llama", {}), ("qwen3", {}), ("deepseek_v3", {}), ("deepseek_v3", {"expert_parallel": True}), ("gdn", {}),
])
def test_two_gpus_score_and_generate_as_one(dense_checkpoints, mla_checkpoints, gdn_checkpoint, family, options):
    path = {"llama": dense_checkpoints["llama"], "qwen3": dense_checkpoints["qwen3"],
            "deepseek_v3": mla_checkpoints["deepseek_v3"], "gdn": gdn_checkpoint}[family]
    ids = prompt(200, seed=1)
    prompts = [prompt(n, seed=n) for n in (5, 23, 61)]
    with LLM(path, device="cuda", show_progress=False) as whole:
        whole_scores = whole.score(ids)
        whole_tokens = greedy_tokens(whole, prompts)
        with LLM(path, device="cuda", show_progress=False, tensor_parallel_size=2, **options) as split:
            assert split.ranks is not None and split.ranks.collectives is not None
            check_scores(split.score(ids), whole_scores, ids, f"{family} {options}")
            split.capture_graphs([1, 4], mixed=False)  # graphs recorded ahead, on both ranks
            split_tokens = greedy_tokens(split, prompts)
            graphs = split.model.runner.graphs
            assert graphs.disabled is None and any(rung.graphs for rung in graphs.rungs.values())
        check_greedy(whole, split_tokens, whole_tokens, prompts)


@pytest.mark.usefixtures("two_gpus")
def test_a_lost_gpu_worker_fails_the_step_instead_of_hanging(dense_checkpoints):
    llm = LLM(dense_checkpoints["llama"], device="cuda", show_progress=False, tensor_parallel_size=2)
    try:
        greedy_tokens(llm, [prompt(9, seed=3)])
        os.kill(llm.ranks._workers[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankError):
            for _ in range(50):  # (the step in flight when the worker dies, or the next)
                greedy_tokens(llm, [prompt(9, seed=4)])
        assert time.monotonic() - started < 60
        with pytest.raises(RankError, match="build it again"):
            greedy_tokens(llm, [prompt(9, seed=5)])
    finally:
        started = time.monotonic()
        llm.close()
        assert time.monotonic() - started < 30


@pytest.mark.usefixtures("two_gpus")
def test_a_gpu_worker_that_fails_a_step_fails_it_on_rank_0(dense_checkpoints):
    """A write the worker's cache refuses: the worker reports its CacheError and exits (rank 0
    waits on its device for the worker's part), the watchdog aborts the group, and rank 0's step
    raises RankError with the worker's error."""
    llm = LLM(dense_checkpoints["llama"], device="cuda", show_progress=False, tensor_parallel_size=2)
    try:
        llm.ranks._state_writes.append(("grow", 1))
        started = time.monotonic()
        with pytest.raises(RankError, match="rank 1 failed in step .*CacheError.*unknown state-row write"):
            llm.score(prompt(12, seed=6))
        assert time.monotonic() - started < 30
    finally:
        llm.close()
