"""Checking kernels against their op's reference.

:func:`check_kernel` runs one kernel on its op's example arguments (``Op.examples``), placed on
a backend the way the engine holds them (:class:`~metrale.ops.Operand` kinds), and compares every
result with the op's NumPy reference run on the same values as the backend stores them (bf16
weights rounded on the GPU). The conformance kit runs :func:`check_plugin_kernels` for every
kernel a plugin registers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelMismatchError
from metrale.ops.registry import BUILTIN, Kernel, Op, OpRegistry, bf16_bits_to_float32


def _bf16_rounded(host: np.ndarray) -> np.ndarray:
    from metrale.kernels.bf16 import float32_to_bf16

    return bf16_bits_to_float32(float32_to_bf16(np.asarray(host, dtype=np.float32)))


def place(op: Op, arguments: dict[str, Any], backend: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(on_backend, for_reference)``: the example's arguments as ``backend`` holds them, and
    the host values the reference must see to compute the same thing."""
    kinds = {p.name: p.kind for p in op.parameters}
    on_backend: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    device = backend.name != "cpu"
    for name, value in arguments.items():
        kind = kinds.get(name, "option")
        if value is None or not isinstance(value, np.ndarray):
            on_backend[name] = reference[name] = value
        elif kind in ("weight", "matmul_input"):
            on_backend[name] = backend.weight(value)
            reference[name] = _bf16_rounded(value) if device else np.array(value, dtype=np.float32)
        elif kind in ("constant", "activation"):
            on_backend[name] = backend.constant(value)
            reference[name] = np.array(value, dtype=np.float32)
        elif kind == "index":
            on_backend[name] = backend.xp.asarray(np.ascontiguousarray(value, dtype=np.int32))
            reference[name] = np.array(value, dtype=np.int32)
        else:
            on_backend[name] = backend.xp.asarray(value.copy())
            reference[name] = value.copy()
    return on_backend, reference


def to_host(value: Any, backend: Any) -> np.ndarray:
    """A result as host float32 (bf16 bits widened)."""
    if backend.name != "cpu":
        backend.synchronize()
        value = backend.xp.asnumpy(value)
    value = np.asarray(value)
    return bf16_bits_to_float32(value) if value.dtype == np.uint16 else value.astype(np.float32)


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def check_kernel(registry: OpRegistry, kernel: Kernel, backend: Any, seed: int = 0) -> list[str]:
    """Where ``kernel`` (on ``backend``) differs from its op's reference beyond the op's
    tolerance, one line per failing example and result; empty when it agrees. An op without
    examples cannot be checked, which is reported too."""
    op = registry.ops[kernel.op]
    if op.examples is None:
        return [f"op {op.name!r} declares no examples, so kernel {kernel.name!r} ({kernel.origin}) cannot be checked"]
    tolerance = op.cpu_tolerance if backend.name == "cpu" else op.cuda_tolerance
    function = kernel.build(backend)
    problems = []
    for index, example in enumerate(op.examples(np.random.default_rng(seed))):
        on_backend, for_reference = place(op, example, backend)
        if kernel.when is not None and not kernel.when(**on_backend):
            continue
        with backend.activate():
            actual = _as_tuple(function(**on_backend))
        expected = _as_tuple(op.reference(**for_reference))
        if len(actual) != len(expected):
            problems.append(f"{op.name} example {index}: {len(actual)} results, the reference gives {len(expected)}")
            continue
        for position, (got, want) in enumerate(zip(actual, expected)):
            got_host, want_host = to_host(got, backend), np.asarray(want, dtype=np.float32)
            if got_host.shape != want_host.shape:
                problems.append(f"{op.name} example {index} result {position}: shape {got_host.shape}, "
                                f"the reference's {want_host.shape}")
                continue
            scale = max(float(np.abs(want_host).max(initial=0.0)), 1e-30)
            error = float(np.abs(got_host - want_host).max(initial=0.0)) / scale
            if not np.isfinite(error) or error > tolerance:
                problems.append(f"{op.name} example {index} result {position}: relative error {error:.3g} > {tolerance:g}")
    return [f"kernel {kernel.name!r} ({kernel.origin}, {backend.name}): {line}" for line in problems]


def check_plugin_kernels(registry: OpRegistry, backend: Any, origins: set[str] | None = None) -> list[str]:
    """:func:`check_kernel` over every kernel on ``backend`` that a plugin registered (those of
    ``origins`` only, when given); returns every problem found."""
    problems = []
    for kernel in registry.kernels:
        if kernel.origin == BUILTIN or kernel.backend != backend.name:
            continue
        if origins is not None and kernel.origin not in origins:
            continue
        problems += check_kernel(registry, kernel, backend)
    return problems


def assert_kernels_match(registry: OpRegistry, backend: Any, origins: set[str] | None = None) -> None:
    """Raise :class:`~metrale.errors.KernelMismatchError` listing every plugin kernel that
    differs from its reference."""
    problems = check_plugin_kernels(registry, backend, origins)
    if problems:
        raise KernelMismatchError("\n".join(problems))
