"""A randomized soak of ``metrale serve``: many clients at once, doing what clients do, for a
bounded time, with the engine process killed once part way.

The server runs as ``metrale serve`` does (a subprocess with its engine process), with two LoRA
adapters (random, PEFT's format), n-gram speculation and a small KV cache (so requests are
preempted). ``--concurrency`` clients each pick at random, again and again until ``--seconds``
have passed: a completion or a chat (streamed or not, greedy or seeded, on the base model or an
adapter, sometimes under a structured output), a stream dropped after a few events, a request
given up by its client part way, a bad request, a grammar that crashes llguidance, a schema
that admits no output, a look at ``/health`` and ``/metrics``. At ``--kill-at`` of the run the
engine process is killed; the server starts it again.

It checks that: no request stalls (each must be answered within ``--request-timeout``); the
server process never dies; every bad request gets its 4xx; requests fail only while the engine
process is down (between the kill and the restart); afterwards ``/metrics`` shows nothing
running, waiting or allocated, and the server shuts down cleanly on SIGINT; and every request
that finished (greedy or seeded) equals its solo run through :class:`metrale.LLM` with the same
options (on the CPU; a GPU's outputs depend on the batch, so there the share that matches is
reported). Prints a summary, writes the details to ``--output`` (JSON) and exits 1 when a
check failed. Run from the repository root::

    python3 tools/soak.py [--model tiny-dense] [--device cpu] [--seconds 180] [--concurrency 16]
                          [--kill-at 0.4] [--seed 0] [--output soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "sweeps"))  # lora_bench.py writes the adapters

from lora_bench import write_adapter  # noqa: E402

WORDS = ("the list of items is sorted by the number of times each one was seen in the file and then written back to "
         "the disk before the program returns a value").split()
ADAPTERS = ("sql", "poem")
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3}
ENGINE = {"max_num_seqs": 8, "num_blocks": 16, "block_size": 8, "max_num_batched_tokens": 64}
#: Engine counters the soak must see move (summed over the engine processes it ran on).
COUNTERS = ("metrale_preemptions_total", "metrale_spec_decode_verify_steps_total", "metrale_prefix_cache_hits_total")
IDLE_METRICS = ("metrale_kv_cache_blocks_used", "metrale_state_slots_used", "metrale_requests_running",
                "metrale_requests_waiting", "metrale_requests_active")
CRASHING_GRAMMAR = "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(3000)] + ['r3000: "b"'])


@dataclass
class Outcome:
    """One client action and what came of it."""

    action: str
    started: float
    ended: float = 0.0
    status: int | None = None
    #: What the request asked for, to run it alone afterwards (requests that finished only).
    replay: dict | None = None
    text: str | None = None
    error: str | None = None
    stalled: bool = False
    checks: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, device: str, port: int, adapters: dict[str, Path], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-c", "import sys; from metrale.entrypoints.cli import main; sys.exit(main())", "serve", model,
               "--device", device, "--port", str(port), "--log-level", "warning", "--no-progress",
               "--speculative-config", json.dumps(SPECULATION), "--max-engine-restarts", "1",
               "--lora-modules", *[f"{name}={path}" for name, path in adapters.items()]]
    for name, value in ENGINE.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def engine_process_pid(server: int) -> int | None:
    """The pid of ``server``'s engine process (its child running the engine)."""
    for task in Path(f"/proc/{server}/task").glob("*"):
        for child in (task / "children").read_text().split():
            try:
                if b"_engine_process_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
            except OSError:
                continue
    return None


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("metrale_") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values


class Soak:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.rng = random.Random(args.seed)
        self.deadline = time.monotonic() + args.seconds
        self.outcomes: list[Outcome] = []
        self.kill_window: list[float] = []  # [killed at, serving again at]
        self.before_kill: dict[str, float] = {}

    def body(self, rng: random.Random, chat: bool) -> dict:
        sampled = rng.random() < 0.3
        body: dict[str, Any] = {"model": rng.choice([self.args.model, self.args.model, *ADAPTERS]),
                                "max_tokens": rng.randrange(1, 24), "temperature": 0.8 if sampled else 0.0,
                                "ignore_eos": True}
        if sampled:
            # Drawn among the top 20 tokens: a draw in the far tail, where tokens of probability
            # 1e-6 sit side by side, picks another one for logits that differ in their last bits
            # (another batch's rounding), which would say nothing of isolation.
            body["seed"], body["top_k"] = rng.randrange(10_000), 20
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 24)))
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if rng.random() < 0.15:
            body["guided_choice"] = ["merge sort", "quick sort", "heap"]
            body.pop("ignore_eos")
        return body

    async def client(self, http: Any, worker: int) -> None:
        rng = random.Random(self.rng.randrange(2**32) + worker)
        actions = ["completion", "completion", "stream", "stream", "chat", "chat_stream", "drop_stream", "give_up",
                   "bad_request", "crashing_grammar", "empty_schema", "look"]
        while time.monotonic() < self.deadline:
            action = rng.choice(actions)
            outcome = Outcome(action, time.monotonic())
            try:
                await asyncio.wait_for(self.act(http, rng, action, outcome), self.args.request_timeout)
            except asyncio.TimeoutError:
                outcome.stalled = True
            except Exception as error:  # a connection the server dropped, say
                outcome.error = f"{type(error).__name__}: {error}"
            outcome.ended = time.monotonic()
            self.outcomes.append(outcome)

    async def act(self, http: Any, rng: random.Random, action: str, outcome: Outcome) -> None:
        if action in ("completion", "chat"):
            body = self.body(rng, chat=action == "chat")
            path = "/v1/chat/completions" if action == "chat" else "/v1/completions"
            answer = await http.post(path, json=body)
            outcome.status = answer.status_code
            if answer.status_code == 200:
                choice = answer.json()["choices"][0]
                outcome.text = choice["message"]["content"] if action == "chat" else choice["text"]
                outcome.replay = {"path": path, **body}
            else:
                outcome.error = answer.text[:300]
        elif action in ("stream", "chat_stream", "drop_stream"):
            chat = action == "chat_stream"
            body = {**self.body(rng, chat=chat), "stream": True}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            drop_after = rng.randrange(1, 6) if action == "drop_stream" else None
            text, done, events = "", False, 0
            async with http.stream("POST", path, json=body) as answer:
                outcome.status = answer.status_code
                async for line in answer.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.error = chunk["error"]["message"]
                        continue
                    events += 1
                    for choice in chunk["choices"]:
                        text += (choice.get("delta", {}).get("content") or "") if chat else choice["text"]
                    if drop_after is not None and events >= drop_after:
                        break
            if done and outcome.error is None and outcome.status == 200:
                outcome.text, outcome.replay = text, {"path": path, **{k: v for k, v in body.items() if k != "stream"}}
        elif action == "give_up":  # a non-streamed client that goes away part way
            body = {**self.body(rng, chat=False), "max_tokens": 64}
            try:
                await http.post("/v1/completions", json=body, timeout=rng.choice([0.01, 0.05, 0.2]))
            except Exception:
                pass
        elif action == "bad_request":
            body = rng.choice([{"model": self.args.model, "prompt": "x", "temperature": -1},
                               {"model": self.args.model, "prompt": "x", "max_tokens": 0},
                               {"model": "no-such-model", "prompt": "x"},
                               {"model": self.args.model, "messages": "not a list"},
                               {"model": self.args.model, "prompt": "x", "guided_regex": "("}])
            answer = await http.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
            outcome.status = answer.status_code
            if not 400 <= answer.status_code < 500 and answer.status_code != 503:
                outcome.checks.append(f"a bad request got {answer.status_code}")
        elif action in ("crashing_grammar", "empty_schema"):
            extra = ({"guided_grammar": CRASHING_GRAMMAR} if action == "crashing_grammar" else
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}})
            answer = await http.post("/v1/chat/completions", json={
                "model": self.args.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
            outcome.status = answer.status_code
            if answer.status_code not in (400, 503):
                outcome.checks.append(f"{action} got {answer.status_code}: {answer.text[:200]}")
        else:
            for path in ("/health", "/metrics"):
                answer = await http.get(path)
                outcome.status = answer.status_code

    async def killer(self, server: subprocess.Popen, http: Any) -> None:
        await asyncio.sleep(self.args.seconds * self.args.kill_at)
        pid = engine_process_pid(server.pid)
        if pid is None:
            return
        self.before_kill = metric_values((await http.get("/metrics")).text)
        os.kill(pid, signal.SIGKILL)
        self.kill_window = [time.monotonic()]
        while time.monotonic() < self.deadline + 120:
            await asyncio.sleep(0.05)
            if (await http.get("/health")).status_code == 200 and engine_process_pid(server.pid) not in (None, pid):
                self.kill_window.append(time.monotonic())
                return

    async def run(self, server: subprocess.Popen) -> dict[str, float]:
        import httpx

        limits = httpx.Limits(max_connections=4 * self.args.concurrency)
        async with httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=self.args.request_timeout,
                                     limits=limits) as http:
            killer = asyncio.create_task(self.killer(server, http))
            await asyncio.gather(*(self.client(http, worker) for worker in range(self.args.concurrency)))
            await killer
            values: dict[str, float] = {}
            for _ in range(200):
                values = metric_values((await http.get("/metrics")).text)
                if all(values.get(name) == 0 for name in IDLE_METRICS):
                    break
                await asyncio.sleep(0.05)
            return values


def in_kill_window(outcome: Outcome, window: list[float]) -> bool:
    if not window:
        return False
    end = window[1] if len(window) > 1 else float("inf")
    return outcome.ended >= window[0] and outcome.started <= end


def solo_texts(args: argparse.Namespace, adapters: dict[str, Path], outcomes: list[Outcome]) -> list[str | None]:
    """Each replayable outcome's text when its request runs alone."""
    from metrale import LLM, SamplingParams, StructuredOutputParams
    from metrale.loading.lora import LoRARequest

    requests = {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(adapters.items())}
    texts = []
    with LLM(args.model, device=args.device, show_progress=False, enable_lora=True, speculative_config=SPECULATION,
             **ENGINE) as llm:
        for outcome in outcomes:
            body = outcome.replay or {}
            structured = StructuredOutputParams(choice=body["guided_choice"]) if "guided_choice" in body else None
            params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"),
                                    top_k=body.get("top_k", 0), ignore_eos=body.get("ignore_eos", False),
                                    structured_output=structured)
            lora = requests.get(body["model"])
            prompt: Any = body.get("prompt")
            if body["path"] == "/v1/chat/completions":  # rendered as the server renders it
                text = llm.render_chat(body["messages"], add_generation_prompt=True)
                prompt = llm.tokenized_prompt(llm.encode(text, add_special_tokens=False), text)
            output = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
            texts.append(output.outputs[0].text)
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kill-at", type=float, default=0.4, help="when the engine process is killed (share of the run)")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    return report(args, soak(args))


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak of ``args`` (see the module docstring); what it found."""
    from metrale.models import embedded_model_path

    folder = embedded_model_path(args.model) or Path(args.model)
    config = json.loads((folder / "config.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="metrale-soak-"))
    adapters = {name: write_adapter(work / name, config, rank=8, seed=index) for index, name in enumerate(ADAPTERS)}
    port = free_port()
    server = start_server(args.model, args.device, port, adapters, work / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, server)
        except RuntimeError:
            print((work / "server.log").read_text()[-3000:], file=sys.stderr)
            raise
        runner = Soak(args, url)
        started = time.monotonic()
        idle = asyncio.run(runner.run(server))
        elapsed = time.monotonic() - started
        alive = server.poll() is None
        server.send_signal(signal.SIGINT)
        exit_code = server.wait(120)
    finally:
        if server.poll() is None:
            server.kill()
    outcomes = runner.outcomes
    replayable = [o for o in outcomes if o.replay is not None]
    solo = solo_texts(args, adapters, replayable)
    differ = [{"request": o.replay, "served": o.text, "alone": alone} for o, alone in zip(replayable, solo) if o.text != alone]
    failed_outside = [asdict(o) for o in outcomes
                      if (o.error is not None or (o.status is not None and o.status >= 500)) and o.action != "give_up"
                      and not in_kill_window(o, runner.kill_window)]
    return {
        "model": args.model, "device": args.device, "seconds": round(elapsed, 1), "concurrency": args.concurrency,
        "seed": args.seed, "engine_options": {**ENGINE, "speculative_config": SPECULATION, "lora_modules": list(ADAPTERS)},
        "actions": len(outcomes),
        "by_action": {a: sum(o.action == a for o in outcomes) for a in sorted({o.action for o in outcomes})},
        "finished_and_replayed": len(replayable), "equal_to_solo": len(replayable) - len(differ), "differ": differ[:20],
        "stalled": [asdict(o) for o in outcomes if o.stalled],
        "check_failures": [c for o in outcomes for c in o.checks],
        "failed_outside_the_kill": failed_outside[:20],
        "failed_in_the_kill": sum(1 for o in outcomes if in_kill_window(o, runner.kill_window) and
                                  (o.error is not None or (o.status or 0) >= 500)),
        "kill": {"engine_killed": bool(runner.kill_window),
                 "seconds_to_serve_again": round(runner.kill_window[1] - runner.kill_window[0], 2)
                 if len(runner.kill_window) == 2 else None},
        "server_alive_at_the_end": alive, "server_exit_code": exit_code,
        "idle_metrics": {name: idle.get(name) for name in IDLE_METRICS},
        "engine_counters": {name: idle.get(name, 0.0) + runner.before_kill.get(name, 0.0) for name in COUNTERS},
        "log": str(work / "server.log"),
    }


def wait_until_healthy(url: str, server: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}) before it served")
        try:
            if httpx.get(f"{url}/health", trust_env=False, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def problems(result: dict[str, Any], exact: bool) -> list[str]:
    """What the soak found wrong (``exact``: every finished request must equal its solo run)."""
    found = []
    if result["stalled"]:
        found.append(f"{len(result['stalled'])} requests stalled")
    if result["check_failures"]:
        found.append(f"{len(result['check_failures'])} wrong answers to bad requests")
    if result["failed_outside_the_kill"]:
        found.append(f"{len(result['failed_outside_the_kill'])} requests failed while the engine ran")
    if not result["kill"]["engine_killed"] or result["kill"]["seconds_to_serve_again"] is None:
        found.append("the engine process was not killed and served again")
    if not result["server_alive_at_the_end"] or result["server_exit_code"] != 0:
        found.append(f"the server died or did not stop cleanly (exit code {result['server_exit_code']})")
    quiet = [name for name in COUNTERS[:2] if not result["engine_counters"][name]]
    if quiet:
        found.append(f"the workload never moved {', '.join(quiet)}")
    if any(value != 0 for value in result["idle_metrics"].values()):
        found.append(f"not idle afterwards: {result['idle_metrics']}")
    if exact and result["equal_to_solo"] != result["finished_and_replayed"]:
        found.append(f"{result['finished_and_replayed'] - result['equal_to_solo']} finished requests differ from their solo run")
    return found


def report(args: argparse.Namespace, result: dict[str, Any]) -> int:
    found = problems(result, exact=args.device == "cpu")
    result["problems"] = found
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    print(f"soak of {result['model']} on {result['device']}: {result['actions']} actions in {result['seconds']} s by "
          f"{result['concurrency']} clients")
    print(f"  finished and replayed alone: {result['finished_and_replayed']}, equal: {result['equal_to_solo']}")
    print(f"  stalled: {len(result['stalled'])}; failed while the engine ran: {len(result['failed_outside_the_kill'])}; "
          f"failed around the kill: {result['failed_in_the_kill']}")
    print(f"  engine killed: {result['kill']['engine_killed']}, serving again after {result['kill']['seconds_to_serve_again']} s")
    print(f"  engine counters: {result['engine_counters']}")
    print(f"  afterwards: {result['idle_metrics']}; server exit code {result['server_exit_code']}")
    print("  OK" if not found else "  PROBLEMS: " + "; ".join(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
