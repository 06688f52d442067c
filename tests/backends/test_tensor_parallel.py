"""Tensor parallelism on the CPU with ranks simulated in one process (metrale.backends.parallel): each rank
loads its shard of the checkpoint and runs on its own thread, the ranks joined by the threads'
collectives; rank 0's logits and greedy tokens equal the unsharded model's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.backends.parallel import Shard, rank_context, run_ranks
from metrale.errors import ConfigError
from metrale.testing.conformance import max_relative_error

PROMPT = [5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 2, 90]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)


def run(checkpoint, prompts):
    with LLM(str(checkpoint), device="cpu", show_progress=False) as llm:
        scores = llm.score(PROMPT)
        outputs = llm.generate(prompts, PARAMS)
        return scores, [o.outputs[0] for o in outputs], llm.cache.spec


def sharded(checkpoint, size, prompts, expert_parallel=False):
    def work(communicator):
        with rank_context(Shard(communicator.rank, size, expert_parallel), communicator):
            return run(checkpoint, prompts)

    return run_ranks(size, work)


def assert_equal_results(ranks, expected_scores, expected):
    for rank, (scores, outputs, _) in enumerate(ranks):
        assert max_relative_error(scores, expected_scores) <= 1e-4, rank
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        for got, want in zip(outputs, expected):
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_dense_model_equals_the_unsharded_one(dense_checkpoint, size):
    prompts = [PROMPT, PROMPT[3:], PROMPT[:5]]
    expected_scores, expected, whole_spec = run(dense_checkpoint, prompts)
    ranks = sharded(dense_checkpoint, size, prompts)
    config = json.loads((dense_checkpoint / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    assert_equal_results(ranks, expected_scores, expected)
    for _, _, spec in ranks:
        # Each rank caches its key/value heads only (one when there are fewer than ranks).
        assert spec.layers[0].num_kv_heads == max(kv_heads // size, 1)
        assert whole_spec.layers[0].num_kv_heads == kv_heads


@pytest.mark.parametrize("variant", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("size, expert_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_a_sharded_mla_model_equals_the_unsharded_one(mla_checkpoints, variant, size, expert_parallel):
    """Query heads split (the latent projections and cache whole on every rank); the MoE layers'
    experts split by their intermediate size, or spread over the ranks (expert parallelism)."""
    checkpoint = mla_checkpoints[variant]
    prompts = [PROMPT, PROMPT[3:], PROMPT[:5]]
    expected_scores, expected, whole_spec = run(checkpoint, prompts)
    ranks = sharded(checkpoint, size, prompts, expert_parallel)
    assert_equal_results(ranks, expected_scores, expected)
    assert all(spec == whole_spec for _, _, spec in ranks)


def test_a_long_prompt_s_grouped_experts_sum_over_the_ranks(mla_checkpoints):
    """More tokens than MAX_PAIRWISE_TOKENS: the CPU groups each expert's pairs (expert
    parallelism: the other ranks' experts' pairs weighted zero)."""
    from metrale.layers.experts import MAX_PAIRWISE_TOKENS

    checkpoint = mla_checkpoints["deepseek_v3"]
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 120, MAX_PAIRWISE_TOKENS + 20)]
    with LLM(str(checkpoint), device="cpu", show_progress=False) as llm:
        expected = llm.score(prompt)
    for expert_parallel in (False, True):
        def work(communicator, expert_parallel=expert_parallel):
            with rank_context(Shard(communicator.rank, 2, expert_parallel), communicator):
                with LLM(str(checkpoint), device="cpu", show_progress=False) as llm:
                    return llm.score(prompt)

        for scores in run_ranks(2, work):
            assert max_relative_error(scores, expected) <= 1e-4


@pytest.mark.parametrize("size, expert_parallel", [(2, False), (2, True)])
def test_a_sharded_gdn_model_equals_the_unsharded_one(gdn_checkpoint, size, expert_parallel):
    """Gated attention heads and linear key heads (with their value heads, conv channels, gates
    and states) split; the MoE's experts split or spread; a prompt longer than a chunk of the
    recurrence."""
    prompts = [PROMPT * 3, PROMPT[3:], PROMPT[:5]]
    expected_scores, expected, whole_spec = run(gdn_checkpoint, prompts)
    ranks = sharded(gdn_checkpoint, size, prompts, expert_parallel)
    assert_equal_results(ranks, expected_scores, expected)
    config = json.loads((gdn_checkpoint / "config.json").read_text())
    for _, _, spec in ranks:
        states = [layer for layer in spec.layers if not hasattr(layer, "num_kv_heads")]
        assert states and states[0].state_shape[0] == config["linear_num_value_heads"] // size


def test_what_does_not_split_is_refused(dense_checkpoints):
    with pytest.raises(ConfigError, match="does not split evenly over tensor_parallel_size=3"):
        sharded(dense_checkpoints["llama"], 3, [PROMPT])
