"""Checking kernels against their op's reference.

:func:`check_kernel` runs one kernel on its op's example arguments (``Op.examples``), placed on
a backend the way the engine holds them (:class:`~metrale.ops.Operand` kinds), and compares every
result with the op's NumPy reference run on the same values as the backend stores them (bf16
weights rounded on the GPU). The conformance kit runs :func:`check_plugin_kernels` for every
kernel a plugin registers, and on a machine without a GPU runs a plugin's CUDA kernels the same
way under numba's CUDA simulator (:mod:`metrale.testing.kernel_check`).
"""

from __future__ import annotations

from typing import Any, Collection

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


def _examples(op: Op, kernel: Kernel, seed: int) -> list[dict[str, Any]]:
    """The op's examples, then the kernel's own (each drawn from its own generator)."""
    found = []
    if op.examples is not None:
        found += op.examples(np.random.default_rng(seed))
    if kernel.examples is not None:
        found += kernel.examples(np.random.default_rng(seed + 1))
    return found


def run_kernel_examples(registry: OpRegistry, kernel: Kernel, backend: Any, seed: int = 0, *,
                        compare: bool = True) -> tuple[int, list[str]]:
    """``(examples run, problems)``: ``kernel`` built on ``backend`` and called on every example of
    its op and of its own (``Kernel.examples``) that its condition accepts, each result compared
    with the op's reference unless ``compare`` is false (then a call only has to succeed). An
    exception from ``build`` or from a call is a problem too, worded with the error."""
    op = registry.ops[kernel.op]
    tolerance = op.cpu_tolerance if backend.name == "cpu" else op.cuda_tolerance
    examples = _examples(op, kernel, seed)
    if not examples:
        return 0, [f"op {op.name!r} declares no examples and the kernel none of its own, so it cannot be checked"]
    try:
        function = kernel.build(backend)
    except Exception as error:
        return 0, [f"build(backend) raised {type(error).__name__}: {error}"]
    problems, run = [], 0
    for index, example in enumerate(examples):
        on_backend, for_reference = place(op, example, backend)
        try:
            if kernel.when is not None and not kernel.when(**on_backend):
                continue
            run += 1
            with backend.activate():
                actual = _as_tuple(function(**on_backend))
            if not compare:
                continue
        except Exception as error:
            problems.append(f"{op.name} example {index}: raised {type(error).__name__}: {error}")
            continue
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
            relative = float(np.abs(got_host - want_host).max(initial=0.0)) / scale
            if not np.isfinite(relative) or relative > tolerance:
                problems.append(f"{op.name} example {index} result {position}: relative error {relative:.3g} > {tolerance:g}")
    return run, problems


def _named(kernel: Kernel, backend: Any, problems: list[str]) -> list[str]:
    return [f"kernel {kernel.name!r} ({kernel.origin}, {backend.name}): {line}" for line in problems]


def check_kernel(registry: OpRegistry, kernel: Kernel, backend: Any, seed: int = 0) -> list[str]:
    """Where ``kernel`` (on ``backend``) differs from its op's reference beyond the op's
    tolerance, or fails, one line per failing example and result; empty when it agrees on every
    example its condition accepts. An op without examples cannot be checked, which is reported
    too."""
    return _named(kernel, backend, run_kernel_examples(registry, kernel, backend, seed)[1])


def plugin_kernels(registry: OpRegistry, backend_name: str, origins: set[str] | None = None) -> list[Kernel]:
    """The kernels on backend ``backend_name`` that plugins registered (those of ``origins`` only,
    when given), in the order they are tried."""
    return [k for k in registry.kernels if k.origin != BUILTIN and k.backend == backend_name
            and (origins is None or k.origin in origins)]


def check_plugin_kernels(registry: OpRegistry, backend: Any, origins: set[str] | None = None,
                         skip: Collection[str] = ()) -> list[str]:
    """:func:`check_kernel` over every kernel on ``backend`` that a plugin registered (those of
    ``origins`` only, when given; none named in ``skip``); returns every problem found. A kernel
    that no example reaches -- its condition refuses every one -- was not checked at all, and is
    reported as such."""
    problems = []
    for kernel in plugin_kernels(registry, backend.name, origins):
        if kernel.name in skip:
            continue
        run, found = run_kernel_examples(registry, kernel, backend)
        if not run and not found:
            found = [f"its condition ({kernel.condition}) accepts none of the examples, so it was not checked; give the "
                     "Kernel examples= that meet it"]
        problems += _named(kernel, backend, found)
    return problems


def assert_kernels_match(registry: OpRegistry, backend: Any, origins: set[str] | None = None,
                         skip: Collection[str] = ()) -> None:
    """Raise :class:`~metrale.errors.KernelMismatchError` listing every plugin kernel that
    differs from its reference, fails, or could not be checked (:func:`check_plugin_kernels`)."""
    problems = check_plugin_kernels(registry, backend, origins, skip)
    if problems:
        raise KernelMismatchError("\n".join(problems))
