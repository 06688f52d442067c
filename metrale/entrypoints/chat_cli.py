"""``metrale chat``: an interactive conversation with a model, loaded here or served at a URL.

Each line read is a user turn; the reply streams as it is generated, and the conversation so far
(with ``--system`` first) is what the next turn is answered from. ``/reset`` forgets the
conversation, ``/exit`` (or ``/quit``, or the end of the input) ends it. With ``--url`` the turns
go to a running OpenAI-compatible server's ``/v1/chat/completions`` (``metrale serve`` or any
other), streamed; otherwise the model (``--model``: a folder, an embedded model or a Hub id) is
loaded in this process and its chat template renders the conversation.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Iterator, TextIO

from metrale.errors import ConfigError, MetraleError
from metrale.models import DEFAULT_MODEL

#: Lines that are commands, not user turns.
EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``metrale chat``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", default=None,
                       help=f"checkpoint folder, embedded model name or Hub id to load here (default: {DEFAULT_MODEL})")
    where.add_argument("--url", default=None, metavar="URL",
                       help="a running OpenAI-compatible server to chat with instead, e.g. http://localhost:8000")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name sent to --url (default: the first model the server lists)")
    parser.add_argument("--api-key", default=None, help="the server's API key (default: $OPENAI_API_KEY, if set)")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per reply at most (default: 512)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy (default: 0.7)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus probability mass (default: 0.95)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where a model loaded here runs (default: auto)")


class Conversation:
    """The messages so far: the system message (if any), then alternating user and assistant."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> list[dict[str, str]]:
        self.messages.append({"role": "user", "content": text})
        return list(self.messages)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def forget_last_turn(self) -> None:
        """Drop the user turn whose reply failed, so the next one is answered without it."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """The conversation loop of ``metrale chat`` (see the module docstring). Exit status 0 at
    the end of the input or ``/exit``; a failed reply is reported on stderr and the conversation
    goes on."""
    stdin = stdin if stdin is not None else sys.stdin
    stdout = stdout if stdout is not None else sys.stdout
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    interactive = stdin.isatty()
    conversation = Conversation(args.system)
    with _replier(args) as reply:
        while True:
            if interactive:
                print("> ", end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if text.strip() in EXIT_COMMANDS:
                break
            if text.strip() == RESET_COMMAND:
                conversation.reset()
                continue
            if not text.strip():
                continue
            messages = conversation.ask(text)
            pieces: list[str] = []
            try:
                for piece in reply(messages):
                    pieces.append(piece)
                    print(piece, end="", file=stdout, flush=True)
            except MetraleError as error:
                print(file=stdout, flush=True)
                print(f"metrale: error: {error}", file=sys.stderr)
                conversation.forget_last_turn()
                continue
            print(file=stdout, flush=True)
            conversation.answered("".join(pieces))
    return 0


class _Closing:
    """A reply function with the resource it needs closed after the conversation."""

    def __init__(self, reply: Callable[[list[dict[str, str]]], Iterator[str]], close: Callable[[], None]) -> None:
        self._reply, self._close = reply, close

    def __enter__(self) -> Callable[[list[dict[str, str]]], Iterator[str]]:
        return self._reply

    def __exit__(self, *exc: Any) -> None:
        self._close()


def _replier(args: argparse.Namespace) -> _Closing:
    if args.url:
        return _server_replier(args)
    return _local_replier(args)


def _local_replier(args: argparse.Namespace) -> _Closing:
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams

    llm = LLM(args.model or DEFAULT_MODEL, device=args.device, show_progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        text = llm.render_chat(messages, add_generation_prompt=True)
        prompt = llm.tokenized_prompt(llm.encode(text, add_special_tokens=False), text)
        printed = 0
        for output in llm.generate_stream([prompt], params):
            if output.finish_reason == "error":
                raise MetraleError(f"the reply failed: {output.error}")
            current = output.text or ""
            if len(current) > printed:
                yield current[printed:]
                printed = len(current)

    return _Closing(reply, llm.close)


def _server_replier(args: argparse.Namespace) -> _Closing:
    try:
        import httpx
    except ImportError:
        raise ConfigError("metrale chat --url needs httpx: pip install \"metrale[serve]\"") from None
    import os

    base = args.url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(30.0, read=None))
    try:
        model = args.served_model_name or _first_model(client)
    except BaseException:
        client.close()
        raise

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": args.max_tokens,
                "temperature": args.temperature, "top_p": args.top_p}
        try:
            with client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise MetraleError(f"the server answered {response.status_code}: {_error_text(response)}")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise MetraleError(f"the reply failed: {event['error'].get('message', event['error'])}")
                    for choice in event.get("choices", []):
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            yield piece
        except httpx.HTTPError as error:
            raise MetraleError(f"cannot reach {base}: {error}") from None

    return _Closing(reply, client.close)


def _first_model(client: Any) -> str:
    import httpx

    try:
        response = client.get("/models")
    except httpx.HTTPError as error:
        raise ConfigError(f"cannot reach {client.base_url}: {error}") from None
    if response.status_code != 200:
        raise ConfigError(f"{client.base_url}/models answered {response.status_code}: {_error_text(response)}")
    models = response.json().get("data") or []
    if not models:
        raise ConfigError(f"{client.base_url} serves no model; pass --served-model-name")
    return str(models[0]["id"])


def _error_text(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body)[:200]
