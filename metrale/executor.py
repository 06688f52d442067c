"""Running one model over several ranks: the worker processes of a tensor-parallel engine.

An :class:`~metrale.LLM` with ``tensor_parallel_size=N`` is rank 0 of ``N``: its process keeps
the scheduler, the cache's bookkeeping, the sampler and every request, and holds rank 0's shard
of the weights and of the cache (:mod:`metrale.parallel`). Ranks ``1 .. N - 1`` are workers,
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
(:class:`~metrale.parallel.HubCommunicator`).

A worker that fails a step reports it; the driver's step then raises
:class:`~metrale.errors.RankError`, and so does every later step (the worker's cache may have
missed writes): the engine has to be closed and built again. A worker that dies, or does not
answer for ``COLLECTIVE_TIMEOUT`` seconds, does the same.
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
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch, Segment
from metrale.errors import ConfigError, RankError
from metrale.parallel import HubCommunicator, RankLostError, Shard, rank_context

logger = logging.getLogger(__name__)

#: Seconds the driver waits for every worker to connect and to load its model.
START_TIMEOUT = 1800.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank: the checkpoint's folder, the engine options the
    :class:`~metrale.LLM` was given (its :class:`~metrale.config.EngineConfig`), the group, and
    where rank 0 listens."""

    model_path: str
    options: dict
    size: int
    expert_parallel: bool
    address: tuple
    authkey: bytes


@dataclass(frozen=True)
class RankSequence:
    """What a worker knows of a step's sequence: its id, recurrent-state slot and block table
    (its row of the batch's ``block_tables``, padded)."""

    seq_id: int
    state_slot: int | None
    block_table: Any


@dataclass
class StepMessage:
    """One step as the workers get it: the batch's row arrays (its segments reduced to
    :class:`RankSequence` stubs and their token counts) and the driver cache's state-row writes
    since the step before."""

    batch: ForwardBatch
    state_writes: list

    @classmethod
    def of(cls, batch: ForwardBatch, state_writes: list) -> "StepMessage":
        # (Stubs where the forward contract has sequences: the forward reads only these fields.)
        segments = [Segment(RankSequence(s.seq.seq_id, s.seq.state_slot, batch.block_tables[i]),  # type: ignore[arg-type]
                            np.asarray(s.token_ids, np.int64), s.start, s.logits)  # type: ignore[arg-type]
                    for i, s in enumerate(batch.segments)]
        return cls(dataclasses.replace(batch, segments=segments, extras={}), state_writes)


class RankExecutor:
    """Ranks ``1 .. size - 1`` of an engine (this process is rank 0): :meth:`start` starts them
    and returns rank 0's communicator, :meth:`build_caches` gives them the driver's cache plan,
    :meth:`submit` sends each step, :meth:`close` stops them."""

    def __init__(self, model_path: str | os.PathLike, options: dict, size: int, expert_parallel: bool = False,
                 backend: str = "mp") -> None:
        if size < 2:
            raise ConfigError(f"a rank executor needs at least two ranks, got {size}")
        if backend not in ("mp", "ray"):
            raise ConfigError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
        self.size, self.backend_name = size, backend
        self._authkey = secrets.token_bytes(32)
        host = "127.0.0.1" if backend == "mp" else "0.0.0.0"
        self._listener = Listener((host, 0), authkey=self._authkey)
        port = self._listener.address[1]
        address = ("127.0.0.1", port) if backend == "mp" else (_node_address(), port)
        self.spec = WorkerSpec(str(model_path), dict(options), size, expert_parallel, address, self._authkey)
        self._workers: list[Any] = []
        self._communicator: HubCommunicator | None = None
        self._state_writes: list = []
        self.broken: str | None = None
        self._closed = False

    # ------------------------------------------------------------------------- starting

    def start(self) -> HubCommunicator:
        """Start the workers and wait until each has connected; rank 0's communicator."""
        try:
            if self.backend_name == "mp":
                self._start_processes()
            else:
                self._start_actors()
            connections = self._accept()
        except BaseException:
            self.close()
            raise
        self._communicator = HubCommunicator(0, self.size, connections)
        return self._communicator

    def _start_processes(self) -> None:
        # Fresh interpreters (python -m metrale._rank_worker), the spec on their stdin: nothing
        # of the caller's main module is imported again.
        for rank in range(1, self.size):
            process = subprocess.Popen([sys.executable, "-m", "metrale._rank_worker"], stdin=subprocess.PIPE)
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
        gpus = 1 if self.spec.options.get("device", "auto") != "cpu" else 0
        remote = ray.remote(num_cpus=1, num_gpus=gpus)(RankActor)
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
        waited = 0.0
        while thread.is_alive():
            thread.join(0.2)
            waited += 0.2
            gone = self._alive()
            if gone is not None or waited > START_TIMEOUT:
                self._listener.close()
                raise RankError(f"the engine's ranks did not start: {gone or f'no answer in {START_TIMEOUT:g} s'}")
        if failure:
            raise RankError(f"the engine's ranks did not start: {failure[0]!r}")
        return [accepted[rank] for rank in range(1, self.size)]

    def build_caches(self, plan: dict) -> None:
        """Send every worker the driver's cache plan (``block_size``, ``num_blocks``,
        ``num_state_slots``, ``num_state_snapshots``) and wait until each has its model and
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
            raise RankError(f"a rank of the engine failed ({self.broken}); close this LLM and build it again")
        assert self._communicator is not None, "start() first"
        return self._communicator

    def _break(self, why: str) -> None:
        self.broken = why

    def submit(self, batch: ForwardBatch) -> None:
        """Send every worker ``batch`` (before rank 0 runs it)."""
        communicator = self._ready()
        for rank, connection in enumerate(communicator.connections, 1):
            try:
                while connection.poll(0):  # what a worker reported after the last collective it joined
                    tag, step, payload = connection.recv()
                    if tag == "error":
                        self._break(f"rank {rank} failed in step {step}: {payload}")
            except (EOFError, OSError) as error:
                self._break(f"rank {rank} went away ({type(error).__name__})")
            if self.broken is not None:
                raise RankError(f"a rank of the engine failed ({self.broken}); close this LLM and build it again")
        communicator.step += 1
        message = StepMessage.of(batch, list(self._state_writes))
        self._state_writes.clear()
        try:
            for rank in range(1, self.size):
                communicator.send(rank, "step", message)
        except RankLostError as error:
            self._break(str(error))
            raise RankError(f"a rank of the engine failed ({error}); close this LLM and build it again") from None

    def abandon(self, error: BaseException) -> None:
        """Rank 0's step failed: release the workers still waiting in its collectives. A lost or
        failed worker (:class:`~metrale.parallel.RankLostError`) breaks the executor."""
        if isinstance(error, RankLostError):
            self._break(str(error))
        communicator = self._communicator
        if communicator is None:
            return
        for rank in range(1, self.size):
            try:
                communicator.send(rank, "error", f"rank 0 failed: {error!r}")
            except RankLostError as lost:
                self._break(str(lost))

    def close(self) -> None:
        """Stop the workers (they exit after their step) and the listener. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._communicator is not None:
            for rank in range(1, self.size):
                try:
                    self._communicator.send(rank, "close", None)
                except RankLostError:
                    pass
        for worker in self._workers:
            if self.backend_name == "mp":
                try:
                    worker.wait(30)
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
    """A worker's life: connect to rank 0, build rank ``rank``'s model (its shard of the
    weights) and, once the driver sends its plan, its cache; then run each step the driver
    sends until told to close."""
    connection = Client(spec.address, authkey=spec.authkey)
    connection.send(("hello", 0, rank))
    communicator = HubCommunicator(rank, spec.size, [connection])
    try:
        try:
            model = _build_rank(spec, rank, communicator)  # (its runner refers to it weakly)
            runner = model.runner
        except BaseException as error:  # noqa: BLE001 - reported to rank 0
            communicator.send(0, "error", f"{error!r}\n{traceback.format_exc()}")
            return
        while True:
            tag, step, payload = connection.recv()
            if tag == "close":
                return
            if tag != "step":
                continue  # a failed step's release, arrived after this rank finished it
            communicator.step = step
            try:
                runner.cache.apply_state_writes(payload.state_writes)
                runner.forward(payload.batch)
            except RankLostError:
                if communicator.closed:
                    return
                continue  # another rank failed this step; the driver knows
            except Exception as error:  # noqa: BLE001 - reported to rank 0
                logger.exception("rank %d failed step %d", rank, step)
                communicator.send(0, "error", repr(error))
    except (EOFError, OSError, RankLostError):
        return  # rank 0 went away
    finally:
        connection.close()


def _build_rank(spec: WorkerSpec, rank: int, communicator: HubCommunicator) -> Any:
    """Rank ``rank``'s model with its cache bound, as :class:`~metrale.LLM` builds rank 0's."""
    from metrale.api import load_rank_model
    from metrale.cache import ModelCache
    from metrale.forward import ModelForward

    shard = Shard(rank, spec.size, spec.expert_parallel)
    with rank_context(shard, communicator):
        model, backend, plugin_manager, environment = load_rank_model(spec.model_path, spec.options)
    forward = ModelForward(model, plugin_manager, environment)
    plan = communicator.receive(0, "cache")
    cache = ModelCache(forward.cache_spec(), backend, block_size=plan["block_size"], num_blocks=plan["num_blocks"],
                       num_state_slots=plan["num_state_slots"], num_state_snapshots=plan["num_state_snapshots"])
    model.bind_cache(cache)
    backend.synchronize()
    communicator.send(0, "ready", None)
    return model
