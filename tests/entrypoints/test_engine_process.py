"""The engine in its own process: concurrent callers get exactly what ``LLM.generate`` gives
(every sampling feature: stop strings, logprobs, ``n``, prompt logprobs, structured output),
streamed outputs only ever grow, aborts free the cache, the queue is bounded, bad requests and
bad options fail with their typed errors, a dead engine process fails its requests, and
shutdown drains then stops the process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import threading
import time

import pytest

from metrale import LLM, SamplingParams, StructuredOutputParams
from metrale.entrypoints.engine_process import EngineProcess
from metrale.errors import (
    CheckpointError,
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    TokenOutOfRangeError,
    UnknownOptionError,
)

OPTIONS = {"device": "cpu", "show_progress": False, "max_num_seqs": 8}
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"],
          "additionalProperties": False}

CASES = [
    ("Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, stop=["the", "\n"])),
    ("Hello", SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True)),
    ([5, 6, 7, 8], SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=11, n=2, logprobs=1)),
    ("The cat sat", SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=2, min_tokens=4,
                                   presence_penalty=0.5, logit_bias={3: 2.0})),
    ("Write JSON:", SamplingParams(max_tokens=60, temperature=0.7, seed=3,
                                   structured_output=StructuredOutputParams(json=SCHEMA))),
]


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-dense", **OPTIONS) as llm:
        return llm.generate([prompt for prompt, _ in CASES], [params for _, params in CASES], use_tqdm=False)


@pytest.fixture(scope="module")
def engine():
    engine = EngineProcess("tiny-dense", **OPTIONS)
    yield engine
    engine.shutdown()


def run(body):
    return asyncio.run(body())


async def stream_of(engine, prompt, params, request_id=None):
    outputs = []
    async for output in engine.generate(prompt, params, request_id):
        outputs.append(output)
    return outputs


def _plain(value):
    """``value`` as nested lists, dicts and scalars (dataclasses as dicts of their fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def assert_same(got, expected, where="output"):
    """Equal, floats to float32 rounding: the streams reach the engine process at their own pace,
    so their rows share steps with other companions than in one ``LLM.generate`` call, and a
    product's float32 sums may round differently by batch shape (tokens, ranks and texts never
    differ)."""
    if isinstance(expected, float):
        assert math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {got} != {expected}"
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), f"{where}: {got} != {expected}"
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), f"{where}: {got} != {expected}"
        for index, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def comparable(output):
    return _plain((output.prompt, output.prompt_token_ids, output.outputs, output.prompt_logprobs,
                   output.finish_reason, output.error, output.finished))


def test_outputs_equal_llm_generate_for_every_sampling_feature(engine, reference):
    async def body():
        return await asyncio.gather(*[stream_of(engine, prompt, params) for prompt, params in CASES])

    streams = run(body)
    for stream, expected in zip(streams, reference):
        final = stream[-1]
        assert_same(comparable(final), comparable(expected))
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        for earlier, later in zip(stream, stream[1:]):  # cumulative: each output extends the one before
            for a, b in zip(earlier.outputs, later.outputs):
                assert b.token_ids[: len(a.token_ids)] == a.token_ids
                assert b.text.startswith(a.text)
    assert streams[-1][-1].outputs[0].finish_reason == "stop"
    json_text = streams[-1][-1].outputs[0].text
    assert set(json.loads(json_text)) == {"a", "b"}
    assert engine.stats().kv_blocks_used == 0 and engine.num_active == 0


def test_aborted_and_abandoned_requests_free_the_cache(engine):
    long = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)

    async def body():
        async def leave_early(prompt):
            async for output in engine.generate(prompt, long):
                if len(output.token_ids) >= 3:
                    break

        target = engine.submit("Return the", long, request_id="target")
        first = await target.next_output()
        engine.abort("target")
        last = first
        while not last.finished:
            last = await target.next_output()
        await asyncio.gather(*[leave_early(p) for p in ("Open a file", "Hello", [4, 5, 6])])
        for _ in range(200):
            if engine.stats().kv_blocks_used == 0 and engine.num_active == 0:
                break
            await asyncio.sleep(0.01)
        return last, engine.stats()

    last, stats = run(body)
    assert last.finish_reason == "abort" and len(last.token_ids) < 600
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0)


def test_embeddings_come_back_from_the_engine_process_as_llm_embed_gives_them(engine):
    """Pooling requests cross to the engine process and their vectors come back: those of
    ``LLM.embed`` (to batch rounding), beside generation requests; aborted and bad ones as in
    the process's own engine."""
    from metrale import PoolingParams

    prompts = ["The quick brown fox", [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 2, 9, 3, 3, 1, 7, 5, 2, 6, 4], [42]]
    with LLM("tiny-dense", **OPTIONS) as llm:
        expected = [o.outputs.embedding for o in llm.embed(prompts)]
        expected_mean = [o.outputs.embedding for o in llm.embed(prompts, pooling="mean", normalize=False)]
        size = llm.embedding_size
    assert engine.llm.embedding_size == size and engine.llm.pooling_unavailable is None

    async def body():
        generating = asyncio.create_task(stream_of(engine, "Hello", SamplingParams(max_tokens=30, ignore_eos=True)))
        last = await asyncio.gather(*[engine.embed(p) for p in prompts])
        mean = []
        for prompt in prompts:
            mean.append([o async for o in engine.encode(prompt, PoolingParams("mean", False))][-1])
        target = engine.submit_pooling([7] * 300, request_id="aborted")
        engine.abort("aborted")
        aborted = await target.next_output()
        with pytest.raises(InvalidRequestError):
            engine.submit_pooling("", None)
        with pytest.raises(InvalidRequestError):
            engine.submit_pooling([1, 2], None, lora_request="adapter")
        generated = await generating
        for _ in range(200):
            if engine.stats().kv_blocks_used == 0 and engine.num_active == 0:
                break
            await asyncio.sleep(0.01)
        return last, mean, aborted, generated, engine.stats()

    last, mean, aborted, generated, stats = run(body)
    for got, want in [*zip(last, expected), *zip(mean, expected_mean)]:
        assert got.finished and got.error is None and len(got.outputs.embedding) == size
        assert max(abs(a - b) for a, b in zip(got.outputs.embedding, want)) <= 1e-5
    # (Aborted at once, unless its one step ran before the abort reached the engine process.)
    assert aborted.finished and aborted.request_id == "aborted" and len(aborted.outputs.embedding) in (0, size)
    assert generated[-1].finished and len(generated[-1].token_ids) == 30
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0)


def test_bad_requests_fail_in_the_caller(engine):
    async def body():
        with pytest.raises(TokenOutOfRangeError):
            engine.submit([10**9], SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError):
            engine.submit("x", SamplingParams(max_tokens=2, structured_output=StructuredOutputParams(regex="(")))
        with pytest.raises(InvalidRequestError, match="already running"):
            engine.submit("x", SamplingParams(max_tokens=50), request_id="twice")
            engine.submit("x", SamplingParams(max_tokens=50), request_id="twice")
        engine.abort("twice")
        return engine.stats()

    run(body)
    assert engine.is_running


def test_the_waiting_queue_is_bounded():
    with_queue = EngineProcess("tiny-dense", max_waiting_requests=1, **{**OPTIONS, "max_num_seqs": 1})
    try:
        async def body():
            long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            taken = [with_queue.submit("Hello", long), with_queue.submit("Return the", long)]
            with pytest.raises(QueueFullError):
                with_queue.submit("Open a file", long)
            for request in taken:
                with_queue.abort(request.request_id)
            return [await request.next_output() for request in taken]

        assert run(body)
    finally:
        with_queue.shutdown()


def test_bad_options_and_checkpoints_raise_their_errors(tmp_path):
    with pytest.raises(UnknownOptionError):
        EngineProcess("tiny-dense", device="cpu", no_such_option=1)
    with pytest.raises(CheckpointError):
        EngineProcess(tmp_path / "missing", device="cpu")
    with pytest.raises(ConfigError, match="plugin_manager"):  # refused before any process starts
        EngineProcess("tiny-dense", device="cpu", plugin_manager=lambda: None)


def test_a_dead_engine_process_fails_its_requests_and_takes_no_more():
    doomed = EngineProcess("tiny-dense", **OPTIONS)
    try:
        last = run(lambda: killed_mid_request(doomed))
        assert last.finish_reason == "error" and "engine process stopped" in last.error
        assert not doomed.is_running
        with pytest.raises(EngineClosedError):
            run(lambda: _submit(doomed))
    finally:
        doomed.shutdown()


async def _submit(engine):
    engine.submit("Hello", SamplingParams(max_tokens=2))


async def killed_mid_request(engine):
    """The last output of a long request whose engine process is killed after its first output."""
    request = engine.submit("Hello", SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
    await request.next_output()
    os.kill(engine._process.pid, signal.SIGKILL)
    last = await request.next_output()
    while not last.finished:
        last = await request.next_output()
    return last


def test_a_killed_engine_process_is_started_again_up_to_max_restarts(reference):
    engine = EngineProcess("tiny-dense", max_restarts=1, **OPTIONS)
    try:
        async def serves_again():
            states = []
            for _ in range(3000):
                states.append(engine.is_running)
                if engine.is_running:
                    break
                try:
                    engine.submit("Hello", SamplingParams(max_tokens=2))
                except EngineClosedError as error:
                    states.append(str(error))
                await asyncio.sleep(0.01)
            prompt, params = CASES[1]
            request = engine.submit(prompt, params)
            last = await request.next_output()
            while not last.finished:
                last = await request.next_output()
            return states, last

        last = run(lambda: killed_mid_request(engine))
        assert last.finish_reason == "error" and "engine process stopped" in last.error
        states, again = run(serves_again)
        assert states[-1] is True and engine.restarts == 1
        assert any("started again" in str(state) for state in states), states  # refused while it reloads
        assert again.outputs[0].token_ids == reference[1].outputs[0].token_ids
        # Past max_restarts it stays down.
        os.kill(engine._process.pid, signal.SIGKILL)
        engine._done.wait(30)
        assert not engine.is_running and engine.restarts == 1
        with pytest.raises(EngineClosedError):
            run(lambda: _submit(engine))
    finally:
        engine.shutdown()


def test_shutdown_drains_the_running_requests_then_stops_the_process():
    own = EngineProcess("tiny-dense", **OPTIONS)

    async def body():
        short = asyncio.create_task(stream_of(own, "Return the", SamplingParams(max_tokens=8, temperature=0.0,
                                                                                ignore_eos=True)))
        await asyncio.sleep(0)
        while own.num_active == 0:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(own.shutdown, 30.0)
        return await short

    outputs = run(body)
    assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 8
    assert own._process.poll() is not None and not own.is_running
    own.shutdown()  # again: nothing to do


def test_structured_outputs_compile_beside_the_steps_in_arrival_order():
    """In the engine process a request's structured output compiles on a thread of its own while
    the engine steps; requests are admitted in arrival order once compiled, a request aborted
    meanwhile never starts, and a compile that fails fails only its request."""
    from multiprocessing import Pipe

    from metrale.entrypoints.engine_process import _EngineLoop

    with LLM("tiny-dense", **OPTIONS) as llm:
        llm.isolate_grammars = False
        _, conn = Pipe()
        loop = _EngineLoop(llm, conn)
        release = threading.Event()
        compile_for_real = loop._compile

        def slow_compile(structured):
            release.wait(10)
            compile_for_real(structured)

        loop._compile = slow_compile
        digits = llm.request_params(SamplingParams(max_tokens=3, structured_output=StructuredOutputParams(regex="[0-9]+")))
        plain = llm.request_params(SamplingParams(max_tokens=2, temperature=0.0))
        loop._handle(("add", "aborted", None, [5, 6, 7], digits, None))
        loop._handle(("add", "plain", None, [5, 6], plain, None))
        assert [message[1] for _, message in loop.compiling] == ["aborted", "plain"] and not loop.driver.groups
        loop._handle(("abort", "aborted"))
        assert loop.records == [("aborted", True, None, 0, 0, None, [])]
        loop._admit_compiled()
        assert list(loop.driver.groups) == ["plain"]  # behind nothing now
        loop._handle(("add", "digits", None, [5, 6, 7], digits, None))
        release.set()
        for _ in range(500):
            loop._admit_compiled()
            if not loop.compiling:
                break
            time.sleep(0.01)
        assert sorted(loop.driver.groups) == ["digits", "plain"]
        loop._compile = lambda structured: (_ for _ in ()).throw(InvalidRequestError("no"))
        bad = llm.request_params(SamplingParams(max_tokens=3, structured_output=StructuredOutputParams(regex="[a-c]+")))
        loop._handle(("add", "bad", None, [5], bad, None))
        for _ in range(500):
            loop._admit_compiled()
            if not loop.compiling:
                break
            time.sleep(0.01)
        assert loop.records[-1][:2] == ("bad", True) and "could not be started" in loop.records[-1][2]
        assert "bad" not in loop.driver.groups
        loop.compiler_thread.shutdown()
        llm.engine.recover()
