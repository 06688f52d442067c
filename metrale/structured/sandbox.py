"""Structured-output constraints are compiled first where a crash costs only their request.

llguidance compiles a JSON schema, regular expression or Lark grammar in native code, and some
inputs crash it outright (a grammar of a few thousand chained rules overflows its stack: the
process dies with SIGSEGV) or take long to compile. A request's constraint is therefore checked
before the process that serves it ever compiles it (:meth:`GrammarCompiler.compile
<metrale.structured.GrammarCompiler.compile>`):

1. its canonical text must be at most :data:`MAX_CONSTRAINT_BYTES` long (checked before any
   compiler sees it);
2. a :class:`GrammarSandbox` -- a worker process of its own, started on first use with the same
   tokenizer -- compiles it and runs its first token, within :data:`COMPILE_TIMEOUT_S` seconds
   and :data:`WORKER_MEMORY_BYTES` of address space. A constraint that crashes the worker, runs
   past the time or the memory, or that llguidance rejects, raises
   :class:`~metrale.errors.InvalidRequestError` naming the limit or the reason; the worker is
   started again for the next one.

Only a constraint that passed both is compiled where it is served; llguidance compiles the same
input the same way there. The checks are cached by the constraint's text, so a schema a server
sees many times is checked once. A sandbox serves one thread at a time (a lock): callers on an
event loop run :meth:`GrammarSandbox.check` on a worker thread.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Sequence

from metrale.child_process import start_child
from metrale.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: Longest canonical constraint text (a schema's compact JSON, a regex, a grammar), in bytes.
MAX_CONSTRAINT_BYTES = 128 * 1024
#: Seconds the sandbox may take to compile a constraint and run its first token.
COMPILE_TIMEOUT_S = 10.0
#: Address space of the sandbox worker, in bytes (its compiles past it fail there, not here).
WORKER_MEMORY_BYTES = 8 * 2**30
#: Seconds a new worker may take to start (import llguidance, read the tokenizer).
WORKER_START_TIMEOUT_S = 60.0
#: Constraints remembered as checked.
CHECKED_CACHE_SIZE = 1024


def check_constraint_size(kind: str, text: str) -> None:
    """:class:`~metrale.errors.InvalidRequestError` when the constraint's text is over
    :data:`MAX_CONSTRAINT_BYTES`."""
    size = len(text.encode("utf-8"))
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidRequestError(f"{kind}: the constraint is {size} bytes long, over the limit of {MAX_CONSTRAINT_BYTES} "
                                  "bytes for a structured output")


class GrammarSandbox:
    """Checks constraints in a worker process (see the module docstring) for one tokenizer
    (``tokenizer_json``: ``tokenizers.Tokenizer.to_str()``), with the compiler settings of
    :class:`~metrale.structured.GrammarCompiler`."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], *,
                 timeout: float = COMPILE_TIMEOUT_S, memory_bytes: int = WORKER_MEMORY_BYTES) -> None:
        self._setup = (tokenizer_json, int(vocab_size), [int(e) for e in eos_token_ids], int(memory_bytes))
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._checked: OrderedDict[tuple[str, str], None] = OrderedDict()
        #: Workers lost to a constraint (crashed, or stopped past the time limit).
        self.restarts = 0

    def check(self, kind: str, text: str) -> None:
        """Compile the constraint ``(kind, text)`` (a :class:`~metrale.structured.StructuredOutputParams`
        key) in the worker; :class:`~metrale.errors.InvalidRequestError` when it is too large,
        is rejected, crashes the compiler or takes longer than :attr:`timeout`."""
        check_constraint_size(kind, text)
        key = (kind, text)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return
            reply = self._ask(("check", kind, text), kind)
            if reply is not None:
                raise InvalidRequestError(reply)
            self._checked[key] = None
            while len(self._checked) > CHECKED_CACHE_SIZE:
                self._checked.popitem(last=False)

    def _ask(self, message: tuple, kind: str) -> str | None:
        """Send ``message`` to the worker; its answer (None: accepted; else why not)."""
        conn = self._worker()
        try:
            conn.send(message)
            if not conn.poll(self.timeout):
                self._stop_worker()
                self.restarts += 1
                return f"{kind}: compiling it took longer than the limit of {self.timeout:g} s"
            answer = conn.recv()
        except (EOFError, OSError):
            code = self._stop_worker()
            self.restarts += 1
            logger.warning("a structured output (%s) crashed the grammar compiler (%s); the request is refused and the "
                           "compiler restarted", kind, _exit_reason(code))
            return (f"{kind}: the constraint crashed the structured-output compiler ({_exit_reason(code)}): it is too "
                    "large or too deeply nested; simplify it")
        return answer

    def _worker(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        self._stop_worker()
        process, conn = start_child("metrale.structured.sandbox_worker", "main")
        self._process, self._conn = process, conn
        try:
            conn.send(("setup", *self._setup))
            if not conn.poll(WORKER_START_TIMEOUT_S):
                raise OSError("no answer")
            answer = conn.recv()
        except (EOFError, OSError) as error:
            code = self._stop_worker()
            raise InvalidRequestError(f"the structured-output compiler could not start ({_exit_reason(code)}, {error})") from None
        if answer is not None:
            self._stop_worker()
            raise InvalidRequestError(f"the structured-output compiler could not start: {answer}")
        return conn

    def _stop_worker(self) -> int | None:
        """Stop the worker (if any); its exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        return process.wait()

    def close(self) -> None:
        """Stop the worker (a later :meth:`check` starts another)."""
        with self._lock:
            self._stop_worker()

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            process.kill()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "it stopped"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
