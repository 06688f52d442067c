"""The asynchronous engine: concurrent callers get exactly their solo outputs, requests join a
running batch, aborted and abandoned requests free their cache at once, the waiting queue is
bounded, bad requests fail before reaching the engine, and shutdown drains or aborts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from metrale import LLM, AsyncLLM, SamplingParams
from metrale.errors import EngineBusyError, EngineClosedError, InvalidRequestError, QueueFullError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[i + 1, 7, 8, 9][: 1 + i % 4] + [3] * (i % 5) for i in range(24)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-dense", device="cpu", show_progress=False, max_num_seqs=8)


@pytest.fixture(scope="module")
def solo(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


async def last_output(engine, prompt, params=GREEDY, request_id=None, delay=0.0):
    last = None
    async for output in engine.generate(prompt, params, request_id):
        last = output
        if delay:
            await asyncio.sleep(delay)
    return last


def run_with(llm, body, **options):
    async def main():
        engine = AsyncLLM(llm, **options)
        try:
            return await body(engine)
        finally:
            await asyncio.to_thread(engine.shutdown, 0.0, False)
    return asyncio.run(main())


def test_concurrent_callers_get_their_solo_outputs_and_the_cache_is_freed(llm, solo):
    async def body(engine):
        # Half start at once, the rest join while the first ones run; some read slowly.
        first = [asyncio.create_task(last_output(engine, p, delay=0.01 * (i % 3))) for i, p in enumerate(PROMPTS[:12])]
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(last_output(engine, p)) for p in PROMPTS[12:]]
        outputs = await asyncio.gather(*first, *rest)
        return outputs, engine.stats()

    outputs, stats = run_with(llm, body)
    assert [o.token_ids for o in outputs] == solo
    assert all(o.finished and o.finish_reason == "length" for o in outputs)
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0) and stats.steps > 0
    assert llm.cache.holdings() == (0, 0) and llm.engine.check() == []


def test_abandoned_and_aborted_requests_free_their_cache(llm, solo):
    async def body(engine):
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

        async def leave_early(prompt):
            async for output in engine.generate(prompt, long):
                if len(output.token_ids) >= 3:
                    break  # the generator is closed: the request is aborted

        async def cancelled(prompt):
            task = asyncio.create_task(last_output(engine, prompt, long))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        stream = engine.generate(PROMPTS[5], long, request_id="target")
        first = await stream.__anext__()
        engine.abort("target")
        rest = [output async for output in stream]
        await asyncio.gather(*(leave_early(p) for p in PROMPTS[:6]), *(cancelled(p) for p in PROMPTS[6:10]))
        for _ in range(200):
            if engine.num_active == 0 and llm.cache.holdings() == (0, 0):
                break
            await asyncio.sleep(0.01)
        still = await last_output(engine, PROMPTS[0])
        return first, rest, still, engine.stats()

    first, rest, still, stats = run_with(llm, body)
    assert not first.finished and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(rest[-1].token_ids) < 400
    assert still.token_ids == solo[0]  # the engine still serves, unchanged
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert llm.cache.holdings() == (0, 0) and llm.engine.check() == []


def test_the_waiting_queue_is_bounded(llm):
    async def body(engine):
        long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        tasks = [asyncio.create_task(last_output(engine, p, long)) for p in PROMPTS[:8 + 2]]
        await asyncio.sleep(0)  # every submission is made
        for _ in range(100):
            if engine.stats().running == 8:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError, match="max_num_seqs=8 \\+ max_waiting_requests=2"):
            async for _ in engine.generate(PROMPTS[11], long):
                pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run_with(llm, body, max_waiting_requests=2)
    assert llm.cache.holdings() == (0, 0)


def test_bad_requests_fail_before_reaching_the_engine(llm):
    async def body(engine):
        for prompt, params, match in [
            ("", GREEDY, "empty"), ([10**6], GREEDY, "outside"),
            ([1, 2], SamplingParams(min_tokens=20, max_tokens=3), "min_tokens"),
            ([1, 2], "greedy", "SamplingParams"), ([1] * 5000, GREEDY, "context"),
        ]:
            with pytest.raises(InvalidRequestError, match=match):
                await engine.generate(prompt, params).__anext__()
        with pytest.raises(InvalidRequestError, match="already running"):
            first = engine.generate([1, 2], SamplingParams(max_tokens=300, ignore_eos=True), request_id="same")
            await first.__anext__()
            await engine.generate([1, 2], GREEDY, request_id="same").__anext__()
        await first.aclose()  # aborted at the engine's next step
        for _ in range(200):
            if engine.num_active == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_active == 0

    run_with(llm, body)


def test_n_logprobs_and_the_llm_is_taken_while_serving(llm, solo):
    async def body(engine):
        with pytest.raises(EngineBusyError):
            llm.generate([1, 2, 3], GREEDY)
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, logprobs=1, ignore_eos=True)
        return await last_output(engine, PROMPTS[2], params)

    output = run_with(llm, body)
    assert len(output.outputs) == 3 and all(len(c.logprobs) == 8 for c in output.outputs)
    reference = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True))[0]
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in reference.outputs]


def test_shutdown_drains_then_aborts_and_refuses_new_requests():
    llm = LLM("tiny-dense", device="cpu", show_progress=False)

    async def main():
        engine = AsyncLLM(llm)
        short = asyncio.create_task(last_output(engine, [1, 2, 3], GREEDY))
        endless = asyncio.create_task(last_output(engine, [4, 5], SamplingParams(max_tokens=100000, ignore_eos=True)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown, 0.5)
        with pytest.raises(EngineClosedError):
            await engine.generate([1], GREEDY).__anext__()
        return await short, await endless

    short, endless = asyncio.run(main())
    assert short.finish_reason == "length" and endless.finish_reason == "abort"
    assert llm.closed


def test_unexpected_errors_fail_their_requests_and_the_engine_goes_on(llm, solo, monkeypatch):
    """An error outside the engine's steps (here computing prompt logprobs, then making an output)
    fails the requests it touches; the engine thread survives and serves the next ones."""
    original = llm.prompt_logprobs

    def broken(group):
        if group.completions[0].params.prompt_logprobs is not None:
            raise RuntimeError("out of device memory")
        return original(group)

    monkeypatch.setattr(llm, "prompt_logprobs", broken)

    async def body(engine):
        failed = await last_output(engine, PROMPTS[0], SamplingParams(max_tokens=4, prompt_logprobs=1))
        fine = await last_output(engine, PROMPTS[1])
        from metrale.engine.generation import RequestGroup

        output = RequestGroup.output
        calls = {"n": 0}

        def flaky(self, finished=None):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a detokenizer bug")
            return output(self, finished)

        monkeypatch.setattr(RequestGroup, "output", flaky)
        hit = await last_output(engine, PROMPTS[2])
        monkeypatch.setattr(RequestGroup, "output", output)
        after = await last_output(engine, PROMPTS[3])
        return failed, fine, hit, after

    failed, fine, hit, after = run_with(llm, body)
    assert failed.finish_reason == "error" and "out of device memory" in failed.error
    assert fine.token_ids == solo[1]
    assert hit.finish_reason == "error" and "detokenizer bug" in hit.error
    assert after.token_ids == solo[3]
    assert llm.cache.holdings() == (0, 0) and llm.engine.check() == []


EMBED_PROMPTS = ["The quick brown fox", [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 2, 9, 3, 3, 1, 7, 5, 2, 6, 4], [42]]


def test_embeddings_share_the_engine_with_generation_and_equal_llm_embed(llm, solo):
    """Pooling requests submitted while generation requests run come back with ``LLM.embed``'s
    vectors (to batch rounding); the generation requests keep their solo tokens; a cancelled
    wait aborts its request; bad pooling requests fail in the caller; nothing stays allocated."""
    from metrale import PoolingParams
    from metrale.errors import ConfigError

    expected = {pooling: [o.outputs.embedding for o in llm.embed(EMBED_PROMPTS, pooling=pooling, normalize=normalize)]
                for pooling, normalize in (("last", True), ("mean", False))}

    async def body(engine):
        generating = [asyncio.create_task(last_output(engine, p)) for p in PROMPTS[:8]]
        await asyncio.sleep(0.02)
        last = await asyncio.gather(*[engine.embed(p) for p in EMBED_PROMPTS])
        mean = []
        for prompt in EMBED_PROMPTS:
            mean.append([o async for o in engine.encode(prompt, PoolingParams("mean", False))])
        waiting = asyncio.create_task(engine.embed([3] * 400, request_id="cancelled"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        for prompt, params, lora, error in [("", None, None, InvalidRequestError), ([10**6], None, None, InvalidRequestError),
                                            ([1, 2], "mean", None, InvalidRequestError),
                                            ([1, 2], None, "adapter", InvalidRequestError)]:
            with pytest.raises(error):
                await engine.embed(prompt, params, lora_request=lora)
        llm.pooling_unavailable = "no embeddings here"
        try:
            with pytest.raises(ConfigError, match="no embeddings here"):
                await engine.embed([1, 2])
        finally:
            llm.pooling_unavailable = None
        tokens = [o.token_ids for o in await asyncio.gather(*generating)]
        for _ in range(200):
            if engine.num_active == 0:
                break
            await asyncio.sleep(0.01)
        return last, mean, tokens, engine.stats()

    last, mean, tokens, stats = run_with(llm, body)
    assert tokens == solo[:8]
    assert all(o.finished and o.error is None for o in last)
    assert all(len(outputs) == 1 and outputs[0].finished for outputs in mean)
    for got, want in [*zip(last, expected["last"]), *((o[0], w) for o, w in zip(mean, expected["mean"]))]:
        assert np.abs(np.asarray(got.outputs.embedding) - np.asarray(want)).max() <= 1e-5
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert llm.cache.holdings() == (0, 0) and llm.engine.check() == []
