"""``metrale serve MODEL``: the command-line front of the server, and :func:`serve`.

:func:`add_serve_arguments` adds the command's options to an :mod:`argparse` parser (the server's
own and every engine option :class:`~metrale.LLM` takes); :func:`run_serve` takes the listening
address first (:func:`listen_sockets`: a busy port fails at once, not after the model loaded),
then loads the model into an :class:`~metrale.entrypoints.engine_process.EngineProcess` (or, with
``--engine-in-process``, an :class:`~metrale.AsyncLLM`), logs what the engine runs with
(:func:`summary_lines`) and serves it until interrupted. uvicorn runs the app
(:func:`build_server`) with an HTTP protocol that adds the connection timeouts uvicorn lacks
(:func:`http_protocol_class`). This module imports neither FastAPI nor uvicorn at import time, so
the ``metrale`` command's parser works without the ``serve`` extra; :func:`run_serve` says how to
install it when it is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import math
import signal
import socket
import sys
import threading
from typing import Any, Iterator, Sequence

from metrale.config import KV_CACHE_DTYPES, environment_api_key, environment_api_key_is_empty
from metrale.errors import ConfigError

logger = logging.getLogger(__name__)

#: The environment variable holding the API key when ``--api-key`` is not given.
API_KEY_VARIABLE = "METRALE_API_KEY"

DEFAULT_HOST = "127.0.0.1"
#: Times ``metrale serve`` starts a stopped engine process again by default.
DEFAULT_MAX_ENGINE_RESTARTS = 3
DEFAULT_PORT = 8000
#: Seconds a connection may take to send a request head (from its opening, or from the head's
#: first byte on a kept-alive connection) before it is closed.
DEFAULT_HEADER_TIMEOUT = 10.0
#: Seconds an idle kept-alive connection stays open (uvicorn's ``timeout_keep_alive``).
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
#: Seconds a response may wait on a client that reads nothing before its connection is closed.
DEFAULT_STREAM_IDLE_TIMEOUT = 60.0
#: Connections the system queues for the server before it accepts them (uvicorn's default).
LISTEN_BACKLOG = 2048
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SERVE_INSTALL_HINT = 'pip install "metrale[serve]"'

#: Engine options with a value: flag -> :class:`~metrale.LLM` keyword.
_VALUE_OPTIONS = {
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "seed": "seed",
    "block_size": "block_size",
    "num_blocks": "num_blocks",
    "memory_bytes": "memory_bytes",
    "num_state_slots": "num_state_slots",
    "num_state_snapshots": "num_state_snapshots",
    "kv_cache_dtype": "kv_cache_dtype",
    "chat_template": "chat_template",
    "speculative_config": "speculative_config",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "tensor_parallel_size": "tensor_parallel_size",
    "distributed_executor_backend": "distributed_executor_backend",
    "quantization": "quantization",
    "revision": "revision",
    "download_dir": "download_dir",
    "tokenizer": "tokenizer",
    "tokenizer_revision": "tokenizer_revision",
}

#: Engine switches (``--no-...``): flag -> :class:`~metrale.LLM` keyword set to False.
_OFF_SWITCHES = {
    "no_prefix_caching": "enable_prefix_caching",
    "no_cuda_graphs": "cuda_graphs",
    "no_overlap_scheduling": "overlap_scheduling",
}

#: Engine switches that turn an option on: flag -> :class:`~metrale.LLM` keyword set to True.
_ON_SWITCHES = {
    "expert_parallel": "expert_parallel",
    "batch_invariant": "batch_invariant",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``metrale serve``'s arguments to ``parser`` (and return it)."""
    server = parser.add_argument_group("server")
    parser.add_argument("model", metavar="MODEL",
                        help="checkpoint folder, embedded model name (such as tiny-dense) or Hugging Face Hub id (ORG/NAME)")
    server.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default: {DEFAULT_PORT})")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_VARIABLE}, else none)")
    server.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients send and /v1/models lists (default: MODEL as given)")
    server.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                        help="requests accepted beyond the --max-num-seqs running ones; past them new requests get 503 "
                        "(default: 1024)")
    server.add_argument("--engine-in-process", action="store_true",
                        help="run the engine on a thread of the server's process instead of its own process (the HTTP "
                        "work then shares the interpreter lock with the engine's)")
    server.add_argument("--max-engine-restarts", type=int, default=DEFAULT_MAX_ENGINE_RESTARTS, metavar="N",
                        help="times an engine process that stops unexpectedly is started again (its unfinished requests "
                        "fail; /health answers 503 while the model loads again); past them the server stays down "
                        f"(default: {DEFAULT_MAX_ENGINE_RESTARTS})")
    server.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                        help="largest request body accepted; larger ones get 413 (default: 1048576)")
    server.add_argument("--max-n", type=int, default=None, metavar="N",
                        help="most completions per prompt a request may ask for with n (default: 16)")
    server.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                        help="most alternatives per token for logprobs, top_logprobs and prompt_logprobs (default: 20)")
    server.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                        help="seconds a shutdown waits for running requests before aborting them (default: 10)")
    server.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                        help="seconds a connection may take to send a request's head before it is closed "
                        f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    server.add_argument("--body-timeout", type=float, default=None, metavar="S",
                        help="seconds a request's body may take to arrive; a slower one gets 408 (default: 30)")
    server.add_argument("--stream-idle-timeout", type=float, default=DEFAULT_STREAM_IDLE_TIMEOUT, metavar="S",
                        help="seconds a response may wait on a client that reads nothing before its connection is "
                        f"closed and its requests aborted (default: {DEFAULT_STREAM_IDLE_TIMEOUT:g})")
    server.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE, metavar="S",
                        help=f"seconds an idle kept-alive connection stays open (default: {DEFAULT_TIMEOUT_KEEP_ALIVE:g})")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="read the tool calls of tool_choice='auto' replies with --tool-call-parser (without it "
                        "such replies are text)")
    server.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="the model's tool-call syntax: hermes, llama3_json, mistral, deepseek_v3, openai, or a "
                        "plugin's parser (metrale plugins lists them)")
    server.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="split replies into reasoning_content and content: deepseek_r1, qwen3, openai_gptoss, or a "
                        "plugin's parser")
    server.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and unload LoRA "
                        "adapters while the server runs (needs --enable-lora); any client with the API key can then "
                        "make the server read any folder it can (default: off, unless VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                        "is 1 or true)")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level (default: info)")
    server.add_argument("--no-progress", action="store_true", help="hide the progress bar while the model loads")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run (default: auto)")
    engine.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length in tokens (default: the checkpoint's)")
    engine.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="requests running at once (default: 16)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                        help="prompt tokens an engine step computes at most (default: 2048)")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="do not share the cache of equal prompt prefixes between requests")
    engine.add_argument("--seed", type=int, default=None, help="seed of the requests that give none (default: 0)")
    engine.add_argument("--no-cuda-graphs", action="store_true", help="do not replay decode steps from CUDA graphs")
    engine.add_argument("--no-overlap-scheduling", action="store_true",
                        help="plan each engine step only after the one before it is read back")
    engine.add_argument("--block-size", type=int, default=None, metavar="N", help="tokens per KV cache block (default: 16)")
    engine.add_argument("--num-blocks", type=int, default=None, metavar="N",
                        help="KV cache blocks (default: as many as --memory-bytes holds)")
    engine.add_argument("--memory-bytes", type=int, default=None, metavar="N",
                        help="bytes for the KV cache (default: 512 MiB on the CPU, 80%% of the free GPU memory)")
    engine.add_argument("--num-state-slots", type=int, default=None, metavar="N",
                        help="recurrent-state slots of models with recurrent layers (default: 8, at least --max-num-seqs)")
    engine.add_argument("--num-state-snapshots", type=int, default=None, metavar="N",
                        help="recurrent-state snapshots kept for prefix-cache hits (default: 16)")
    add_kv_cache_dtype_argument(engine)
    engine.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    engine.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template file replacing the checkpoint's")
    engine.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (--lora-modules turns it on too; without adapters, for those "
                        "loaded at run time: --allow-runtime-lora-updating)")
    engine.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) a request picks by its model field; turns LoRA on")
    engine.add_argument("--max-loras", type=int, default=None, metavar="N",
                        help="adapters on the device at once (default: 4)")
    engine.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                        help="the largest adapter rank served (default: 16)")
    add_parallel_arguments(engine)
    add_batch_invariant_argument(engine)
    add_model_source_arguments(engine)
    return parser


def add_batch_invariant_argument(group: Any) -> None:
    """The ``--batch-invariant`` flag (:class:`~metrale.config.EngineConfig`), shared with ``metrale generate``."""
    group.add_argument("--batch-invariant", action="store_true",
                       help="compute every row from its own inputs alone: a prompt's logits are bitwise the same "
                       "whatever else is in the batch and however its prefill is chunked (slower; on the GPU, bf16 weights "
                       "and caches, no MoE, MLA, Gated DeltaNet or LoRA layers)")


def add_kv_cache_dtype_argument(group: Any) -> None:
    """The ``--kv-cache-dtype`` flag (:class:`~metrale.config.CacheConfig`), shared with ``metrale generate``."""
    group.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                       help="how the cache stores keys, values and latents: auto, the model's dtype (float32 on the "
                       "CPU, bf16 on the GPU), or fp8 / fp8_e4m3, FP8 E4M3 with a scale per token and head, the "
                       "checkpoint's k_scale / v_scale where it has them (on the GPU not for MLA's latents; default: auto)")


def add_model_source_arguments(group: Any) -> None:
    """Where a Hugging Face Hub model comes from (:mod:`metrale.loading.hub`), and a tokenizer from
    elsewhere; shared with ``metrale generate``."""
    group.add_argument("--revision", default=None, metavar="REV",
                       help="branch, tag or commit of a Hub model (default: main)")
    group.add_argument("--download-dir", default=None, metavar="DIR",
                       help="the Hub cache to read and download into (default: HF_HUB_CACHE, else HF_HOME/hub)")
    group.add_argument("--tokenizer", default=None, metavar="MODEL",
                       help="take the tokenizer and chat template from this checkpoint folder, embedded model or Hub "
                       "id (default: the model's)")
    group.add_argument("--tokenizer-revision", default=None, metavar="REV",
                       help="branch, tag or commit of a Hub --tokenizer (default: main)")


def add_parallel_arguments(group: Any) -> None:
    """The tensor-parallel flags (:mod:`metrale.backends.executor`) and ``--quantization``, shared
    with ``metrale generate``."""
    group.add_argument("--quantization", "-q", default=None, choices=("fp8",),
                       help="quantize a full-precision checkpoint's linear layers at load: fp8 (E4M3 weights with "
                       "per-channel scales, inputs quantized per token); a quantized checkpoint is read as stored "
                       "without it (default: none)")
    group.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                       help="split the model over N ranks, a worker process each (default: 1)")
    group.add_argument("--expert-parallel", action="store_true",
                       help="spread an MoE model's routed experts over the ranks instead of splitting each expert")
    group.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                       help="how the ranks' workers start: mp, processes on this machine (default), or ray, Ray "
                       "actors on a Ray cluster (RAY_ADDRESS, else a local one)")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def lora_modules(args: argparse.Namespace) -> list[Any]:
    """The :class:`~metrale.loading.lora.LoRARequest` of each ``--lora-modules`` entry (ids from 1, in
    order); :class:`~metrale.errors.ConfigError` for a name given twice."""
    from metrale.loading.lora import LoRARequest

    entries = args.lora_modules or []
    names = [name for name, _ in entries]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--lora-modules names {name!r} twice")
    return [LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(entries)]


def _speculative_config(text: str) -> dict:
    from metrale.speculative import parse_config_argument

    try:
        return parse_config_argument(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is {error}") from None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~metrale.LLM` keywords the parsed ``args`` give (those left out keep their defaults)."""
    options: dict[str, Any] = {"device": args.device, "show_progress": not args.no_progress}
    for flag, keyword in _VALUE_OPTIONS.items():
        value = getattr(args, flag)
        if value is not None:
            options[keyword] = value
    for flag, keyword in _OFF_SWITCHES.items():
        if getattr(args, flag):
            options[keyword] = False
    for flag, keyword in _ON_SWITCHES.items():
        if getattr(args, flag):
            options[keyword] = True
    if args.lora_modules or args.enable_lora:
        options["enable_lora"] = True
    return options


def _require_serve_extra() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError as error:  # (the module itself, or one it needs: name both)
            missing.append(module if error.name in (None, module) else f"{module} (which needs {error.name})")
    if missing:
        raise ConfigError(f"metrale serve needs {', '.join(missing)}; install them with: {SERVE_INSTALL_HINT}")


def _check_server_options(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ConfigError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_engine_restarts < 0:
        raise ConfigError(f"--max-engine-restarts must be >= 0, got {args.max_engine_restarts}")
    for flag, value, minimum in (("--max-body-bytes", args.max_body_bytes, 1), ("--max-n", args.max_n, 1),
                                 ("--max-logprobs", args.max_logprobs, 0)):
        if value is not None and value < minimum:
            raise ConfigError(f"{flag} must be >= {minimum}, got {value}")
    if args.max_logprobs is not None and args.max_logprobs > 20:
        raise ConfigError(f"--max-logprobs must be <= 20, got {args.max_logprobs}")
    if args.drain_timeout is not None and not args.drain_timeout >= 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--stream-idle-timeout", args.stream_idle_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{flag} must be a number of seconds > 0, got {value}")
    if args.served_model_name is not None and not args.served_model_name:
        raise ConfigError("--served-model-name must not be empty")
    if args.served_model_name is not None and any(name == args.served_model_name for name, _ in args.lora_modules or []):
        raise ConfigError(f"--lora-modules names {args.served_model_name!r}, the base model's served name")
    if args.api_key is not None and not args.api_key:
        raise ConfigError(f"--api-key must not be empty (leave it out, and {API_KEY_VARIABLE} unset, for no key)")
    _check_parsers(args)


def _check_parsers(args: argparse.Namespace) -> None:
    """Refuse unknown parser names, and --enable-auto-tool-choice without a parser, before the
    model loads."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME to read the model's calls with")
    if args.tool_call_parser is None and args.reasoning_parser is None:
        return
    from metrale.entrypoints.parsers import get_reasoning_parser, get_tool_parser
    from metrale.model.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    if args.tool_call_parser is not None:
        get_tool_parser(args.tool_call_parser, manager)
    if args.reasoning_parser is not None:
        get_reasoning_parser(args.reasoning_parser, manager)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_key(flag: str | None, host: str) -> str | None:
    """The key ``metrale serve`` requires: ``--api-key`` (``flag``), else :envvar:`METRALE_API_KEY`,
    else None. The variable set but empty is refused with :class:`~metrale.errors.ConfigError` when
    ``host`` reaches beyond this machine (it looks like a key and means none), and warned about on
    a loopback ``host``; a key with spaces around it (which no request could match: the server
    strips the key requests send) is refused."""
    key = flag if flag is not None else environment_api_key()
    if key is None and environment_api_key_is_empty():
        if not _is_loopback(host):
            raise ConfigError(f"{API_KEY_VARIABLE} is set but empty, which means no API key, and --host {host} "
                              f"reaches beyond this machine: set a key in {API_KEY_VARIABLE} (or --api-key), or "
                              "unset it to serve without one")
        logger.warning("%s is set but empty: the server requires NO API key (anyone on this machine can use it); "
                       "set a key, or unset the variable to silence this warning", API_KEY_VARIABLE)
    if key is not None and key != key.strip():
        source = "--api-key" if flag is not None else API_KEY_VARIABLE
        raise ConfigError(f"the API key of {source} starts or ends with whitespace, which no request can send; "
                          "remove it")
    return key


# ------------------------------------------------------------------------------ listening


_LISTEN_HINTS = {
    errno.EADDRINUSE: "another process listens there; stop it or choose another --port",
    errno.EADDRNOTAVAIL: "no network interface of this machine has that address; check --host",
    errno.EACCES: "ports below 1024 need privileges; choose another --port",
}


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_sockets(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> list[socket.socket]:
    """Sockets bound to ``host:port`` and listening already, one per address ``host`` resolves to
    (``localhost`` may give 127.0.0.1 and ::1), all on the same port (the one the system picks
    when ``port`` is 0). Taking the port before the model loads makes a busy port fail at once,
    and leaves no moment for another process to take it; connections made meanwhile wait in the
    listen queue. Raises :class:`OSError` whose message names the address and the cause."""
    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(error.errno, f"cannot listen on {where}: {(error.strerror or str(error)).lower()}") from None
    addresses = list(dict.fromkeys((family, address) for family, _, _, _, address in infos))
    sockets: list[socket.socket] = []
    failure: OSError | None = None
    try:
        for family, address in addresses:
            if sockets:  # (port 0: every address on the port the first one got)
                port = sockets[0].getsockname()[1]
            try:
                sockets.append(_bind(family, (address[0], port, *address[2:]), backlog))
            except OSError as error:
                # An address of a family this machine has turned off (IPv6, say) is skipped, as
                # asyncio's own servers skip it, when another address remains.
                if error.errno != errno.EADDRNOTAVAIL or len(addresses) == 1:
                    raise
                failure = error
        if not sockets and failure is not None:
            raise failure
    except OSError as error:
        for sock in sockets:
            sock.close()
        cause = (error.strerror or str(error)).lower()
        hint = _LISTEN_HINTS.get(error.errno or 0)
        raise OSError(error.errno, f"cannot listen on {where}: {cause}" + (f" ({hint})" if hint else "")) from None
    return sockets


def _bind(family: int, address: tuple, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restarted server can take its port back while the last one's connections linger
        # in TIME_WAIT (a port another socket listens on stays refused).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin has a socket of its own
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


# ------------------------------------------------------------------------------ the server


def http_protocol_class(*, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT) -> type:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with the two timeouts it
    lacks, so that a slow or silent client holds nothing for long:

    * a request head must arrive within ``header_timeout`` seconds, counted from the opening of
      the connection, then from the first byte of each next head on a kept-alive one (the idle
      time between requests is uvicorn's ``timeout_keep_alive``); else the connection is closed;
    * a connection whose client reads nothing for ``stream_idle_timeout`` seconds while a
      response waits to be sent (the send buffer stays full) is aborted: the app sees a
      disconnect, and a stream's engine requests are aborted as for any client that went away.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class TimedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: Any = None
        _stall_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(header_timeout, self._close_slow_head)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a whole head arrived: its request runs
                self._cancel("_head_timer")
            elif self._head_timer is None and (cycle is None or cycle.response_complete):
                self._head_timer = self.loop.call_later(header_timeout, self._close_slow_head)  # the next head began

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(stream_idle_timeout, self._abort_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel("_stall_timer")

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel("_head_timer")
            self._cancel("_stall_timer")
            super().connection_lost(exc)

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _close_slow_head(self) -> None:
            self._head_timer = None
            logger.debug("closed the connection of %s: no request head within %g s", _client(self), header_timeout)
            self.transport.close()

        def _abort_stalled(self) -> None:
            self._stall_timer = None
            logger.info("the client at %s read nothing for %g s: its connection is closed and its requests aborted",
                        _client(self), stream_idle_timeout)
            self.transport.abort()

    return TimedHTTPProtocol


def _client(protocol: Any) -> str:
    client = getattr(protocol, "client", None)
    return _address(str(client[0]), int(client[1])) if client else "an unknown address"


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def build_server(app: Any, *, log_level: str = "info", drain_timeout: float | None = None,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT, timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
                 stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT) -> Any:
    """The uvicorn server :func:`serve` runs ``app`` (a :func:`~metrale.entrypoints.server.app.build_app`
    app) with; start it with ``server.run(sockets=listen_sockets(host, port))``. On SIGINT or
    SIGTERM it refuses new requests at once, waits ``drain_timeout`` seconds (default: the
    app's) for the running ones, and returns. ``header_timeout`` and ``stream_idle_timeout`` are
    :func:`http_protocol_class`'s; ``timeout_keep_alive`` is how long an idle kept-alive
    connection stays open."""
    import uvicorn
    from uvicorn.server import HANDLED_SIGNALS

    state = app.state.metrale
    protocol = http_protocol_class(header_timeout=_check_seconds("header_timeout", header_timeout),
                                   stream_idle_timeout=_check_seconds("stream_idle_timeout", stream_idle_timeout))

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, refusing new requests as soon as the shutdown starts, and returning
        after a signal (uvicorn raises the signal again once it has shut down, which would end
        the process with it instead of the exit status)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # (uvicorn says where it listens only for sockets it bound itself)
                for server in self.servers:
                    for sock in server.sockets:
                        host, port = sock.getsockname()[:2]
                        logger.info("listening on http://%s (press CTRL+C to quit)", _address(host, port))

        async def shutdown(self, sockets: Any = None) -> None:
            state.begin_drain()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    # (uvicorn declares its timeouts as ints; it passes them to the event loop, which takes floats.)
    graceful: Any = state.drain_timeout if drain_timeout is None else drain_timeout
    keep_alive: Any = _check_seconds("timeout_keep_alive", timeout_keep_alive)
    # ws="none": the app has no WebSocket route, and an upgraded connection would leave the
    # protocol whose timers guard it.
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", server_header=False, http=protocol, ws="none",
                            timeout_graceful_shutdown=graceful, timeout_keep_alive=keep_alive)
    return DrainingServer(config)


# ------------------------------------------------------------------------- start-up summary


def summary_lines(summary: dict[str, Any], served_name: str) -> list[str]:
    """The start-up summary :func:`serve` logs: ``summary`` is
    :func:`~metrale.entrypoints.engine_process.engine_summary`'s, ``served_name`` the name requests give."""
    blocks, block_size, max_model_len = summary["kv_cache_blocks"], summary["block_size"], summary["max_model_len"]
    blocks_per_sequence = math.ceil(max_model_len / block_size)
    limits = [f"the KV cache holds {blocks / blocks_per_sequence:.2f}x", f"max_num_seqs {summary['max_num_seqs']}"]
    concurrency = min(blocks // blocks_per_sequence, summary["max_num_seqs"])
    if summary["state_slots"] is not None:
        limits.append(f"{summary['state_slots']} recurrent-state slots")
        concurrency = min(concurrency, summary["state_slots"])
    graphs = "on" if summary["cuda_graphs"] else f"off ({summary['cuda_graphs_off_reason']})"
    lora = summary["lora"]
    lora_text = "off" if lora is None else (
        f"{len(lora['adapters'])} adapters ({', '.join(lora['adapters']) or 'none yet'}), "
        f"max_loras {lora['max_loras']}, max_lora_rank {lora['max_lora_rank']}")
    speculative = summary["speculative"]
    speculative_text = "off" if speculative is None else (
        f"{speculative['method']}, {speculative['num_speculative_tokens']} draft tokens per step")
    on_off = {True: "on", False: "off"}
    return [
        "engine ready:",
        f"  device: {summary['device']}, backend {summary['backend']}",
        f"  model: {summary['model']} (family {summary['family']}), served as {served_name!r}",
        f"  dtype: {summary['dtype']}",
        f"  max model len: {max_model_len} tokens",
        f"  KV cache: {blocks} blocks of {block_size} tokens ({blocks * block_size} tokens)",
        f"  max concurrency at {max_model_len} tokens per sequence: {concurrency} ({', '.join(limits)})",
        f"  max batched tokens: {summary['max_num_batched_tokens']} per step",
        f"  prefix caching: {on_off[summary['prefix_caching']]}",
        f"  CUDA graphs: {graphs}",
        f"  overlap scheduling: {on_off[summary['overlap_scheduling']]}",
        f"  LoRA: {lora_text}",
        f"  speculative decoding: {speculative_text}",
        f"  tensor parallel size: {summary['tensor_parallel_size']} (expert parallel {on_off[summary['expert_parallel']]})",
        f"  batch invariant: {on_off[summary.get('batch_invariant', False)]}",
    ]


def serve(engine: Any, *, model_name: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          log_level: str = "info", header_timeout: float = DEFAULT_HEADER_TIMEOUT,
          timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE, stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
          sockets: Sequence[socket.socket] | None = None, **app_options: Any) -> None:
    """Serve ``engine`` (an :class:`~metrale.entrypoints.engine_process.EngineProcess` or an
    :class:`~metrale.AsyncLLM`) with uvicorn at ``host:port`` (or on ``sockets``, listening
    already: :func:`listen_sockets`) until interrupted (SIGINT or SIGTERM), then shut down
    gracefully: new requests get 503, the running ones get up to ``drain_timeout`` seconds (an
    ``app_options`` keyword, as ``max_body_bytes``, ``body_timeout``, ``max_n``,
    ``max_logprobs`` and ``owns_engine``: see :func:`~metrale.entrypoints.server.app.build_app`), the rest
    are aborted and the engine is shut down. ``header_timeout``, ``timeout_keep_alive`` and
    ``stream_idle_timeout`` bound slow clients (:func:`build_server`). Logs the engine's
    start-up summary (:func:`summary_lines`) first. Raises :class:`OSError` when ``host:port``
    cannot be bound."""
    from metrale.entrypoints.server.app import build_app
    from metrale.entrypoints.server.state import engine_summary_of

    listening = listen_sockets(host, port) if sockets is None else list(sockets)
    try:
        app = build_app(engine, model_name=model_name, api_key=api_key, **app_options)
        server = build_server(app, log_level=log_level, header_timeout=header_timeout,
                              timeout_keep_alive=timeout_keep_alive, stream_idle_timeout=stream_idle_timeout)
        for line in summary_lines(engine_summary_of(engine), model_name):
            logger.info("%s", line)
        server.run(sockets=listening)
    finally:
        if sockets is None:  # (the caller's own sockets stay theirs to close)
            for sock in listening:
                sock.close()


def run_serve(args: argparse.Namespace) -> int:
    """Run ``metrale serve`` with the parsed ``args`` (:func:`add_serve_arguments`); returns the
    exit status (0 after a clean shutdown, 1 when the server could not start: its address cannot
    be bound, checked before the model loads). Bad options raise
    :class:`~metrale.errors.ConfigError`."""
    _check_server_options(args)
    _require_serve_extra()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    api_key = resolve_api_key(args.api_key, args.host)
    if api_key is None and not _is_loopback(args.host):
        logger.warning("listening on %s without an API key: anyone who reaches it can use the model "
                       "(set --api-key or %s)", args.host, API_KEY_VARIABLE)
    adapters = lora_modules(args)
    try:
        sockets = listen_sockets(args.host, args.port)
    except OSError as error:
        print(f"metrale: error: {error.strerror or error}", file=sys.stderr)
        return 1
    try:
        engine = _start_engine(args, adapters)
        try:
            serve(engine, model_name=args.served_model_name or args.model, log_level=args.log_level, api_key=api_key,
                  header_timeout=args.header_timeout, timeout_keep_alive=args.timeout_keep_alive,
                  stream_idle_timeout=args.stream_idle_timeout, sockets=sockets, lora_modules=adapters,
                  **_app_options(args))
        except SystemExit as exit:  # uvicorn exits when its start fails (it logs why)
            return 1 if exit.code else 0
        finally:
            engine.shutdown()
    finally:
        for sock in sockets:
            sock.close()
    return 0


def _start_engine(args: argparse.Namespace, adapters: list[Any]) -> Any:
    """The loaded engine ``args`` ask for, its adapters read and its CUDA graphs recorded."""
    from metrale.entrypoints.async_llm import DEFAULT_MAX_WAITING_REQUESTS

    waiting = args.max_waiting_requests if args.max_waiting_requests is not None else DEFAULT_MAX_WAITING_REQUESTS
    if args.engine_in_process:
        from metrale.entrypoints.async_llm import AsyncLLM
        from metrale.entrypoints.llm import LLM

        llm = LLM(args.model, **engine_options(args))
        try:
            for lora in adapters:
                llm.add_lora(lora)
            llm.capture_graphs()
        except BaseException:
            llm.close()
            raise
        return AsyncLLM(llm, max_waiting_requests=waiting)
    from metrale.entrypoints.engine_process import EngineProcess

    # Every decode and mixed step's CUDA graph is recorded before the first request (a no-op on
    # the CPU), so no request waits for a recording.
    return EngineProcess(args.model, max_waiting_requests=waiting, capture_graphs=True, lora_modules=adapters,
                         max_restarts=args.max_engine_restarts, **engine_options(args))


def _app_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`~metrale.entrypoints.server.app.build_app` keywords the parsed ``args`` give (those left out
    keep their defaults)."""
    options: dict[str, Any] = {}
    for name in ("max_body_bytes", "body_timeout", "max_n", "max_logprobs", "drain_timeout", "tool_call_parser",
                 "reasoning_parser"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.enable_auto_tool_choice:
        options["enable_auto_tool_choice"] = True
    if args.allow_runtime_lora_updating:  # (left out: build_app reads VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        options["allow_runtime_lora_updating"] = True
    return options
