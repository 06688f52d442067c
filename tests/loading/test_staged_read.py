"""metrale/loading/staged_read.py and Checkpoint.stored_bytes: bytes read through a ring of buffers
into their places, against the files' own bytes, with copies that finish late (as a GPU's do)."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale.errors import CheckpointError
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.staged_read import ByteRange, StagedReader, split_ranges


class LateCopies:
    """A stand-in device: a copy is queued and done later by another thread, reading the buffer
    only then (as an asynchronous copy out of a pinned buffer does); ``wait`` blocks until it is."""

    def __init__(self, destination: np.ndarray, delay: float = 0.0005) -> None:
        self.destination, self.delay = destination, delay
        self.queue: queue.Queue = queue.Queue()
        self.copies = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            piece, filled, done = self.queue.get()
            time.sleep(self.delay)
            self.destination[piece.target:piece.target + piece.size] = filled
            done.set()

    def copy(self, piece: ByteRange, filled: np.ndarray) -> threading.Event:
        done = threading.Event()
        self.copies += 1
        self.queue.put((piece, filled, done))
        return done

    @staticmethod
    def wait(done: threading.Event) -> None:
        assert done.wait(10), "a copy never finished"


def _files(tmp_path: Path, sizes=(1000, 333)) -> list[tuple[Path, bytes]]:
    rng = np.random.default_rng(0)
    out = []
    for index, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path = tmp_path / f"part{index}.bin"
        path.write_bytes(data)
        out.append((path, data))
    return out


def _reader(buffers: int = 3, size: int = 64, workers: int = 2) -> StagedReader:
    return StagedReader([np.zeros(size, np.uint8) for _ in range(buffers)], LateCopies.wait, workers)


def test_split_ranges_cuts_each_range_in_order():
    ranges = [ByteRange(Path("a"), 10, 150, 0), ByteRange(Path("b"), 0, 64, 150), ByteRange(Path("c"), 5, 0, 214)]
    assert split_ranges(ranges, 64) == [
        ByteRange(Path("a"), 10, 64, 0), ByteRange(Path("a"), 74, 64, 64), ByteRange(Path("a"), 138, 22, 128),
        ByteRange(Path("b"), 0, 64, 150),
    ]
    with pytest.raises(ValueError):
        split_ranges(ranges, 0)


@pytest.mark.parametrize("buffers,size,workers", [(1, 64, 1), (3, 64, 2), (8, 7, 8), (4, 4096, 3)])
def test_ranges_land_in_place_though_copies_finish_late(tmp_path, buffers, size, workers):
    (first, a), (second, b) = _files(tmp_path)
    # Parts of two files, interleaved, into one destination (a stacked weight's parts).
    ranges = [ByteRange(second, 20, 300, 0), ByteRange(first, 0, 1000, 300), ByteRange(second, 0, 10, 1300)]
    destination = np.zeros(1310, np.uint8)
    device = LateCopies(destination)
    reader = _reader(buffers, size, workers)
    reader.read(ranges, device.copy)
    reader.drain()
    assert destination.tobytes() == b[20:320] + a + b[:10]
    assert device.copies == len(split_ranges(ranges, size))
    # The same reader again (its buffers' last copies waited for first).
    again = np.zeros(1000, np.uint8)
    late = LateCopies(again)
    reader.read([ByteRange(first, 0, 1000, 0)], late.copy)
    reader.close()
    assert again.tobytes() == a


def test_a_file_cut_short_is_a_checkpoint_error_and_the_reader_goes_on(tmp_path):
    (first, a), _ = _files(tmp_path)
    reader = _reader()
    destination = np.zeros(2000, np.uint8)
    with pytest.raises(CheckpointError, match=r"part0\.bin: the file ends at byte 1000"):
        reader.read([ByteRange(first, 0, 2000, 0)], LateCopies(destination).copy)
    with pytest.raises(CheckpointError, match="cannot read .*missing.bin"):
        reader.read([ByteRange(first, 0, 10, 0), ByteRange(tmp_path / "missing.bin", 0, 10, 10)],
                    LateCopies(destination).copy)
    good = np.zeros(500, np.uint8)
    reader.read([ByteRange(first, 500, 500, 0)], LateCopies(good).copy)
    reader.close()
    assert good.tobytes() == a[500:]


def test_stored_bytes_are_the_tensors_bytes(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"a": rng.integers(0, 2**16, (6, 5), dtype=np.uint16), "b": rng.standard_normal(7).astype(np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    checkpoint = Checkpoint(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()

    def stored(*args):
        file, first, size = checkpoint.stored_bytes(*args)
        assert file == tmp_path / "model.safetensors"
        return data[first:first + size]

    assert stored("a", (6, 5)) == tensors["a"].tobytes()
    assert stored("a", None, slice(2, 5)) == tensors["a"][2:5].tobytes()
    assert stored("a", None, slice(-2, None)) == tensors["a"][-2:].tobytes()
    assert stored("a", None, slice(4, 2)) == b""
    assert stored("b") == tensors["b"].tobytes()
    assert checkpoint.unconsumed() == []
    assert checkpoint.stored_bytes("a", None, slice(0, 6, 2)) is None
    with pytest.raises(CheckpointError, match=r"'a' has shape \[6, 5\], expected \[5, 6\]"):
        checkpoint.stored_bytes("a", (5, 6))
