"""Clients that go away never stall the others: streamed completions through ``metrale serve``'s
stack (an engine process behind uvicorn), many at once, two in three dropped by their client after
a few events, on every family, with overlap scheduling and with n-gram speculation, on a cache
small enough to preempt (some go before their first event). Every stream read to its end gets ``[DONE]`` within its deadline
and the text it gets alone; afterwards ``/metrics`` shows nothing running, waiting or allocated."""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serverkit import (  # noqa: E402
    ServerThread,
    async_http_client,
    http_client,
    idle_report,
    metric_values,
    read_stream,
    wait_idle,
)

from metrale import LLM, SamplingParams  # noqa: E402
from metrale.entrypoints.engine_process import EngineProcess  # noqa: E402
from metrale.entrypoints.server import build_app  # noqa: E402

pytestmark = pytest.mark.slow

FAMILIES = {"dense": "tiny-dense", "mla": "tiny-mla", "gdn": "tiny-gdn"}
MODES = {
    "overlap": dict(overlap_scheduling=True),
    "speculation": dict(overlap_scheduling=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}
OPTIONS = dict(device="cpu", show_progress=False, block_size=4, num_blocks=20, max_num_batched_tokens=16,
               max_num_seqs=6)
WORDS = ("the list of items is sorted by the number of times each one was seen in the file and then written "
         "back to the disk before the program returns").split()
#: Seconds a stream that is read to its end may take.
STREAM_DEADLINE_S = 60.0


def workload(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for index in range(count):
        prompt = f"Case {index}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 20)))
        sampled = rng.random() < 0.3  # (drawing among the top 20 tokens: see engine/test_abort_isolation.py)
        items.append({
            "prompt": prompt, "max_tokens": rng.randrange(1, 25), "temperature": 0.9 if sampled else 0.0,
            "seed": rng.randrange(1000) if sampled else None,
            # Two in three clients go away after 0 (before the first token) to 5 events.
            "drop_after": rng.randrange(0, 6) if rng.random() < 2 / 3 else None,
        })
    return items


async def stream_one(client: httpx.AsyncClient, item: dict, model: str) -> dict:
    body = {"model": model, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": item["temperature"],
            "top_k": 20, "ignore_eos": True, "stream": True}
    if item["seed"] is not None:
        body["seed"] = item["seed"]
    return await read_stream(client, body, stop_after=item["drop_after"])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dropped_streams_never_stall_the_others(family, mode):
    seed = sorted(FAMILIES).index(family) * 10 + list(MODES).index(mode)
    items = workload(seed, 72)
    model = FAMILIES[family]
    engine = EngineProcess(model, max_waiting_requests=1024, **OPTIONS, **MODES[mode])
    try:
        server = ServerThread(build_app(engine, model_name=model)).start()
    except BaseException:
        engine.shutdown()
        raise

    async def run() -> list:
        gate = asyncio.Semaphore(24)

        async def limited(item: dict) -> dict:
            async with gate:
                return await asyncio.wait_for(stream_one(client, item, model), STREAM_DEADLINE_S)

        async with async_http_client(server.url) as client:
            return await asyncio.gather(*(limited(item) for item in items), return_exceptions=True)

    try:
        results = asyncio.run(run())
        with http_client(server.url) as http:
            values = wait_idle(http, timeout=10.0)
            stats = metric_values(http)
    finally:
        server.stop()
        engine.shutdown()
    stalled = [index for index, result in enumerate(results) if isinstance(result, asyncio.TimeoutError)]
    assert not stalled, f"streams that waited past {STREAM_DEADLINE_S} s: {stalled}"
    failed = [(index, result) for index, result in enumerate(results) if isinstance(result, BaseException)]
    assert not failed, failed
    assert all(values[name] == 0 for name in idle_report(values)), idle_report(values)
    assert stats["metrale_preemptions_total"] > 0, "the workload never preempted a request"
    reference = LLM(model, **OPTIONS)
    try:
        read_to_end = [(item, result) for item, result in zip(items, results) if item["drop_after"] is None]
        assert len(read_to_end) >= 12
        for item, result in read_to_end:
            params = SamplingParams(max_tokens=item["max_tokens"], temperature=item["temperature"], seed=item["seed"],
                                    top_k=20, ignore_eos=True)
            alone = reference.generate(item["prompt"], params, use_tqdm=False)[0].outputs[0]
            assert result["done"], item
            assert (result["text"], result["finish_reason"]) == (alone.text, alone.finish_reason), item
    finally:
        reference.close()
