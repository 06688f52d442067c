"""Who holds an :class:`~metrale.LLM`'s engine, and why an interrupt can never leave it held.

One generation runs at a time on an ``LLM``: :meth:`~metrale.LLM.generate`, :meth:`~metrale.LLM.score`,
:meth:`~metrale.LLM.close` hold the engine while their call runs, a
:class:`~metrale.entrypoints.streams.RequestStream` while it is open, an :class:`~metrale.AsyncLLM` while it
serves. A second taker meanwhile gets :class:`~metrale.errors.EngineBusyError`.

A plain lock cannot give that guarantee under ``KeyboardInterrupt``: Python raises it between any
two lines, and a line between taking a lock and entering the ``try`` that releases it -- or the
releasing line itself -- leaves the lock taken for good. So a hold is not a lock but a claim that
knows whether its holder is still there (:meth:`EngineHold.active`):

* a call holds while its frame is on its thread's stack (an interrupted call's frame is not);
* an object it was handed to (:meth:`EngineHold.hand_to`) holds while it says so
  (``holds_engine``) and while it exists.

Claims are kept in arrival order (:class:`EngineHolds`); the first active one owns the engine, and
claims found inactive are dropped on the way. Taking the engine after a holder that went away
without releasing it therefore just works, and tells the caller so (the ``LLM`` then recovers
its engine, :meth:`metrale.engine.engine.Engine.recover`). Every step is a single list or
attribute operation, which the interpreter lock makes atomic, so two threads taking at once
agree on who won.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any


class EngineHold:
    """One claim on an engine (see the module docstring): ``what`` names the holder in errors."""

    __slots__ = ("what", "released", "_frame", "_thread", "_owner", "__weakref__")

    def __init__(self, what: str, frame: FrameType | None, thread: int) -> None:
        self.what = what
        self.released = False
        self._frame = frame
        self._thread = thread
        self._owner: weakref.ref | None = None

    def hand_to(self, owner: Any) -> None:
        """From now on ``owner`` holds (while ``owner.holds_engine`` is true and it exists), not
        the call that took the hold."""
        self._owner = weakref.ref(owner)
        self._frame = None

    def active(self) -> bool:
        """Whether the holder is still there (a released hold never is)."""
        if self.released:
            return False
        if self._owner is not None:
            owner = self._owner()
            return owner is not None and bool(owner.holds_engine)
        return self._frame is not None and _on_stack(self._frame, self._thread)

    def __repr__(self) -> str:
        return f"EngineHold({self.what!r}, {'released' if self.released else 'held'})"


def _on_stack(frame: FrameType, thread: int) -> bool:
    """Whether ``frame`` is running on thread ``thread`` (it is on that thread's stack)."""
    top = sys._current_frames().get(thread)
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class EngineHolds:
    """The claims on one engine, oldest first; the first active claim owns it."""

    def __init__(self) -> None:
        self._claims: list[EngineHold] = []

    def claim(self, what: str, frame: FrameType) -> tuple[EngineHold | None, EngineHold, list[EngineHold]]:
        """Claim the engine for the call running ``frame`` (on this thread). Returns ``(owner,
        hold, gone)``: ``hold`` owns the engine when ``owner is hold``; ``gone`` lists the
        claims found inactive and dropped (holders that went away without releasing)."""
        hold = EngineHold(what, frame, threading.get_ident())
        self._claims.append(hold)
        owner, gone = self._owner()
        if owner is not hold:
            self.release(hold)
        return owner, hold, gone

    def _owner(self) -> tuple[EngineHold | None, list[EngineHold]]:
        gone: list[EngineHold] = []
        for claim in list(self._claims):
            if claim.active():
                return claim, gone
            gone.append(claim)
            self._drop(claim)
        return None, gone

    def owner(self) -> EngineHold | None:
        """The claim that owns the engine now, or None."""
        return self._owner()[0]

    def owns(self, hold: EngineHold) -> bool:
        """Whether ``hold`` is not released and no claim older than it is active (so the engine
        is still its to clean up)."""
        if hold.released:
            return False
        for claim in list(self._claims):
            if claim is hold:
                return True
            if claim.active():
                return False
        return False

    def release(self, hold: EngineHold) -> None:
        """Give ``hold`` up (any number of times)."""
        hold.released = True
        self._drop(hold)

    def _drop(self, hold: EngineHold) -> None:
        try:
            self._claims.remove(hold)
        except ValueError:  # dropped by another thread already
            pass
