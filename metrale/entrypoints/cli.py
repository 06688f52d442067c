"""The ``metrale`` command.

``metrale generate [--model M] [--stream] PROMPT...`` generates a continuation of each prompt
(the embedded default model when ``--model`` is not given); ``metrale plugins`` lists the
installed plugins, the architectures each family serves, the tool-call and reasoning parsers
and the kernels of every op;
``metrale serve MODEL`` serves a model over HTTP (:mod:`metrale.entrypoints.server.main`);
``metrale chat`` holds a conversation with a model or a server (:mod:`metrale.entrypoints.chat_cli`);
``metrale bench`` measures prefill and decode against transformers, offline throughput, or a
running server (:mod:`metrale.benchmarks`). ``python -m metrale`` is the same command.

Exit status: 0 on success; 1 when a request failed (its error is printed) or ``metrale serve``
cannot listen on its address (one line on stderr, before the model loads); 2 for bad input or
options (one line on stderr: ``metrale: error: ...``, no traceback); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from metrale._version import __version__
from metrale.errors import ConfigError, MetraleError
from metrale.models import DEFAULT_MODEL


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a continuation of each prompt",
        description="Generate a continuation of each PROMPT and print prompt and continuation.",
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"checkpoint folder, embedded model name or Hugging Face Hub id (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run (default: auto)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy (default: 0.7)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default: 0)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus probability mass (default: 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of every request (default: 0)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at TEXT (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--stream", action="store_true",
                        help="print the continuation of a single PROMPT as it is generated")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    from metrale.entrypoints.server.main import (
        add_batch_invariant_argument,
        add_kv_cache_dtype_argument,
        add_model_source_arguments,
        add_parallel_arguments,
    )

    add_kv_cache_dtype_argument(parser)
    add_parallel_arguments(parser)
    add_batch_invariant_argument(parser)
    add_model_source_arguments(parser)
    parser.set_defaults(handler=_generate)


def _speculative_config(text: str) -> dict:
    from metrale.speculative import parse_config_argument

    try:
        return parse_config_argument(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is {error}") from None


def _add_plugins(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list installed plugins, the architectures they serve and the kernel of every op",
        description="List every registered plugin, its distribution and the families it serves, then every op "
        "with what serves it on the CPU and on the GPU (a plugin's kernels first, each under its condition).",
    )
    parser.set_defaults(handler=_plugins)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure decode and prefill throughput on the GPU beside Hugging Face transformers",
        description="Build random-weight bf16 checkpoints of Llama shapes, then time Metrale and "
        "transformers on them: decode tok/s, GB/s and the fraction of the bandwidth floor, prefill "
        "tok/s, load and graph-capture time. Needs a CUDA device, torch and transformers.",
    )
    parser.add_argument("--shapes", default="llama-1b,llama-8b",
                        help="comma-separated: llama-1b, llama-8b, deepseek-v2-lite, qwen3-next-small, qwen3-30b-a3b, "
                        "gpt-oss-20b, llama-70b (only in "
                        "--quantization formats, written straight in them) "
                        "(default: llama-1b,llama-8b)")
    parser.add_argument("--batch-sizes", default="1,32", help="decode batch sizes (default: 1,32)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence before decoding (default: 512)")
    parser.add_argument("--decode-steps", type=int, default=64, help="timed decode steps (default: 64)")
    parser.add_argument("--prefill-lengths", default="512,2048", help="prompt lengths timed for prefill (default: 512,2048)")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="time prefill at 512, 1024, 2048, 4096, 8192, 16384, 32768 and 131072 tokens and a "
                        "512-token chunk after 8192 cached ones (overrides --prefill-lengths and --prefix-chunk)")
    parser.add_argument("--prefix-chunk", default="", metavar="CACHED,NEW",
                        help="also time a chunk of NEW prompt tokens after CACHED ones, e.g. 8192,512")
    parser.add_argument("--quantization", default="", metavar="FORMATS",
                        help="also time Metrale on each shape in these quantized formats, comma-separated: fp8 "
                        "(online), fp8-dynamic, fp8-block, w8a8, w4a16 (checkpoints written in the real formats from "
                        "the bf16 one), with the accuracy against bf16 (default: none)")
    parser.add_argument("--kv-cache-fp8", action="store_true",
                        help="also time each shape's bf16 model with an FP8 KV cache (decode at --context), with its "
                        "blocks per byte and accuracy against the bf16 cache")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also time each shape in batch-invariant mode beside the default, with a check that 32 "
                        "prompts give the same greedy tokens alone and batched")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--hf-compile", action="store_true", help="also time transformers with a static cache and torch.compile")
    parser.add_argument("--no-start-times", action="store_true", help="skip the cold and cached start-time probes")
    parser.add_argument("--throughput", action="store_true",
                        help="run the offline throughput benchmark instead: many requests through continuous "
                        "batching on a Qwen3-0.6B shape, beside transformers' continuous batching")
    parser.add_argument("--num-requests", type=int, default=256, help="requests of --throughput (default: 256)")
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="requests running at once in --throughput (default: 128)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="run --throughput with overlap scheduling off (each step read back before the next is planned)")
    parser.add_argument("--workdir", default="/tmp/metrale-bench", help="where checkpoints are written")
    parser.add_argument("--output", default="bench.json", help="JSON result file (default: bench.json)")
    from metrale.benchmarks.serve import add_serve_arguments

    add_serve_arguments(parser)
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from metrale.backends import devices as backend
    from metrale.benchmarks.latency import SHAPES, BenchOptions, run, table
    from metrale.errors import BackendUnavailableError, ConfigError

    if args.serve:  # a client of a running server: no GPU needed here
        from metrale.benchmarks import serve as bench_serve

        return bench_serve.run_from_args(args)
    shapes = tuple(s for s in args.shapes.split(",") if s)
    from metrale.benchmarks.quantized import FORMATS

    quantization = tuple(name for name in args.quantization.split(",") if name)
    unserved = [name for name in quantization if name not in FORMATS]
    if unserved:
        raise ConfigError(f"unknown quantized formats {unserved}; known: {', '.join(FORMATS)}")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ConfigError(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    try:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
        prefill_lengths = tuple(int(n) for n in args.prefill_lengths.split(",") if n)
    except ValueError as error:
        raise ConfigError(f"--batch-sizes and --prefill-lengths take comma-separated ints: {error}") from None
    prefix_chunk = None
    if args.prefill_sweep:
        from metrale.benchmarks.latency import PREFILL_SWEEP_CHUNK, PREFILL_SWEEP_LENGTHS

        prefill_lengths, prefix_chunk = PREFILL_SWEEP_LENGTHS, PREFILL_SWEEP_CHUNK
    elif args.prefix_chunk:
        try:
            cached, new = (int(n) for n in args.prefix_chunk.split(","))
        except ValueError:
            raise ConfigError(f"--prefix-chunk takes CACHED,NEW (two ints), got {args.prefix_chunk!r}") from None
        if cached < 1 or new < 1:
            raise ConfigError(f"--prefix-chunk takes positive numbers, got {args.prefix_chunk!r}")
        prefix_chunk = (cached, new)
    counts = {"--batch-sizes": min(batch_sizes, default=0), "--context": args.context, "--decode-steps": args.decode_steps}
    if prefill_lengths:
        counts["--prefill-lengths"] = min(prefill_lengths)
    for option, value in counts.items():
        if value < 1:
            raise ConfigError(f"{option} takes positive numbers, got {value}")
    for option, value in (("--num-requests", args.num_requests), ("--max-num-seqs", args.max_num_seqs)):
        if value < 1:
            raise ConfigError(f"{option} takes positive numbers, got {value}")
    reason = backend.cuda_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"metrale bench needs a CUDA device: {reason}")
    if args.throughput:
        from metrale.benchmarks import throughput as bench_throughput

        throughput_options = bench_throughput.ThroughputOptions(
            num_requests=args.num_requests, max_num_seqs=args.max_num_seqs, hf=not args.no_hf,
            overlap=not args.no_overlap, workdir=Path(args.workdir), output=Path(args.output),
        )
        print(bench_throughput.table(bench_throughput.run(throughput_options)))
        print(f"results: {throughput_options.output}")
        return 0
    options = BenchOptions(
        shapes=shapes, batch_sizes=batch_sizes, context=args.context, decode_steps=args.decode_steps,
        prefill_lengths=prefill_lengths, prefix_chunk=prefix_chunk, hf=not args.no_hf, hf_compile=args.hf_compile,
        start_times=not args.no_start_times, quantization=quantization, kv_cache_fp8=args.kv_cache_fp8,
        batch_invariant=args.batch_invariant,
        workdir=Path(args.workdir), output=Path(args.output),
    )
    results = run(options)
    print(table(results))
    print(f"results: {options.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metrale",
        description="Metrale: LLM inference with pluggable model families.",
    )
    parser.add_argument("--version", action="version", version=f"metrale {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_generate(subparsers)
    _add_plugins(subparsers)
    _add_bench(subparsers)
    _add_serve(subparsers)
    _add_chat(subparsers)
    _add_config_file_options(parser)
    return parser


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    from metrale.entrypoints.chat_cli import add_chat_arguments

    parser = subparsers.add_parser(
        "chat",
        help="chat with a model, loaded here or served at a URL",
        description="Read user turns line by line and stream each reply; the conversation so far answers the next "
        "turn. /reset forgets it, /exit (or the end of the input) ends it. --url chats with a running "
        "OpenAI-compatible server instead of loading a model.",
    )
    add_chat_arguments(parser)
    parser.set_defaults(handler=_chat)


def _chat(args: argparse.Namespace) -> int:
    from metrale.entrypoints.chat_cli import run_chat

    return run_chat(args)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from metrale.entrypoints.server.main import add_serve_arguments

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over HTTP with OpenAI's completions and chat completions API "
        "(needs the serve extra: pip install \"metrale[serve]\").",
    )
    add_serve_arguments(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from metrale.entrypoints.server.main import run_serve

    return run_serve(args)


def _generate(args: argparse.Namespace) -> int:
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.stream and len(args.prompts) != 1:
        raise ConfigError(f"--stream prints one continuation; got {len(args.prompts)} prompts")
    options: dict[str, Any] = {name: True for name in ("expert_parallel", "batch_invariant") if getattr(args, name)}
    if args.quantization is not None:
        options["quantization"] = args.quantization
    if args.tensor_parallel_size is not None:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.distributed_executor_backend is not None:
        options["distributed_executor_backend"] = args.distributed_executor_backend
    if args.kv_cache_dtype is not None:
        options["kv_cache_dtype"] = args.kv_cache_dtype
    for name in ("revision", "download_dir", "tokenizer", "tokenizer_revision"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    with LLM(args.model, device=args.device, show_progress=not args.no_progress,
             speculative_config=args.speculative_config, **options) as llm:
        if args.stream:
            outputs: list[Any] = [_stream(llm, args.prompts[0], params)]
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=not args.no_progress)
            for index, output in enumerate(outputs):
                if index:
                    print()
                print(f"{output.prompt}{output.text}")
    failed = [output for output in outputs if output.finish_reason == "error"]
    for output in failed:
        print(f"metrale: error: prompt {output.request_id} failed: {output.error}", file=sys.stderr)
    return 1 if failed else 0


def _stream(llm: Any, prompt: str, params: Any) -> Any:
    """Print ``prompt``, then its continuation as it comes; returns the final output. The
    engine holds back text that may still become a stop string or is an incomplete character,
    so each output's text extends the one before."""
    stream = llm.generate_stream([prompt], params)  # checks the prompt before anything is printed
    print(prompt, end="", flush=True)
    printed = 0
    final = None
    for output in stream:
        text = output.text or ""
        print(text[printed:], end="", flush=True)
        printed = len(text)
        final = output
    print()
    return final


def _plugins(args: argparse.Namespace) -> int:
    from metrale.model.family import installed_families
    from metrale.model.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    families: dict[str, list] = {}
    for spec, plugin_name in installed_families(manager):
        families.setdefault(plugin_name, []).append(spec)
    registered = [(name, plugin) for name, plugin in manager.list_name_plugin() if plugin is not None]
    for name, plugin in sorted(registered, key=lambda item: item[0]):
        distribution = manager.distributions.get(name, "unknown")
        hooks = sorted(caller.name for caller in manager.get_hookcallers(plugin) or [])
        print(f"{name}  (distribution {distribution})")
        for spec in families.get(name, []):
            print(f"  family {spec.name}: {', '.join(spec.architectures)}")
            print(f"    model_type: {', '.join(spec.model_types)}")
        if name not in families:
            print(f"  hooks: {', '.join(hooks)}")
        for label, names in _parser_names(manager, name):
            print(f"  {label}: {', '.join(names)}")
    blocked = sorted(name for name, plugin in manager.list_name_plugin() if plugin is None)
    if blocked:
        print(f"blocked: {', '.join(blocked)}")
    _print_ops(manager)
    return 0


def _parser_names(manager: Any, plugin_name: str) -> list[tuple[str, list[str]]]:
    """The tool-call and reasoning parsers the plugin ``plugin_name`` declares, by kind."""
    found = []
    for label, hook in (("tool parsers", "metrale_tool_parsers"), ("reasoning parsers", "metrale_reasoning_parsers")):
        for implementation in getattr(manager.hook, hook).get_hookimpls():
            if implementation.plugin_name == plugin_name:
                answer = implementation.function() or {}
                found.append((label, sorted(answer)))
    return found


def _print_ops(manager: object) -> None:
    """Every op, and what serves it on each backend: one line when one kernel serves every call,
    else each kernel on a line of its own, in the order tried, with when it serves."""
    from metrale.config import read_environment
    from metrale.ops import build_op_registry

    registry = build_op_registry(manager)  # type: ignore[arg-type]
    environment = read_environment()
    print("ops:")
    for op in registry:
        origin = "" if op.origin == "metrale" else f"  (declared by {op.origin})"
        print(f"  {op.name}{origin}")
        for backend in ("cpu", "cuda"):
            serving = registry.serving(op.name, backend, environment)
            if len(serving) == 1:
                print(f"    {backend}: {serving[0]}")
                continue
            print(f"    {backend}, in order:")
            for line in serving:
                print(f"      {line}")


#: The subcommands that read options from a YAML file too (``--config FILE``).
CONFIG_FILE_COMMANDS = ("generate", "serve", "chat", "bench")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub for action in actions for name, sub in action.choices.items()}


def _add_config_file_options(parser: argparse.ArgumentParser) -> None:
    for name, subparser in _subparsers(parser).items():
        if name in CONFIG_FILE_COMMANDS:
            subparser.add_argument(
                "--config", default=None, metavar="FILE",
                help="a YAML file of options, keys named as the flags (port: 8000, tensor-parallel-size: 2, or "
                "with underscores); flags given on the command line win")


def config_file_options(subparser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The options of the YAML file ``path`` for ``subparser``: each key (a flag's name, dashes or
    underscores) mapped to its destination, its value checked and converted as the flag's would
    be. :class:`~metrale.errors.ConfigError` for a file that cannot be read, is not a mapping, or
    names an option the command does not have or a value it refuses."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle)
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ConfigError(f"--config {path}: not YAML{where}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values, got {type(values).__name__}")
    actions = {option.lstrip("-").replace("-", "_"): action
               for action in subparser._actions for option in action.option_strings if option.startswith("--")}
    positional = {action.dest: action for action in subparser._actions if not action.option_strings}
    options: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        action = actions.get(name) or positional.get(name)
        if action is None or name in ("config", "help"):
            known = ", ".join(sorted(n.replace("_", "-") for n in actions if n not in ("config", "help")))
            raise ConfigError(f"--config {path}: {key!r} is not an option of this command (its options: {known})")
        options[action.dest] = _config_value(action, value, f"--config {path}: {key}")
    return options


def _config_value(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` of a YAML file as ``action`` would read it from the command line."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} is a switch: true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    items = value if isinstance(value, list) else [value]
    if not many and isinstance(value, list):
        raise ConfigError(f"{where} takes one value, got a list")
    converted = []
    for item in items:
        if isinstance(item, (dict, list)) and action.type is not None and not isinstance(item, str):
            import json

            item = json.dumps(item)  # (a JSON option such as --speculative-config, written as YAML)
        text = item if isinstance(item, str) else ("true" if item is True else "false" if item is False else str(item))
        try:
            result = action.type(text) if callable(action.type) else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error or f'bad value {item!r}'}") from None
        if action.choices is not None and result not in action.choices:
            raise ConfigError(f"{where}: {item!r} is not one of {', '.join(map(str, action.choices))}")
        converted.append(result)
    return converted if many else converted[0]


def _config_path(argv: Sequence[str], commands: Sequence[str]) -> tuple[str, str] | None:
    """``(command, FILE)`` when the command line names a subcommand of ``commands`` and gives it
    ``--config FILE`` (read before the rest is parsed: the file may give required values)."""
    command = next((token for token in argv if token in commands), None)
    if command is None:
        return None
    tokens = list(argv)[list(argv).index(command) + 1:]
    for index, token in enumerate(tokens):
        if token == "--":
            return None
        if token == "--config" and index + 1 < len(tokens):
            return command, tokens[index + 1]
        if token.startswith("--config="):
            return command, token.split("=", 1)[1]
    return None


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line parsed, options from ``--config FILE`` filling what it does not give."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    found = _config_path(argv, CONFIG_FILE_COMMANDS)
    if found is None:
        return parser.parse_args(argv)
    command, path = found
    subparser = _subparsers(parser)[command]
    subparser.set_defaults(**config_file_options(subparser, path))
    for action in subparser._actions:
        if not action.option_strings and action.dest in subparser._defaults:
            # The file gives the positional value; the command line may still give it (and wins).
            action.nargs = "*" if action.nargs in ("+", "*") else "?"
            action.default = subparser._defaults[action.dest]
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_arguments(argv)
    except ConfigError as error:
        print(f"metrale: error: {error}", file=sys.stderr)
        return 2
    try:
        return args.handler(args)
    except MetraleError as error:
        print(f"metrale: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metrale: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``metrale generate ... | head``): stop quietly; later writes at
        # exit go nowhere instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
