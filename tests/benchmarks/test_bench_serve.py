"""``metrale bench --serve``: the serving benchmark client against fake OpenAI-streaming servers.

The fake servers stream deterministic chunks with known delays (``FIRST_DELAY`` before the first
chunk, ``GAP`` between chunks, ``TOKENS_PER_CHUNK`` tokens each) and a usage chunk; most tests use
an ``httpx.MockTransport``, one a real uvicorn server on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from metrale.benchmarks import serve as bench_serve  # noqa: E402
from metrale.benchmarks.serve import RequestRecord, ServeWorkload  # noqa: E402
from metrale.benchmarks.throughput import ThroughputOptions, workload  # noqa: E402
from metrale.errors import ConfigError, MetraleError  # noqa: E402

FIRST_DELAY = 0.03
GAP = 0.01
TOKENS_PER_CHUNK = 2
SMALL = ServeWorkload(min_len=3, max_len=8, vocab_size=100)


def sse(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def chunk(text, finish_reason=None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


async def events(body: dict, mode: str = "ok", first_delay: float = FIRST_DELAY):
    """The event stream of one request: content chunks, the usage chunk, ``[DONE]``; ``mode``
    ``malformed`` sends a line that is not JSON after the first chunk, ``drop`` stops after it."""
    total = body["max_tokens"]
    await asyncio.sleep(first_delay)
    sent = 0
    while sent < total:
        k = min(TOKENS_PER_CHUNK, total - sent)
        sent += k
        yield sse(chunk("ab" * k, "length" if sent == total else None))
        if mode == "malformed":
            yield b"data: {this is not json\n\n"
        if mode == "drop":
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        if sent < total:
            await asyncio.sleep(GAP)
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": total, "total_tokens": len(body["prompt"]) + total}
    yield sse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake", "choices": [], "usage": usage})
    yield sse("[DONE]")


class FakeServer:
    """An ``httpx.MockTransport`` handler; ``modes`` maps the number of a completion request (0 is
    the benchmark's untimed test request) to ``503``, ``malformed`` or ``drop``."""

    def __init__(self, modes=None, models=None, first_delay=FIRST_DELAY):
        self.modes = modes or {}
        self.models = [{"id": "fake", "object": "model", "vocab_size": 50}] if models is None else models
        self.first_delay = first_delay
        self.requests: list[tuple[float, dict]] = []

    async def __call__(self, request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": self.models})
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        mode = self.modes.get(len(self.requests), "ok")
        self.requests.append((time.perf_counter(), body))
        if mode == "503":
            return httpx.Response(503, json={"error": {"message": "the server is overloaded"}})
        if mode == "400":
            return httpx.Response(400, json={"error": {"message": "token id 77 is out of range"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events(body, mode, self.first_delay))

    @property
    def timed(self) -> list[tuple[float, dict]]:
        return self.requests[1:]  # without the test request


def run(server, **kwargs):
    options = dict(model="fake", rates=[math.inf], num_prompts=8, seed=0, api_key=None, workload=SMALL, timeout_s=10.0,
                   progress=False, transport=httpx.MockTransport(server))
    options.update(kwargs)
    return bench_serve.run_serve_benchmark("http://fake.test:8000", **options)


def test_latencies_follow_the_injected_delays_and_tokens_come_from_the_usage_chunk():
    server = FakeServer()
    result = run(server, num_prompts=12)
    (summary,) = result["runs"]
    assert summary["completed"] == 12 and summary["failed"] == 0 and summary["failure_reasons"] == {}
    bodies = [body for _, body in server.timed]
    assert summary["output_tokens"] == sum(b["max_tokens"] for b in bodies)  # the usage, not the chunk count
    assert summary["prompt_tokens"] == sum(len(b["prompt"]) for b in bodies)
    assert summary["content_chunks"] == sum(math.ceil(b["max_tokens"] / TOKENS_PER_CHUNK) for b in bodies)
    assert 1.5 <= summary["tokens_per_chunk"] <= 2.0
    assert summary["requests_without_usage"] == 0 and summary["output_length_mismatches"] == 0
    ms = 1e3
    assert FIRST_DELAY * ms * 0.9 <= summary["ttft_ms"]["p50"] <= FIRST_DELAY * ms + 150
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
    assert GAP * ms * 0.8 <= summary["itl_ms"]["p50"] <= GAP * ms + 50
    # tpot = (e2e - ttft) / (tokens - 1): about GAP * (chunks - 1) / (tokens - 1), 2.5-7 ms for 3-8 tokens
    assert 2.0 <= summary["tpot_ms"]["mean"] <= 60
    assert summary["e2e_ms"]["p50"] >= summary["ttft_ms"]["p50"] + GAP * ms * 0.8
    assert summary["duration_s"] * ms >= summary["e2e_ms"]["p99"] * 0.99
    assert summary["request_throughput"] == pytest.approx(12 / summary["duration_s"])
    assert summary["output_token_throughput"] == pytest.approx(summary["output_tokens"] / summary["duration_s"])
    assert summary["total_token_throughput"] == pytest.approx(
        (summary["output_tokens"] + summary["prompt_tokens"]) / summary["duration_s"])
    # every request as the brief has it
    for body in bodies:
        assert body["model"] == "fake" and body["stream"] is True and body["temperature"] == 0
        assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
        assert all(isinstance(t, int) and 0 <= t < 100 for t in body["prompt"])


def test_failures_are_counted_with_their_reasons_and_the_run_goes_on():
    server = FakeServer(modes={3: "503", 5: "malformed", 7: "drop"})
    (summary,) = run(server, num_prompts=10)["runs"]
    assert summary["completed"] == 7 and summary["failed"] == 3
    reasons = summary["failure_reasons"]
    assert sum(reasons.values()) == 3
    assert any(r.startswith("HTTP 503") and "overloaded" in r for r in reasons)
    assert any("malformed SSE data" in r for r in reasons)
    assert any("RemoteProtocolError" in r and "peer closed" in r for r in reasons)
    assert summary["output_tokens"] == sum(body["max_tokens"] for i, (_, body) in enumerate(server.timed)
                                           if i + 1 not in (3, 5, 7))


def test_stream_errors_are_failures():
    def record():
        return RequestRecord(0, 1, 1)

    with pytest.raises(bench_serve._StreamError, match="malformed SSE line"):
        bench_serve._read_event("garbage without a field", record(), 0.0)
    with pytest.raises(bench_serve._StreamError, match="server error"):
        bench_serve._read_event('data: {"error": {"message": "boom"}}', record(), 0.0)
    with pytest.raises(bench_serve._StreamError, match="malformed completion chunk"):
        bench_serve._read_event('data: {"choices": [], "usage": {"prompt_tokens": 1}}', record(), 0.0)
    seen = record()
    assert not bench_serve._read_event(": keep-alive comment", seen, 0.0)
    assert not bench_serve._read_event("event: completion", seen, 0.0)
    assert not bench_serve._read_event('data:{"choices": [{"text": "x"}]}', seen, 0.5)  # no space after data:
    assert bench_serve._read_event("data: [DONE]", seen, 1.0)
    assert seen.chunk_times == [0.5 - seen.sent]

    async def no_done(request):
        if request.url.path == "/v1/models":
            return httpx.Response(404)
        return httpx.Response(200, content=sse(chunk("x")) + sse(chunk("y")))

    async def empty(request):
        return httpx.Response(200, content=sse(chunk("")) + sse("[DONE]"))

    async def slow(request):
        return httpx.Response(200, content=events(json.loads(request.content), first_delay=5.0))

    async def one(handler, timeout_s=5.0):
        async with httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(handler)) as client:
            return await bench_serve.send_request(client, b'{"max_tokens": 2, "prompt": [1]}', record(), timeout_s)

    assert asyncio.run(one(no_done)).error == "the stream ended before data: [DONE]"
    assert asyncio.run(one(empty)).error == "no text in the stream"
    started = time.perf_counter()
    assert asyncio.run(one(slow, timeout_s=0.1)).error == "timed out after 0.1 s"
    assert time.perf_counter() - started < 2


def test_a_server_without_usage_counts_chunks():
    async def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(404)  # lists no model: the named one is used
        body = json.loads(request.content)
        return httpx.Response(200, content=b"".join(sse(chunk("a")) for _ in range(body["max_tokens"])) + sse("[DONE]"))

    result = bench_serve.run_serve_benchmark("http://fake.test/v1/", model="m", rates=[math.inf], num_prompts=4,
                                             workload=SMALL, progress=False, transport=httpx.MockTransport(handler))
    (summary,) = result["runs"]
    assert summary["completed"] == 4 and summary["requests_without_usage"] == 4
    assert summary["output_tokens"] == result["config"]["lengths"]["output"]["total"]
    assert result["config"]["base_url"] == "http://fake.test"


def test_unreachable_server_raises_a_clear_error_before_timing():
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(bench_serve.ServerUnreachableError, match=f"cannot reach the server at {url}") as caught:
        bench_serve.run_serve_benchmark(url, model="m", rates=[1.0], num_prompts=2, progress=False, timeout_s=5.0)
    assert isinstance(caught.value, MetraleError) and isinstance(caught.value, ConnectionError)


def test_a_failing_test_request_or_a_rejected_key_stops_before_timing():
    server = FakeServer(modes={0: "400"})
    with pytest.raises(bench_serve.ServerCheckError, match="test completion .* HTTP 400: .*out of range"):
        run(server)
    assert len(server.requests) == 1

    async def unauthorized(request):
        assert request.headers["authorization"] == "Bearer sk-secret"
        return httpx.Response(401, json={"error": "bad key"})

    with pytest.raises(bench_serve.ServerCheckError, match="rejected the API key"):
        run(unauthorized, api_key="sk-secret")


def test_workload_is_the_throughput_benchmarks_and_the_vocab_comes_from_the_server():
    server = FakeServer()  # lists vocab_size 50
    result = run(server, model=None, workload=ServeWorkload(min_len=3, max_len=8), num_prompts=6, seed=3)
    config = result["config"]
    assert config["model"] == "fake"  # the first one listed
    assert config["workload"]["vocab_size"] == 50 and config["workload"]["vocab_size_from"] == "server"
    prompts, lengths = workload(ThroughputOptions(num_requests=6, min_len=3, max_len=8, seed=3), 50)
    assert [b["prompt"] for _, b in server.timed] == prompts
    assert [b["max_tokens"] for _, b in server.timed] == lengths
    assert config["lengths"]["output"] == {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / 6,
                                           "total": sum(lengths)}
    unlisted = run(FakeServer(models=[]), workload=ServeWorkload(min_len=3, max_len=8))["config"]["workload"]
    assert unlisted == {"min_len": 3, "max_len": 8, "vocab_size": bench_serve.DEFAULT_VOCAB_SIZE, "vocab_size_from": "default"}
    with pytest.raises(ConfigError, match="more than the 10 tokens"):
        run(FakeServer(models=[{"id": "fake", "max_model_len": 10}]))


def test_poisson_arrivals_are_seeded_with_the_right_mean_gap():
    times = bench_serve.arrival_times(4000, 20.0, seed=1)
    assert times == bench_serve.arrival_times(4000, 20.0, seed=1)
    assert times != bench_serve.arrival_times(4000, 20.0, seed=2)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 20, rel=0.06)  # 4 standard errors
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.1)  # exponential: std == mean
    assert bench_serve.arrival_times(5, math.inf, seed=1) == [0.0] * 5
    slower = bench_serve.arrival_times(4000, 10.0, seed=1)  # the same pattern, scaled
    assert slower[-1] == pytest.approx(2 * times[-1])
    with pytest.raises(ConfigError):
        bench_serve.arrival_times(3, 0.0, seed=1)


def test_requests_leave_on_the_poisson_schedule_and_all_at_once_at_inf():
    server = FakeServer(first_delay=0.0)
    result = run(server, rates=[40.0, math.inf], num_prompts=16)
    finite, at_once = server.timed[:16], server.timed[16:]
    expected = bench_serve.arrival_times(16, 40.0, seed=0)
    observed = [t - finite[0][0] for t, _ in finite]
    # None leaves early; a busy machine may start one late, not by much (the schedule spans ~0.4 s).
    assert all(o >= e - 0.01 for o, e in zip(observed, expected)), (observed, expected)
    assert max(o - e for o, e in zip(observed, expected)) < 0.25
    # At an infinite rate all 16 are in flight together (started within a busy machine's delay).
    assert result["runs"][1]["max_in_flight"] == 16
    assert at_once[-1][0] - at_once[0][0] < 0.25
    assert result["config"]["rates"] == [40.0, "inf"]
    assert result["runs"][0]["duration_s"] >= expected[-1]


def test_cancelling_the_benchmark_cancels_every_request():
    server = FakeServer(first_delay=30.0)

    async def main():
        task = asyncio.create_task(bench_serve.serve_benchmark(
            "http://fake.test", model="fake", rates=[math.inf], num_prompts=6, workload=SMALL, probe=False,
            transport=httpx.MockTransport(server)))
        while len(server.requests) < 6:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    started = time.perf_counter()
    assert asyncio.run(main()) == []
    assert time.perf_counter() - started < 5


def test_percentiles_and_summaries_on_a_known_list():
    values = list(range(1, 101))
    assert bench_serve.percentile(values, 50) == pytest.approx(50.5)
    assert bench_serve.percentile(values, 90) == pytest.approx(90.1)
    assert bench_serve.percentile(values, 99) == pytest.approx(99.01)
    assert bench_serve.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert bench_serve.percentile([7.0], 99) == 7.0
    summary = bench_serve.summarize([v / 1000 for v in values])  # seconds in, milliseconds out
    assert summary == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert bench_serve.summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    record = RequestRecord(0, 4, 5, chunk_times=[0.1, 0.15, 0.25], e2e=0.5, completion_tokens=5)
    assert record.ttft == 0.1 and record.itl == pytest.approx([0.05, 0.1]) and record.tpot == pytest.approx(0.1)
    assert RequestRecord(0, 4, 1, chunk_times=[0.1], e2e=0.1, completion_tokens=1).tpot is None


def test_report_round_trips_and_the_table_has_one_row_per_rate(tmp_path):
    server = FakeServer(first_delay=0.0, modes={2: "503"})
    result = run(server, rates=[100.0, 400.0, math.inf], num_prompts=5, api_key="sk-secret")
    path = bench_serve.write_report(result, tmp_path / "sub" / "serve.json")
    assert json.loads(path.read_text()) == result
    assert "sk-secret" not in path.read_text()
    assert result["config"]["base_url"] == "http://fake.test:8000"
    assert bench_serve.redact_url("http://user:sk-secret@host:8000/v1?key=sk-secret") == "http://host:8000/v1"
    table = bench_serve.format_table(result)
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| rate")]
    assert [row.split("|")[1].strip() for row in rows] == ["100", "400", "inf"]
    assert "failed at rate 100: 1 x HTTP 503" in table


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    result = run(FakeServer(first_delay=0.0), rates=[50.0, math.inf], num_prompts=4)
    path = bench_serve.plot_serve(result, tmp_path / "plots")
    assert path == tmp_path / "plots" / "serve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rates_and_cli_arguments():
    assert bench_serve.parse_rates("1,4,16,inf") == [1.0, 4.0, 16.0, math.inf]
    for bad in ("0", "x", "-1", "nan", ""):
        with pytest.raises(ConfigError):
            bench_serve.parse_rates(bad)
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="bench.json")  # as metrale bench has
    parser.add_argument("--seed", type=int, default=5)  # an option the parser has already is kept
    bench_serve.add_serve_arguments(parser)
    args = parser.parse_args(["--serve", "http://h:1", "--request-rates", "2,inf", "--num-prompts", "3",
                              "--model", "m", "--output", "r.json", "--plot-dir", "d"])
    assert (args.serve, args.request_rates, args.num_prompts, args.model, args.output, args.plot_dir, args.seed) == (
        "http://h:1", "2,inf", 3, "m", "r.json", "d", 5)
    assert args.request_timeout == 600.0 and args.vocab_size is None


@pytest.fixture
def uvicorn_server():
    """A real OpenAI-style streaming server (FastAPI on uvicorn) in a thread; yields its URL and
    the fake server whose modes it follows."""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    fake = FakeServer(modes={2: "503", 4: "drop"})
    app = FastAPI()

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request):  # Starlette routes: this module's string annotations would not resolve
        body = await request.json()
        mode = fake.modes.get(len(fake.requests), "ok")
        fake.requests.append((time.perf_counter(), body))
        if mode == "503":
            return JSONResponse({"error": {"message": "the server is overloaded"}}, status_code=503)

        async def stream():
            try:
                async for part in events(body, mode):
                    yield part
            except httpx.RemoteProtocolError:
                raise RuntimeError("dropped on purpose") from None  # uvicorn drops the connection

        return StreamingResponse(stream(), media_type="text/event-stream")

    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", fake
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_against_a_real_uvicorn_server_through_the_cli_helpers(uvicorn_server, tmp_path, capsys):
    url, fake = uvicorn_server
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="bench.json")  # as metrale bench has
    bench_serve.add_serve_arguments(parser)
    out = tmp_path / "serve.json"
    args = parser.parse_args(["--serve", url, "--request-rates", "50,inf", "--num-prompts", "6", "--min-len", "3",
                              "--max-len", "8", "--vocab-size", "100", "--output", str(out), "--no-progress"])
    assert bench_serve.run_from_args(args) == 1  # two requests failed
    printed = capsys.readouterr().out
    assert f"results: {out}" in printed and "| inf |" in printed
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "fake" and result["config"]["base_url"] == url
    first, second = result["runs"]
    assert (first["completed"], first["failed"]) == (4, 2) and (second["completed"], second["failed"]) == (6, 0)
    reasons = " ".join(first["failure_reasons"])
    assert "HTTP 503" in reasons and "RemoteProtocolError" in reasons
    for summary in result["runs"]:
        assert 1e3 * FIRST_DELAY * 0.9 <= summary["ttft_ms"]["p50"] <= 1e3 * FIRST_DELAY + 200
        # Over TCP a late chunk shortens the gap after it (on a loaded machine two chunks may arrive
        # together), so the median gap can fall well under GAP; their mean keeps the waits between
        # the chunks (the stream's last chunks follow without one).
        assert 1e3 * GAP * 0.5 <= summary["itl_ms"]["mean"] <= 1e3 * GAP + 80
        assert summary["output_length_mismatches"] == 0 and summary["requests_without_usage"] == 0
    timed = [body for _, body in fake.requests[1:]]
    assert second["output_tokens"] == sum(b["max_tokens"] for b in timed[6:])
