"""Aborts and dropped callers never hurt the other requests.

Many requests run at once through :class:`~metrale.AsyncLLM` on a cache small enough to chunk
prompts, share prefixes and preempt; a seeded random plan aborts some of them at random points
-- before their first output, part way, after their last, while preempted -- or drops them the
way a client goes away (leaving the iteration, cancelling the task). Every family, with overlap
scheduling, step by step, and with n-gram speculation. Every request that is not aborted must
finish with exactly the tokens it gets alone, within a deadline (none may wait for an output
that never comes), and afterwards the engine must hold nothing: no block, no state slot, no
adapter slot, no queued or admitted request.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from metrale import LLM, AsyncLLM, SamplingParams

pytestmark = pytest.mark.slow

FAMILIES = {"dense": "tiny-dense", "mla": "tiny-mla", "gdn": "tiny-gdn"}
MODES = {
    "overlap": dict(overlap_scheduling=True),
    "step-by-step": dict(overlap_scheduling=False),
    "speculation": dict(overlap_scheduling=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}
#: Four-token blocks, 16-token chunks, six requests at once and too few blocks for all of them.
OPTIONS = dict(device="cpu", show_progress=False, block_size=4, num_blocks=24, max_num_batched_tokens=16,
               max_num_seqs=6)
ACTIONS = ("keep", "keep", "keep", "abort-before-first", "abort-midway", "leave-midway", "cancel",
           "abort-after-last", "abort-when-preempted")
#: Seconds the whole plan may take before the requests still running count as stalled.
DEADLINE_S = 60.0


@dataclass
class Planned:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    action: str
    #: Outputs to read before an action taken part way.
    after: int
    #: Seconds the caller sleeps after each output (a slow reader).
    delay: float


def make_plan(seed: int, count: int) -> list[Planned]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 3000) for _ in range(12)]
    plan = []
    for index in range(count):
        body = [rng.randrange(3, 3000) for _ in range(rng.randrange(1, 28))]
        prompt = (shared[: rng.randrange(4, 13)] + body) if rng.random() < 0.4 else body
        # Greedy, or sampled with a seed of its own, so each request's tokens are fixed alone. A
        # sampled row draws among its top 20 tokens: a draw in the far tail, where tokens of
        # probability 1e-6 sit side by side, would pick another one for logits that differ in
        # their last bits (another batch's rounding), which is no isolation failure.
        sampled = rng.random() < 0.3
        params = SamplingParams(max_tokens=rng.randrange(1, 25), ignore_eos=True, temperature=0.9 if sampled else 0.0,
                                top_k=20 if sampled else 0, seed=rng.randrange(1000) if sampled else None)
        plan.append(Planned(f"req-{index}", prompt, params, rng.choice(ACTIONS), rng.randrange(1, 4),
                            rng.choice([0.0, 0.0, 0.002, 0.01])))
    return plan


async def run_one(engine: AsyncLLM, item: Planned, progress: dict) -> object:
    """Play ``item``'s part; returns its last output (None when the caller left)."""
    progress[item.request_id] = "submitted"
    if item.action == "abort-before-first":
        active = engine.submit(item.prompt, item.params, item.request_id)
        engine.abort(item.request_id)
        while not (output := await active.next_output()).finished:
            pass
        progress[item.request_id] = "finished"
        return output
    stream = engine.generate(item.prompt, item.params, item.request_id)
    last = None
    seen = 0
    async for output in stream:
        last = output
        seen += 1
        progress[item.request_id] = f"{seen} outputs"
        if item.delay:
            await asyncio.sleep(item.delay)
        if output.finished:
            break
        if item.action == "abort-midway" and seen == item.after:
            engine.abort(item.request_id)
        elif item.action == "leave-midway" and seen == item.after:
            await stream.aclose()  # the caller goes away: the request is aborted
            progress[item.request_id] = "left"
            return None
        elif item.action == "abort-when-preempted" and output.num_preemptions:
            engine.abort(item.request_id)
    if item.action == "abort-after-last":
        engine.abort(item.request_id)  # finished already: nothing happens
    progress[item.request_id] = "finished"
    return last


async def play(engine: AsyncLLM, plan: list[Planned], seed: int) -> dict[str, object]:
    rng = random.Random(seed + 1)
    progress: dict[str, str] = {}
    tasks = {}
    for item in plan:
        tasks[item.request_id] = asyncio.create_task(run_one(engine, item, progress))
        if rng.random() < 0.5:
            await asyncio.sleep(rng.choice([0.0, 0.001, 0.005]))  # requests arrive over time
    for item in plan:
        if item.action == "cancel":
            await asyncio.sleep(rng.choice([0.0, 0.002, 0.01]))
            tasks[item.request_id].cancel()
    done, pending = await asyncio.wait(tasks.values(), timeout=DEADLINE_S)
    stalled = {rid: progress.get(rid) for rid, task in tasks.items() if task in pending}
    for task in pending:
        task.cancel()
    assert not stalled, f"requests still waiting for an output after {DEADLINE_S} s: {stalled}"
    return {rid: (None if task.cancelled() else task.result()) for rid, task in tasks.items()}


def assert_nothing_held(llm: LLM, engine: AsyncLLM) -> None:
    assert engine.num_active == 0, f"{engine.num_active} requests still active"
    assert engine._driver.groups == {}, f"admitted groups left: {sorted(engine._driver.groups)}"
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.running == [] and llm.engine.scheduler.waiting == []
    assert llm.cache.holdings() == (0, 0), "blocks / state slots still held"
    assert llm.engine.check() == [] and llm.engine.repairs == []
    if llm.lora is not None:
        assert not any(llm.lora.holders(slot) for slot in range(1, llm.lora.max_loras + 1))


def play_plan(family, mode, device="cpu"):
    """Run the seeded plan of ``family`` and ``mode`` through an AsyncLLM; (the plan, its
    outputs, the engine's stats, the LLM), after checking that nothing is held."""
    seed = sorted(FAMILIES).index(family) * 10 + list(MODES).index(mode)
    plan = make_plan(seed, 36)
    llm = LLM(FAMILIES[family], **{**OPTIONS, "device": device}, **MODES[mode])
    if mode == "overlap":
        assert llm.engine.overlap, "the engine does not overlap steps: the mode tests nothing"

    async def main():
        engine = AsyncLLM(llm)
        try:
            outputs = await play(engine, plan, seed)
            for _ in range(500):
                if engine.num_active == 0:
                    break
                await asyncio.sleep(0.01)
            assert_nothing_held(llm, engine)
            return outputs, engine.stats()
        finally:
            await asyncio.to_thread(engine.shutdown, 0.0, False)

    outputs, stats = asyncio.run(main())
    assert stats.preemptions > 0, "the plan never preempted a request"
    if mode == "speculation":
        assert stats.spec_verify_steps > 0, "no step speculated"
    for item in plan:
        output = outputs[item.request_id]
        if item.action in ("abort-before-first", "abort-midway") and output is not None:
            assert output.finished, item
    return plan, outputs, stats, llm


def kept(plan):
    return [item for item in plan if item.action in ("keep", "abort-after-last")]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_aborts_and_dropped_callers_leave_every_other_request_its_solo_output(family, mode):
    plan, outputs, _, llm = play_plan(family, mode)
    assert len(kept(plan)) >= 8
    for item in kept(plan):
        output = outputs[item.request_id]
        alone = llm.generate([item.prompt], item.params, use_tqdm=False)[0]
        assert output is not None and output.finished, item
        assert (output.outputs[0].token_ids, output.outputs[0].finish_reason) == (
            alone.outputs[0].token_ids, alone.outputs[0].finish_reason), f"{item.request_id} differs from its solo run"
    llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_aborts_and_dropped_callers_on_the_gpu_stall_nothing_and_hold_nothing(family, mode):
    """The same plans on the GPU (CUDA graphs, overlap on the device): no request waits, nothing
    is held, every kept request gets all its tokens. (Its tokens equal its solo run's only as far
    as bf16 decode steps of other batch sizes round alike, which they need not.)"""
    plan, outputs, _, llm = play_plan(family, mode, device="cuda")
    for item in kept(plan):
        output = outputs[item.request_id]
        assert output is not None and output.finished, item
        completion = output.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == item.params.max_tokens, item
    llm.close()
