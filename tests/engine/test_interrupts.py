"""A KeyboardInterrupt at any line of the cache and scheduler bookkeeping never corrupts the engine.

For each family, a workload that chunks prompts, batches them, hits the prefix cache, evicts
cached blocks and preempts requests is first run without a fault, recording every line the
bookkeeping executes. Then, for every such line, a fresh ``LLM`` runs the workload again with a
``KeyboardInterrupt`` raised at that line -- at its first execution through ``generate``, at its
last through ``generate_stream`` -- and must: let the interrupt reach the caller, hold no block
and no state slot afterwards, report consistent bookkeeping that needed no repair, and then
generate exactly what a fresh ``LLM`` generates.
"""

from __future__ import annotations

import pytest
from faults import LineFaults, describe, functions_of

from metrale import LLM, SamplingParams
from metrale.cache import blocks, prefix, store
from metrale.engine import engine, scheduler
from metrale.model.family import FamilyModel
from metrale.model.plugin_manager import get_plugin_manager
from metrale.runner import ModelRunner

pytestmark = pytest.mark.slow

#: The bookkeeping: every function of the allocator, slot pool, snapshots, prefix cache, model
#: cache, scheduler and engine step, and the model runner's cache reservation. The recovery itself
#: runs only after an exception, so it is never a target.
BOOKKEEPING = functions_of(
    blocks.BlockAllocator, store.StateSlotPool, store.StateSnapshots, store.ModelCache, prefix.PrefixCache,
    scheduler.Scheduler, engine.Engine, engine,
    exclude=("recover", "_rebuild", "check", "reset", "repair"),
) | {FamilyModel.run_segments.__code__, ModelRunner.run.__code__}

SHARED = [5, 6, 7, 8, 9, 10, 11, 12]
#: Two prompts share two blocks, the fourth repeats the first (a prefix-cache hit once the first
#: is published), one is short; one request samples with its own seed.
PROMPTS = [SHARED + [13], SHARED + [20, 21], [30, 31, 32], SHARED + [13]]
PARAMS = [
    SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
]
#: Four-token blocks, eight-token chunks, three requests at once and too few blocks for them to
#: finish: prompts are chunked, cached blocks evicted and requests preempted.
OPTIONS = dict(device="cpu", show_progress=False, block_size=4, num_blocks=6, max_num_batched_tokens=8, max_num_seqs=3)
FAMILIES = ["dense", "mla", "gdn"]


@pytest.fixture(scope="module")
def plugin_manager():
    return get_plugin_manager()


def fresh(model, plugin_manager):
    return LLM(model, plugin_manager=plugin_manager, **OPTIONS)


def generated(outputs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def run(llm, api):
    if api == "generate":
        return llm.generate(PROMPTS, PARAMS)
    finals = [output for output in llm.generate_stream(PROMPTS, PARAMS) if output.finished]
    return sorted(finals, key=lambda output: int(output.request_id))


def assert_idle_and_consistent(llm, where):
    assert not llm.engine.has_unfinished(), where
    assert llm.cache.holdings() == (0, 0), f"blocks / state slots still held after an interrupt {where}"
    assert llm.engine.check() == [], where
    assert llm.engine.repairs == [], f"the bookkeeping needed repairs after an interrupt {where}"


def family_checkpoint(request, family):
    """The tiny random-weight checkpoint of ``family`` (Llama, DeepSeek-V3, Qwen3-Next)."""
    if family == "dense":
        return request.getfixturevalue("dense_checkpoints")["llama"]
    if family == "mla":
        return request.getfixturevalue("mla_checkpoints")["deepseek_v3"]
    return request.getfixturevalue("gdn_checkpoint")


@pytest.fixture(scope="module", params=FAMILIES)
def recorded(request, plugin_manager):
    """(model, the outputs of a fresh LLM, the bookkeeping lines the workload executes)."""
    model = family_checkpoint(request, request.param)
    faults = LineFaults(BOOKKEEPING)
    llm = fresh(model, plugin_manager)
    with faults.record() as seen:
        outputs = run(llm, "generate")
    reference = generated(outputs)
    # The workload exercises what it is meant to.
    names = {code.co_name for code, _ in seen}
    assert {"_preempt_newest", "_evicted", "publish", "share_all", "allocate", "free", "release"} <= names, names
    assert any(o.num_preemptions for o in outputs) and any(o.cached_tokens for o in outputs)
    if request.param == "gdn":
        assert {"take", "restore", "lookup_with_state"} <= names, names
    assert generated(run(fresh(model, plugin_manager), "generate_stream")) == reference
    return model, reference, dict(seen)


@pytest.mark.parametrize("api", ["generate", "generate_stream"])
def test_an_interrupt_at_any_bookkeeping_line_leaves_a_clean_engine(recorded, plugin_manager, api):
    model, reference, seen = recorded
    faults = LineFaults(BOOKKEEPING)
    missed = []
    for line, count in sorted(seen.items(), key=lambda item: (item[0][0].co_qualname, item[0][1])):
        occurrence = 1 if api == "generate" else count
        where = f"at {describe(line)}, occurrence {occurrence} of {count}, through {api}"
        llm = fresh(model, plugin_manager)
        try:
            with faults.inject(line, occurrence):
                run(llm, api)
        except KeyboardInterrupt as interrupt:
            assert faults.fired and "injected" in str(interrupt), where
        else:
            missed.append(where)
            continue
        assert_idle_and_consistent(llm, where)
        assert generated(run(llm, "generate")) == reference, f"output differs from a fresh LLM's after an interrupt {where}"
    assert not missed, missed


def test_an_interrupt_between_steps_of_a_stream_leaves_a_clean_engine(request, plugin_manager):
    """A Ctrl-C outside the bookkeeping -- in the caller's loop over a stream -- closes it."""
    model = family_checkpoint(request, "gdn")
    llm = fresh(model, plugin_manager)
    reference = generated(run(fresh(model, plugin_manager), "generate"))
    with pytest.raises(KeyboardInterrupt):
        with llm.generate_stream(PROMPTS, PARAMS) as stream:
            for index, _ in enumerate(stream):
                if index == 3:
                    raise KeyboardInterrupt
    assert_idle_and_consistent(llm, "in the caller's loop")
    assert generated(run(llm, "generate")) == reference
