"""Device backends: where arrays live and which implementation of each op runs.

* ``cpu`` -- NumPy float32 reference ops (the reference of every kernel module in
  :mod:`metrale.kernels`). What CI and the parity tests run.
* ``cuda`` -- CuPy arrays, ``numba.cuda`` kernels and cuBLAS (:mod:`metrale.cuda_backend`).
  Nothing CUDA-related is imported before a CUDA backend is asked for.

Family code calls ``backend.ops.<op>``, ``backend.load_weight`` / ``backend.constant`` and
``backend.xp`` (the array module) only, so the same model code runs on both. The ops are:

``embedding(weight, ids)`` -> ``[N, H]`` float32;
``rmsnorm_residual(x, residual, weight, eps, offset=0.0)`` -> ``(normed, x + residual)``;
``rmsnorm(x, weight, eps, offset=0.0)`` -> normed;
``linear(x, weight, bias=None)`` -> ``[N, out]`` float32;
``qkv_rope_cache(qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads,
num_kv_heads, head_dim, k_cache, v_cache, q_norm=None, k_norm=None, eps=1e-6, norm_offset=0.0,
interleaved=False)`` -> ``q [N, nh, d]``;
``paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)`` -> ``[N, nh * dv]``;
``silu_and_mul(gate_up)`` -> ``[N, I]``;
``linear_silu(x, weight, bias=None)`` -> ``silu_and_mul(linear(x, weight, bias))`` (one kernel
on the GPU for small batches);
``latent_attention(q, latent, batch, value_dim, scale)`` -> ``[N, nh * value_dim]``: MLA's absorbed
decode attention of one-row segments over the paged latent cache (:mod:`metrale.kernels.attention_latent`);
``latent_cache_write(kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved,
slot_mapping, latent)``: MLA's cache write, ``[rmsnorm(kv_a[:, :r]) | rope(kv_a[:, r:])]`` at each
row's slot;
``head_linear(x, weight)`` -> ``[N, nh, out]`` float32: ``weight[h] @ x[n, h]`` per head, ``weight``
stacked ``[nh * out, in]`` (:mod:`metrale.kernels.head_linear`);
``moe_route(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling)`` -> (experts
``[N, k]`` int32, weights ``[N, k]`` float32) from float32 router logits ``x @ gate^T``;
``moe_experts(x, experts, weights, gate_up, down)`` -> ``[N, H]`` float32: the chosen experts'
SwiGLU from stacked expert weights (:mod:`metrale.kernels.moe`);
``gdn_conv_update(inputs, weight, conv_state, slots)`` -> ``[N, C]`` and
``gdn_recurrent_step(q, k, v, g, beta, state, slots)`` -> ``[N, H, d_v]``: one token per row of
a Gated DeltaNet layer, the rows' slot states updated in place, and ``gdn_prompt_rule(q, k, v, g,
beta, state, slots, starts)`` -> ``[T, H, d_v]``: the gated delta rule over each segment's rows
``starts[s]:starts[s + 1]`` from slot ``slots[s]`` (:mod:`metrale.kernels.gated_delta`);
``gated_rmsnorm(x, z, weight, eps)`` -> ``rms(x; weight) * silu(z)`` over the last axis and
``sigmoid_gate(x, gate)`` -> ``x * sigmoid(gate)``, both inputs of matrix products
(:mod:`metrale.kernels.gated`).
"Normed" outputs and attention outputs are the inputs of matrix products: float32 on the CPU,
bf16 bits (``uint16``) on the GPU.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from metrale.errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)


class Backend:
    """Base class: array placement, the op table, sampling."""

    name = "abstract"
    #: NumPy-compatible array module (numpy or cupy).
    xp: Any = np
    #: dtype of cached K/V and latent values.
    cache_dtype: Any = np.float32
    ops: SimpleNamespace

    def load_weight(self, checkpoint: Any, *parts: tuple[str, Sequence[int]]) -> Any:
        """Read tensors ``(name, shape)`` from ``checkpoint``, concatenated along the first axis,
        as a weight in this backend's format (float32 on the CPU, bf16 bits on the GPU)."""
        raise NotImplementedError

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

    def graph_runner(self, model: Any) -> Any:
        """The CUDA-graph runner of ``model``'s decode steps, or None (no graphs)."""
        return None

    def sample_tokens(self, logits: Any, params: Sequence[Any], seeds: Sequence[int], steps: Sequence[int]) -> list[int]:
        """One token per row of ``logits`` (see :mod:`metrale.kernels.sampling`)."""
        from metrale.engine.sampler import sample_rows

        return sample_rows(self.to_numpy(logits), params, seeds, steps)

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

    def __init__(self) -> None:
        from metrale.kernels import (
            activation,
            attention,
            attention_latent,
            embedding,
            gated,
            gated_delta,
            head_linear,
            linear,
            moe,
            rmsnorm,
            rope,
        )

        def paged_attention(q, k_cache, v_cache, batch, scale, sliding_window):
            out = attention.paged_attention_reference(
                q, k_cache, v_cache, batch.block_tables, batch.seq_index, batch.positions, scale, sliding_window
            )
            return out.reshape(out.shape[0], -1)

        def silu_and_mul(gate_up):
            width = gate_up.shape[1] // 2
            return activation.silu_and_mul_reference(gate_up[:, :width], gate_up[:, width:])

        def linear_silu(x, weight, bias=None):
            return silu_and_mul(linear.linear_reference(x, weight, bias))

        def latent_attention(q, latent, batch, value_dim, scale):
            out = attention_latent.latent_attention_reference(
                q, latent, batch.block_tables, batch.seq_index, batch.positions, value_dim, scale
            )
            return out.reshape(out.shape[0], -1)

        def moe_route(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling):
            logits = np.asarray(x, dtype=np.float32) @ gate.T
            return moe.route_reference(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling)

        self.ops = SimpleNamespace(
            embedding=embedding.embedding_reference,
            rmsnorm=rmsnorm.rmsnorm_reference,
            rmsnorm_residual=rmsnorm.rmsnorm_residual_reference,
            linear=linear.linear_reference,
            silu_and_mul=silu_and_mul,
            linear_silu=linear_silu,
            qkv_rope_cache=rope.qkv_rope_cache_reference,
            paged_attention=paged_attention,
            latent_attention=latent_attention,
            latent_cache_write=attention_latent.latent_cache_write_reference,
            head_linear=head_linear.head_linear_reference,
            moe_route=moe_route,
            moe_experts=moe.experts_reference,
            gdn_conv_update=gated_delta.conv_update_reference,
            gdn_recurrent_step=gated_delta.recurrent_step_reference,
            gdn_prompt_rule=gated_delta.prompt_rule_reference,
            gated_rmsnorm=gated.gated_rmsnorm_reference,
            sigmoid_gate=gated.sigmoid_gate_reference,
        )

    def load_weight(self, checkpoint: Any, *parts: tuple[str, Sequence[int]]) -> np.ndarray:
        arrays = [checkpoint.tensor(name, shape) for name, shape in parts]
        return np.ascontiguousarray(arrays[0] if len(arrays) == 1 else np.concatenate(arrays), dtype=np.float32)

    def constant(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def weight(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)


def cuda_device_present() -> bool:
    """Whether a CUDA device can be used (initialises the CUDA driver; never at import)."""
    try:
        from numba import config, cuda

        return not config.ENABLE_CUDASIM and bool(cuda.is_available())
    except Exception:
        return False


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (no device, or the gpu extra missing), or None."""
    if not cuda_device_present():
        return "no CUDA device is available"
    try:
        import cupy  # noqa: F401
        import nvmath.bindings.cublas  # noqa: F401
    except ImportError as error:
        return f"the gpu extra is not installed ({error}); pip install 'metrale[gpu]'"
    return None


def get_backend(device: str, **options: Any) -> Backend:
    """The backend for ``device`` (``"auto"``, ``"cpu"`` or ``"cuda"``).

    ``"auto"`` picks CUDA when a device and the gpu extra are usable, else the CPU (and logs once, as a
    warning, why).
    """
    backend = _new_backend(device, **options)
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
        return CpuBackend()
    if device not in ("auto", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    reason = cuda_unavailable_reason()
    if reason is None:
        from metrale.cuda_backend import CudaBackend

        return CudaBackend(**options)
    if device == "auto":
        _log_cpu_fallback(reason)
        return CpuBackend()
    raise BackendUnavailableError(f"device='cuda' cannot be used: {reason}; use device='cpu'")


_cpu_fallback_logged = False


def _log_cpu_fallback(reason: str) -> None:
    """Say once per process why ``device="auto"`` runs on the CPU."""
    global _cpu_fallback_logged
    if not _cpu_fallback_logged:
        _cpu_fallback_logged = True
        logger.warning("device='auto' runs on the CPU: %s", reason)


def with_device_arrays(batch: Any, convert: Any) -> Any:
    """A copy of ``batch`` whose row-metadata arrays went through ``convert`` (int32)."""
    fields = ("token_ids", "positions", "seq_index", "slot_mapping", "block_tables", "logits_rows", "state_slots")
    return replace(batch, **{
        name: convert(np.ascontiguousarray(getattr(batch, name), dtype=np.int32))
        for name in fields if getattr(batch, name) is not None
    })
