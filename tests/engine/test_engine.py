"""The engine on the cpu backend: continuous batching, chunked / mixed / batched prefill, prefix
cache and preemption give every request exactly the tokens it gets when it runs alone."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from metrale import LLM, SamplingParams
from metrale.engine.generation import make_request
from metrale.errors import ConfigError, EngineBusyError, SchedulerStuckError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(dense_checkpoints):
    return dense_checkpoints["llama"]


@pytest.fixture(scope="module")
def solo_llm(checkpoint):
    """One request at a time, whole prompts, no prefix cache: the reference runs."""
    return LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=1, enable_prefix_caching=False,
               max_num_batched_tokens=4096, block_size=4)


def solo(llm, prompts, params, adapters=None):
    params = params if isinstance(params, list) else [params] * len(prompts)
    adapters = adapters or [None] * len(prompts)
    return [llm.generate([p], q, lora_request=[a])[0].token_ids for p, q, a in zip(prompts, params, adapters)]


def prompts_of(lengths, seed=0, shared=None):
    rng = np.random.default_rng(seed)
    prefix = list(shared or [])
    return [prefix + rng.integers(1, 128, n).tolist() for n in lengths]


def assert_all_blocks_free(llm):
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    assert all(allocator.ref_count(b) == 0 for b in range(1, allocator.num_blocks + 1))


@pytest.mark.parametrize("budget", [4, 8, 13, 64, 4096])
def test_chunk_sizes_and_batching_match_solo_runs(checkpoint, solo_llm, budget):
    prompts = prompts_of([3, 17, 9, 30, 1, 12], seed=budget)
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4,
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    unfinished_ends = []

    def checked():
        plan = schedule()
        assert plan.num_tokens <= max(budget, len(plan.decode))  # decode rows always run
        unfinished_ends.extend(c.start + c.length for c in plan.prefill if not c.is_last)
        return plan

    scheduler.schedule = checked
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(end % 4 == 0 for end in unfinished_ends)  # non-last chunks end on block boundaries
    assert together == solo(solo_llm, prompts, GREEDY)
    assert_all_blocks_free(llm)
    if budget < 30:  # the 30-token prompt needed several chunks
        calls = llm.engine.calls
        prefill_steps = sum(calls.get(m, 0) for m in ("prefill_chunk", "prefill_batch_chunk", "mixed_forward"))
        assert prefill_steps > len(prompts)


def test_every_kind_of_step_runs_and_seeded_sampling_matches(checkpoint, solo_llm):
    """Staggered arrivals: decode-only, mixed, single and batched prefill steps all occur."""
    prompts = prompts_of([10, 6, 21, 5, 14], seed=3)
    params = [SamplingParams(max_tokens=7, temperature=0.9, top_k=20, seed=11 + i, ignore_eos=True) for i in range(5)]
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=3, block_size=4,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    engine = llm.engine
    requests = [make_request(i, None, p, q, 0) for i, (p, q) in enumerate(zip(prompts, params))]
    engine.add_request(requests[0])
    engine.add_request(requests[1])
    steps = 0
    while engine.has_unfinished() or steps < 3:
        if steps == 3:
            for request in requests[2:]:
                engine.add_request(request)
        engine.step()
        steps += 1
    assert {"decode_batch", "mixed_forward", "prefill_chunk", "prefill_batch_chunk"} <= set(engine.calls)
    assert [r.generated for r in requests] == solo(solo_llm, prompts, params)
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_give_the_same_tokens(checkpoint, solo_llm):
    shared = prompts_of([13], seed=5)[0]
    prompts = prompts_of([4, 7, 2], seed=6, shared=shared)
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4, max_num_batched_tokens=64)
    first = llm.generate(prompts[:1], GREEDY)[0]
    rest = llm.generate(prompts[1:], GREEDY)
    assert first.cached_tokens == 0
    assert [o.cached_tokens for o in rest] == [12, 12]  # the three full blocks of the shared prefix
    assert [first.token_ids] + [o.token_ids for o in rest] == solo(solo_llm, prompts, GREEDY)
    # The same prompt again: everything but its last token's block comes from the cache.
    again = llm.generate(prompts[:1], GREEDY)[0]
    assert again.cached_tokens == (len(prompts[0]) - 1) // 4 * 4 and again.token_ids == first.token_ids
    assert llm.engine.prefix_cache.hit_blocks > 0
    assert_all_blocks_free(llm)


def test_preemption_recomputes_and_matches(checkpoint, solo_llm):
    prompts = prompts_of([9, 12, 7, 10], seed=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # 14 blocks of 4 tokens: the four requests (up to 24 tokens, 6 blocks each) cannot all fit.
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4, num_blocks=14,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    outputs = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == solo(solo_llm, prompts, params)
    assert all(o.finish_reason == "length" for o in outputs)
    assert_all_blocks_free(llm)


def test_a_request_that_can_never_fit_fails_alone(checkpoint, solo_llm):
    prompts = prompts_of([5, 40, 6], seed=9)
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4, num_blocks=8)
    outputs = llm.generate(prompts, GREEDY)
    assert outputs[1].finish_reason == "error" and "needs 10 KV blocks" in outputs[1].error
    assert outputs[1].token_ids == []
    assert [outputs[0].token_ids, outputs[2].token_ids] == solo(solo_llm, [prompts[0], prompts[2]], GREEDY)
    # One that fits as a prompt but outgrows the cache while decoding fails too; the other finishes.
    long_run = llm.generate(prompts[:1] + prompts[2:],
                            [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), GREEDY])
    assert long_run[0].finish_reason == "error" and "KV blocks" in long_run[0].error
    assert long_run[1].token_ids == solo(solo_llm, prompts[2:], GREEDY)[0]
    assert_all_blocks_free(llm)


def test_error_in_an_admitted_batched_prefill_is_raised_once(checkpoint, monkeypatch):
    prompts = prompts_of([6, 7, 5], seed=10)
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=4, block_size=4, max_num_batched_tokens=64)
    model = llm.model
    original = model.forward_batch
    calls = []

    def failing(batch):
        calls.append(len(batch.segments))
        if len(batch.segments) > 1:
            raise RuntimeError("injected")
        return original(batch)

    monkeypatch.setattr(model, "forward_batch", failing)
    engine = llm.engine
    requests = [make_request(i, None, p, GREEDY, 0) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert calls == [3]  # one admitted batch, one attempt
    assert all(r.finish_reason == "error" and "injected" in r.error for r in requests)
    assert not engine.has_unfinished()
    assert_all_blocks_free(llm)
    # The engine goes on with new requests.
    monkeypatch.setattr(model, "forward_batch", original)
    assert llm.generate(prompts[:1], GREEDY)[0].finish_reason == "length"


def test_streaming_yields_tokens_as_they_come(checkpoint, solo_llm):
    prompts = prompts_of([5, 9], seed=13)
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4)
    seen: dict[str, list[list[int]]] = {}
    final = {}
    for output in llm.generate_stream(prompts, GREEDY):
        seen.setdefault(output.request_id, []).append(output.token_ids)
        if output.finished:
            final[output.request_id] = output
        else:
            assert output.finish_reason is None
    ids = sorted(final, key=int)
    assert [final[i].token_ids for i in ids] == solo(solo_llm, prompts, GREEDY)
    for request_id, snapshots in seen.items():
        # One output per new token; the one with the last token is also the finished one.
        assert [len(s) for s in snapshots] == list(range(1, GREEDY.max_tokens + 1))


def test_closing_a_stream_early_frees_its_requests(checkpoint):
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4)
    stream = llm.generate_stream(prompts_of([5, 9], seed=14), GREEDY)
    next(stream)
    with pytest.raises(EngineBusyError, match="another generation runs"):
        llm.generate([1, 2, 3], GREEDY)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert_all_blocks_free(llm)
    assert llm.generate([1, 2, 3], GREEDY)[0].finish_reason == "length"


def test_budget_below_the_block_size_is_a_config_error(checkpoint):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(checkpoint, device="cpu", show_progress=False, block_size=16, max_num_batched_tokens=8)


EXAMPLES = int(os.environ.get("METRALE_HYPOTHESIS_EXAMPLES", "12"))


def run_random_case(checkpoint, solo_llm, data, adapters=None, **options):
    """Random arrivals, lengths, shared prefixes, budgets, a small block pool and speculation
    (n-gram drafts) on or off, and with ``adapters`` a LoRA adapter or the base model drawn per
    request over fewer slots than adapters: every request equals its solo run (or fails exactly
    when it cannot fit the whole cache) and nothing leaks."""
    count = data.draw(st.integers(2, 6), label="requests")
    shared = prompts_of([data.draw(st.integers(0, 12), label="shared")], seed=data.draw(st.integers(0, 99)))[0]
    lengths = data.draw(st.lists(st.integers(1, 14), min_size=count, max_size=count), label="lengths")
    with_prefix = data.draw(st.lists(st.booleans(), min_size=count, max_size=count), label="with_prefix")
    prompts = [(shared if use else []) + p for p, use in zip(prompts_of(lengths, seed=len(shared)), with_prefix)]
    max_tokens = data.draw(st.lists(st.integers(1, 12), min_size=count, max_size=count), label="max_tokens")
    arrivals = sorted(data.draw(st.lists(st.integers(0, 6), min_size=count, max_size=count), label="arrivals"))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    chosen = [None] * count
    if adapters:
        chosen = data.draw(st.lists(st.sampled_from([None, *adapters]), min_size=count, max_size=count), label="adapters")
        options = {**options, "enable_lora": True, "max_lora_rank": 8,
                   "max_loras": data.draw(st.integers(1, len(adapters)), label="max_loras")}
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4,
              num_blocks=data.draw(st.integers(6, 16), label="num_blocks"),
              max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
              max_num_batched_tokens=data.draw(st.sampled_from([4, 8, 12, 32]), label="budget"),
              enable_prefix_caching=data.draw(st.booleans(), label="prefix_cache"),
              overlap_scheduling=data.draw(st.booleans(), label="overlap"),
              speculative_config=data.draw(st.sampled_from([None, 1, 4]).map(
                  lambda k: k and {"method": "ngram", "num_speculative_tokens": k}), label="speculation"),
              **options)
    engine = llm.engine
    # What an is_mla() family gets: whole prompts, alone in their steps.
    engine.scheduler.one_chunk_prefill = data.draw(st.booleans(), label="one_chunk_prefill")
    requests = [make_request(i, None, p, q, 0) for i, (p, q) in enumerate(zip(prompts, params))]
    for request, adapter in zip(requests, chosen):
        if adapter is not None:
            llm.lora.resolve(adapter)
            request.lora, request.seq.adapter_id = adapter, adapter.lora_int_id
    step = 0
    pending = list(zip(arrivals, requests))
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        engine.step()
        step += 1
        assert step < 500
    expected = solo(solo_llm, prompts, params, chosen)
    for request, prompt, param, tokens in zip(requests, prompts, params, expected):
        # The KV of prompt + max_tokens - 1 tokens must fit the whole cache, or the request fails.
        fits = -(-(len(prompt) + param.max_tokens - 1) // 4) <= llm.cache.num_blocks
        if fits:
            assert request.error is None and request.generated == tokens
        else:
            assert request.finish_reason == "error" and "KV blocks" in request.error
    event(f"preempted: {any(r.num_preemptions for r in requests)}")
    event(f"prefix hits: {any(r.cached_tokens for r in requests)}")
    event(f"failed: {any(r.error for r in requests)}")
    event(f"mixed steps: {'mixed_forward' in engine.calls}")
    event(f"speculated: {'verify' in engine.calls}")
    if adapters:
        event(f"several adapters drawn: {len({a for a in chosen if a is not None}) > 1}")
        assert engine.check() == []
        assert all(llm.lora.holders(slot) == 0 for slot in range(1, llm.lora.max_loras + 1))
    assert_all_blocks_free(llm)
    if llm.cache.state_slots is not None:
        assert llm.cache.state_slots.num_free == llm.cache.state_slots.num_slots


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_match_solo_runs_and_leak_nothing(checkpoint, solo_llm, data):
    run_random_case(checkpoint, solo_llm, data)


@pytest.fixture(scope="module")
def lora_adapters(checkpoint, tmp_path_factory):
    """Two adapters on the Llama test model (LoRA on every projection, one replacing token rows)."""
    from metrale import LoRARequest
    from metrale.testing.hf import build_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    build_peft_adapter(checkpoint, root / "a", seed=1, r=8, lora_alpha=16, target_modules=targets)
    build_peft_adapter(checkpoint, root / "b", seed=2, r=4, lora_alpha=4, target_modules=targets[:4],
                       trainable_token_indices={"embed_tokens": [3, 50, 90], "lm_head": [7, 11]})
    return [LoRARequest("a", 1, root / "a"), LoRARequest("b", 2, root / "b")]


@pytest.fixture(scope="module")
def solo_lora(checkpoint):
    return LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=1, enable_prefix_caching=False,
               max_num_batched_tokens=4096, block_size=4, enable_lora=True, max_lora_rank=8, max_loras=2)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_with_lora_adapters(checkpoint, solo_lora, lora_adapters, data):
    """The same with an adapter (or the base model) per request: mixed steps of several adapters,
    requests waiting for a slot, prefix hits only within an adapter."""
    run_random_case(checkpoint, solo_lora, data, adapters=lora_adapters)


@pytest.fixture(scope="module")
def solo_gdn(gdn_checkpoint):
    return LLM(gdn_checkpoint, device="cpu", show_progress=False, max_num_seqs=1, enable_prefix_caching=False,
               max_num_batched_tokens=4096, block_size=4)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_on_a_hybrid_model(gdn_checkpoint, solo_gdn, data):
    """The same on Qwen3-Next: recurrent-state slots, state snapshots (few, so they are dropped
    too) and prefix hits that resume from them."""
    run_random_case(gdn_checkpoint, solo_gdn, data, num_state_snapshots=data.draw(st.integers(0, 3), label="snapshots"))


def test_one_chunk_prefill_runs_each_prompt_whole_and_alone(checkpoint, solo_llm, monkeypatch):
    """What an ``is_mla()`` family gets: no chunked, batched or mixed prefill."""
    llm = LLM(checkpoint, device="cpu", show_progress=False, max_num_seqs=3, block_size=4,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    engine = llm.engine
    assert not engine.scheduler.one_chunk_prefill
    monkeypatch.setattr(engine.scheduler, "one_chunk_prefill", True)
    seen = []
    original = llm.forward.run

    def recording(method, step, **arguments):
        if method == "prefill_chunk":
            seen.append((arguments["chunk_start"], arguments["chunk_len"], len(arguments["tokens"]),
                         arguments["is_last_chunk"]))
        return original(method, step, **arguments)

    monkeypatch.setattr(llm.forward, "run", recording)
    prompts = prompts_of([19, 4, 11, 25], seed=15)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == solo(solo_llm, prompts, GREEDY)
    assert set(engine.calls) == {"prefill_chunk", "decode_batch"}
    assert all(start == 0 and length == total and last for start, length, total, last in seen)
    assert len(seen) == len(prompts)


@pytest.mark.parametrize("chunk_size", [1, 4, 7])
def test_two_phase_prefill_continues_like_the_engine(checkpoint, solo_llm, chunk_size):
    """A prompt prefilled in two phases (``prefill_twophase``), then decoded greedily by hand,
    gives the engine's tokens."""
    from metrale.sequence import SequenceState

    prompt = prompts_of([15], seed=16)[0]
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4)
    seq = SequenceState.from_prompt(prompt)
    try:
        logits = llm.forward.prefill_twophase(prompt, seq, chunk_size)
        tokens = [int(np.argmax(logits[0]))]
        while len(tokens) < GREEDY.max_tokens:
            tokens.append(int(np.argmax(llm.forward.decode(tokens[-1], seq)[0])))
    finally:
        llm.cache.release(seq)
    assert tokens == solo(solo_llm, [prompt], GREEDY)[0]


def test_the_recurrent_state_is_checked_after_every_unfinished_chunk(checkpoint, monkeypatch):
    llm = LLM(checkpoint, device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=8)
    checked = []
    monkeypatch.setattr(llm.forward, "normalize_ssm_states", lambda seq, stream=None: checked.append(seq.num_cached))
    llm.generate(prompts_of([21], seed=17), GREEDY)
    assert checked == [8, 16]  # after the chunks ending at 8 and 16; not after the last one


@pytest.mark.parametrize("leak", ["blocks", "state slots"])
def test_a_stuck_scheduler_raises_instead_of_spinning(gdn_checkpoint, leak):
    """With every block (or state slot) taken outside any request -- a leak -- nothing can run:
    the step raises SchedulerStuckError instead of looping, and the recovery rebuilds the
    bookkeeping so the next call runs."""
    from metrale.sequence import SequenceState

    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=4)
    reference = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    if leak == "blocks":
        llm.cache.allocator.allocate(llm.cache.allocator.num_free)
    else:
        while llm.cache.state_slots.num_free:
            llm.cache.state_slots.allocate(SequenceState.from_prompt([1]))
    with pytest.raises(SchedulerStuckError, match="neither run nor admit"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert llm.engine.repairs, "the leak was not noticed"
    assert llm.cache.holdings() == (0, 0)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == reference
