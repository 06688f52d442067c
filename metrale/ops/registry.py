"""The op registry: every op declared once, each backend's kernels registered against it.

An :class:`Op` declares an operation: its name, its parameters and results with their shapes and
dtypes on each backend, its NumPy reference (which is also the CPU implementation unless a CPU
kernel is registered), whether it may run inside a CUDA graph, and example arguments the kernel
check runs. A :class:`Kernel` implements one op on one backend, optionally only under a
condition (``when``, asked at each call; ``enabled``, asked once per backend of its settings).
:meth:`OpRegistry.table` binds, for one backend, every op to the kernels that serve it there: a
plugin's kernels are tried before the built-in ones, each under its condition, and the first that
applies runs. This is the one place kernels are chosen: below it, a kernel's launcher checks its
arguments, allocates and launches, and never picks another kernel.

Plugins add ops and kernels through the ``metrale_register_ops`` hook
(:func:`build_op_registry`); :doc:`/reference/ops` is generated from the declarations.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from metrale.errors import GraphCaptureError, OpNameClashError, OpRegistrationError, UnknownOpError
from metrale.kernels.bf16 import bf16_to_float32 as bf16_bits_to_float32

if TYPE_CHECKING:  # pragma: no cover
    pass

#: What an operand is, which decides how it is placed on a backend (see :class:`Operand`).
OPERAND_KINDS = ("activation", "matmul_input", "weight", "constant", "index", "scalar", "cache", "batch", "option")

BUILTIN = "metrale"


@dataclass(frozen=True)
class Operand:
    """One parameter or result of an op.

    ``kind`` says how the engine holds it on each backend:

    * ``activation`` -- float32 on both backends;
    * ``matmul_input`` -- an input of a matrix product: float32 on the CPU, bf16 bits (``uint16``)
      on the GPU; ops taking one accept float32 too;
    * ``weight`` -- placed with ``backend.load_weight`` / ``backend.weight``: float32 on the CPU,
      bf16 bits on the GPU; a weight a checkpoint stores quantized arrives as a
      :class:`~metrale.kernels.quantized.QuantizedWeight` instead, which the matrix products
      (``linear``, ``linear_silu``, ``rmsnorm_linear``, ``rmsnorm_mlp``, ``moe_experts``) take;
    * ``constant`` -- placed with ``backend.constant``: float32 on both;
    * ``index`` -- int32 on both;
    * ``cache`` -- a cache or state array the op updates in place (the backend's ``cache_dtype``
      for K/V and latents, float32 for recurrent states);
    * ``batch`` -- the step's :class:`~metrale.batch.ForwardBatch` (row metadata on the device);
    * ``scalar`` / ``option`` -- a Python number / a Python flag or string.
    """

    name: str
    shape: str = ""
    kind: str = "activation"
    doc: str = ""
    optional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OPERAND_KINDS:
            raise OpRegistrationError(f"operand {self.name!r}: kind must be one of {OPERAND_KINDS}, got {self.kind!r}")

    def dtype_on(self, backend: str) -> str:
        """The dtype this operand has on ``backend`` (``"cpu"`` or ``"cuda"``), in words."""
        return {
            "activation": "float32",
            "matmul_input": "float32" if backend == "cpu" else "bf16 bits (uint16); float32 accepted",
            "weight": "float32" if backend == "cpu" else "bf16 bits (uint16)",  # or a QuantizedWeight
            "constant": "float32",
            "index": "int32",
            "cache": "float32" if backend == "cpu" else "bf16 bits (K/V, latents); float32 (states)",
            "batch": "ForwardBatch",
            "scalar": "Python number",
            "option": "Python value",
        }[self.kind]


#: ``examples(rng)`` returns argument dicts, keyed by parameter name, of host (NumPy) values.
Examples = Callable[[np.random.Generator], list[dict[str, Any]]]


@dataclass(frozen=True)
class Op:
    """The declaration of one op (see the module docstring)."""

    name: str
    summary: str
    parameters: tuple[Operand, ...]
    results: tuple[Operand, ...]
    reference: Callable[..., Any]
    #: Whether the op may run inside a captured CUDA graph: no host synchronisation, no
    #: data-dependent allocation.
    graph_safe: bool = True
    examples: Examples | None = None
    #: Largest relative error (over the result's largest magnitude) a kernel may show against the
    #: reference, on the CPU and on the GPU (whose bf16 storage rounds).
    cpu_tolerance: float = 1e-5
    cuda_tolerance: float = 2e-2
    origin: str = BUILTIN

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise OpRegistrationError(f"op name {self.name!r} is not a Python identifier")
        if not callable(self.reference):
            raise OpRegistrationError(f"op {self.name!r}: the reference must be callable")
        names = [p.name for p in self.parameters]
        try:
            signature = inspect.signature(self.reference)
        except (TypeError, ValueError):
            return
        accepted = list(signature.parameters)
        takes_any = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values())
        if not takes_any and accepted[: len(names)] != names:
            raise OpRegistrationError(
                f"op {self.name!r}: the reference takes {accepted}, the declaration {names}"
            )

    @property
    def signature(self) -> str:
        """``name(p1, p2, p3=None)`` (optional parameters default to None)."""
        parts = [f"{p.name}=None" if p.optional else p.name for p in self.parameters]
        return f"{self.name}({', '.join(parts)})"


@dataclass(frozen=True)
class Kernel:
    """An implementation of op ``op`` on backend ``backend`` (``"cpu"`` or ``"cuda"``).

    ``build(backend)`` returns the callable, which takes the op's parameters; it is called once
    per backend. ``when(*args, **kwargs)``, if given, says whether the kernel serves a call (the
    next kernel is tried when it does not). ``enabled(environment)``, if given, is asked once per
    backend with the backend's :class:`~metrale.config.EnvironmentConfig` (the ``METRALE_*``
    settings): where it answers False the kernel is not bound at all. ``condition`` says both in
    words, for ``metrale plugins`` and the docs. ``examples(rng)``, like :attr:`Op.examples`, adds
    argument sets the kernel check runs on this kernel besides its op's: those that meet a
    condition the op's examples do not.
    """

    op: str
    backend: str
    name: str
    build: Callable[[Any], Callable[..., Any]]
    when: Callable[..., bool] | None = None
    condition: str = ""
    origin: str = BUILTIN
    examples: Examples | None = None
    enabled: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("cpu", "cuda"):
            raise OpRegistrationError(f"kernel {self.name!r}: backend must be 'cpu' or 'cuda', got {self.backend!r}")
        if self.when is not None and not self.condition:
            raise OpRegistrationError(f"kernel {self.name!r}: a kernel with `when` must say its condition in words")
        if self.enabled is not None and not self.condition:
            raise OpRegistrationError(f"kernel {self.name!r}: a kernel with `enabled` must say its condition in words")

    @property
    def unconditional(self) -> bool:
        """Whether the kernel serves every call on every backend of its kind (no ``when``, no
        ``enabled``)."""
        return self.when is None and self.enabled is None


@dataclass
class OpRegistry:
    """Declared ops and their kernels (see the module docstring)."""

    ops: dict[str, Op] = field(default_factory=dict)
    kernels: list[Kernel] = field(default_factory=list)
    #: plugin name -> the distribution that provides it, for messages (:meth:`from_plugin`).
    distributions: dict[str, str] = field(default_factory=dict)

    def declare(self, op: Op) -> Op:
        """Add ``op``; a name already declared raises :class:`~metrale.errors.OpNameClashError`
        naming the op and both declarers."""
        if op.name in self.ops:
            raise self._clash(self.ops[op.name], op)
        self.ops[op.name] = op
        return op

    def _who(self, origin: str) -> str:
        distribution = self.distributions.get(origin)
        return f"plugin {origin!r}" + (f" (distribution {distribution!r})" if distribution else "")

    def _clash(self, first: Op, second: Op) -> OpNameClashError:
        name = second.name
        if first.origin == BUILTIN:
            message = (f"{self._who(second.origin)} declares op {name!r}, which is a built-in op of Metrale; to run its "
                       f"own kernel for it, the plugin registers Kernel({name!r}, ...) instead of declaring the op again")
        elif first.origin == second.origin:
            message = f"{self._who(second.origin)} declares op {name!r} twice"
        else:
            message = (f"{self._who(first.origin)} and {self._who(second.origin)} both declare op {name!r}, and an op "
                       f"name can be declared once; rename the op in one of them, or block one plugin "
                       f"(METRALE_BLOCKED_PLUGINS={second.origin}) until they agree")
        return OpNameClashError(message, op=name, origins=(first.origin, second.origin), plugin=second.origin,
                                distribution=self.distributions.get(second.origin))

    def add_kernel(self, kernel: Kernel) -> Kernel:
        """Add ``kernel``. A plugin's kernels are tried before the built-in ones of the same op;
        among plugins, the one added last first."""
        if kernel.op not in self.ops:
            raise OpRegistrationError(
                f"kernel {kernel.name!r} ({kernel.origin}) implements op {kernel.op!r}, which is not declared; "
                f"declared ops: {', '.join(sorted(self.ops))}"
            )
        if kernel.origin == BUILTIN:
            self.kernels.append(kernel)
        else:
            self.kernels.insert(0, kernel)
        return kernel

    def copy(self) -> "OpRegistry":
        return OpRegistry(dict(self.ops), list(self.kernels), dict(self.distributions))

    def from_plugin(self, origin: str, distribution: str | None = None) -> "PluginOps":
        """A view that stamps ``origin`` (the plugin's name) on what a plugin declares and
        registers; ``distribution``, when known, names the package in error messages."""
        if distribution:
            self.distributions[origin] = distribution
        return PluginOps(self, origin)

    def kernels_for(self, op: str, backend: str) -> list[Kernel]:
        """The kernels of ``op`` on ``backend``, in the order they are tried."""
        return [k for k in self.kernels if k.op == op and k.backend == backend]

    def serving(self, op: str, backend: str, environment: Any = None) -> list[str]:
        """What serves ``op`` on ``backend``, in words, in the order tried. With ``environment``
        (an :class:`~metrale.config.EnvironmentConfig`), a kernel its settings leave unbound is
        marked ``(off in this environment)``."""
        described = [
            f"{k.name} [{k.origin}]" + (f" when {k.condition}" if k.condition else "")
            + (" (off in this environment)" if environment is not None and k.enabled is not None
               and not k.enabled(environment) else "")
            for k in self.kernels_for(op, backend)
        ]
        if not any(k.unconditional for k in self.kernels_for(op, backend)):
            declared = self.ops[op]
            described.append(
                f"reference [{declared.origin}]" if backend == "cpu" else f"host fallback of the reference [{declared.origin}]"
            )
        return described

    def table(self, backend: Any) -> "OpTable":
        """Every op bound to ``backend``'s kernels."""
        return OpTable(self, backend)

    def __iter__(self) -> Iterator[Op]:
        return iter(sorted(self.ops.values(), key=lambda op: op.name))


class PluginOps:
    """What a plugin's ``metrale_register_ops`` receives: :meth:`declare` and :meth:`add_kernel`,
    with the plugin's name recorded on everything it adds."""

    def __init__(self, registry: OpRegistry, origin: str) -> None:
        self._registry = registry
        self.origin = origin

    @property
    def ops(self) -> dict[str, Op]:
        """The ops declared so far (read only)."""
        return dict(self._registry.ops)

    def declare(self, op: Op) -> Op:
        return self._registry.declare(replace(op, origin=self.origin))

    def add_kernel(self, kernel: Kernel) -> Kernel:
        return self._registry.add_kernel(replace(kernel, origin=self.origin))


class OpTable:
    """The ops of one backend, as attributes: ``backend.ops.rmsnorm(x, weight, eps)``."""

    def __init__(self, registry: OpRegistry, backend: Any) -> None:
        self._registry = registry
        self._backend_name = backend.name
        self._graph_unsafe: set[str] = set()
        for op in registry.ops.values():
            setattr(self, op.name, self._bind(op, backend))

    def _bind(self, op: Op, backend: Any) -> Callable[..., Any]:
        environment = getattr(backend, "environment", None)
        if environment is None:
            from metrale.config import EnvironmentConfig

            environment = EnvironmentConfig()
        kernels = [kernel for kernel in self._registry.kernels_for(op.name, backend.name)
                   if kernel.enabled is None or kernel.enabled(environment)]
        built: list[tuple[Kernel | None, Callable[..., Any]]] = []
        for kernel in kernels:
            function = kernel.build(backend)
            if backend.name != "cpu" and not op.graph_safe and kernel.origin != BUILTIN:
                function = refusing_capture(op.name, backend, function)
            built.append((kernel, function))
        if not any(kernel.when is None for kernel in kernels):
            fallback = op.reference if backend.name == "cpu" else host_fallback(op, backend)
            if backend.name != "cpu":
                self._graph_unsafe.add(op.name)
            built.append((None, fallback))
        if len(built) == 1:
            return built[0][1]
        return _Dispatch(op.name, built)

    def graph_safe(self, name: str) -> bool:
        """Whether op ``name`` may run inside a captured CUDA graph on this backend."""
        return name not in self._graph_unsafe and self._registry.ops[name].graph_safe

    def names(self) -> list[str]:
        return sorted(self._registry.ops)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not ops.
        raise UnknownOpError(
            f"the {self.__dict__.get('_backend_name', '?')} backend has no op {name!r}; declared ops: "
            f"{', '.join(sorted(self.__dict__.get('_registry', OpRegistry()).ops))}. A plugin adds ops through "
            "the metrale_register_ops hook"
        )


class _Dispatch:
    """Tries each kernel's condition in order; the last entry has none."""

    def __init__(self, name: str, kernels: Sequence[tuple[Kernel | None, Callable[..., Any]]]) -> None:
        self.name = name
        self.kernels = list(kernels)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for kernel, function in self.kernels:
            if kernel is None or kernel.when is None or kernel.when(*args, **kwargs):
                return function(*args, **kwargs)
        raise UnknownOpError(f"no kernel of op {self.name!r} applies to these arguments")


def refusing_capture(name: str, backend: Any, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a plugin's kernel of op ``name``, declared ``graph_safe=False``), raising
    :class:`~metrale.errors.GraphCaptureError` instead of running while ``backend``'s stream
    records a CUDA graph: the engine then runs the model's steps eagerly."""
    stream = getattr(backend, "stream", None)

    def run(*args: Any, **kwargs: Any) -> Any:
        if stream is not None and stream.is_capturing():
            raise GraphCaptureError(f"op {name!r} is declared graph_safe=False; its kernel does not run inside a "
                                    "CUDA graph capture")
        return function(*args, **kwargs)

    run.__name__ = getattr(function, "__name__", name)
    return run


def host_fallback(op: Op, backend: Any) -> Callable[..., Any]:
    """``op``'s NumPy reference run on the host for a device backend: device arrays are copied
    to the host (bf16 bits widened to float32), the results copied back as float32. It
    synchronises, so a model using it cannot be captured into CUDA graphs."""
    xp = backend.xp

    def to_host(value: Any) -> Any:
        if isinstance(value, xp.ndarray):
            host = xp.asnumpy(value)
            return bf16_bits_to_float32(host) if host.dtype == np.uint16 else host
        return value

    def to_device(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return xp.asarray(value.astype(np.float32) if value.dtype.kind == "f" else value)
        if isinstance(value, tuple):
            return tuple(to_device(v) for v in value)
        return value

    def run(*args: Any, **kwargs: Any) -> Any:
        stream = getattr(backend, "stream", None)
        if stream is not None and stream.is_capturing():
            raise GraphCaptureError(f"op {op.name!r} has no {backend.name} kernel; its reference runs on the host")
        backend.synchronize()
        result = op.reference(*(to_host(a) for a in args), **{k: to_host(v) for k, v in kwargs.items()})
        return to_device(result)

    run.__name__ = f"{op.name}_host_fallback"
    return run
