"""The iterator :meth:`metrale.LLM.generate_stream` returns."""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterator

from metrale.params import RequestOutput


class RequestStream(Iterator[RequestOutput]):
    """Outputs of one streaming generation, as they are made (see
    :meth:`metrale.LLM.generate_stream`).

    The stream holds its :class:`~metrale.LLM`'s engine from its creation until it is exhausted,
    closed (:meth:`close`, the end of a ``with`` block) or dropped; closing it early drops its
    unfinished requests and frees their cache. An exception raised while it runs (a
    ``KeyboardInterrupt`` included) ends it the same way.
    """

    def __init__(self, outputs: Generator[RequestOutput, None, None], release: Callable[[], None]) -> None:
        self._outputs: Generator[RequestOutput, None, None] | None = outputs
        self._release: Callable[[], None] | None = release

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> RequestOutput:
        if self._outputs is None:
            raise StopIteration
        try:
            return next(self._outputs)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        """Whether the stream is finished (exhausted, closed or ended by an error)."""
        return self._outputs is None

    def close(self) -> None:
        """Drop the unfinished requests, free their cache and give the engine back."""
        outputs, release = self._outputs, self._release
        self._outputs, self._release = None, None
        if outputs is None or release is None:
            return
        try:
            outputs.close()
        finally:
            release()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
