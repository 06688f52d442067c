"""``metrale serve MODEL``: the command-line front of the server, and :func:`serve`.

:func:`add_serve_arguments` adds the command's options to an :mod:`argparse` parser (the server's
own and every engine option :class:`~metrale.LLM` takes); :func:`run_serve` loads the model into
an :class:`~metrale.engine_process.EngineProcess` (or, with ``--engine-in-process``, an
:class:`~metrale.AsyncLLM`) and serves it until interrupted. This module imports neither
FastAPI nor uvicorn at import time, so the ``metrale`` command's parser works without the
``serve`` extra; :func:`run_serve` says how to install it when it is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import signal
import threading
from typing import Any, Iterator

from metrale.config import environment_api_key
from metrale.errors import ConfigError

logger = logging.getLogger(__name__)

#: The environment variable holding the API key when ``--api-key`` is not given.
API_KEY_VARIABLE = "METRALE_API_KEY"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
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
    "chat_template": "chat_template",
    "speculative_config": "speculative_config",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "tensor_parallel_size": "tensor_parallel_size",
    "distributed_executor_backend": "distributed_executor_backend",
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
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``metrale serve``'s arguments to ``parser`` (and return it)."""
    server = parser.add_argument_group("server")
    parser.add_argument("model", metavar="MODEL", help="checkpoint folder or embedded model name (such as tiny-dense)")
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
    server.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                        help="largest request body accepted; larger ones get 413 (default: 1048576)")
    server.add_argument("--max-n", type=int, default=None, metavar="N",
                        help="most completions per prompt a request may ask for with n (default: 16)")
    server.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                        help="most alternatives per token for logprobs, top_logprobs and prompt_logprobs (default: 20)")
    server.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                        help="seconds a shutdown waits for running requests before aborting them (default: 10)")
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
    engine.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    engine.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template file replacing the checkpoint's")
    engine.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) a request picks by its model field; turns LoRA on")
    engine.add_argument("--max-loras", type=int, default=None, metavar="N",
                        help="adapters on the device at once (default: 4)")
    engine.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                        help="the largest adapter rank served (default: 16)")
    add_parallel_arguments(engine)
    return parser


def add_parallel_arguments(group: Any) -> None:
    """The tensor-parallel flags (:mod:`metrale.executor`), shared with ``metrale generate``."""
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
    """The :class:`~metrale.lora.LoRARequest` of each ``--lora-modules`` entry (ids from 1, in
    order); :class:`~metrale.errors.ConfigError` for a name given twice."""
    from metrale.lora import LoRARequest

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
    if args.lora_modules:
        options["enable_lora"] = True
    return options


def _require_serve_extra() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(f"metrale serve needs {', '.join(missing)}; install them with: {SERVE_INSTALL_HINT}")


def _check_server_options(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ConfigError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    for flag, value, minimum in (("--max-body-bytes", args.max_body_bytes, 1), ("--max-n", args.max_n, 1),
                                 ("--max-logprobs", args.max_logprobs, 0)):
        if value is not None and value < minimum:
            raise ConfigError(f"{flag} must be >= {minimum}, got {value}")
    if args.max_logprobs is not None and args.max_logprobs > 20:
        raise ConfigError(f"--max-logprobs must be <= 20, got {args.max_logprobs}")
    if args.drain_timeout is not None and not args.drain_timeout >= 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.served_model_name is not None and not args.served_model_name:
        raise ConfigError("--served-model-name must not be empty")
    if args.served_model_name is not None and any(name == args.served_model_name for name, _ in args.lora_modules or []):
        raise ConfigError(f"--lora-modules names {args.served_model_name!r}, the base model's served name")
    if args.api_key is not None and not args.api_key:
        raise ConfigError(f"--api-key must not be empty (leave it out, and {API_KEY_VARIABLE} unset, for no key)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(engine: Any, *, model_name: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          log_level: str = "info", **app_options: Any) -> None:
    """Serve ``engine`` (an :class:`~metrale.engine_process.EngineProcess` or an
    :class:`~metrale.AsyncLLM`) with uvicorn at ``host:port`` until
    interrupted (SIGINT or SIGTERM), then shut down gracefully: new requests get 503, the
    running ones get up to ``drain_timeout`` seconds (an ``app_options`` keyword, as
    ``max_body_bytes``, ``max_n``, ``max_logprobs`` and ``owns_engine``: see
    :func:`~metrale.server.app.build_app`), the rest are aborted and the engine is shut down."""
    import uvicorn
    from uvicorn.server import HANDLED_SIGNALS

    from metrale.server.app import DEFAULT_DRAIN_TIMEOUT, build_app

    app = build_app(engine, model_name=model_name, api_key=api_key, **app_options)
    state = app.state.metrale
    drain_timeout = app_options.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT)

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, refusing new requests as soon as the shutdown starts, and returning
        after a signal (uvicorn raises the signal again once it has shut down, which would end
        the process with it instead of the exit status)."""

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

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            server_header=False)
    DrainingServer(config).run()


def run_serve(args: argparse.Namespace) -> int:
    """Run ``metrale serve`` with the parsed ``args`` (:func:`add_serve_arguments`); returns the
    exit status (0 after a clean shutdown, 1 when the server could not start)."""
    _check_server_options(args)
    _require_serve_extra()
    api_key = args.api_key if args.api_key is not None else environment_api_key()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if api_key is None and not _is_loopback(args.host):
        logger.warning("listening on %s without an API key: anyone who reaches it can use the model "
                       "(set --api-key or %s)", args.host, API_KEY_VARIABLE)
    from metrale.async_llm import DEFAULT_MAX_WAITING_REQUESTS

    waiting = args.max_waiting_requests if args.max_waiting_requests is not None else DEFAULT_MAX_WAITING_REQUESTS
    adapters = lora_modules(args)
    engine: Any
    if args.engine_in_process:
        from metrale.api import LLM
        from metrale.async_llm import AsyncLLM

        llm = LLM(args.model, **engine_options(args))
        for lora in adapters:
            llm.add_lora(lora)
        llm.capture_graphs()
        engine = AsyncLLM(llm, max_waiting_requests=waiting)
    else:
        from metrale.engine_process import EngineProcess

        # Every decode and mixed step's CUDA graph is recorded before the first request (a
        # no-op on the CPU), so no request waits for a recording.
        engine = EngineProcess(args.model, max_waiting_requests=waiting, capture_graphs=True, lora_modules=adapters,
                               **engine_options(args))
    app_options: dict[str, Any] = {}
    for name in ("max_body_bytes", "max_n", "max_logprobs", "drain_timeout"):
        value = getattr(args, name)
        if value is not None:
            app_options[name] = value
    try:
        serve(engine, model_name=args.served_model_name or args.model, host=args.host, port=args.port, api_key=api_key,
              log_level=args.log_level, lora_modules=adapters, **app_options)
    except SystemExit as exit:  # uvicorn exits when it cannot bind the address (it logs why)
        return int(exit.code) if isinstance(exit.code, int) else 1
    finally:
        engine.shutdown()
    return 0
