"""Running one model over several ranks: the worker processes of a tensor-parallel engine.

An :class:`~metrale.LLM` with ``tensor_parallel_size=N`` is rank 0 of ``N``: its process keeps
the scheduler, the cache's bookkeeping, the sampler and every request, and holds rank 0's shard
of the weights and of the cache (:mod:`metrale.backends.parallel`). Ranks ``1 .. N - 1`` are workers,
each a process with its own backend, its shard of the weights (read from the checkpoint, only
its part) and its cache of the same blocks and slots. A :class:`RankExecutor` starts them,
``"mp"`` as processes on this machine, ``"ray"`` as Ray actors wherever a Ray cluster places
them (``ray.init()`` joins the cluster that ``RAY_ADDRESS`` names, or starts a local one).

Each step the driver's model runner sends every worker the step's metadata -- the rows' arrays
of the :class:`~metrale.batch.ForwardBatch` (tokens, positions, block tables, slots) and the
writes its cache made to recurrent-state rows since the step before -- never a request or a
sequence object; every rank then runs the same forward, the collectives joining them, and rank
0's logits (gathered over the vocabulary) are sampled by the driver. Control messages and, on
the CPU backend, the collectives travel over authenticated TCP connections to rank 0
(:class:`~metrale.backends.parallel.HubCommunicator`). On GPUs each rank takes one device (worker ``r``
of ``"mp"`` runs with ``CUDA_VISIBLE_DEVICES`` set to entry ``r`` of the driver's visible devices)
and the collectives run through NCCL on the rank's stream
(:class:`~metrale.backends.parallel.NcclCommunicator`), inside the decode steps' CUDA graphs.

A worker that fails a step reports it; the driver's step then raises
:class:`~metrale.errors.RankError`, and so does every later step (the worker's cache may have
missed writes): the engine has to be closed and built again. A worker that dies, or does not
answer for ``COLLECTIVE_TIMEOUT`` seconds, does the same. On GPUs a lost worker would leave the
others waiting in a collective on the device: the driver watches its workers and aborts the NCCL
group when one goes (:class:`RankExecutor`), and a worker whose driver is gone exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from typing import Any

import numpy as np

from metrale.backends.parallel import (
    HubCommunicator,
    NcclCommunicator,
    RankLostError,
    Shard,
    nccl_unique_id,
    rank_context,
    visible_cuda_devices,
)
from metrale.batch import ForwardBatch, Segment
from metrale.errors import ConfigError, RankError

logger = logging.getLogger(__name__)

#: Seconds the driver waits for every worker to connect and to load its model.
START_TIMEOUT = 1800.0
#: Seconds between two looks of the GPU driver's watchdog at its workers (and of a worker at its
#: driver).
WATCH_INTERVAL = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank: the checkpoint's folder, the engine options the
    :class:`~metrale.LLM` was given (its :class:`~metrale.config.EngineConfig`), the group, where
    rank 0 listens, and for GPU ranks the NCCL group's id and each rank's device (as
    ``CUDA_VISIBLE_DEVICES`` names it)."""

    model_path: str
    options: dict
    size: int
    expert_parallel: bool
    address: tuple
    authkey: bytes
    nccl_id: tuple | None = None
    devices: tuple[str, ...] = ()
    driver_pid: int = dataclasses.field(default_factory=os.getpid)


@dataclass
class RankSequence:
    """What a worker knows of a step's sequence: its id, recurrent-state slot and block table
    (its row of the batch's ``block_tables``, padded); for a speculative verdict, its cached
    length before the verdict (which the verdict rewinds, as the driver's)."""

    seq_id: int
    state_slot: int | None
    block_table: Any
    num_cached: int = 0


@dataclass
class StepMessage:
    """One step as the workers get it: the batch's row arrays (its segments reduced to
    :class:`RankSequence` stubs and their token counts) and the driver cache's state-row writes
    since the step before."""

    batch: ForwardBatch
    state_writes: list
    #: Whether the step is a speculative verify (the model's ``verifying`` while it runs).
    verifying: bool = False

    @classmethod
    def of(cls, batch: ForwardBatch, state_writes: list, verifying: bool = False) -> "StepMessage":
        return cls(stub_batch(batch), state_writes, verifying)


def stub_batch(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` as a worker gets it: its sequences reduced to :class:`RankSequence` stubs (the
    forward reads only their fields), no extras."""
    segments = [Segment(RankSequence(s.seq.seq_id, s.seq.state_slot, batch.block_tables[i]),  # type: ignore[arg-type]
                        np.asarray(s.token_ids, np.int64), s.start, s.logits)  # type: ignore[arg-type]
                for i, s in enumerate(batch.segments)]
    return dataclasses.replace(batch, segments=segments, extras={})


@dataclass
class VerdictMessage:
    """A speculative verdict as the workers get it (:meth:`RankExecutor.verdict`): the verified
    sequences as stubs with their cached lengths, each one's verified rows and kept drafts."""

    seqs: list
    rows: list
    accepted: list


@dataclass
class DrafterMessage:
    """A drafter module's forward as the workers get it (:meth:`RankExecutor.drafter_forward`):
    the module's batch (stubs, as a step's; its rows run as decode rows of their own,
    :func:`~metrale.runner.graphs.as_decode_rows`) and the main model's final states of its rows
    ``[rows, H]`` float32 on the host."""

    batch: ForwardBatch
    hidden: Any


class RankExecutor:
    """Ranks ``1 .. size - 1`` of an engine (this process is rank 0): :meth:`start` starts them
    and returns rank 0's communicator, :meth:`build_caches` gives them the driver's cache plan,
    :meth:`submit` sends each step (:meth:`finish` ends it), :meth:`close` stops them.

    With ``gpu`` every rank takes one of this machine's visible CUDA devices (rank 0 the first)
    and the collectives run through NCCL; a watchdog thread then checks the workers every
    :data:`WATCH_INTERVAL` seconds and, when one is gone, marks the group broken and aborts the
    NCCL group, which ends rank 0's wait in a collective the lost worker will never join."""

    def __init__(self, model_path: str | os.PathLike, options: dict, size: int, expert_parallel: bool = False,
                 backend: str = "mp", gpu: bool = False) -> None:
        if size < 2:
            raise ConfigError(f"a rank executor needs at least two ranks, got {size}")
        if backend not in ("mp", "ray"):
            raise ConfigError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
        devices: tuple[str, ...] = ()
        nccl_id = None
        if gpu:
            if backend == "ray":
                raise ConfigError("the Ray executor runs CPU ranks only so far (device='cpu'); GPU ranks on one "
                                  "machine run with distributed_executor_backend='mp'")
            devices = tuple(visible_cuda_devices())
            if len(devices) < size:
                raise ConfigError(f"tensor_parallel_size={size} takes {size} GPUs, one a rank; this process sees "
                                  f"{len(devices)} ({', '.join(devices) or 'none'})")
            nccl_id = new_nccl_id()
        self.size, self.backend_name = size, backend
        self._authkey = secrets.token_bytes(32)
        host = "127.0.0.1" if backend == "mp" else "0.0.0.0"
        self._listener = Listener((host, 0), authkey=self._authkey)
        port = self._listener.address[1]
        address = ("127.0.0.1", port) if backend == "mp" else (_node_address(), port)
        self.spec = WorkerSpec(str(model_path), dict(options), size, expert_parallel, address, self._authkey,
                               nccl_id, devices)
        self._workers: list[Any] = []
        self._communicator: HubCommunicator | None = None
        #: Rank 0's NCCL communicator (GPU ranks), None on the CPU.
        self.collectives: Any = None
        self._stop_watching = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._abort_lock = threading.Lock()
        self._state_writes: list = []
        self.broken: str | None = None
        self._closed = False

    # ------------------------------------------------------------------------- starting

    def start(self) -> Any:
        """Start the workers and wait until each has connected (and, on GPUs, joined the NCCL
        group); the communicator of rank 0's collectives."""
        try:
            if self.backend_name == "mp":
                self._start_processes()
            else:
                self._start_actors()
            connections = self._accept()
            self._communicator = HubCommunicator(0, self.size, connections)
            if self.spec.nccl_id is None:
                return self._communicator
            self.collectives = self._join_nccl()
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="metrale-rank-watchdog", daemon=True)
        self._watchdog.start()
        return self.collectives

    def _start_processes(self) -> None:
        # Fresh interpreters (python -m metrale.backends.rank_worker), the spec on their stdin: nothing
        # of the caller's main module is imported again.
        for rank in range(1, self.size):
            environment = dict(os.environ)
            if self.spec.devices:
                environment["CUDA_VISIBLE_DEVICES"] = self.spec.devices[rank]
            process = subprocess.Popen([sys.executable, "-m", "metrale.backends.rank_worker"], stdin=subprocess.PIPE,
                                       env=environment)
            assert process.stdin is not None
            process.stdin.write(pickle.dumps((self.spec, rank)))
            process.stdin.close()
            self._workers.append(process)

    def _start_actors(self) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'metrale[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=True)
        # (CPU ranks: an actor asking for a GPU would wait for ever on a cluster without one.)
        remote = ray.remote(num_cpus=1, num_gpus=0)(RankActor)
        for rank in range(1, self.size):
            actor = remote.remote()
            self._workers.append((actor, actor.run.remote(self.spec, rank)))

    def _alive(self) -> str | None:
        """Why a worker is gone, or None while all run."""
        for rank, worker in enumerate(self._workers, 1):
            if self.backend_name == "mp":
                if worker.poll() is not None:
                    return f"rank {rank}'s process exited with code {worker.returncode}"
            else:
                import ray

                done, _ = ray.wait([worker[1]], timeout=0)
                if done:
                    try:
                        ray.get(done[0])
                    except Exception as error:  # noqa: BLE001 - reported to the caller
                        return f"rank {rank}'s actor failed: {error}"
                    return f"rank {rank}'s actor stopped"
        return None

    def _accept(self) -> list[Any]:
        """Each worker's connection, in rank order."""
        accepted: dict[int, Any] = {}
        failure: list[BaseException] = []

        def accept_all() -> None:
            try:
                while len(accepted) < self.size - 1:
                    connection = self._listener.accept()
                    tag, _, rank = connection.recv()
                    if tag != "hello" or not isinstance(rank, int) or not 0 < rank < self.size or rank in accepted:
                        connection.close()
                        continue
                    accepted[rank] = connection
            except BaseException as error:  # noqa: BLE001 - the listener closed, or a bad peer
                failure.append(error)

        thread = threading.Thread(target=accept_all, name="metrale-rank-accept", daemon=True)
        thread.start()
        self._wait_for(thread, self._listener.close)
        if failure:
            raise RankError(f"the engine's ranks did not start: {failure[0]!r}")
        return [accepted[rank] for rank in range(1, self.size)]

    def _wait_for(self, thread: threading.Thread, give_up: Any = None) -> None:
        """Wait for ``thread`` while every worker runs, at most :data:`START_TIMEOUT` seconds;
        else call ``give_up`` and raise RankError."""
        waited = 0.0
        while thread.is_alive():
            thread.join(0.2)
            waited += 0.2
            gone = self._alive()
            if gone is not None or waited > START_TIMEOUT:
                if give_up is not None:
                    give_up()
                raise RankError(f"the engine's ranks did not start: {gone or f'no answer in {START_TIMEOUT:g} s'}")

    def _join_nccl(self) -> Any:
        """Rank 0's NCCL communicator, once every worker has joined the group (the NCCL
        initialisation blocks until all have; it runs on a thread so a worker that fails first
        is noticed)."""
        joined: list[Any] = []
        unique_id = self.spec.nccl_id
        assert unique_id is not None, "GPU ranks only"

        def join() -> None:
            try:
                joined.append(new_nccl_communicator(0, self.size, unique_id))
            except BaseException as error:  # noqa: BLE001 - raised below
                joined.append(error)

        thread = threading.Thread(target=join, name="metrale-nccl-join", daemon=True)
        thread.start()
        try:
            self._wait_for(thread)
        except RankError:
            self._read_reports()  # (what a worker that could not join said before it exited)
            if self.broken is None:
                raise
            raise RankError(f"the engine's ranks did not start: {self.broken}") from None
        if isinstance(joined[0], BaseException):
            raise RankError(f"rank 0 could not join the NCCL group: {joined[0]!r}") from joined[0]
        return joined[0]

    def _watch(self) -> None:
        """The GPU driver's watchdog: when a worker is gone, break the group and abort NCCL (a
        wait on the device for the lost rank's part would never end)."""
        while not self._stop_watching.wait(WATCH_INTERVAL):
            gone = self._alive()
            if gone is not None:
                self._break(gone)
                self._abort_collectives()
                return

    def _abort_collectives(self) -> None:
        with self._abort_lock:
            if self.collectives is not None:
                self.collectives.abort()

    def build_caches(self, plan: dict) -> None:
        """Send every worker the driver's cache plan (``block_size``, ``num_blocks``,
        ``num_state_slots``, ``num_state_snapshots``, ``kv_cache_dtype``) and wait until each has its model and
        cache; the driver's cache records its state-row writes for them from now on."""
        communicator = self._ready()
        try:
            for rank in range(1, self.size):
                communicator.send(rank, "cache", plan)
            for rank in range(1, self.size):
                communicator.receive(rank, "ready")
        except RankLostError as error:
            self._break(str(error))
            raise RankError(f"a rank of the engine could not load its model: {error}") from None

    def mirror(self, cache: Any) -> None:
        """Record ``cache``'s state-row writes for the workers."""
        cache.mirror_state_writes(self._state_writes)

    # ------------------------------------------------------------------------- steps

    def _ready(self) -> HubCommunicator:
        if self._closed:
            raise RankError("the engine's ranks were stopped")
        if self.broken is not None:
            raise self._broken_error()
        assert self._communicator is not None, "start() first"
        return self._communicator

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why

    def _broken_error(self) -> RankError:
        return RankError(f"a rank of the engine failed ({self.broken}); close this LLM and build it again")

    def submit(self, batch: ForwardBatch, verifying: bool = False) -> None:
        """Send every worker ``batch`` (before rank 0 runs it); ``verifying``: the step is a
        speculative verify."""
        message = StepMessage.of(batch, list(self._state_writes), verifying)
        self._state_writes.clear()
        self._send_all("step", message)

    def verdict(self, seqs: list, rows: list, accepted: list) -> None:
        """Send every worker a speculative verdict (before rank 0 applies it, so the cached
        lengths sent are those it rewinds): a family that keeps per-row state of a verify
        (recurrent states) keeps each sequence's kept rows on every rank."""
        stubs = [RankSequence(seq.seq_id, seq.state_slot, None, seq.num_cached) for seq in seqs]
        self._send_all("verdict", VerdictMessage(stubs, [int(r) for r in rows], [int(a) for a in accepted]))

    def write_adapter(self, slot: int, request: Any) -> None:
        """Have every worker write the adapter of ``request`` (a
        :class:`~metrale.loading.lora.LoRARequest`; its folder read on each rank, so it must be
        readable there at the same path) into adapter slot ``slot``: each rank its part."""
        self._send_all("adapter", (int(slot), request))

    def drafter_forward(self, batch: ForwardBatch, hidden: Any) -> None:
        """Send every worker the forward of the model's drafter module over ``batch`` with the
        final states ``hidden`` (a host array; before rank 0 runs it: the module's collectives
        meet)."""
        self._send_all("drafter", DrafterMessage(stub_batch(batch), np.asarray(hidden, dtype=np.float32)))

    def capture_graphs(self, sizes: tuple[int, ...], mixed: tuple[int, int] | None) -> None:
        """Have every worker record the decode graphs :meth:`~metrale.LLM.capture_graphs`
        records on rank 0 (before rank 0 does: their eager runs meet in the collectives)."""
        self._send_all("capture", (tuple(sizes), mixed))

    def _send_all(self, kind: str, payload: Any) -> None:
        """Send every worker the next step's ``kind`` message, after reading what they reported
        since the last one (a failure breaks the group)."""
        communicator = self._ready()
        self._read_reports()
        if self.broken is not None:
            raise self._broken_error()
        communicator.step += 1
        try:
            for rank in range(1, self.size):
                communicator.send(rank, kind, payload)
        except RankLostError as error:
            self._break(str(error))
            raise self._broken_error() from None

    def _read_reports(self) -> None:
        """Read what the workers reported since the last step (on the CPU, after the last
        collective they joined; on GPUs, before they exit): an error breaks the group, and its
        text replaces a vaguer reason (a process that exited)."""
        connections = self._communicator.connections if self._communicator is not None else []
        for rank, connection in enumerate(connections, 1):
            try:
                while connection.poll(0):
                    tag, step, report = connection.recv()
                    if tag == "error":
                        self.broken = f"rank {rank} failed in step {step}: {report}"
                        return
            except (EOFError, OSError) as error:
                self._break(f"rank {rank} went away ({type(error).__name__})")

    def finish(self, backend: Any) -> None:
        """Rank 0 has queued its part of the step on ``backend``. On GPUs wait until the device
        has run it (the watchdog ends the wait when a worker is lost); raise RankError when the
        group broke meanwhile, so no output of a broken step is used."""
        try:
            if self.collectives is not None:
                backend.synchronize()
        except Exception as error:
            if self.broken is None:
                raise
            self._read_reports()
            raise self._broken_error() from error
        if self.broken is not None:
            self._read_reports()
            raise self._broken_error()

    def abandon(self, error: BaseException) -> None:
        """Rank 0's step failed: release the workers still waiting in its collectives. A lost or
        failed worker (:class:`~metrale.backends.parallel.RankLostError`) breaks the executor; so does any
        failure on GPUs, where the workers' collectives already queued on their devices would
        pair with the next step's (the NCCL group is aborted)."""
        if isinstance(error, RankLostError):
            self._break(str(error))
        if self.collectives is not None:
            self._break(f"rank 0's step failed ({error!r})")
            self._abort_collectives()
        communicator = self._communicator
        if communicator is None:
            return
        for rank in range(1, self.size):
            try:
                communicator.send(rank, "error", f"rank 0 failed: {error!r}")
            except RankLostError as lost:
                self._break(str(lost))

    def close(self) -> None:
        """Stop the workers (they exit after their step), the watchdog, the NCCL group and the
        listener. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if self._communicator is not None:
            for rank in range(1, self.size):
                try:
                    self._communicator.send(rank, "close", None)
                except RankLostError:
                    pass
        for worker in self._workers:
            if self.backend_name == "mp":
                try:
                    worker.wait(5 if self.broken is not None else 30)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait(5)
            else:
                import ray

                try:
                    ray.get(worker[1], timeout=30)
                except Exception:  # noqa: BLE001 - the actor is killed below either way
                    pass
                ray.kill(worker[0])
        if self._communicator is not None:
            for connection in self._communicator.connections:
                connection.close()
        # (Aborted, not destroyed: the workers are gone, and a destroy may wait for peers, or for
        # a broken group's pending collectives.)
        self._abort_collectives()
        self._listener.close()


def _node_address() -> str:
    """This node's address as the Ray cluster knows it."""
    import ray

    return ray.util.get_node_ip_address()


# ----------------------------------------------------------------------------- the worker side


class RankActor:
    """A worker rank as a Ray actor: :meth:`run` is :func:`worker_main`."""

    def run(self, spec: WorkerSpec, rank: int) -> None:
        worker_main(spec, rank)


def worker_main(spec: WorkerSpec, rank: int) -> None:
    """A worker's life: connect to rank 0 (on GPUs join the NCCL group), build rank ``rank``'s
    model (its shard of the weights) and, once the driver sends its plan, its cache; then run
    each step the driver sends until told to close."""
    connection = Client(spec.address, authkey=spec.authkey)
    connection.send(("hello", 0, rank))
    communicator = HubCommunicator(rank, spec.size, [connection])
    collectives: Any = None
    try:
        try:
            if spec.nccl_id is not None:
                collectives = new_nccl_communicator(rank, spec.size, spec.nccl_id)
            model = _build_rank(spec, rank, communicator, collectives or communicator)  # (its runner refers to it weakly)
            runner = model.runner
        except BaseException as error:  # noqa: BLE001 - reported to rank 0
            communicator.send(0, "error", f"{error!r}\n{traceback.format_exc()}")
            return
        while True:
            tag, step, payload = connection.recv()
            if tag == "close":
                return
            if tag not in ("step", "capture", "verdict", "drafter", "adapter"):
                continue  # a failed step's release, arrived after this rank finished it
            communicator.step = step
            try:
                if tag == "capture":
                    runner.capture_graphs(*payload)
                elif tag == "adapter":
                    model.lora_manager.write_slot(*payload)
                elif tag == "verdict":
                    model.verdict(payload.seqs, payload.rows, payload.accepted, None)
                elif tag == "drafter":
                    _run_drafter(model, payload)
                else:
                    _run_step(model, runner, payload)
            except RankLostError:
                if communicator.closed:
                    return
                continue  # another rank failed this step; the driver knows
            except Exception as error:  # noqa: BLE001 - reported to rank 0
                logger.exception("rank %d failed step %d", rank, step)
                communicator.send(0, "error", repr(error))
                if collectives is not None:
                    # Rank 0 waits on its device for this rank's part of the step: the exit lets
                    # its watchdog see the loss and abort the group.
                    return
    except (EOFError, OSError, RankLostError):
        return  # rank 0 went away
    finally:
        connection.close()
        if collectives is not None:
            collectives.abort()  # (a step left half done on the device must not hold the exit)


def _enable_lora(model: Any, backend: Any, options: dict, environment: Any) -> None:
    """A worker's adapter slots, built as rank 0 builds its own (before the cache), with the
    manager that writes its part of each adapter rank 0 writes (``model.lora_manager``)."""
    from metrale.config import EngineConfig
    from metrale.engine.lora_slots import LoraManager

    config = EngineConfig.from_options(options, environment)
    with backend.activate():
        layout = model.enable_lora(config.max_loras, config.max_lora_rank)
    model.lora_layout = layout
    model.lora_manager = LoraManager(backend, layout, max_lora_rank=config.max_lora_rank,
                                     vocab_size=model.vocab_size)


def _run_step(model: Any, runner: Any, message: StepMessage) -> None:
    """A worker's step: what a verdict left pending folded in (as rank 0's flush stage does),
    the driver's state-row writes applied, the forward run (as a verify when it is one, set up
    by the model's ``begin_verify`` as rank 0's ``verify`` does)."""
    flush = getattr(model, "flush_pending", None)
    if flush is not None:
        flush()
    runner.cache.apply_state_writes(message.state_writes)
    if message.verifying:
        begin = getattr(model, "begin_verify", None)
        if begin is not None:
            begin(list(message.batch.segments))
    model.verifying = message.verifying
    try:
        runner.forward(message.batch)
    finally:
        model.verifying = False


def _run_drafter(model: Any, message: DrafterMessage) -> None:
    """A worker's part of the drafter module's forward (:meth:`RankExecutor.drafter_forward`)."""
    from metrale.runner.graphs import as_decode_rows

    backend = model.backend
    with backend.activate():
        batch = backend.prepare_batch(as_decode_rows(message.batch))
        model.mtp_forward(batch, backend.xp.asarray(message.hidden))


def exit_with_parent(parent: int, interval: float = WATCH_INTERVAL) -> threading.Thread:
    """Exit this process as soon as it is no longer the child of process ``parent`` (a worker
    process of ``"mp"`` and its driver: a GPU worker whose driver died may be waiting on the
    device for a collective that will never complete, and would outlive it)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="metrale-parent-watch", daemon=True)
    thread.start()
    return thread


def new_nccl_id() -> tuple:
    """A new NCCL group's id, or ConfigError where CuPy finds no NCCL library."""
    from cupy.cuda import nccl

    if not nccl.available:
        raise ConfigError("tensor parallelism on GPUs needs NCCL, which CuPy does not find here: "
                          "pip install 'metrale[gpu,nccl]' (or install a system NCCL), or use tensor_parallel_size=1")
    return nccl_unique_id()


def new_nccl_communicator(rank: int, size: int, unique_id: tuple) -> Any:
    """Rank ``rank``'s :class:`~metrale.backends.parallel.NcclCommunicator` on this process's first CUDA
    device (each worker sees only its own)."""
    import cupy

    cupy.cuda.Device(0).use()
    return NcclCommunicator(rank, size, unique_id)


def _build_rank(spec: WorkerSpec, rank: int, communicator: HubCommunicator, collectives: Any) -> Any:
    """Rank ``rank``'s model with its cache bound, as :class:`~metrale.LLM` builds rank 0's;
    ``collectives`` joins its forward to the other ranks' (the hub's ``communicator`` on the CPU,
    NCCL on GPUs)."""
    from metrale.cache import ModelCache
    from metrale.loading.model import load_rank_model
    from metrale.model.forward import ModelForward
    from metrale.runner import ModelRunner

    shard = Shard(rank, spec.size, spec.expert_parallel)
    with rank_context(shard, collectives):
        model, backend, plugin_manager, environment = load_rank_model(spec.model_path, spec.options)
    forward = ModelForward(model, plugin_manager, environment)
    if spec.options.get("enable_lora"):
        _enable_lora(model, backend, spec.options, environment)
    speculative = spec.options.get("speculative_config")
    prepare = getattr(model, "prepare_speculation", None)
    if speculative is not None and prepare is not None:
        # (As rank 0 does before its cache: a drafter module's cache layers are part of the plan.)
        from metrale.speculative import SpeculativeConfig

        prepare(SpeculativeConfig.from_value(speculative))
    plan = communicator.receive(0, "cache")
    cache = ModelCache(forward.cache_spec(), backend, block_size=plan["block_size"], num_blocks=plan["num_blocks"],
                       num_state_slots=plan["num_state_slots"], num_state_snapshots=plan["num_state_snapshots"],
                       kv_cache_dtype=plan.get("kv_cache_dtype", "auto"))
    model.bind_cache(cache, ModelRunner(model, cache))
    backend.synchronize()
    communicator.send(0, "ready", None)
    return model
