"""The process of a grammar sandbox (:class:`~metrale.structured.sandbox.GrammarSandbox`): one
compiler, then each constraint it is sent compiled and its first token run."""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.structured import GrammarCompiler, StructuredOutputParams


def main(fd: int) -> None:
    """The sandbox worker, on the socket ``fd``: set up one compiler, then answer each
    ``("check", kind, text)`` with None (compiled, its first token ran) or the reason it fails."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C stops the caller, which stops this)
    conn = Connection(fd)
    try:
        _, tokenizer_json, vocab_size, eos_token_ids, memory_bytes = conn.recv()
    except (EOFError, OSError):
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        compiler = _compiler(tokenizer_json, vocab_size, eos_token_ids)
    except Exception as error:
        conn.send(f"{type(error).__name__}: {error}")
        return
    conn.send(None)
    while True:
        try:
            _, kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiler.compile(StructuredOutputParams.from_key(kind, text))
            answer = None
        except InvalidRequestError as error:
            answer = str(error)
        except MemoryError:
            answer = f"{kind}: compiling it needs more than the limit of {memory_bytes // 2**20} MiB of memory"
        except Exception as error:
            answer = f"{kind}: the structured-output compiler failed on it ({type(error).__name__}: {error})"
        conn.send(answer)


def _compiler(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> Any:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids, isolated=False)
