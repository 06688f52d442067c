"""Which backend runs on which device: :func:`get_backend` for ``"auto"``, ``"cpu"`` or
``"cuda"``, and why CUDA cannot run here when it cannot (:func:`cuda_unavailable_reason`)."""

from __future__ import annotations

import gc
import importlib.util
import logging
from typing import Any

from metrale.backends.base import Backend, CpuBackend
from metrale.backends.parallel import current_rank
from metrale.errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)


def cuda_device_present() -> bool:
    """Whether a CUDA device can be used (initialises the CUDA driver; never at import)."""
    try:
        from numba import config, cuda

        return not getattr(config, "ENABLE_CUDASIM", False) and bool(cuda.is_available())
    except Exception:
        return False


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (no device, or the gpu extra missing), or None."""
    if not cuda_device_present():
        return "no CUDA device is available"
    try:
        import cupy  # noqa: F401
    except ImportError as error:
        return f"the gpu extra is not installed ({error}); pip install 'metrale[gpu]'"
    # nvmath is imported where cuBLAS is first used (its package imports every library it binds:
    # most of a second); here only whether it is installed.
    if importlib.util.find_spec("nvmath") is None:
        return "the gpu extra is not installed (no module named 'nvmath'); pip install 'metrale[gpu]'"
    return None


def get_backend(device: str, **options: Any) -> Backend:
    """The backend for ``device`` (``"auto"``, ``"cpu"`` or ``"cuda"``).

    ``"auto"`` picks CUDA when a device and the gpu extra are usable, else the CPU (and logs once, as a
    warning, why). ``options`` go to the backend: ``environment`` (the ``METRALE_*`` settings,
    :class:`~metrale.config.EnvironmentConfig`) to either, ``cuda_graphs`` to the CUDA one.
    """
    backend = _new_backend(device, **options)
    backend.shard, backend.communicator = current_rank()
    _collect_import_garbage()
    return backend


_import_garbage_collected = False


def _collect_import_garbage() -> None:
    """Once per process, after the first backend: collect the reference cycles that importing
    ``numba.cuda`` can leave. Where no CUDA driver loads, numba keeps the load errors in a list
    local to its probing frame, whose tracebacks lead back through every calling frame -- the
    ``LLM`` under construction included -- so the first ``LLM`` would outlive its last reference
    until the garbage collector ran."""
    global _import_garbage_collected
    if not _import_garbage_collected:
        _import_garbage_collected = True
        gc.collect()


def _new_backend(device: str, **options: Any) -> Backend:
    if device == "cpu":
        return CpuBackend(environment=options.get("environment"))
    if device not in ("auto", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    reason = cuda_unavailable_reason()
    if reason is None:
        from metrale.backends.cuda import CudaBackend

        return CudaBackend(**options)
    if device == "auto":
        _log_cpu_fallback(reason)
        return CpuBackend(environment=options.get("environment"))
    raise BackendUnavailableError(f"device='cuda' cannot be used: {reason}; use device='cpu'")


_cpu_fallback_logged = False


def _log_cpu_fallback(reason: str) -> None:
    """Say once per process why ``device="auto"`` runs on the CPU."""
    global _cpu_fallback_logged
    if not _cpu_fallback_logged:
        _cpu_fallback_logged = True
        logger.warning("device='auto' runs on the CPU: %s", reason)
