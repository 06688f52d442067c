"""A KeyboardInterrupt at any line of the public entry points leaves the ``LLM`` usable.

For each family, a workload of the public calls -- ``generate``, ``generate_stream`` (read in a
``with`` block), ``score`` and ``chat`` -- is first run without a fault, recording every line
that the entry points and what they call on the way to the engine execute: :class:`~metrale.LLM`
and its module, :class:`~metrale.entrypoints.streams.RequestStream`, the engine hold, the prompt front end,
prompt and chat rendering, and the requests' text and stop rules. Then, for every such line, at
its first execution (each family) and at its middle one (the dense family: the lines are the
same code for every family), a fresh ``LLM`` runs the workload with a
``KeyboardInterrupt`` raised at that line, and must: let the interrupt reach the caller, hold no
block, state slot or engine hold afterwards, report consistent bookkeeping, and then run the
whole workload with exactly a fresh ``LLM``'s outputs. ``close`` gets the same sweep: after an
interrupted close the ``LLM`` is either open and runs the workload as before, or closed; either
way a second ``close()`` finishes it.
"""

from __future__ import annotations

import gc

import pytest
from faults import LineFaults, describe, functions_of

from metrale import LLM, SamplingParams, api, chat, engine_hold, frontend, prompts, streams
from metrale.engine import generation
from metrale.errors import EngineClosedError
from metrale.model.plugin_manager import get_plugin_manager

pytestmark = pytest.mark.slow

ENTRY_POINTS = functions_of(
    api.LLM, api, streams.RequestStream, engine_hold.EngineHold, engine_hold.EngineHolds, engine_hold,
    frontend.PromptFrontend, prompts, chat, generation.IncrementalText, generation.Request, generation.StopChecker,
    generation.RequestGroup, generation,
)
FAMILIES = {"dense": "tiny-dense", "mla": "tiny-mla", "gdn": "tiny-gdn"}
OPTIONS = dict(device="cpu", show_progress=False, block_size=4, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=3)
PROMPTS = ["Return the list of", {"prompt": "Sort the"}, [5, 6, 7, 8, 9]]
PARAMS = [
    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, stop=["zq"]),
    SamplingParams(max_tokens=2, temperature=0.8, seed=3, ignore_eos=True, n=2, logprobs=1),
    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a sort."}]


@pytest.fixture(scope="module")
def plugin_manager():
    return get_plugin_manager()


def fresh(model, plugin_manager):
    return LLM(model, plugin_manager=plugin_manager, **OPTIONS)


def summary(outputs):
    return [(o.request_id if not o.request_id.isdigit() else None, [(c.token_ids, c.text, c.finish_reason) for c in o.outputs])
            for o in outputs]


def workload(llm):
    """Every public generation call once; returns what each gave."""
    results = [summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))]
    with llm.generate_stream(PROMPTS, PARAMS) as stream:
        results.append(summary([output for output in stream if output.finished]))
    results.append(llm.score(llm.encode("Return the number of")).round(5).tolist())
    results.append(summary(llm.chat(MESSAGES, PARAMS[0], use_tqdm=False)))
    return results


def assert_usable(llm, where):
    assert llm._holds.owner() is None, f"the engine is still held after an interrupt {where}"
    assert not llm.engine.has_unfinished(), where
    assert llm.cache.holdings() == (0, 0), f"blocks / state slots still held after an interrupt {where}"
    assert llm.engine.check() == [], where


@pytest.fixture(scope="module", params=list(FAMILIES))
def recorded(request, plugin_manager):
    return record(request.param, plugin_manager)


def record(family, plugin_manager):
    """(model, a fresh LLM's workload results, the entry-point lines the workload executes, the
    lines ``close`` executes)."""
    model = FAMILIES[family]
    faults = LineFaults(ENTRY_POINTS)
    llm = fresh(model, plugin_manager)
    # As in interrupted(): no collection while recording, or a stream of an earlier test collected
    # meanwhile would add an execution of its close that the interrupted runs never see.
    gc.collect()
    gc.disable()
    try:
        with faults.record() as seen:
            reference = workload(llm)
        with faults.record() as closing:
            llm.close()
    finally:
        gc.enable()
    assert reference == workload(fresh(model, plugin_manager))
    names = {code.co_name for code, _ in seen}
    assert {"generate", "generate_stream", "score", "chat", "__next__", "close", "claim", "release"} <= names, names
    return model, reference, dict(seen), dict(closing)


def targets(seen, which):
    """(line, occurrence) pairs: each line at its first execution, or at its middle one (for
    lines executed more than once)."""
    chosen = []
    for line, count in sorted(seen.items(), key=lambda item: (item[0][0].co_qualname, item[0][1])):
        if which == "first":
            chosen.append((line, 1))
        elif count > 1:
            chosen.append((line, count // 2 + 1))
    return chosen


def interrupted(faults, line, occurrence, call):
    """Run ``call`` with the interrupt; True when it fired and reached the caller. The
    traceback is dropped before returning, as a caller that handled the interrupt does. The
    cyclic garbage collector runs before and after, never during: a stream of an earlier run
    collected meanwhile would run its ``close`` where the interrupt was meant to land."""
    gc.collect()
    gc.disable()
    try:
        with faults.inject(line, occurrence):
            call()
    except KeyboardInterrupt as interrupt:
        fired = faults.fired and "injected" in str(interrupt)
    else:
        fired = False
    finally:
        gc.enable()
    gc.collect()
    return fired


def sweep(recorded, plugin_manager, which):
    model, reference, seen, _ = recorded
    faults = LineFaults(ENTRY_POINTS)
    missed = []
    chosen = targets(seen, which)
    assert len(chosen) > (100 if which == "first" else 30)
    gc.freeze()  # what exists now is never garbage: each collection below scans only the new objects
    try:
        for line, occurrence in chosen:
            where = f"at {describe(line)}, occurrence {occurrence}"
            llm = fresh(model, plugin_manager)
            if not interrupted(faults, line, occurrence, lambda: workload(llm)):
                missed.append(where)
                continue
            assert_usable(llm, where)
            assert workload(llm) == reference, f"output differs from a fresh LLM's after an interrupt {where}"
            llm.close()
    finally:
        gc.unfreeze()
    assert not missed, missed


def test_an_interrupt_at_any_entry_point_line_leaves_the_llm_usable(recorded, plugin_manager):
    sweep(recorded, plugin_manager, "first")


def test_an_interrupt_at_a_later_execution_of_any_line_leaves_the_llm_usable(plugin_manager):
    """The lines executed more than once, interrupted at their middle execution, on the dense
    family: the entry points' lines are the same code for every family, and what a family changes
    (its cache's blocks and state slots) the sweep of first executions meets for each."""
    sweep(record("dense", plugin_manager), plugin_manager, "middle")


def test_an_interrupted_close_leaves_the_llm_open_and_usable_or_closed(recorded, plugin_manager):
    model, reference, _, closing = recorded
    faults = LineFaults(ENTRY_POINTS)
    outcomes = set()
    for line, count in closing.items():
        for occurrence in sorted({1, count // 2 + 1}):
            where = f"at {describe(line)}, occurrence {occurrence}"
            llm = fresh(model, plugin_manager)
            assert interrupted(faults, line, occurrence, llm.close), where
            if llm.closed:
                outcomes.add("closed")
                with pytest.raises(EngineClosedError):
                    llm.generate(PROMPTS, PARAMS)
            else:
                outcomes.add("open")
                assert_usable(llm, where)
                assert workload(llm) == reference, where
            llm.close()
            assert llm.closed and llm._torn_down and llm._holds.owner() is None, where
            llm.close()  # a second close does nothing
    assert outcomes == {"open", "closed"}
