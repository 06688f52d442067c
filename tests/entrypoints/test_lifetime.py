"""An LLM's lifetime: one generation at a time, streams that hold and give back the engine,
close() and ``with``, and no reference cycle (dropping an LLM frees it at once)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import EngineBusyError, EngineClosedError, MetraleError
from metrale.model.hookspecs import hookimpl

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]


@pytest.fixture
def llm(dense_checkpoints):
    return LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, block_size=4)


@pytest.fixture(scope="module")
def reference(dense_checkpoints):
    """What a fresh LLM generates for PROMPTS."""
    fresh = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, block_size=4)
    return [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]


def held_blocks(llm):
    return llm.cache.allocator.num_in_use


# --------------------------------------------------------------------- one generation at a time


def test_a_second_stream_is_refused_and_the_first_is_unaffected(llm, reference):
    first = llm.generate_stream(PROMPTS, GREEDY)
    next(first)
    with pytest.raises(EngineBusyError, match="one runs at a time"):
        llm.generate_stream(PROMPTS, GREEDY)
    with pytest.raises(EngineBusyError):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineBusyError):
        llm.score([1, 2, 3])
    finals = sorted((o for o in first if o.finished), key=lambda o: int(o.request_id))
    assert [o.token_ids for o in finals] == reference
    assert first.closed
    # Exhausted: the engine is free again.
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_a_stream_takes_the_engine_at_creation_and_gives_it_back_when_dropped(llm, reference):
    stream = llm.generate_stream(PROMPTS, GREEDY)
    with pytest.raises(EngineBusyError):
        llm.generate(PROMPTS, GREEDY)
    del stream  # never started
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    with llm.generate_stream(PROMPTS, GREEDY) as stream:
        next(stream)
        assert held_blocks(llm) > 0
    assert held_blocks(llm) == 0 and not llm.engine.has_unfinished()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_a_bad_prompt_leaves_the_engine_free(llm, reference):
    with pytest.raises(MetraleError):
        llm.generate_stream([[1, 2], None], GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_generate_from_another_thread_is_refused_while_one_runs(llm, reference):
    """Thread A's generation is held inside a forward step while thread B calls generate."""
    inside, release = threading.Event(), threading.Event()

    class HoldOnce:
        held = False

        @hookimpl
        def metrale_stamp(self, model, step):
            if not self.held and threading.current_thread().name == "A":
                self.held = True
                inside.set()
                release.wait(30)

    llm.plugin_manager.register(HoldOnce(), name="hold-once")
    results = {}

    def run_a():
        results["A"] = llm.generate(PROMPTS, GREEDY)

    thread = threading.Thread(target=run_a, name="A")
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(EngineBusyError):
            llm.generate(PROMPTS, GREEDY)
        with pytest.raises(EngineBusyError):
            llm.close()
    finally:
        release.set()
        thread.join(30)
    llm.plugin_manager.unregister(name="hold-once")
    assert [o.token_ids for o in results["A"]] == reference
    assert all(len(o.token_ids) <= GREEDY.max_tokens for o in results["A"])


def test_sampling_params_edited_after_submission_do_not_reach_running_requests(llm, reference):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    stream = llm.generate_stream(PROMPTS, params)
    next(stream)
    params.max_tokens = 2
    finals = sorted((o for o in stream if o.finished), key=lambda o: int(o.request_id))
    assert [o.token_ids for o in finals] == reference


# ------------------------------------------------------------------------------------ lifetime


def test_dropping_an_llm_frees_it_without_the_garbage_collector(dense_checkpoints):
    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False)
    llm.generate(PROMPTS, GREEDY)
    stream = llm.generate_stream(PROMPTS, GREEDY)
    next(stream)
    stream.close()
    parts = [llm, llm.model, llm.cache, llm.cache.allocator, llm.engine, llm.engine.scheduler, llm.backend,
             llm.forward, llm.checkpoint]
    if llm.engine.prefix_cache is not None:
        parts.append(llm.engine.prefix_cache)
    refs = [weakref.ref(part) for part in parts]
    cache_array = weakref.ref(llm.cache.layers[0].k)
    gc.collect()
    gc.disable()
    try:
        del llm, parts, stream
        alive = [type(ref()).__name__ for ref in refs if ref() is not None]
        assert alive == [], f"still alive without a garbage collection: {alive}"
        assert cache_array() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("model", ["tiny-mla", "tiny-gdn"])
def test_families_with_latent_and_recurrent_caches_hold_no_cycle(model):
    llm = LLM(model, device="cpu", show_progress=False)
    llm.generate("Return the", SamplingParams(max_tokens=3))
    refs = [weakref.ref(llm), weakref.ref(llm.model), weakref.ref(llm.cache)]
    gc.collect()
    gc.disable()
    try:
        del llm
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


def test_close_frees_the_cache_and_model_and_refuses_later_calls(dense_checkpoints):
    with LLM(dense_checkpoints["llama"], device="cpu", show_progress=False) as llm:
        assert llm.generate(PROMPTS, GREEDY)
        cache, model = weakref.ref(llm.cache), weakref.ref(llm.model)
    assert llm.closed
    gc.disable()
    try:
        assert cache() is None and model() is None
    finally:
        gc.enable()
    for call in (lambda: llm.generate(PROMPTS, GREEDY), lambda: llm.generate_stream(PROMPTS),
                 lambda: llm.score([1, 2]), llm.capture_graphs):
        with pytest.raises(EngineClosedError):
            call()
    llm.close()  # closing twice is fine
    assert "closed" in repr(llm)


def test_close_is_refused_while_a_stream_is_open(llm):
    stream = llm.generate_stream(PROMPTS, GREEDY)
    next(stream)
    with pytest.raises(EngineBusyError):
        llm.close()
    stream.close()
    llm.close()
    assert llm.closed


def test_the_first_llm_of_a_process_is_freed_without_the_garbage_collector():
    """Where no CUDA driver loads, importing numba.cuda leaves reference cycles that reach the
    frames of whoever imported it -- the first LLM's constructor; they are collected at once."""
    probe = (
        "import gc, weakref\n"
        "gc.disable()\n"
        "from metrale import LLM\n"
        "llm = LLM('tiny-dense', show_progress=False)\n"
        "alive = weakref.ref(llm)\n"
        "del llm\n"
        "print('freed' if alive() is None else 'alive')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # the real numba.cuda
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip().splitlines()[-1] == "freed"
