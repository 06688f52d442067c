"""Splitting a model across ranks: which part of each weight a rank holds, and the collectives
that join the ranks' partial results.

A rank of a tensor-parallel group of ``size`` ranks holds:

* column-parallel projections (q/k/v, gate/up): its heads' or its slice's output rows;
* row-parallel projections (o, down): the matching input columns; its partial outputs are summed
  over the ranks (:meth:`Communicator.all_reduce`) before the residual add;
* the vocabulary-parallel embedding and LM head: its slice of the vocabulary's rows (embedding
  rows outside it are zero and summed over the ranks; logits gathered,
  :meth:`Communicator.all_gather`);
* key/value heads split across the ranks, or, when there are fewer of them than ranks, the one
  head its query heads read (replicated).

:class:`Shard` says which slices a rank reads; :class:`Communicator` is what joins the ranks:
:class:`SoloCommunicator` for one rank, :class:`ThreadedRanks` for ranks simulated in one process
(each rank's forward on its own thread, collectives meeting at a barrier), which the CPU tests use
to check a sharded forward against the unsharded one.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import numpy as np

from metrale.errors import ConfigError, RankError


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks. With ``expert_parallel`` an
    MoE layer's routed experts are spread over the ranks (each holding its experts whole) instead
    of each expert's intermediate size being split."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.size!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.size:
            raise ConfigError(f"rank must be in [0, {self.size}), got {self.rank!r}")

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def split(self, total: int, what: str) -> slice:
        """This rank's equal part of ``total`` (rows, heads, experts); ``what`` names them in the
        error when ``total`` does not divide evenly."""
        if total % self.size:
            raise ConfigError(f"{what}={total} does not split evenly over tensor_parallel_size={self.size}")
        part = total // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> slice:
        """The key/value heads this rank holds: its equal part when there are at least as many
        as ranks; else the one head its query heads (:meth:`split` of ``num_heads``) read."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ConfigError(f"num_key_value_heads={num_kv_heads} is fewer than tensor_parallel_size={self.size} "
                              "ranks and does not divide it: the ranks cannot share heads evenly")
        heads = self.split(num_heads, "num_attention_heads")
        head = heads.start // (num_heads // num_kv_heads)
        return slice(head, head + 1)


def rows_of(array: np.ndarray, part: slice, block: int = 1) -> np.ndarray:
    """The rows ``part`` of ``array`` counted in blocks of ``block`` rows (``part`` of heads,
    ``block`` the head size)."""
    return array[part.start * block : part.stop * block]


class Communicator(Protocol):
    """What joins the ranks of a tensor-parallel group."""

    rank: int
    size: int

    def all_reduce(self, x: Any) -> Any:
        """The sum of every rank's ``x`` (the same shape on every rank), on every rank."""
        ...

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        """Every rank's ``x`` concatenated along ``axis`` in rank order, on every rank."""
        ...


def sum_in_rank_order(parts: list[Any]) -> Any:
    """The sum of the ranks' ``parts`` (NumPy arrays), added in rank order: every rank that
    computes it gets the same bits."""
    total = np.array(parts[0], copy=True)
    for part in parts[1:]:
        total += part
    return total


class SoloCommunicator:
    """One rank: the collectives return their input."""

    rank = 0
    size = 1

    def all_reduce(self, x: Any) -> Any:
        return x

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        return x


class ThreadedRanks:
    """``size`` ranks simulated in one process: each rank runs on its own thread with the
    :class:`ThreadCommunicator` of :meth:`communicator`; a collective waits until every rank has
    brought its part, and every rank then combines the parts in rank order (the same result on
    every rank)."""

    def __init__(self, size: int, timeout: float = 600.0) -> None:
        Shard(0, size)  # checks size
        self.size = size
        self._parts: list[Any] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def communicator(self, rank: int) -> "ThreadCommunicator":
        Shard(rank, self.size)  # checks rank
        return ThreadCommunicator(self, rank)

    def abort(self) -> None:
        """Break the barrier: ranks waiting in a collective raise (one rank failed)."""
        self._barrier.abort()

    def exchange(self, rank: int, part: Any) -> list[Any]:
        self._parts[rank] = part
        self._barrier.wait()
        parts = list(self._parts)
        self._barrier.wait()  # every rank has read the parts before any rank writes its next
        return parts


@dataclass
class ThreadCommunicator:
    """Rank ``rank`` of a :class:`ThreadedRanks`. NumPy arrays, or CuPy arrays of ranks whose
    backends share a process (and a GPU): those travel through host copies (the rank's stream is
    waited for), and the result comes back on the rank's current stream -- a check of sharded GPU
    kernels, not a fast path (and not capturable into a CUDA graph)."""

    group: ThreadedRanks
    rank: int

    @property
    def size(self) -> int:
        return self.group.size

    def all_reduce(self, x: Any) -> Any:
        host, device = _host_copy(x)
        return _back(sum_in_rank_order(self.group.exchange(self.rank, host)), device)

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        host, device = _host_copy(x)
        return _back(np.concatenate(self.group.exchange(self.rank, host), axis=axis), device)


def _host_copy(x: Any) -> tuple[np.ndarray, Any]:
    """``(a host copy of x, CuPy where x is a CuPy array else None)``."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__cuda_array_interface__"):
        return np.array(x, copy=True), None
    import cupy

    return cupy.asnumpy(x, stream=cupy.cuda.get_current_stream()), cupy


def _back(result: np.ndarray, device: Any) -> Any:
    return result if device is None else device.asarray(result)


def run_ranks(size: int, work: Any) -> list[Any]:
    """``[work(communicator) for each rank]``, each rank on its own thread of one
    :class:`ThreadedRanks` group; the first rank's exception is raised (after the others are
    released from their collectives)."""
    group = ThreadedRanks(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = work(group.communicator(rank))
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors[rank] = error
            group.abort()

    threads = [threading.Thread(target=run, args=(rank,), name=f"metrale-rank-{rank}") for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((error for error in errors if error is not None and not isinstance(error, threading.BrokenBarrierError)),
                 next((error for error in errors if error is not None), None))
    if first is not None:
        raise first
    return results


_rank = threading.local()


@contextlib.contextmanager
def rank_context(shard: Shard, communicator: Communicator) -> Iterator[None]:
    """Backends made on this thread inside the block (:func:`metrale.backends.devices.get_backend`) are
    rank ``shard.rank`` of ``shard.size``, joined by ``communicator``: a model loaded on one reads
    its shard of the weights (how a rank's worker builds its model)."""
    if communicator.size != shard.size or communicator.rank != shard.rank:
        raise ConfigError(f"communicator of rank {communicator.rank} of {communicator.size} for shard "
                          f"{shard.rank} of {shard.size}")
    previous = getattr(_rank, "current", None)
    _rank.current = (shard, communicator)
    try:
        yield
    finally:
        _rank.current = previous


def current_rank() -> tuple[Shard, Communicator]:
    """The rank of backends made on this thread now (:func:`rank_context`; one rank outside)."""
    current = getattr(_rank, "current", None)
    return current if current is not None else (Shard(), SoloCommunicator())


# ------------------------------------------------------------------------- ranks in processes

#: Seconds a rank waits for another rank's part of a collective (or a worker for its next
#: message is unbounded: it waits for work) before giving up with an EngineError.
COLLECTIVE_TIMEOUT = 600.0


class RankLostError(RankError):
    """Another rank of the group failed or went away; the message says which and why."""


class HubCommunicator:
    """Rank ``rank`` of ``size`` ranks in separate processes (on one machine or several), joined
    through rank 0: ``connections`` are rank 0's connections to ranks ``1 .. size - 1`` (on rank
    0) or this rank's one connection to rank 0 (on the others), :mod:`multiprocessing.connection`
    connections (authenticated TCP). In a collective every rank sends its part to rank 0, which
    combines the parts in rank order and sends the result back: every rank gets the same bits.
    For NumPy arrays (CPU-backend ranks).

    Messages carry the step (:attr:`step`, which the executor advances on every rank before each
    forward), so a step that failed on some rank leaves nothing behind for the next: parts and
    results of earlier steps are dropped. A rank that reports an error instead of its part (a
    ``("error", step, why)`` message), or whose connection closes, makes the collective raise
    :class:`RankLostError`."""

    def __init__(self, rank: int, size: int, connections: list[Any], timeout: float = COLLECTIVE_TIMEOUT) -> None:
        Shard(rank, size)  # checks both
        expected = size - 1 if rank == 0 else 1
        if len(connections) != expected:
            raise ConfigError(f"rank {rank} of {size} needs {expected} connections, got {len(connections)}")
        self.rank, self.size, self.timeout = rank, size, timeout
        self.connections = connections
        #: The step whose collectives run now.
        self.step = 0
        #: Whether a ``close`` message came (the group is being stopped).
        self.closed = False

    def receive(self, peer: int, kind: str) -> Any:
        """The next ``kind`` message of this step from ``peer`` (0 on the ranks past 0)."""
        connection = self.connections[peer - 1 if self.rank == 0 else 0]
        while True:
            try:
                ready = connection.poll(self.timeout)
                message = connection.recv() if ready else None
            except (EOFError, OSError) as error:
                raise RankLostError(f"rank {peer} went away ({type(error).__name__})") from None
            if not ready:
                raise RankLostError(f"rank {peer} sent nothing for {self.timeout:g} s")
            tag, step, payload = message  # type: ignore[misc]  # (set when ready)
            if step < self.step:
                continue  # left by a step that failed
            if tag == "error":
                raise RankLostError(f"rank {peer} failed: {payload}")
            if tag == "close":
                self.closed = True
                raise RankLostError(f"rank {peer} closed the group")
            if tag != kind:
                raise RankLostError(f"rank {peer} sent {tag!r} where {kind!r} was expected")
            return payload

    def send(self, peer: int, kind: str, payload: Any) -> None:
        """Send ``peer`` a ``kind`` message of this step."""
        connection = self.connections[peer - 1 if self.rank == 0 else 0]
        try:
            connection.send((kind, self.step, payload))
        except (EOFError, OSError) as error:
            raise RankLostError(f"rank {peer} went away ({type(error).__name__})") from None

    def _exchange(self, part: Any, combine: Any) -> Any:
        if self.size == 1:
            return combine([part])
        if self.rank:
            self.send(0, "part", part)
            return self.receive(0, "result")
        parts = [part] + [self.receive(peer, "part") for peer in range(1, self.size)]
        result = combine(parts)
        for peer in range(1, self.size):
            self.send(peer, "result", result)
        return result

    def all_reduce(self, x: Any) -> Any:
        return self._exchange(np.asarray(x), sum_in_rank_order)

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        return self._exchange(np.asarray(x), lambda parts: np.concatenate(parts, axis=axis))


class NcclCommunicator:
    """Rank ``rank`` of ``size`` GPU ranks joined by NCCL (CuPy's binding, one GPU per rank):
    each collective runs on the current CuPy stream (the backend's, inside
    ``backend.activate()``), so a decode step's collectives are captured into its CUDA graph with
    the kernels around them. ``unique_id`` is rank 0's :func:`nccl_unique_id`, handed to every
    rank before they join (the NCCL initialisation waits until all ``size`` ranks have called
    it). Float32, float16 and int32 arrays; the result is a new array."""

    def __init__(self, rank: int, size: int, unique_id: tuple) -> None:
        Shard(rank, size)  # checks both
        from cupy.cuda import nccl

        self.rank, self.size = rank, size
        self._nccl = nccl
        self._communicator = nccl.NcclCommunicator(size, unique_id, rank)
        self._closed = False

    def _type(self, array: Any) -> int:
        nccl = self._nccl
        types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
                 np.dtype(np.int32): nccl.NCCL_INT32}
        if array.dtype not in types:
            raise ConfigError(f"NCCL collectives take float32, float16 or int32 arrays, got {array.dtype}")
        return types[array.dtype]

    def all_reduce(self, x: Any) -> Any:
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        stream = cupy.cuda.get_current_stream()
        self._communicator.allReduce(x.data.ptr, out.data.ptr, x.size, self._type(x), self._nccl.NCCL_SUM, stream.ptr)
        return out

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        import cupy

        x = cupy.ascontiguousarray(x)
        parts = cupy.empty((self.size, *x.shape), dtype=x.dtype)
        stream = cupy.cuda.get_current_stream()
        self._communicator.allGather(x.data.ptr, parts.data.ptr, x.size, self._type(x), stream.ptr)
        return cupy.concatenate(list(parts), axis=axis)

    def abort(self) -> None:
        """Stop the group at once: collectives queued or running on any stream of this rank end
        without their result (how a rank waiting for a lost peer is released). The communicator
        is unusable afterwards; :meth:`close` does nothing more."""
        if not self._closed:
            self._closed = True
            self._communicator.abort()

    def close(self) -> None:
        """Free the NCCL communicator (after the last collective). Idempotent."""
        if not self._closed:
            self._closed = True
            self._communicator.destroy()


def nccl_unique_id() -> tuple:
    """A new NCCL group's id (rank 0 makes it; every rank passes it to :class:`NcclCommunicator`)."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def visible_cuda_devices(count: int | None = None) -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices or
    UUIDs): that variable's entries when it is set, else ``0 .. count - 1`` (``count``: the
    devices the CUDA runtime reports, asked only then). Rank ``r`` of a group on one machine runs
    on entry ``r``."""
    import os

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        devices = []
        for entry in (entry.strip() for entry in listed.split(",")):
            if not entry or entry.startswith("-"):
                break  # (CUDA ignores the entries after an invalid one; "-1" hides every device)
            devices.append(entry)
        return devices
    if count is None:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    return [str(index) for index in range(count)]
