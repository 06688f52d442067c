"""The op layer: declared ops, their NumPy references and each backend's kernels.

Family code calls ``backend.ops.<op>(...)``; :doc:`/reference/ops` lists every op. Plugins add
ops and kernels through the ``metrale_register_ops`` hook, with :class:`Op` and :class:`Kernel`.
"""

from metrale.ops.builtin import build_op_registry
from metrale.ops.registry import (
    OPERAND_KINDS,
    Kernel,
    Op,
    Operand,
    OpRegistry,
    OpTable,
    PluginOps,
    bf16_bits_to_float32,
    host_fallback,
)

__all__ = [
    "OPERAND_KINDS",
    "Kernel",
    "Op",
    "OpRegistry",
    "OpTable",
    "Operand",
    "PluginOps",
    "bf16_bits_to_float32",
    "build_op_registry",
    "host_fallback",
]
