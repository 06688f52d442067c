"""Tensor parallelism on the CPU with ranks simulated in one process (metrale.parallel): each rank
loads its shard of the checkpoint and runs on its own thread, the ranks joined by the threads'
collectives; rank 0's logits and greedy tokens equal the unsharded model's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.errors import ConfigError
from metrale.parallel import Shard, rank_context, run_ranks
from metrale.testing.conformance import max_relative_error

PROMPT = [5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 2, 90]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)


def run(checkpoint, prompts):
    with LLM(str(checkpoint), device="cpu", show_progress=False) as llm:
        scores = llm.score(PROMPT)
        outputs = llm.generate(prompts, PARAMS)
        return scores, [o.outputs[0] for o in outputs], llm.cache.spec


def sharded(checkpoint, size, prompts):
    def work(communicator):
        with rank_context(Shard(communicator.rank, size), communicator):
            return run(checkpoint, prompts)

    return run_ranks(size, work)


@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_dense_model_equals_the_unsharded_one(dense_checkpoint, size):
    prompts = [PROMPT, PROMPT[3:], PROMPT[:5]]
    expected_scores, expected, whole_spec = run(dense_checkpoint, prompts)
    ranks = sharded(dense_checkpoint, size, prompts)
    config = json.loads((dense_checkpoint / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    for rank, (scores, outputs, spec) in enumerate(ranks):
        assert max_relative_error(scores, expected_scores) <= 1e-4, rank
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        for got, want in zip(outputs, expected):
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)
        # Each rank caches its key/value heads only (one when there are fewer than ranks).
        assert spec.layers[0].num_kv_heads == max(kv_heads // size, 1)
        assert whole_spec.layers[0].num_kv_heads == kv_heads


def test_what_does_not_split_is_refused(dense_checkpoints, mla_checkpoints):
    with pytest.raises(ConfigError, match="does not split evenly over tensor_parallel_size=3"):
        sharded(dense_checkpoints["llama"], 3, [PROMPT])
    with pytest.raises(ConfigError, match="does not run tensor-parallel yet"):
        sharded(mla_checkpoints["deepseek_v2"], 2, [PROMPT])
