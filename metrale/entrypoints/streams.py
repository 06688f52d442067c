"""The iterator :meth:`metrale.LLM.generate_stream` returns."""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterator

from metrale.entrypoints.engine_hold import EngineHold
from metrale.params import RequestOutput


class RequestStream(Iterator[RequestOutput]):
    """Outputs of one streaming generation, as they are made (see
    :meth:`metrale.LLM.generate_stream`).

    The stream holds its :class:`~metrale.LLM`'s engine from its creation until it is exhausted,
    closed (:meth:`close`, the end of a ``with`` block) or dropped; closing it early drops its
    unfinished requests and frees their cache. An exception raised while it runs (a
    ``KeyboardInterrupt`` included) ends it the same way. The engine is held through an
    :class:`~metrale.entrypoints.engine_hold.EngineHold` that this stream owns while it is open
    (:attr:`holds_engine`), so a stream that an interrupt left half closed, or that is gone,
    holds nothing.
    """

    def __init__(self, outputs: Generator[RequestOutput, None, None], hold: EngineHold,
                 release: Callable[[EngineHold], None]) -> None:
        self._hold = hold
        self._release = release
        self._outputs: Generator[RequestOutput, None, None] | None = outputs
        hold.hand_to(self)

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> RequestOutput:
        outputs = self._outputs
        if outputs is None:
            raise StopIteration
        try:
            return next(outputs)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        """Whether the stream is finished (exhausted, closed or ended by an error)."""
        return self._outputs is None

    @property
    def holds_engine(self) -> bool:
        """Whether the stream still holds its ``LLM``'s engine: it is open and its outputs are
        not exhausted."""
        outputs: Any = self._outputs
        return outputs is not None and (outputs.gi_running or outputs.gi_frame is not None)

    def close(self) -> None:
        """Drop the unfinished requests, free their cache and give the engine back."""
        outputs, self._outputs = self._outputs, None
        if outputs is None:
            return
        try:
            outputs.close()
        finally:
            self._release(self._hold)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if "_outputs" in self.__dict__:  # (not when an interrupt cut __init__ short before it)
            self.close()
