"""The op reference page of the documentation, rendered from the op declarations.

The page is checked in as ``docs/reference/ops.rst``, so that it reads in a checkout and on any
forge; a test compares it with what the declarations render. After changing an op or a
built-in kernel, regenerate it from the repository root::

    python3 -m metrale.ops.reference_page > docs/reference/ops.rst

(``--check docs/reference/ops.rst`` exits with status 1 and prints the difference when the page
is stale.)
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from metrale.ops.registry import Op, OpRegistry

#: The command that regenerates the checked-in page, run from the repository root.
REGENERATE = "python3 -m metrale.ops.reference_page > docs/reference/ops.rst"


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
        f".. Generated from the op declarations; regenerate with: {REGENERATE}",
        "",
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


def builtin_page() -> str:
    """The page of the built-in ops (what ``docs/reference/ops.rst`` holds)."""
    from metrale.ops.builtin import builtin_registry

    return render(builtin_registry())


def stale_difference(page: Path, limit: int = 40) -> str | None:
    """None when ``page`` holds :func:`builtin_page`; else the first ``limit`` lines of a unified
    diff from the page to what the declarations render, followed by the command that regenerates
    it."""
    expected = builtin_page()
    found = page.read_text(encoding="utf-8") if page.is_file() else ""
    if found == expected:
        return None
    diff = list(difflib.unified_diff(found.splitlines(), expected.splitlines(), str(page), "rendered", lineterm=""))
    shown = diff[:limit] + ([f"... ({len(diff) - limit} more lines)"] if len(diff) > limit else [])
    state = "is missing" if not page.is_file() else "differs from what the op declarations render"
    return "\n".join([f"{page} {state}; regenerate it from the repository root with", f"    {REGENERATE}", *shown])


def main(argv: list[str] | None = None) -> int:
    """Print the op reference page, or with ``--check PAGE`` compare ``PAGE`` with it."""
    parser = argparse.ArgumentParser(
        prog="python3 -m metrale.ops.reference_page",
        description=f"Render the op reference page from the op declarations ({REGENERATE}).",
    )
    parser.add_argument("--check", metavar="PAGE", type=Path,
                        help="compare PAGE with the rendered page; exit with status 1 and the difference when they differ")
    arguments = parser.parse_args(argv)
    if arguments.check is not None:
        difference = stale_difference(arguments.check)
        if difference is not None:
            print(difference, file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(builtin_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
