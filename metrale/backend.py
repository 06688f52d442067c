"""Device backends: where arrays live and which implementation of each op runs.

* ``cpu`` -- NumPy float32 reference ops (the reference of every kernel module in
  :mod:`metrale.kernels`). What CI and the parity tests run.
* ``cuda`` -- CuPy arrays, ``numba.cuda`` kernels and cuBLAS. Nothing CUDA-related is imported
  before a CUDA backend is asked for.

Family code calls ``backend.ops.<op>`` and ``backend.xp`` (the array module) only, so the same
model code runs on both.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from metrale.errors import BackendUnavailableError, ConfigError


class Backend:
    """Base class: array placement and the op table."""

    name = "abstract"
    #: NumPy-compatible array module (numpy or cupy).
    xp: Any = np
    #: dtype of cached K/V and latent values.
    cache_dtype: Any = np.float32
    ops: SimpleNamespace

    def asarray(self, host: np.ndarray) -> Any:
        """Place a host float array (a weight) on this backend in its compute dtype."""
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.xp.zeros(shape, dtype=dtype)

    def to_numpy(self, array: Any) -> np.ndarray:
        """Copy an array of this backend to the host as float32."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def end_graph_capture(self, stream: Any) -> None:
        """End and discard an open CUDA-graph capture on ``stream`` (a no-op on the CPU)."""


class CpuBackend(Backend):
    """NumPy float32 reference backend."""

    name = "cpu"
    xp = np
    cache_dtype = np.float32

    def __init__(self) -> None:
        from metrale.kernels import activation, attention, embedding, linear, rmsnorm, rope

        self.ops = SimpleNamespace(
            embedding=embedding.embedding_reference,
            rmsnorm=rmsnorm.rmsnorm_reference,
            rmsnorm_residual=rmsnorm.rmsnorm_residual_reference,
            linear=linear.linear_reference,
            silu_and_mul=activation.silu_and_mul_reference,
            rope=rope.rope_reference,
            paged_kv_write=attention.paged_kv_write_reference,
            paged_attention=attention.paged_attention_reference,
        )

    def asarray(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)


def cuda_device_present() -> bool:
    """Whether a CUDA device can be used (initialises the CUDA driver; never at import)."""
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:
        return False


def get_backend(device: str) -> Backend:
    """The backend for ``device`` (``"auto"``, ``"cpu"`` or ``"cuda"``)."""
    if device == "cpu":
        return CpuBackend()
    if device == "auto":
        return CpuBackend()
    if device == "cuda":
        present = cuda_device_present()
        reason = "this build has no CUDA backend yet" if present else "no CUDA device is available"
        raise BackendUnavailableError(f"device='cuda' cannot be used: {reason}; use device='cpu'")
    raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
