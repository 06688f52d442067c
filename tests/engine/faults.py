"""A fault injector: raises an exception at a chosen line of chosen functions (``sys.settrace``).

The trace function sees every Python line the target functions execute; a run without a fault
records them (:meth:`LineFaults.record`), and a later run raises at the ``n``-th execution of one
of those lines (:meth:`LineFaults.inject`), the way a Ctrl-C can land between any two lines.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections import Counter
from types import CodeType, ModuleType
from typing import Iterator

#: (code object, line number): one line of one target function.
Line = tuple[CodeType, int]


def functions_of(*owners: type | ModuleType, exclude: tuple[str, ...] = ()) -> set[CodeType]:
    """The code objects of the functions, methods and properties defined by ``owners``."""
    codes = set()
    for owner in owners:
        for name, member in vars(owner).items():
            if name in exclude:
                continue
            if isinstance(member, property):
                members = [member.fget, member.fset]
            elif isinstance(member, (staticmethod, classmethod)):
                members = [member.__func__]
            else:
                members = [member]
            for function in members:
                if inspect.isfunction(function) and function.__module__ == (
                    owner.__name__ if isinstance(owner, ModuleType) else owner.__module__
                ):
                    codes.add(function.__code__)
    return codes


class LineFaults:
    """Traces the lines of ``codes``; see the module docstring."""

    def __init__(self, codes: set[CodeType]) -> None:
        self.codes = codes
        self.seen: Counter[Line] = Counter()
        self._target: Line | None = None
        self._occurrence = 0
        self._exception: type[BaseException] = KeyboardInterrupt
        self.fired = False

    def _global(self, frame, event, arg):
        return self._local if frame.f_code in self.codes else None

    def _local(self, frame, event, arg):
        if event == "line":
            line = (frame.f_code, frame.f_lineno)
            self.seen[line] += 1
            if not self.fired and line == self._target and self.seen[line] == self._occurrence:
                self.fired = True
                raise self._exception(f"injected at {describe(line)} (occurrence {self._occurrence})")
        return self._local

    @contextlib.contextmanager
    def _tracing(self) -> Iterator[None]:
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            yield
        finally:
            sys.settrace(previous)

    @contextlib.contextmanager
    def record(self) -> Iterator[Counter[Line]]:
        """Count the target lines executed in the block; yields the counter."""
        self.seen, self._target, self.fired = Counter(), None, False
        with self._tracing():
            yield self.seen

    @contextlib.contextmanager
    def inject(self, line: Line, occurrence: int, exception: type[BaseException] = KeyboardInterrupt) -> Iterator[None]:
        """Raise ``exception`` at the ``occurrence``-th execution of ``line`` in the block."""
        self.seen, self._target, self._occurrence, self._exception, self.fired = Counter(), line, occurrence, exception, False
        with self._tracing():
            yield


def describe(line: Line) -> str:
    code, number = line
    return f"{code.co_qualname} line {number}"
