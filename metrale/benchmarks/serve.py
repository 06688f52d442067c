"""``metrale bench --serve URL``: latency and throughput of an OpenAI-compatible server under load.

The client sends ``num_prompts`` streamed completions to ``POST {URL}/v1/completions`` at each
request rate in turn and times every server-sent event as it arrives. It needs ``httpx``; it runs
anywhere that reaches the server (no GPU, no model files).

Workload
    The prompt lengths, output lengths and prompt token ids of the offline throughput benchmark
    (:func:`metrale.benchmarks.throughput.workload`): lengths uniform in ``min_len``-``max_len``
    (100-1024 by default), token ids uniform in ``[0, vocab_size)``, all fixed by ``seed``. With
    the defaults (256 prompts, seed 0) the lengths are those of ``metrale bench --throughput``.
    ``vocab_size`` is, in this order: the one given; the ``vocab_size`` field of the model's
    entry in ``GET /v1/models`` when the server lists one; 32000 (valid for any vocabulary of at
    least 32000 entries). The same prompts are sent at every rate.

Requests
    Each request is a completion whose ``prompt`` is the list of token ids, with ``max_tokens``
    its output length, ``temperature`` 0, ``ignore_eos`` true (a server extension: every request
    generates exactly ``max_tokens`` tokens), ``stream`` true and ``stream_options:
    {"include_usage": true}`` (a last chunk with ``"choices": []`` and the token counts). One
    connection pool holds as many connections as there are prompts, so no request waits for a
    connection. Proxy environment variables are ignored.

Arrivals
    At a finite rate *r* (requests per second) the gaps between consecutive sends are drawn from
    an exponential distribution of mean 1/*r* (a Poisson process), from a generator seeded by
    ``seed``; the first request leaves at once and request *i* leaves at the sum of the first
    *i* gaps, measured from the start of the rate's run (an absolute schedule, so the client's
    own delays do not accumulate). The same seed gives the same pattern at every rate, scaled
    by 1/*r*. At rate ``inf`` every request is sent at once.

Before any timing, ``GET /v1/models`` checks that the server answers (else
:class:`ServerUnreachableError`) and names the model when none is given, and one untimed test
completion (the first prompt, 2 tokens) checks that requests succeed and warms the server up
(else :class:`ServerCheckError`, with the server's reason).

Per request, with times taken by the client's monotonic clock (``time.perf_counter``):

* *send*: just before the request is written; *content chunk*: an event whose first choice has a
  non-empty ``text``, timed when its line is read; *end*: when ``data: [DONE]`` is read.
* **TTFT** (time to first token) = first content chunk - send. It includes the connection set-up
  of a new pooled connection, queueing in the server, and the prefill.
* **ITL** (inter-token latency) = the gaps between consecutive content chunks of a request. It is
  per *chunk*: a server may put several tokens into one chunk (or hold back text that is not a
  whole character yet), so a gap can cover more than one token. The report's
  ``tokens_per_chunk`` (output tokens over content chunks) says how many.
* **TPOT** (time per output token) = (E2E - TTFT) / (completion_tokens - 1), with
  ``completion_tokens`` from the usage chunk; only for requests of two tokens or more.
* **E2E** (end-to-end latency) = end - send.
* A request **fails** when the connection fails or drops, the status is not 200 (the reason holds
  the status and the start of the body), an event is not valid server-sent-event JSON, the
  stream carries an ``error`` object or ends before ``data: [DONE]``, no text arrives, or it
  takes longer than ``timeout_s``. A failure never stops the run: it is counted, with its
  reason, and left out of every latency and throughput figure.

Per rate, over the completed requests: ``duration_s``, from the first send to the end of the
last request; ``request_throughput`` = completed / duration (requests/s);
``output_token_throughput`` = their completion tokens / duration; ``total_token_throughput`` =
their prompt plus completion tokens / duration (tokens/s; prompt tokens from the usage chunk);
and the mean, median (p50), p90 and p99 of TTFT, TPOT, ITL (pooled over the gaps of every
request) and E2E in milliseconds. Percentiles interpolate linearly between the closest ranks
(NumPy's default). A request without a usage chunk counts its content chunks as its tokens and
is counted in ``requests_without_usage``; one whose token count differs from its ``max_tokens``
is counted in ``output_length_mismatches``.

The client is one Python process: at high rates with thousands of requests in flight its own
event loop can add latency; a rate's ``max_in_flight`` says how many requests were open at once.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit, urlunsplit

from metrale.benchmarks.throughput import ThroughputOptions
from metrale.benchmarks.throughput import workload as throughput_workload
from metrale.errors import ConfigError, MetraleError

logger = logging.getLogger(__name__)

#: Token ids are drawn below this when neither the caller nor the server gives a vocabulary size.
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_RATES = "1,4,16,inf"
PERCENTILES = (50, 90, 99)
#: Tokens of the untimed test completion sent before the timed runs.
PROBE_TOKENS = 2
#: Characters of an error body kept in a failure reason.
REASON_CHARS = 200
#: Second element of the arrival generator's seed, so that it is independent of the workload's.
_ARRIVAL_STREAM = 0x5E7


class ServeBenchmarkError(MetraleError):
    """The serving benchmark cannot run (``httpx`` is missing, or the server check failed)."""


class ServerUnreachableError(ServeBenchmarkError, ConnectionError):
    """The server did not answer ``GET /v1/models`` at the start of the benchmark; the message
    names the URL and the connection error."""


class ServerCheckError(ServeBenchmarkError, RuntimeError):
    """The server answered the checks before the timed runs with an error: a rejected API key, or
    a failed test completion (the message holds the server's reason)."""


@dataclass
class ServeWorkload:
    """Lengths and token ids of the benchmark's prompts (see the module docstring)."""

    min_len: int = 100
    max_len: int = 1024
    #: None: the server's (``GET /v1/models``), else :data:`DEFAULT_VOCAB_SIZE`.
    vocab_size: int | None = None


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    sent: float = 0.0  # perf_counter at the send
    ok: bool = False
    error: str | None = None
    status: int | None = None
    #: Seconds from the send to each content chunk.
    chunk_times: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage: bool = False
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


class _StreamError(Exception):
    """A response that is not the stream the benchmark expects; the message is the reason."""


def _httpx() -> Any:
    try:
        return importlib.import_module("httpx")
    except ImportError:
        raise ServeBenchmarkError("the serving benchmark needs httpx: python3 -m pip install httpx") from None


# ---------------------------------------------------------------------------------- pure parts


def parse_rates(text: str) -> list[float]:
    """``"1,4,16,inf"`` -> ``[1.0, 4.0, 16.0, inf]``; each rate positive (requests per second)."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ConfigError(f"request rates are comma-separated numbers or inf, got {part!r}") from None
        if not rate > 0:  # also NaN
            raise ConfigError(f"request rates must be positive, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ConfigError(f"no request rate in {text!r}")
    return rates


def rate_label(rate: float | str) -> str:
    """``inf`` or the rate without trailing zeros (``4``, ``0.5``)."""
    rate = float(rate)
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def arrival_times(num_prompts: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start of a run at which each request is sent: 0, then the running sum of
    exponential gaps of mean ``1 / rate`` (seeded); all 0 at rate ``inf``."""
    import numpy as np

    if not rate > 0:
        raise ConfigError(f"a request rate must be positive, got {rate}")
    if math.isinf(rate) or num_prompts <= 1:
        return [0.0] * num_prompts
    gaps = np.random.default_rng([seed, _ARRIVAL_STREAM]).exponential(1.0 / rate, num_prompts - 1)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


def build_workload(num_prompts: int, seed: int, workload: ServeWorkload, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths): :func:`metrale.benchmarks.throughput.workload` with these lengths."""
    options = ThroughputOptions(num_requests=num_prompts, min_len=workload.min_len, max_len=workload.max_len, seed=seed)
    return throughput_workload(options, vocab_size)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated linearly between the closest ranks."""
    import numpy as np

    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean and :data:`PERCENTILES` of ``seconds``, in milliseconds; None for each when empty."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not seconds:
        return dict.fromkeys(keys)
    ms = [1e3 * s for s in seconds]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def _clip(text: str, limit: int = REASON_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact_url(url: str) -> str:
    """``url`` without user information (``user:key@``), query or fragment."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _api_root(base_url: str) -> str:
    """The server's root URL: a missing scheme is ``http://``, a trailing ``/v1`` is dropped."""
    url = base_url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"the server URL must be http(s)://HOST[:PORT], got {redact_url(base_url)!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def summarize_rate(rate: float, records: list[RequestRecord], duration: float, max_in_flight: int) -> dict[str, Any]:
    """The report of one rate's run (see the module docstring)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output_tokens = sum(r.completion_tokens or 0 for r in done)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    chunks = sum(len(r.chunk_times) for r in done)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return {
        "rate": _rate_json(rate),
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration,
        "max_in_flight": max_in_flight,
        "request_throughput": per_second(len(done)),
        "output_token_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(prompt_tokens + output_tokens),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "content_chunks": chunks,
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "requests_without_usage": sum(not r.usage for r in done),
        "output_length_mismatches": sum(r.completion_tokens != r.max_tokens for r in done),
        "ttft_ms": summarize([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": summarize([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": summarize([gap for r in done for gap in r.itl]),
        "e2e_ms": summarize([r.e2e for r in done if r.e2e is not None]),
        "failure_reasons": dict(Counter(r.error or "unknown" for r in failed).most_common()),
    }


def _length_summary(lengths: Sequence[int]) -> dict[str, float]:
    return {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths), "total": sum(lengths)}


# -------------------------------------------------------------------------------- the client


def _request_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _read_event(line: str, record: RequestRecord, now: float) -> bool:
    """Take one line of the event stream into ``record``; True at ``data: [DONE]``."""
    if not line or line.startswith(":"):  # event separator, comment
        return False
    name, _, value = line.partition(":")
    if name != "data":
        if name in ("event", "id", "retry"):
            return False
        raise _StreamError(f"malformed SSE line {_clip(line, 80)!r}")
    value = value[1:] if value.startswith(" ") else value
    if value.strip() == "[DONE]":
        return True
    try:
        chunk = json.loads(value)
    except ValueError:
        raise _StreamError(f"malformed SSE data {_clip(value, 80)!r}") from None
    if not isinstance(chunk, dict):
        raise _StreamError(f"malformed SSE data {_clip(value, 80)!r}")
    if chunk.get("error"):
        raise _StreamError(f"server error in the stream: {_clip(json.dumps(chunk['error']))}")
    try:
        usage = chunk.get("usage")
        if usage:
            record.completion_tokens = int(usage["completion_tokens"])
            record.prompt_tokens = int(usage["prompt_tokens"]) if usage.get("prompt_tokens") is not None else None
            record.usage = True
        choices = chunk.get("choices") or []
        if choices:
            choice = choices[0]
            if choice.get("text"):
                record.chunk_times.append(now - record.sent)
            if choice.get("finish_reason"):
                record.finish_reason = str(choice["finish_reason"])
    except (TypeError, KeyError, ValueError, AttributeError, IndexError):
        raise _StreamError(f"malformed completion chunk {_clip(value, 80)!r}") from None
    return False


async def _stream(client: Any, body: bytes, record: RequestRecord) -> None:
    record.sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", content=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            raise _StreamError(f"HTTP {response.status_code}: {_clip(text)}" if text.strip() else f"HTTP {response.status_code}")
        end = None
        async for line in response.aiter_lines():
            now = time.perf_counter()
            if end is None and _read_event(line, record, now):
                end = now  # read on to the end of the body, so that the connection goes back to the pool
    if end is None:
        raise _StreamError("the stream ended before data: [DONE]")
    if not record.chunk_times:
        raise _StreamError("no text in the stream")
    record.e2e = end - record.sent
    if record.completion_tokens is None:
        record.completion_tokens = len(record.chunk_times)


async def send_request(client: Any, body: bytes, record: RequestRecord, timeout_s: float) -> RequestRecord:
    """Send one streamed completion and fill ``record``; every failure ends up in
    ``record.error``, never raised (cancellation excepted)."""
    try:
        await asyncio.wait_for(_stream(client, body, record), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
    except _StreamError as error:
        record.error = str(error)
    except Exception as error:  # connection errors, dropped connections, protocol errors
        record.error = f"{type(error).__name__}: {_clip(str(error))}" if str(error) else type(error).__name__
    record.ok = record.error is None
    return record


async def run_rate(client: Any, bodies: list[bytes], records: list[RequestRecord], rate: float, seed: int,
                   timeout_s: float, progress: bool = False) -> dict[str, Any]:
    """Send ``bodies`` at ``rate`` (Poisson arrivals) and summarize; on cancellation every request
    still open is cancelled and awaited before the cancellation goes on."""
    offsets = arrival_times(len(bodies), rate, seed)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(bodies), desc=f"rate {rate_label(rate)}", unit="req", leave=False)
    tasks: list[asyncio.Task] = []
    in_flight = max_in_flight = 0

    def finished(task: asyncio.Task) -> None:
        nonlocal in_flight
        in_flight -= 1
        if bar is not None and not task.cancelled():
            bar.update(1)

    start = time.perf_counter()
    try:
        for body, record, offset in zip(bodies, records, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_request(client, body, record, timeout_s))
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            task.add_done_callback(finished)
            tasks.append(task)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        open_tasks = [task for task in tasks if not task.done()]
        for task in open_tasks:
            task.cancel()
        if open_tasks:
            await asyncio.gather(*open_tasks, return_exceptions=True)
        if bar is not None:
            bar.close()
    return summarize_rate(rate, records, duration, max_in_flight)


async def _check_server(client: Any, url: str, model: str | None) -> tuple[str, dict[str, Any]]:
    """(model, its ``GET /v1/models`` entry or {}); raises before any timing when the server
    cannot be reached or rejects the key."""
    httpx = _httpx()
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as error:
        raise ServerUnreachableError(f"cannot reach the server at {url}: {type(error).__name__}: {error}") from None
    if response.status_code in (401, 403):
        raise ServerCheckError(f"{url} rejected the API key (HTTP {response.status_code}: {_clip(response.text)})")
    listed: list[dict[str, Any]] = []
    if response.status_code == 200:
        try:
            listed = [entry for entry in response.json().get("data", []) if isinstance(entry, dict) and "id" in entry]
        except (ValueError, AttributeError):
            listed = []
    if model is None:
        if not listed:
            raise ConfigError(f"give the model name: {url}/v1/models lists none (HTTP {response.status_code})")
        model = str(listed[0]["id"])
    entry = next((e for e in listed if e["id"] == model), {})
    if listed and not entry:
        logger.warning("%s lists the models %s, not %r", url, [e["id"] for e in listed], model)
    return model, entry


async def serve_benchmark(base_url: str, *, model: str | None = None, rates: Sequence[float] = (1.0, 4.0, 16.0, math.inf),
                          num_prompts: int = 256, seed: int = 0, api_key: str | None = None,
                          workload: ServeWorkload | None = None, timeout_s: float = 600.0, progress: bool = False,
                          probe: bool = True, transport: Any = None) -> dict[str, Any]:
    """The coroutine behind :func:`run_serve_benchmark` (same arguments), for callers that run
    an event loop already."""
    httpx = _httpx()
    workload = workload or ServeWorkload()
    rates = [float(rate) for rate in rates]
    if not rates or not all(rate > 0 for rate in rates):
        raise ConfigError(f"request rates must be positive, got {rates}")
    if num_prompts < 1:
        raise ConfigError(f"num_prompts must be positive, got {num_prompts}")
    if not 1 <= workload.min_len <= workload.max_len:
        raise ConfigError(f"need 1 <= min_len <= max_len, got {workload.min_len} and {workload.max_len}")
    if workload.vocab_size is not None and workload.vocab_size < 1:
        raise ConfigError(f"vocab_size must be positive, got {workload.vocab_size}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    root = _api_root(base_url)
    shown = redact_url(root)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    # Idle connections are dropped well before a server's keep-alive timeout (uvicorn's: 5 s), so
    # a request never goes out on a connection the server is closing.
    limits = httpx.Limits(max_connections=num_prompts + 1, max_keepalive_connections=num_prompts + 1, keepalive_expiry=1.0)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
    async with httpx.AsyncClient(base_url=root, headers=headers, limits=limits, timeout=timeout, transport=transport,
                                 trust_env=False) as client:
        model, entry = await _check_server(client, shown, model)
        vocab_size, vocab_from = workload.vocab_size, "argument"
        if vocab_size is None:
            listed = entry.get("vocab_size")
            vocab_size, vocab_from = (int(listed), "server") if isinstance(listed, int) and listed > 0 else (
                DEFAULT_VOCAB_SIZE, "default")
        prompts, lengths = build_workload(num_prompts, seed, workload, vocab_size)
        max_model_len = entry.get("max_model_len")
        if isinstance(max_model_len, int):
            too_long = sum(len(p) + n > max_model_len for p, n in zip(prompts, lengths))
            if too_long:
                raise ConfigError(f"{too_long} of the {num_prompts} requests need more than the {max_model_len} tokens of "
                                  f"{model!r} on {shown} (prompt + output up to {2 * workload.max_len}); lower max_len")
        bodies = [_request_body(model, prompt, n) for prompt, n in zip(prompts, lengths)]
        if probe:
            check = await send_request(client, _request_body(model, prompts[0], PROBE_TOKENS),
                                       RequestRecord(-1, len(prompts[0]), PROBE_TOKENS), timeout_s)
            if not check.ok:
                raise ServerCheckError(f"the test completion of model {model!r} at {shown}/v1/completions failed: {check.error}")
        result: dict[str, Any] = {
            "benchmark": "serve",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": {
                "base_url": shown, "model": model, "rates": [_rate_json(rate) for rate in rates],
                "num_prompts": num_prompts, "seed": seed, "timeout_s": timeout_s,
                "workload": {"min_len": workload.min_len, "max_len": workload.max_len, "vocab_size": vocab_size,
                             "vocab_size_from": vocab_from},
                "lengths": {"prompt": _length_summary([len(p) for p in prompts]), "output": _length_summary(lengths)},
                "request": {"temperature": 0, "ignore_eos": True, "stream": True, "include_usage": True},
            },
            "runs": [],
        }
        for rate in rates:
            records = [RequestRecord(i, len(p), n) for i, (p, n) in enumerate(zip(prompts, lengths))]
            result["runs"].append(await run_rate(client, bodies, records, rate, seed, timeout_s, progress))
    return result


def run_serve_benchmark(base_url: str, *, model: str | None = None, rates: Sequence[float] = (1.0, 4.0, 16.0, math.inf),
                        num_prompts: int = 256, seed: int = 0, api_key: str | None = None,
                        workload: ServeWorkload | None = None, timeout_s: float = 600.0, progress: bool = True,
                        probe: bool = True, transport: Any = None) -> dict[str, Any]:
    """Benchmark the OpenAI-compatible server at ``base_url`` at each of ``rates``.

    Args:
        base_url: the server's root (``http://HOST:PORT``; a trailing ``/v1`` is accepted).
        model: the model name sent with each request; None takes the first one the server lists.
        rates: requests per second, one run each; ``math.inf`` sends every request at once.
        num_prompts: requests per rate.
        seed: fixes the workload and the arrival times.
        api_key: sent as ``Authorization: Bearer``; never written to the result.
        workload: prompt and output lengths and the vocabulary size (:class:`ServeWorkload`).
        timeout_s: the limit of one request, from its send to its end.
        progress: show a progress bar per rate.
        probe: send the untimed test completion first.
        transport: an ``httpx`` async transport instead of the network (tests).

    Returns:
        A JSON-serialisable dict: ``config`` (the arguments, the resolved model and vocabulary
        size, the lengths' minimum, maximum, mean and total) and ``runs``, one summary per rate.

    Raises:
        ServerUnreachableError: the server did not answer ``GET /v1/models``.
        ServerCheckError: it rejected the API key or the test completion failed.
        ConfigError: a bad argument, or requests longer than the server's ``max_model_len``.
    """
    return asyncio.run(serve_benchmark(base_url, model=model, rates=rates, num_prompts=num_prompts, seed=seed,
                                       api_key=api_key, workload=workload, timeout_s=timeout_s, progress=progress,
                                       probe=probe, transport=transport))


# -------------------------------------------------------------------------------- reporting


def write_report(result: dict[str, Any], path: str | Path) -> Path:
    """Write ``result`` as strict JSON (no NaN or infinity) to ``path``; returns the path."""
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table, one row per rate (latencies in milliseconds), followed by
    the reasons of any failures."""
    config = result["config"]
    prompt, output = config["lengths"]["prompt"], config["lengths"]["output"]
    lines = [
        f"{config['model']} at {config['base_url']}: {config['num_prompts']} requests per rate, prompt lengths "
        f"{prompt['min']}-{prompt['max']}, output lengths {output['min']}-{output['max']}, seed {config['seed']}",
        "",
    ]
    columns = ["rate (req/s)", "completed", "failed", "duration s", "req/s", "output tok/s", "total tok/s",
               "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99"]
    lines += ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for run in result["runs"]:
        cells = [rate_label(run["rate"]), str(run["completed"]), str(run["failed"]), f"{run['duration_s']:.2f}",
                 f"{run['request_throughput']:.2f}", f"{run['output_token_throughput']:.1f}",
                 f"{run['total_token_throughput']:.1f}"]
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            cells += [_ms(run[metric]["p50"]), _ms(run[metric]["p99"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Latencies in ms; ITL is per content chunk"]
    chunked = [run["tokens_per_chunk"] for run in result["runs"] if run["tokens_per_chunk"]]
    if chunked:
        spread = f"{min(chunked):.2f}" + (f"-{max(chunked):.2f}" if f"{min(chunked):.2f}" != f"{max(chunked):.2f}" else "")
        lines[-1] += f" ({spread} tokens per chunk)"
    lines[-1] += "."
    for run in result["runs"]:
        for reason, count in run["failure_reasons"].items():
            lines.append(f"failed at rate {rate_label(run['rate'])}: {count} x {reason}")
    return "\n".join(lines)


def plot_serve(result: dict[str, Any], out_dir: str | Path) -> Path:
    """Draw TTFT and TPOT (p50 and p99) and the token throughputs against the request rate into
    ``out_dir/serve.png`` (matplotlib, the ``plots`` extra); returns the file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    labels = [rate_label(run["rate"]) for run in runs]
    x = list(range(len(runs)))

    def series(metric: str, key: str) -> list[float]:
        return [math.nan if run[metric][key] is None else run[metric][key] for run in runs]

    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    for metric, name, colour in (("ttft_ms", "TTFT", "tab:blue"), ("tpot_ms", "TPOT", "tab:orange")):
        latency.plot(x, series(metric, "p50"), marker="o", color=colour, label=f"{name} p50")
        latency.plot(x, series(metric, "p99"), marker="s", linestyle="--", color=colour, label=f"{name} p99")
    if all(value > 0 for metric in ("ttft_ms", "tpot_ms") for value in series(metric, "p50") if not math.isnan(value)):
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        latency.set_yscale("log")
        # Labels at 1, 2 and 5 times each power of ten; the other minor ticks stay unlabelled.
        latency.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        latency.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        latency.yaxis.set_minor_formatter(NullFormatter())
    latency.set_ylabel("ms")
    latency.set_title("latency")
    throughput.plot(x, [run["output_token_throughput"] for run in runs], marker="o", label="output tok/s")
    throughput.plot(x, [run["total_token_throughput"] for run in runs], marker="s", label="prompt + output tok/s")
    throughput.set_ylabel("tokens/s")
    throughput.set_ylim(bottom=0)
    throughput.set_title("throughput")
    for axes in (latency, throughput):
        axes.set_xticks(x, labels)
        axes.set_xlabel("request rate (req/s)")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    config = result["config"]
    figure.suptitle(f"{config['model']}: {config['num_prompts']} requests per rate")
    figure.tight_layout()
    path = out_dir / "serve.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# ------------------------------------------------------------------------------------ CLI


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--serve URL`` and its options to ``parser`` (``metrale bench``), in their own group;
    an option the parser already has is left as it is."""
    group = parser.add_argument_group("serving benchmark (--serve URL)")
    taken = set(parser._option_string_actions)

    def add(flag: str, **kwargs: Any) -> None:
        if flag not in taken:
            group.add_argument(flag, **kwargs)

    add("--serve", metavar="URL", default=None,
        help="benchmark the OpenAI-compatible server at URL (http://HOST:PORT) instead: streamed completions at "
        "each --request-rates, timing TTFT, TPOT, ITL and end-to-end latency; needs no GPU")
    add("--request-rates", default=DEFAULT_RATES, metavar="RATES",
        help=f"comma-separated requests per second, inf for all at once (default: {DEFAULT_RATES})")
    add("--num-prompts", type=int, default=256, help="requests per rate (default: 256)")
    add("--model", default=None, help="model name sent to the server (default: the first one it lists)")
    add("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY when set)")
    add("--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)")
    add("--min-len", type=int, default=100, help="shortest prompt and output, in tokens (default: 100)")
    add("--max-len", type=int, default=1024, help="longest prompt and output, in tokens (default: 1024)")
    add("--vocab-size", type=int, default=None,
        help=f"token ids are drawn below this (default: the server's, else {DEFAULT_VOCAB_SIZE})")
    add("--request-timeout", type=float, default=600.0, metavar="SECONDS",
        help="a request running longer fails (default: 600)")
    add("--plot-dir", default=None, metavar="DIR", help="also draw DIR/serve.png (needs matplotlib)")
    add("--no-progress", action="store_true", help="hide progress bars")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark that :func:`add_serve_arguments` describes; prints the table. Returns 0,
    or 1 when a request failed (the report is written either way)."""
    if not args.serve:
        raise ConfigError("give the server's URL with --serve URL")
    rates = parse_rates(args.request_rates)
    if args.plot_dir and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot-dir needs matplotlib: python3 -m pip install 'metrale[plots]'")
    workload = ServeWorkload(min_len=args.min_len, max_len=args.max_len, vocab_size=args.vocab_size)
    result = run_serve_benchmark(
        args.serve, model=args.model, rates=rates, num_prompts=args.num_prompts, seed=args.seed,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), workload=workload, timeout_s=args.request_timeout,
        progress=not args.no_progress,
    )
    print(format_table(result))
    print(f"results: {write_report(result, args.output)}")
    if args.plot_dir:
        print(f"plot: {plot_serve(result, args.plot_dir)}")
    return 1 if any(run["failed"] for run in result["runs"]) else 0
