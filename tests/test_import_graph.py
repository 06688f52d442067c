"""The import structure: no cycle among Metrale's modules (every import statement counted,
inside functions and under ``if TYPE_CHECKING`` too), a root of few modules, and floors that
never reach the floors above them (kernels reach no op registry, backend, engine, runner, entry
point or checkpoint loading, directly or through another module), families that never import
one another."""

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


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(child) for statement in node.body for child in ast.walk(statement)}
    return inside


def imports(module: str, top_level_only: bool = False, annotations: bool = True) -> set[str]:
    """The metrale modules ``module`` imports: at import time only (top-level statements, not
    under ``if TYPE_CHECKING``), or anywhere in it (functions included; with ``annotations``,
    the ``if TYPE_CHECKING`` imports too)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    if top_level_only:
        nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        nodes += [n for block in tree.body if isinstance(block, ast.Try) for n in block.body
                  if isinstance(n, (ast.Import, ast.ImportFrom))]
    else:
        skipped = set() if annotations else _type_checking_nodes(tree)
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            target = _resolve(module, node, path.name == "__init__.py")
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target for alias in node.names]
        found |= {name for name in names if name in MODULES and name != module}
    return found


def test_no_import_cycle_among_metrale_modules():
    graph = {module: imports(module) for module in MODULES}
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


def test_the_cycle_check_sees_function_level_and_annotation_imports():
    """The graph above counts an import inside a function and one under ``if TYPE_CHECKING``."""
    assert "metrale.loading.model" in imports("metrale.backends.executor")  # inside worker_main
    assert "metrale.entrypoints.llm" in imports("metrale.engine.driver")  # under TYPE_CHECKING
    assert "metrale.entrypoints.llm" not in imports("metrale.engine.driver", annotations=False)


#: The most modules the root of the package may hold (everything else lives in a room).
MAX_ROOT_MODULES = 14


def test_the_root_holds_few_modules():
    root = sorted(path.name for path in (ROOT / "metrale").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"metrale/ holds {len(root)} modules: {root}"


def _parents(module: str) -> list[str]:
    """The packages importing ``module`` runs first, below ``metrale`` itself (whose
    ``__init__`` is the public facade)."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(2, len(parts))]


def reached(module: str) -> set[str]:
    """Every module importing ``module`` can run: its imports (functions included, annotations
    not), theirs, and the packages above each."""
    seen: set[str] = set()
    stack = [module, *_parents(module)]
    while stack:
        for target in imports(stack.pop(), annotations=False):
            for name in (*_parents(target), target):
                if name in MODULES and name not in seen:
                    seen.add(name)
                    stack.append(name)
    return seen


ENTRY = ("metrale.entrypoints", "metrale.benchmarks", "metrale.testing")
#: Each floor -> the rooms it must never reach.
FLOORS = {
    "metrale.kernels": ENTRY + ("metrale.engine", "metrale.runner", "metrale.loading", "metrale.model", "metrale.backends",
                                "metrale.cache", "metrale.layers", "metrale.ops", "metrale.plugins", "metrale.structured"),
    "metrale.ops": ENTRY + ("metrale.engine", "metrale.runner", "metrale.loading", "metrale.model", "metrale.cache",
                            "metrale.layers", "metrale.plugins"),
    "metrale.cache": ENTRY + ("metrale.engine", "metrale.runner", "metrale.model", "metrale.layers", "metrale.plugins"),
    "metrale.layers": ENTRY + ("metrale.engine", "metrale.runner", "metrale.loading.model", "metrale.plugins"),
    "metrale.backends.base": ENTRY + ("metrale.engine", "metrale.runner", "metrale.model"),
    "metrale.backends.cuda": ENTRY + ("metrale.engine", "metrale.runner", "metrale.model"),
    "metrale.backends.devices": ENTRY + ("metrale.engine", "metrale.runner", "metrale.model"),
    "metrale.backends.parallel": ENTRY + ("metrale.engine", "metrale.runner", "metrale.model"),
    "metrale.runner": ENTRY + ("metrale.engine",),
    "metrale.engine": ENTRY,
    "metrale.plugins": ENTRY + ("metrale.engine",),
    "metrale.structured": ENTRY + ("metrale.engine", "metrale.runner", "metrale.model"),
}
for _data_module in ("errors", "params", "sequence", "batch", "config", "validation", "speculative"):
    FLOORS[f"metrale.{_data_module}"] = ENTRY + ("metrale.engine", "metrale.runner", "metrale.model", "metrale.loading",
                                                 "metrale.backends")


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_no_floor_reaches_the_floors_above_it(floor):
    above = FLOORS[floor]
    for module in (m for m in MODULES if m == floor or m.startswith(floor + ".")):
        crossing = sorted(m for m in reached(module) if m.startswith(above))
        assert not crossing, f"{module} reaches {crossing}"


def test_the_floor_check_follows_imports_through_other_modules():
    """``reached`` follows a chain: the engine reaches the kernels through the runner and the ops."""
    assert "metrale.kernels.lora_tiles" in reached("metrale.engine.engine")


FAMILIES = ("dense", "mla", "gdn")


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_imports_another(family):
    others = tuple(f"metrale.plugins.{other}" for other in FAMILIES if other != family)
    for module in (m for m in MODULES if m.startswith(f"metrale.plugins.{family}")):
        crossing = {m for m in imports(module, top_level_only=False) if m.startswith(others)}
        assert not crossing, f"{module} imports {sorted(crossing)}"
