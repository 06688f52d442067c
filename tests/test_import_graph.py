"""The import structure: no cycle among Metrale's modules, backends that never import the engine
or the runner, families that never import one another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folder -> installed package (setup.cfg's package_dir).
PACKAGES = {"metrale": "metrale", "plugins": "metrale.plugins", "kernels": "metrale.kernels"}


def module_files() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = module_files()


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, top_level_only: bool) -> set[str]:
    """The metrale modules ``module`` imports: at import time only (top-level statements, not
    under ``if TYPE_CHECKING``), or anywhere in it."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    if top_level_only:
        nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        nodes += [n for block in tree.body if isinstance(block, ast.Try) for n in block.body
                  if isinstance(n, (ast.Import, ast.ImportFrom))]
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            target = _resolve(module, node, path.name == "__init__.py")
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target for alias in node.names]
        found |= {name for name in names if name in MODULES and name != module}
    return found


def test_no_import_cycle_among_metrale_modules():
    graph = {module: imports(module, top_level_only=True) for module in MODULES}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [module, target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m in ("metrale.backend", "metrale.cuda_backend")
                                          or m.startswith("metrale.ops")))
def test_backends_and_ops_import_neither_the_engine_nor_the_runner(module):
    forbidden = {m for m in imports(module, top_level_only=False) if m.startswith(("metrale.engine", "metrale.runner"))}
    assert not forbidden, f"{module} imports {sorted(forbidden)}"


FAMILIES = ("dense", "mla", "gdn")


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_imports_another(family):
    others = tuple(f"metrale.plugins.{other}" for other in FAMILIES if other != family)
    for module in (m for m in MODULES if m.startswith(f"metrale.plugins.{family}")):
        crossing = {m for m in imports(module, top_level_only=False) if m.startswith(others)}
        assert not crossing, f"{module} imports {sorted(crossing)}"
