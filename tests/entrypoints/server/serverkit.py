"""Helpers of the server tests (imported by them; not a conftest, whose module name the suite's
root ``tests/conftest.py`` already takes): an engine on the embedded tiny-dense model (in an
engine process, as ``metrale serve`` runs it, or on a thread of this process) served by the
uvicorn server ``metrale serve`` runs (:func:`metrale.entrypoints.server.main.build_server`) in a background
thread (its own event loop) on a free port of 127.0.0.1, and clients."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any, Sequence

import httpx
import openai

from metrale import LLM
from metrale.entrypoints.async_llm import AsyncLLM
from metrale.entrypoints.engine_process import EngineProcess
from metrale.entrypoints.server import build_app
from metrale.entrypoints.server.main import build_server, listen_sockets

MODEL = "tiny-dense"
API_KEY = "test-key-4f9c2a"


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a background thread, as
    ``metrale serve`` runs it (``server_options``: :func:`build_server`'s timeouts)."""

    def __init__(self, app: Any, drain_timeout: float = 2.0, **server_options: Any) -> None:
        self.app = app
        self.server = build_server(app, log_level="warning", drain_timeout=drain_timeout, **server_options)
        self.sockets = listen_sockets("127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": self.sockets}, name="test-uvicorn",
                                       daemon=True)
        self.port = 0

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the test server did not stop"
        for sock in self.sockets:
            sock.close()


def new_llm(**options: Any) -> LLM:
    return LLM(MODEL, device="cpu", show_progress=False, **{"max_num_seqs": 64, **options})


def http_client(url: str, **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=url, trust_env=False, timeout=kwargs.pop("timeout", 60), **kwargs)


def async_http_client(url: str, **kwargs: Any) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=url, trust_env=False, timeout=kwargs.pop("timeout", 120), limits=limits, **kwargs)


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


def new_engine(in_process: bool, max_waiting_requests: int = 1024, lora_modules: Sequence[Any] = (),
               **options: Any) -> AsyncLLM | EngineProcess:
    """The engine ``metrale serve`` runs (an :class:`EngineProcess`), or with ``in_process`` an
    :class:`AsyncLLM` on a thread of this process; ``lora_modules`` (with ``enable_lora=True``) are
    read before it serves, as ``metrale serve --lora-modules`` reads them."""
    if in_process:
        llm = new_llm(**options)
        for lora in lora_modules:
            llm.add_lora(lora)
        return AsyncLLM(llm, max_waiting_requests=max_waiting_requests)
    return EngineProcess(MODEL, device="cpu", show_progress=False, max_waiting_requests=max_waiting_requests,
                         lora_modules=lora_modules, **{"max_num_seqs": 64, **options})


def engine_stopped(engine: AsyncLLM | EngineProcess) -> bool:
    """Whether ``engine``'s engine has stopped and freed the model."""
    if isinstance(engine, EngineProcess):
        return engine._process.poll() is not None
    return not engine._thread.is_alive() and engine.llm.closed


class Stack:
    """An engine (``engine_options`` for its LLM, ``max_waiting_requests``; an engine process
    unless ``in_process``), its app (``app_options`` for :func:`build_app`) and uvicorn serving
    it (``server_options`` for :func:`build_server`), with an httpx client (``http``) and an
    openai client (``client``); ``lora_modules`` go to the engine and the app. ``close()`` stops
    all of it."""

    def __init__(self, *, max_waiting_requests: int = 1024, engine_options: dict | None = None,
                 drain_timeout: float = 2.0, in_process: bool = False, server_options: dict | None = None,
                 lora_modules: Sequence[Any] = (), **app_options: Any) -> None:
        self.engine = new_engine(in_process, max_waiting_requests, lora_modules, **(engine_options or {}))
        try:
            self.app = build_app(self.engine, model_name=MODEL, lora_modules=lora_modules, **app_options)
            self.thread = ServerThread(self.app, drain_timeout=drain_timeout, **(server_options or {})).start()
        except BaseException:
            self.engine.shutdown()
            raise
        self.url = self.thread.url
        self.http = http_client(self.url)
        self.client = openai_client(self.url)

    def close(self) -> None:
        self.http.close()
        self.client.close()
        try:
            self.thread.stop()
        finally:
            self.engine.shutdown()


_SAMPLE = re.compile(r"^(metrale_[a-z_]+) ([-+0-9.eE]+|NaN|[+-]Inf)$")


def metric_values(http: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of ``/metrics``."""
    response = http.get("/metrics")
    assert response.status_code == 200
    values = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


IDLE_METRICS = ("metrale_kv_cache_blocks_used", "metrale_state_slots_used", "metrale_requests_running",
                "metrale_requests_waiting", "metrale_requests_active")


def wait_idle(http: httpx.Client, timeout: float = 5.0) -> dict[str, float]:
    """Poll ``/metrics`` until nothing is allocated or running, for up to ``timeout`` seconds;
    returns the last values (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(http)
        if all(values.get(name) == 0 for name in IDLE_METRICS) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def idle_report(values: dict[str, float]) -> dict[str, float | None]:
    return {name: values.get(name) for name in IDLE_METRICS}


async def read_stream(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> dict:
    """Stream one completion; with ``stop_after``, close the response after that many events
    (0: once its headers arrived, before the first event)."""
    text, events, finish, usage, done = "", 0, None, None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        if stop_after == 0:
            return {"text": text, "finish_reason": finish, "usage": usage, "done": done, "events": events}
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            events += 1
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
            if stop_after is not None and events >= stop_after:
                break  # leaving the block closes the connection: the client is gone
    return {"text": text, "finish_reason": finish, "usage": usage, "done": done, "events": events}
