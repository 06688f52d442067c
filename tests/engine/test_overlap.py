"""Overlap scheduling on the cpu backend: each step planned and queued while the one before it is
in flight, its decode tokens fed from that step's sampled tokens, gives every request exactly the
tokens and finish reasons of the step-by-step engine, and leaves the cache as clean."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.backends.base import CpuBackend
from metrale.engine.generation import make_request
from metrale.model.family import FamilyModel
from metrale.model.hookspecs import hookimpl
from metrale.model.plugin_manager import get_plugin_manager

FAMILIES = ["dense", "mla", "gdn"]


def prompts_of(lengths, seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 128, 9).tolist()
    return [(shared if n % 2 else []) + rng.integers(1, 128, n).tolist() for n in lengths]


def outcome(outputs):
    return [(o.token_ids, o.finish_reason, o.error) for o in outputs]


def counted_rows(llm):
    """Wrap the model's forward: returns the list that collects each call's row count."""
    rows = []
    forward = llm.model.forward_batch

    def counting(batch):
        rows.append(batch.num_rows)
        return forward(batch)

    llm.model.forward_batch = counting
    return rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_blocks", [None, 14])
def test_overlapped_steps_give_the_step_by_step_tokens(family_checkpoint_of, family, num_blocks):
    path = family_checkpoint_of(family)
    prompts = prompts_of([3, 17, 9, 30, 1, 12, 6], seed=len(family))
    options = dict(device="cpu", show_progress=False, max_num_seqs=3, block_size=4, max_num_batched_tokens=16)
    if num_blocks:
        options["num_blocks"] = num_blocks  # too few for every request at once: preemption
    step_by_step = LLM(path, overlap_scheduling=False, **options)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = [o.token_ids for o in step_by_step.generate(prompts, greedy)]
    # Stops on a token from the middle of each output, one seeded sampler, one max_tokens of 1.
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[t[4]]) for t in first]
    params[2] = SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True)
    params[5] = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    step_by_step = LLM(path, overlap_scheduling=False, **options)  # a fresh cache, as the one below
    expected = step_by_step.generate(prompts, params)
    overlapped = LLM(path, **options)
    assert overlapped.engine.overlap and not step_by_step.engine.overlap
    got = overlapped.generate(prompts, params)
    assert outcome(got) == outcome(expected)
    assert any(o.finish_reason == "stop" for o in got)
    if num_blocks:
        assert any(o.num_preemptions for o in got)
    assert overlapped.engine.overlapped_steps > 0 and step_by_step.engine.overlapped_steps == 0
    assert overlapped.cache.holdings() == (0, 0) and overlapped.engine.check() == []
    assert not overlapped.engine.has_unfinished() and overlapped.engine.in_flight is None
    # The prefix cache holds as many blocks either way: nothing a step in flight computed was
    # published before the step was read back, and nothing less.
    if overlapped.engine.prefix_cache is not None and not num_blocks:
        assert (len(overlapped.engine.prefix_cache.registered_blocks())
                == len(step_by_step.engine.prefix_cache.registered_blocks()))
    # And again, on prefix-cache hits.
    assert outcome(overlapped.generate(prompts, params)) == outcome(expected)


def test_rows_sure_to_finish_are_not_planned_ahead(dense_checkpoints):
    """Requests that end by length run exactly their rows; one that stops on a token runs one row
    more, planned ahead before its stop was read, whose token is dropped."""
    prompts = prompts_of([5, 8, 3], seed=1)
    lengths = [4, 7, 2]
    options = dict(device="cpu", show_progress=False, max_num_seqs=4, block_size=4)
    llm = LLM(dense_checkpoints["llama"], **options)
    rows = counted_rows(llm)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    assert [len(o.token_ids) for o in outputs] == lengths
    assert sum(rows) == sum(len(p) for p in prompts) + sum(n - 1 for n in lengths)
    stop = outputs[1].token_ids[2]
    llm = LLM(dense_checkpoints["llama"], **options)
    rows = counted_rows(llm)
    stopped = llm.generate(prompts[1:2], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=[stop]))[0]
    assert stopped.token_ids == outputs[1].token_ids[:3] and stopped.finish_reason == "stop"
    assert sum(rows) == len(prompts[1]) + 2 + 1  # the row after the stop ran and was dropped
    assert llm.cache.holdings() == (0, 0)


def test_a_failing_step_reads_the_step_in_flight_back_first(dense_checkpoints):
    """The third forward call raises while the second is in flight: the second's tokens are
    kept, the third's requests fail, the error propagates and the engine goes on."""
    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, max_num_seqs=4, block_size=4)
    forward = llm.model.forward_batch
    calls = []

    def failing(batch):
        calls.append(batch.num_rows)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return forward(batch)

    llm.model.forward_batch = failing
    engine = llm.engine
    prompts = prompts_of([5, 7], seed=2)
    requests = [make_request(i, None, p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), 0)
                for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    engine.step()  # the prompts: queued
    engine.step()  # the first decode step queued, the prompts' tokens read back
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert all(len(r.generated) == 2 for r in requests)  # the prompts' tokens and the first decode's
    assert all(r.finish_reason == "error" and "injected" in r.error for r in requests)
    assert engine.in_flight is None and not engine.has_unfinished()
    assert llm.cache.holdings() == (0, 0) and engine.check() == []
    llm.model.forward_batch = forward
    assert all(o.error is None for o in llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0)))


def test_a_model_that_overrides_its_decode_path_is_not_fed_on_the_device():
    class OwnDecode(FamilyModel):
        def decode_batch(self, tokens, seqs, stream):
            return None

    class Plain(FamilyModel):
        pass

    backend = CpuBackend()
    assert Plain(backend, vocab_size=8, max_model_len=16).feeds_pending_tokens
    assert not OwnDecode(backend, vocab_size=8, max_model_len=16).feeds_pending_tokens


class AnsweringFirst:
    """A plugin answering decode steps before the family (it reads the tokens on the host)."""

    @hookimpl(tryfirst=True)
    def metrale_decode_batch(self, model, tokens, seqs, stream):
        return None


def test_overlap_is_off_when_another_plugin_answers_decode_steps_first(dense_checkpoints):
    manager = get_plugin_manager()
    manager.register(AnsweringFirst(), name="answering-first")
    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, plugin_manager=manager)
    assert not llm.engine.overlap
    assert LLM(dense_checkpoints["llama"], device="cpu", show_progress=False).engine.overlap
