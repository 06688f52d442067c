"""Kernels are chosen in the op registry only: the launchers below it -- the host functions of
``kernels/*.py`` and the methods of :class:`metrale.ops.cuda.CudaKernels` -- check arguments,
allocate and launch, and never pick among kernels.

Read from the source (``metrale.ops.cuda`` imports CuPy), two rules:

* a launcher calls no kernel's selection helper (``supports``, ``*_supported``, ``merges_itself``)
  except as the guard of an ``if`` that only raises (refusing arguments it cannot serve);
* no ``if`` (or conditional expression) of a launcher has two sides that reach different kernels:
  where both the branch and what runs otherwise (the ``else``, or the statements after a branch
  that returns) launch or name kernels, they launch or name the same ones. A branch that only
  adapts arguments (a conversion before the one kernel, a merge step a launch needs) passes; a
  dtype, a size or a setting that sends a call to one kernel or another does not.

What counts as reaching a kernel: a launch (``kernel[grid, block](...)``, ``launch(kernel, ...)``,
``kernel(grid, block, args)``), a module-level ``numba.cuda`` kernel, a kernel factory (a function
whose name ends in ``_kernel``), a launcher of another kernel module (a host function that reaches
a kernel) and a kernel module's constant handed to a call (a mode: one compiled kernel of
several), and, in ``CudaKernels``, a call of another of its methods that reaches one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import metrale.kernels
import metrale.ops

KERNELS = Path(metrale.kernels.__file__).parent
OPS_CUDA = Path(metrale.ops.__file__).parent / "cuda.py"
SELECTION_HELPERS = ("supports", "merges_itself")
DEVICE_DECORATORS = ("jit", "jit_kernel", "inline_device")


def selection_helper(name: str) -> bool:
    return name in SELECTION_HELPERS or name.endswith("_supported")


def called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def decorator_names(function: ast.FunctionDef) -> set[str]:
    names = set()
    for decorator in function.decorator_list:
        for node in ast.walk(decorator):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
    return names


def is_device_code(function: ast.FunctionDef) -> bool:
    return bool(decorator_names(function) & set(DEVICE_DECORATORS))


def is_launch(call: ast.Call) -> bool:
    """A numba launch ``k[grid, block, ...](...)``, ``launch(k, ...)`` of :mod:`metrale.kernels._launch`,
    or a CuPy kernel called with its grid and block."""
    if isinstance(call.func, ast.Subscript):
        return True
    if isinstance(call.func, ast.Name) and call.func.id == "launch":
        return True
    return len(call.args) >= 2 and all(isinstance(a, ast.Tuple) for a in call.args[:2])


@dataclass
class Module:
    name: str
    tree: ast.Module
    kernel_modules: dict[str, str]  # local name -> kernel module
    jit_kernels: set[str]  # module-level numba kernels
    host_functions: dict[str, ast.FunctionDef]


def read_module(path: Path) -> Module:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kernel_modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "metrale.kernels":
            for alias in node.names:
                kernel_modules[alias.asname or alias.name] = alias.name
    jit_kernels = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and is_device_code(node)
                   and "device" not in ast.unparse(node.decorator_list[0])}
    host = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and not is_device_code(node)}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    host[f"{node.name}.{item.name}"] = item
    return Module(path.stem, tree, kernel_modules, jit_kernels, host)


def kernel_modules() -> dict[str, Module]:
    return {path.stem: read_module(path) for path in sorted(KERNELS.glob("*.py")) if path.stem != "__init__"}


def launchers(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Per kernel module, its host functions that reach a kernel (to a fixed point: a function
    calling another module's launcher is one)."""
    found: dict[str, set[str]] = {name: set() for name in modules}
    changed = True
    while changed:
        changed = False
        for module in modules.values():
            for name, function in module.host_functions.items():
                if name not in found[module.name] and reaches(function, module, modules, found, own=None):
                    found[module.name].add(name)
                    changed = True
    return found


def kernel_references(node: ast.AST, module: Module, modules: dict[str, Module], found: dict[str, set[str]],
                      own: set[str] | None) -> set[str]:
    """What under ``node`` launches or names a kernel (see the module docstring), as source text."""
    references: set[str] = set()
    for child in walk_without_functions(node):
        if isinstance(child, ast.Call) and is_launch(child):
            target = child.args[0] if isinstance(child.func, ast.Name) and child.func.id == "launch" else child.func
            references.add(ast.unparse(target.value if isinstance(target, ast.Subscript) else target))
        if isinstance(child, ast.Call):
            # A kernel module's constant handed to a launcher (decode_gemv.PLAIN, ...): a mode, one
            # compiled kernel of several.
            for argument in child.args:
                if (isinstance(argument, ast.Attribute) and isinstance(argument.value, ast.Name)
                        and argument.value.id in module.kernel_modules and argument.attr.isupper()):
                    references.add(ast.unparse(argument))
        elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
            other = module.kernel_modules.get(child.value.id)
            if other in modules and (child.attr in found[other] or child.attr in modules[other].jit_kernels
                                     or child.attr.endswith("_kernel")):
                references.add(ast.unparse(child))
            elif own is not None and child.value.id == "self" and child.attr in own:
                references.add(ast.unparse(child))
        elif isinstance(child, ast.Name) and (child.id in module.jit_kernels or child.id in found.get(module.name, ())
                                              or child.id.endswith("_kernel")):
            references.add(child.id)
    return references


def walk_without_functions(node: ast.AST):
    """``ast.walk`` that does not enter nested function definitions (device code, closures)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)


def reaches(function: ast.FunctionDef, module: Module, modules: dict[str, Module], found: dict[str, set[str]],
            own: set[str] | None) -> bool:
    return bool(kernel_references(ast.Module(body=function.body, type_ignores=[]), module, modules, found, own))


def terminates(statements: list[ast.stmt]) -> bool:
    return bool(statements) and isinstance(statements[-1], (ast.Return, ast.Raise))


def problems_of(name: str, function: ast.FunctionDef, module: Module, modules: dict[str, Module],
                found: dict[str, set[str]], own: set[str] | None) -> list[str]:
    where = f"{module.name}.{name} (line {function.lineno})"
    problems: list[str] = []
    guards: set[int] = set()

    def block(statements: list[ast.stmt]) -> None:
        for index, statement in enumerate(statements):
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(statement, ast.If):
                if all(isinstance(s, ast.Raise) for s in statement.body):  # a guard: refuses, picks nothing
                    guards.update(id(n) for n in ast.walk(statement.test))
                else:
                    otherwise = statement.orelse or (statements[index + 1:] if terminates(statement.body) else [])
                    compare(statement, statement.body, otherwise)
                block(statement.body)
                block(statement.orelse)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], (ast.stmt, ast.ExceptHandler)):
                    block([s for item in inner for s in (item.body if isinstance(item, ast.ExceptHandler) else [item])])

    # Names the function binds itself (arguments, assignments) shadow the module's.
    local = {a.arg for a in function.args.args + function.args.kwonlyargs}
    local |= {n.id for n in walk_without_functions(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def refs(statements: list[ast.AST]) -> set[str]:
        found_here = set().union(*(kernel_references(s, module, modules, found, own) for s in statements))
        return {reference for reference in found_here if reference not in local}

    def compare(node: ast.AST, body: list, otherwise: list) -> None:
        taken, other = refs(body), refs(otherwise)
        if taken and other and taken != other:
            problems.append(f"{where}: line {node.lineno} branches between {sorted(taken)} and {sorted(other)}")

    block(function.body)
    for node in walk_without_functions(ast.Module(body=function.body, type_ignores=[])):
        if isinstance(node, ast.IfExp):
            compare(node, [node.body], [node.orelse])
            sides = [ast.unparse(side) for side in (node.body, node.orelse)
                     if isinstance(side, ast.Name) and side.id in module.kernel_modules]
            if len(sides) == 2 and sides[0] != sides[1]:  # one kernel module or another
                problems.append(f"{where}: line {node.lineno} branches between the modules {sides}")
        if (isinstance(node, ast.Call) and selection_helper(called_name(node)) and id(node) not in guards
                and not selection_helper(function.name)):
            problems.append(f"{where}: line {node.lineno} calls the selection helper {ast.unparse(node.func)}")
    return problems


def launcher_problems() -> list[str]:
    modules = kernel_modules()
    found = launchers(modules)
    problems: list[str] = []
    for module in modules.values():
        for name, function in module.host_functions.items():
            problems += problems_of(name, function, module, modules, found, own=None)
    cuda = read_module(OPS_CUDA)
    methods = {name.split(".", 1)[1]: f for name, f in cuda.host_functions.items() if name.startswith("CudaKernels.")}
    # The methods that reach a kernel, to a fixed point (one calling another that launches is one).
    own: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, function in methods.items():
            if name not in own and reaches(function, cuda, modules, found, own):
                own.add(name)
                changed = True
    for name, function in methods.items():
        problems += problems_of(f"CudaKernels.{name}", function, cuda, modules, found, own)
    return problems


def test_no_launcher_picks_among_kernels():
    problems = launcher_problems()
    assert not problems, "launchers that pick among kernels (a choice belongs in metrale.ops.selection):\n" + "\n".join(
        problems)


# ------------------------------------------------------------------------- the check itself

PICKS = '''
from metrale.kernels import attention_mma, attention_prefill

class CudaKernels:
    def paged_attention(self, q, heads):
        if attention_mma.supports(heads):
            return attention_mma.prefill_attention(q)
        return attention_prefill.paged_attention_prefill(q)

    def by_dtype(self, x):
        launch = attention_mma.prefill_attention if x.dtype == 1 else attention_prefill.paged_attention_prefill
        return launch(x)

    def by_module(self, x):
        rule = attention_mma if x.dtype == 1 else attention_prefill
        return rule.prompt_rule(x)

    def adapts(self, x):
        if x.dtype == 1:
            x = self.convert(x)
        return attention_mma.prefill_attention(x)

    def convert(self, x):
        return attention_prefill.paged_attention_prefill(x)
'''


@pytest.mark.parametrize("method, found", [("paged_attention", 2), ("by_dtype", 1), ("by_module", 1), ("adapts", 0)])
def test_the_check_finds_a_launcher_that_picks(tmp_path, method, found):
    source = tmp_path / "cuda.py"
    source.write_text(PICKS)
    modules = kernel_modules()
    cuda = read_module(source)
    found_launchers = launchers(modules)
    own = {"paged_attention", "by_dtype", "by_module", "adapts", "convert"}
    function = cuda.host_functions[f"CudaKernels.{method}"]
    problems = problems_of(method, function, cuda, modules, found_launchers, own)
    assert len(problems) == found, problems
