"""Checkpoint bytes read straight into a device array through a ring of pinned host buffers.

A weight's bytes are split into chunks; a pool of threads reads chunks with ``preadv`` (the
system call runs without the GIL, so several reads proceed at once) into a ring of page-locked
buffers, and the calling thread hands each filled buffer to an asynchronous copy into its place
in the destination, in order. A buffer is read into again only once the copy out of it is done,
so the reads run ahead of the copies by the ring's length. Nothing passes through an
intermediate host array: no memory map faulted in page by page, no concatenation of a stacked
weight's parts.

The device side is two callables (the ``copy`` of :meth:`StagedReader.read` and the reader's
``wait``), so the ring runs unchanged on the host in the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metrale.errors import CheckpointError

#: Bytes one read and one copy move (the ring holds ``2 * workers`` buffers of this size).
CHUNK_BYTES = 8 << 20
#: Threads reading at once.
READ_WORKERS = 8


@dataclass(frozen=True)
class ByteRange:
    """``size`` bytes of ``file`` from ``offset``, bound for byte ``target`` of the destination."""

    file: Path
    offset: int
    size: int
    target: int


def split_ranges(ranges: Sequence[ByteRange], chunk_bytes: int = CHUNK_BYTES) -> list[ByteRange]:
    """``ranges`` cut into pieces of at most ``chunk_bytes``, in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    pieces = []
    for whole in ranges:
        for start in range(0, whole.size, chunk_bytes):
            size = min(chunk_bytes, whole.size - start)
            pieces.append(ByteRange(whole.file, whole.offset + start, size, whole.target + start))
    return pieces


def read_exactly(descriptor: int, buffer: np.ndarray, offset: int, path: Path) -> None:
    """Fill ``buffer`` with the bytes of ``descriptor`` from ``offset`` (a short read is retried
    from where it stopped; end of file first is a :class:`CheckpointError`)."""
    view = memoryview(buffer.reshape(-1).view(np.uint8).data).cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(descriptor, [view[done:]], offset + done)
        if count <= 0:
            raise CheckpointError(f"{path}: the file ends at byte {offset + done}, inside a tensor's bytes "
                                  f"(up to byte {offset + len(view)}); it was cut short or changed while loading")
        done += count


class StagedReader:
    """Copies byte ranges of files into destinations through ``buffers`` (equal ``uint8`` arrays,
    page-locked on a GPU); ``wait(token)`` blocks until the copy a token stands for is done."""

    def __init__(self, buffers: Sequence[np.ndarray], wait: Callable[[Any], None], workers: int = READ_WORKERS) -> None:
        if not buffers:
            raise ValueError("a staged reader needs at least one buffer")
        self.buffers = list(buffers)
        self.chunk_bytes = min(int(b.nbytes) for b in self.buffers)
        self.wait = wait
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(self.buffers))),
                                        thread_name_prefix="metrale-read")
        #: The token of the last copy out of each buffer (waited for before the buffer is refilled).
        self._copies: list[Any] = [None] * len(self.buffers)

    def read(self, ranges: Sequence[ByteRange], copy: Callable[[ByteRange, np.ndarray], Any]) -> None:
        """Read every range; ``copy(piece, filled)`` starts the copy of a filled buffer (the piece's
        bytes) to byte ``piece.target`` of the destination and returns the token of that copy.
        Returns once the last copy has started (:meth:`drain` waits for them)."""
        pieces = split_ranges(ranges, self.chunk_bytes)
        if not pieces:
            return
        descriptors: dict[Path, int] = {}
        try:
            for path in {piece.file for piece in pieces}:
                descriptors[path] = os.open(path, os.O_RDONLY)
        except OSError as error:
            for descriptor in descriptors.values():
                os.close(descriptor)
            raise CheckpointError(f"cannot read {error.filename}: {error.strerror}") from error
        slots = len(self.buffers)
        reads: dict[int, Future] = {}

        def fill(index: int, previous_copy: Any) -> np.ndarray:
            piece, buffer = pieces[index], self.buffers[index % slots]
            if previous_copy is not None:
                self.wait(previous_copy)
            filled = buffer[:piece.size]
            read_exactly(descriptors[piece.file], filled, piece.offset, piece.file)
            return filled

        try:
            for index in range(min(slots, len(pieces))):
                reads[index] = self._pool.submit(fill, index, self._copies[index % slots])
            for index, piece in enumerate(pieces):
                filled = reads.pop(index).result()
                token = self._copies[index % slots] = copy(piece, filled)
                if index + slots < len(pieces):
                    reads[index + slots] = self._pool.submit(fill, index + slots, token)
        finally:
            # A failed read leaves the others running into the ring: let them end before the
            # descriptors close and before any later read reuses the buffers.
            for future in reads.values():
                future.exception()
            for descriptor in descriptors.values():
                os.close(descriptor)

    def drain(self) -> None:
        """Wait for every copy started (the buffers may then be freed)."""
        for index, token in enumerate(self._copies):
            if token is not None:
                self.wait(token)
                self._copies[index] = None

    def close(self) -> None:
        """Wait for the copies and stop the reading threads."""
        self.drain()
        self._pool.shutdown(wait=True)
