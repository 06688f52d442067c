"""The op reference page of the documentation, rendered from the op declarations (the docs
build writes it, so it cannot drift from the code)."""

from __future__ import annotations

from metrale.ops.registry import Op, OpRegistry


def _operand_rows(op: Op) -> list[str]:
    rows = []
    for direction, operands in (("in", op.parameters), ("out", op.results)):
        for operand in operands:
            name = f"``{operand.name}``" + (" (optional)" if operand.optional else "")
            shape = f"``{operand.shape}``" if operand.shape else ""
            rows += [
                f"   * - {direction}",
                f"     - {name}",
                f"     - {shape}",
                f"     - {operand.dtype_on('cpu')}",
                f"     - {operand.dtype_on('cuda')}",
                f"     - {operand.doc}",
            ]
    return rows


def render(registry: OpRegistry, title: str = "Ops") -> str:
    """reStructuredText of every op of ``registry``: signature, summary, operands with their
    shapes and dtypes on each backend, graph safety and what serves it on each backend."""
    lines = [
        title,
        "=" * len(title),
        "",
        "Every op family code may call as ``backend.ops.<name>(...)``, generated from the declarations in",
        ":mod:`metrale.ops.builtin`. Each op's NumPy reference is what the CPU backend runs; the GPU runs the",
        "kernel named. *Graph-safe* ops may run inside a captured CUDA graph (no host synchronisation, no",
        "data-dependent allocation): a model whose decode step uses only graph-safe ops can set",
        "``graph_capturable = True``. Plugins add ops and kernels through ``metrale_register_ops``",
        "(:doc:`/writing-plugins`).",
        "",
    ]
    for op in registry:
        lines += [
            op.name,
            "-" * len(op.name),
            "",
            f"``{op.signature}``",
            "",
            op.summary,
            "",
            f"Graph-safe: {'yes' if op.graph_safe else 'no'}. "
            f"CPU: {'; then '.join(registry.serving(op.name, 'cpu'))}. "
            f"GPU: {'; then '.join(registry.serving(op.name, 'cuda'))}.",
            "",
            ".. list-table::",
            "   :header-rows: 1",
            "   :widths: 6 18 20 14 22 20",
            "",
            "   * - dir",
            "     - operand",
            "     - shape",
            "     - CPU dtype",
            "     - GPU dtype",
            "     - notes",
            *_operand_rows(op),
            "",
        ]
    return "\n".join(lines) + "\n"
