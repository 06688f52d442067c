"""The engine on the cuda backend (``-m gpu``): batching, chunking, prefix hits and preemption
give every request its solo greedy tokens, up to near-ties.

A different batch shape changes GEMM rounding on the GPU, so two runs of a request may part; the
test allows that only right after a position whose top-2 logit margin in the solo run is below
``MARGIN`` (relative to that row's largest absolute logit), and checks the margin at the first
difference of every request.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu

#: Top-2 margin, relative to the row's largest |logit|, below which bf16 rounding may flip the pick.
MARGIN = 2e-2


def prompts_of(lengths, seed, shared=()):
    rng = np.random.default_rng(seed)
    return [list(shared) + rng.integers(1, 128, n).tolist() for n in lengths]


def first_difference(a, b):
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.parametrize("budget, num_blocks", [(4096, None), (8, None), (16, 24)])
def test_engine_matches_solo_runs_up_to_near_ties(dense_checkpoints, budget, num_blocks):
    path = dense_checkpoints["qwen3"]
    shared = prompts_of([21], seed=1)[0]
    prompts = prompts_of([5, 40, 2, 17, 9, 30], seed=2) + prompts_of([3, 11, 6], seed=3, shared=shared)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    solo = LLM(path, device="cuda", show_progress=False, max_num_seqs=1, enable_prefix_caching=False, block_size=4)
    expected = [solo.generate([p], params)[0].token_ids for p in prompts]
    options = {"num_blocks": num_blocks} if num_blocks else {}
    llm = LLM(path, device="cuda", show_progress=False, max_num_seqs=4, block_size=4,
              max_num_batched_tokens=budget, **options)
    outputs = llm.generate(prompts, params)
    again = llm.generate(prompts[-2:], params)  # prefix-cache hits on whole prompts
    assert all(o.cached_tokens > 0 for o in again)
    checked = 0
    for prompt, want, got in zip(prompts + prompts[-2:], expected + expected[-2:], outputs + again):
        assert got.error is None
        index = first_difference(want, got.token_ids)
        if index is None:
            continue
        # The solo run's logits at the position that picked token ``index``.
        logits = solo.score(prompt + want[:index])[-1]
        top2 = np.sort(logits)[-2:]
        margin = float(top2[1] - top2[0]) / float(np.abs(logits).max())
        assert margin < MARGIN, f"outputs part at token {index} although its top-2 margin is {margin:.3g}"
        checked += 1
    print(f"budget {budget}, blocks {num_blocks}: {checked} of {len(prompts) + 2} requests parted at a near-tie; "
          f"preemptions {sum(o.num_preemptions for o in outputs)}, calls {llm.engine.calls}")
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks


@pytest.mark.parametrize("head_dim", [64, 128])
def test_graphs_replay_short_contexts_as_eager_steps_compute_them(tmp_path, head_dim):
    """Model-sized heads (the tensor-core decode attention, the decode GEMV) and a long
    ``max_model_len``: the decode graphs' split counts are chosen for their context bucket, and
    short prompts replay them with most splits past the rows' last keys. Every request finishes,
    and the graphs give the eager steps' tokens up to near-ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from metrale.testing.hf import build_hf_checkpoint

    config = LlamaConfig(vocab_size=512, hidden_size=8 * head_dim, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=4096)
    path = build_hf_checkpoint(LlamaForCausalLM, config, tmp_path / "llama", seed=5, dtype=torch.bfloat16)
    prompts = prompts_of([9, 65, 130, 20, 600], seed=4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        llm = LLM(path, device="cuda", show_progress=False, max_model_len=4096, max_num_seqs=4, cuda_graphs=graphs)
        runs[graphs] = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
        if graphs:
            assert llm.model.runner.graphs.disabled is None
            llm.close()
        else:
            eager = llm
    for prompt, want, got in zip(prompts + prompts[:1], runs[False], runs[True]):
        assert want.error is None and got.error is None
        assert len(got.token_ids) == len(want.token_ids) == 32
        index = first_difference(want.token_ids, got.token_ids)
        if index is not None:
            logits = eager.score(prompt + want.token_ids[:index])[-1]
            top2 = np.sort(logits)[-2:]
            margin = float(top2[1] - top2[0]) / float(np.abs(logits).max())
            assert margin < MARGIN, f"graph and eager tokens part at token {index}, top-2 margin {margin:.3g}"
    eager.close()
