"""Pooling requests in the engine (:mod:`metrale.engine.pooling`): admitted, chunked and batched
as prompts beside generation requests, each finishing with transformers' pooled final states,
the generation requests keeping their solo tokens; failures, aborts and preemption leave the
engine consistent and nothing allocated."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.engine.generation import make_request
from metrale.engine.pooling import make_pooling_group
from metrale.params import PoolingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LAST = PoolingParams("last", True)
MEAN = PoolingParams("mean", False)


@pytest.fixture(scope="module")
def checkpoint(dense_checkpoints):
    return dense_checkpoints["llama"]


@pytest.fixture(scope="module")
def solo_llm(checkpoint):
    return LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=1, enable_prefix_caching=False,
               max_num_batched_tokens=4096, block_size=4)


@pytest.fixture(scope="module")
def hf_states(checkpoint):
    """transformers' final normed states (``last_hidden_state``, float64) of a prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()

    def states(ids):
        with torch.no_grad():
            return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()

    return states


def expected_vector(hf_states, ids, params):
    states = hf_states(ids)
    vector = states[-1] if params.pooling == "last" else states.mean(axis=0)
    return vector / np.linalg.norm(vector) if params.normalize else vector


def prompts_of(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 128, n).tolist() for n in lengths]


def pooling_request(index, ids, params):
    return make_pooling_group(f"pool-{index}", None, ids, params).request


def assert_idle(llm):
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    assert llm.engine.check() == []
    assert not llm.engine.has_unfinished()


def assert_close(got, want):
    assert np.abs(np.asarray(got, dtype=np.float64) - want).max() <= 1e-5 * max(np.abs(want).max(), 1.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_pooling_and_generation_requests_share_steps(checkpoint, solo_llm, hf_states, overlap):
    """Generation requests decode while pooling requests arrive and run chunk by chunk in the
    same steps: the generated tokens are the solo runs', each vector transformers' pooled
    states."""
    gen_prompts = prompts_of([6, 11, 3], seed=1)
    pool_prompts = prompts_of([23, 2, 14, 9], seed=2)
    pool_params = [LAST, MEAN, MEAN, LAST]
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=6, block_size=4, max_num_batched_tokens=8,
              overlap_scheduling=overlap)
    engine = llm.engine
    original, widths = llm.forward.final_states, []

    def recorded(segments, stream=None):
        widths.append(len(segments))
        return original(segments, stream)

    llm.forward.final_states = recorded
    generating = [make_request(i, None, p, GREEDY, 0) for i, p in enumerate(gen_prompts)]
    pooling = [pooling_request(i, p, q) for i, (p, q) in enumerate(zip(pool_prompts, pool_params))]
    for request in generating:
        engine.add_request(request)
    shared_steps, step = 0, 0
    while engine.has_unfinished() or step < 3:
        if step == 2:  # the generation requests are decoding by now
            for request in pooling:
                engine.add_request(request)
        before = dict(engine.calls)
        engine.step()
        grew = {name for name, count in engine.calls.items() if count > before.get(name, 0)}
        shared_steps += "final_states" in grew and bool(grew - {"final_states"})
        step += 1
        assert step < 200
    assert shared_steps > 0
    assert max(widths) > 1  # several pooling requests' chunks in one call
    assert [r.generated for r in generating] == [solo_llm.generate([p], GREEDY)[0].token_ids for p in gen_prompts]
    for request, prompt, params in zip(pooling, pool_prompts, pool_params):
        assert request.finish_reason == "stop" and request.error is None and request.generated == []
        assert_close(request.embedding, expected_vector(hf_states, prompt, params))
    assert_idle(llm)


def test_generation_alone_never_runs_a_final_states_call(checkpoint):
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=8)
    llm.generate(prompts_of([9, 3], seed=3), GREEDY)
    assert "final_states" not in llm.engine.calls


def test_a_preempted_pooling_request_pools_its_recomputation(checkpoint, hf_states):
    """Decode rows that outgrow a small cache preempt the newest request, a mean-pooled prompt
    part-way through its chunks; recomputed later, it still gets transformers' mean."""
    gen_prompts = prompts_of([8, 8], seed=4)
    prompt = prompts_of([30], seed=5)[0]
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4, num_blocks=12,
              max_num_batched_tokens=8, enable_prefix_caching=False, overlap_scheduling=False)
    engine = llm.engine
    long_greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    generating = [make_request(i, None, p, long_greedy, 0) for i, p in enumerate(gen_prompts)]
    for request in generating:
        engine.add_request(request)
    engine.step()
    request = pooling_request(0, prompt, MEAN)
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert request.num_preemptions > 0
    assert request.error is None
    assert_close(request.embedding, expected_vector(hf_states, prompt, MEAN))
    assert all(r.error is None and len(r.generated) == 16 for r in generating)
    assert_idle(llm)


def test_pooling_requests_skip_the_prefix_lookup_and_publish_their_blocks(checkpoint):
    prompt = prompts_of([17], seed=6)[0]
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=64)
    first = llm.embed([prompt], pooling="last")[0]
    hits = llm.engine.prefix_cache.hit_blocks
    again = llm.embed([prompt], pooling="last")[0]
    assert llm.engine.prefix_cache.hit_blocks == hits  # no lookup: every row computed again
    assert again.outputs.embedding == first.outputs.embedding
    generated = llm.generate([prompt], GREEDY)[0]
    assert generated.cached_tokens == 16  # the four full blocks the pooling request published
    assert_idle(llm)


def test_a_failing_final_states_call_fails_its_pooling_requests_only(checkpoint, solo_llm, monkeypatch):
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4, max_num_batched_tokens=64)
    engine = llm.engine
    generating = make_request(0, None, prompts_of([5], seed=7)[0], GREEDY, 0)
    pooling = [pooling_request(i, p, LAST) for i, p in enumerate(prompts_of([6, 10], seed=8))]
    engine.add_request(generating)
    engine.step()

    def failing(segments, stream=None):
        raise RuntimeError("injected")

    monkeypatch.setattr(llm.forward, "final_states", failing)
    for request in pooling:
        engine.add_request(request)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert all(r.finish_reason == "error" and "injected" in r.error and r.embedding is None for r in pooling)
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    assert generating.generated == solo_llm.generate([generating.prompt_token_ids], GREEDY)[0].token_ids
    assert_idle(llm)


def test_an_aborted_pooling_request_frees_its_cache(checkpoint):
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    request = pooling_request(0, prompts_of([30], seed=9)[0], MEAN)
    engine.add_request(request)
    engine.step()
    assert request.seq.num_cached == 8 and request.finish_reason is None
    assert engine.abort([request]) == [request]
    assert request.finish_reason == "abort" and request.embedding is None
    assert_idle(llm)


def test_a_one_chunk_prefill_family_runs_each_pooling_prompt_alone(checkpoint, hf_states):
    """Where every prompt chunk runs whole and alone (an ``is_mla()`` family), a pooling chunk is
    that chunk: one prompt per ``final_states`` call, no decode rows beside it."""
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4)
    engine = llm.engine
    engine.scheduler.one_chunk_prefill = True
    prompts = prompts_of([7, 12, 3], seed=10)
    requests = [pooling_request(i, p, MEAN) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert engine.calls["final_states"] == len(prompts)
    for request, prompt in zip(requests, prompts):
        assert_close(request.embedding, expected_vector(hf_states, prompt, MEAN))
    assert_idle(llm)
