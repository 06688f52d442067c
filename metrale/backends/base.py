"""Device backends: where arrays live and which implementation of each op runs.

* ``cpu`` -- NumPy float32 reference ops (the reference of every kernel module in
  :mod:`metrale.kernels`). What CI and the parity tests run.
* ``cuda`` -- CuPy arrays, ``numba.cuda`` kernels and cuBLAS (:mod:`metrale.backends.cuda`).
  Nothing CUDA-related is imported before a CUDA backend is asked for.

Family code calls ``backend.ops.<op>``, ``backend.load_weight`` / ``backend.constant`` and
``backend.xp`` (the array module) only, so the same model code runs on both. The ops are declared
in :mod:`metrale.ops` (each with its NumPy reference, which the CPU backend runs); the op
reference of the documentation lists them with their shapes and dtypes on each backend.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Any

import numpy as np

from metrale.backends.parallel import Shard, SoloCommunicator


class Backend:
    """Base class: array placement and the op table."""

    name = "abstract"
    #: NumPy-compatible array module (numpy or cupy).
    xp: Any = np
    #: dtype of cached K/V and latent values.
    cache_dtype: Any = np.float32
    #: The op table: every declared op bound to this backend's kernels.
    ops: Any
    #: This backend's rank of a tensor-parallel group (:mod:`metrale.backends.parallel`): the part of each
    #: weight its model holds, and what joins the ranks' partial results.
    shard: Any = Shard()
    communicator: Any = SoloCommunicator()
    #: The ``METRALE_*`` settings (:class:`~metrale.config.EnvironmentConfig`) the op table binds
    #: kernels under (a kernel's ``enabled``, :class:`~metrale.ops.Kernel`); None: the defaults.
    environment: Any = None

    @property
    def batch_invariant(self) -> bool:
        """Whether this backend computes every row from that row's inputs alone (the engine's
        ``batch_invariant`` option; :mod:`metrale.kernels.batch_invariant`)."""
        return bool(getattr(self.environment, "batch_invariant", False))

    def all_reduce(self, x: Any) -> Any:
        """The sum of ``x`` over the ranks (``x`` itself on one rank)."""
        return self.communicator.all_reduce(x) if self.shard.sharded else x

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        """``x`` of every rank concatenated along ``axis`` (``x`` itself on one rank)."""
        return self.communicator.all_gather(x, axis) if self.shard.sharded else x

    def load_weight(self, checkpoint: Any, *parts: tuple) -> Any:
        """Read tensors ``(name, shape)`` from ``checkpoint``, concatenated along the first axis,
        as a weight in this backend's format (float32 on the CPU, bf16 bits on the GPU). A part
        ``(name, shape, rows, columns)`` reads those rows and columns only (slices or None: a
        rank's shard, :meth:`~metrale.loading.checkpoint.Checkpoint.tensor`). Weights the
        checkpoint stores quantized (or that ``quantization=`` quantizes at load) come back as one
        :class:`~metrale.kernels.quantized.QuantizedWeight`, which the matrix-product ops take."""
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Drop what only loading weights needed (on the GPU, the page-locked staging buffers of
        :meth:`load_weight`); called once a model is loaded (a later :meth:`load_weight` makes
        them again)."""

    def constant(self, host: np.ndarray) -> Any:
        """A float32 array (biases, RoPE frequencies) on this backend."""
        raise NotImplementedError

    def weight(self, host: np.ndarray) -> Any:
        """A matrix computed on the host, as a weight in this backend's format (float32 on the
        CPU, bf16 bits on the GPU)."""
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.xp.zeros(shape, dtype=dtype)

    def to_numpy(self, array: Any) -> np.ndarray:
        """Copy an array of this backend to the host as float32."""
        raise NotImplementedError

    def prepare_batch(self, batch: Any) -> Any:
        """The batch with its row metadata on this backend's device."""
        return batch

    def use_ops(self, registry: Any) -> None:
        """Bind the ops of ``registry`` (:func:`metrale.ops.build_op_registry`: the built-in ops
        plus every plugin's) to this backend."""
        self.ops = registry.table(self)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def activate(self) -> Any:
        """A context manager under which array work runs on this backend's stream."""
        return contextlib.nullcontext()

    def default_cache_bytes(self) -> int:
        """Cache memory to plan with when the engine config gives none."""
        return 512 * 1024 * 1024

    def end_graph_capture(self, stream: Any) -> None:
        """End and discard an open CUDA-graph capture on ``stream`` (a no-op on the CPU)."""

    def available_memory_bytes(self) -> int | None:
        """Memory the cache may still take (None when unknown): on the CPU the memory the
        operating system reports available, on the GPU the free device memory."""
        return host_available_memory()

    def close(self) -> None:
        """Drop what the backend holds for its models (graphs, buffers) and give pooled memory
        back (on the GPU, to the device)."""


def host_available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, else the free physical pages, else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


class CpuBackend(Backend):
    """NumPy float32 reference backend."""

    name = "cpu"
    xp = np
    cache_dtype = np.float32

    def __init__(self, environment: Any = None) -> None:
        from metrale.ops.builtin import builtin_registry

        self.environment = environment
        self.ops = builtin_registry().table(self)

    def load_weight(self, checkpoint: Any, *parts: tuple) -> Any:
        quantized = checkpoint.quantized_parts(parts) if hasattr(checkpoint, "quantized_parts") else None
        if quantized is not None:
            return quantized
        arrays = [checkpoint.tensor(*part) for part in parts]
        return np.ascontiguousarray(arrays[0] if len(arrays) == 1 else np.concatenate(arrays), dtype=np.float32)

    def constant(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def weight(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)


def with_device_arrays(batch: Any, convert: Any) -> Any:
    """A copy of ``batch`` whose row-metadata arrays went through ``convert`` (int32)."""
    fields = ("token_ids", "positions", "seq_index", "slot_mapping", "block_tables", "logits_rows", "state_slots",
              "adapter_slots", "adapter_tiles")
    return replace(batch, **{
        name: convert(np.ascontiguousarray(getattr(batch, name), dtype=np.int32))
        for name in fields if getattr(batch, name) is not None
    })
