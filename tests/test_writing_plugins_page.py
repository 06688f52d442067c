"""Every Python example of docs/writing-plugins.rst is complete and runs as the page says.

Each ``.. code-block:: python`` names nothing it neither defines nor imports (a missing helper
fails here, not in a reader's hands). Blocks without a caption run as they are, or, when they
hold tests, under pytest; the blocks captioned with a file of the ``my_ops`` package are written
out as that package, installed with its entry point (a ``.dist-info`` folder on ``sys.path``), and
its test module runs under pytest -- the kernel checks the page describes, without a GPU, in a
process where numba runs no simulator, as a plugin author's would.
"""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import symtable
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.rst"
DIRECTIVE = re.compile(r"^(?P<indent> *)\.\. code-block:: python\s*$")


@dataclass(frozen=True)
class Block:
    line: int
    caption: str | None
    code: str

    @property
    def holds_tests(self) -> bool:
        return re.search(r"^(def test_|class Test)", self.code, re.MULTILINE) is not None

    def __str__(self) -> str:
        return f"{PAGE.name}:{self.line}" + (f" ({self.caption})" if self.caption else "")


def python_blocks(text: str) -> list[Block]:
    """The ``.. code-block:: python`` directives of ``text``: line, ``:caption:`` and body."""
    lines = text.splitlines()
    blocks = []
    for number, line in enumerate(lines):
        match = DIRECTIVE.match(line)
        if match is None:
            continue
        indent = len(match["indent"])
        caption, body, index = None, [], number + 1
        while index < len(lines) and re.match(rf"^ {{{indent + 1},}}:(\w+):", lines[index]):
            option = lines[index].strip()
            if option.startswith(":caption:"):
                caption = option[len(":caption:"):].strip()
            index += 1
        while index < len(lines) and (not lines[index].strip() or len(lines[index]) - len(lines[index].lstrip()) > indent):
            body.append(lines[index])
            index += 1
        blocks.append(Block(number + 1, caption, textwrap.dedent("\n".join(body)).strip() + "\n"))
    return blocks


BLOCKS = python_blocks(PAGE.read_text(encoding="utf-8"))
PACKAGE = {block.caption: block for block in BLOCKS if block.caption and block.caption.startswith(("my_ops/", "tests/"))}


def undefined_names(code: str) -> set[str]:
    """Names ``code`` reads, at module level or in any function, that it never binds at module
    level (assignment, import, def, class) and that are not builtins."""
    table = symtable.symtable(code, "<example>", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins)) | {"__name__", "__file__"}
    missing = {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.get_name() not in known}

    def walk(scope: symtable.SymbolTable) -> None:
        for child in scope.get_children():
            for symbol in child.get_symbols():
                if symbol.is_referenced() and symbol.is_global() and symbol.get_name() not in known:
                    missing.add(symbol.get_name())
            walk(child)

    walk(table)
    return missing


def test_the_page_has_the_examples_this_test_reads():
    assert len(BLOCKS) >= 6
    assert set(PACKAGE) == {"my_ops/plugin.py", "my_ops/kernels.py", "tests/test_my_ops.py"}


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_example_defines_or_imports_what_it_uses(block):
    compile(block.code, str(block), "exec")
    assert undefined_names(block.code) == set(), f"{block} uses names it neither defines nor imports"


def test_the_undefined_name_check_catches_a_missing_helper():
    code = "from metrale.ops import Kernel\n\nK = Kernel('a', 'cuda', 'k', build=lambda b: make_it(b.stream))\n"
    assert undefined_names(code) == {"make_it"}
    assert undefined_names("class A:\n    x = missing\n") == {"missing"}
    assert undefined_names("import numpy as np\n\ndef f(rng):\n    return [np.ones(2) for _ in rng]\n") == set()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.caption is None and not b.holds_tests], ids=str)
def test_the_plain_examples_run(block):
    exec(compile(block.code, str(block), "exec"), {"__name__": "example"})


def child_environment(*paths: Path, simulator: bool) -> dict[str, str]:
    env = dict(os.environ)
    if not simulator:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *(entry for entry in sys.path if entry)])
    return env


def run_pytest(folder: Path, *paths: Path, simulator: bool) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist", str(folder)],
        capture_output=True, text=True, cwd=folder, env=child_environment(*paths, simulator=simulator), timeout=900,
    )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.caption is None and b.holds_tests], ids=str)
def test_the_test_examples_pass(block, tmp_path):
    (tmp_path / f"test_example_{block.line}.py").write_text(block.code)
    result = run_pytest(tmp_path, simulator=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture
def my_ops(tmp_path, monkeypatch):
    """The page's ``my_ops`` package, installed: its modules and a ``.dist-info`` folder with its
    entry point, on this process's ``sys.path`` (for the test's duration) and a child's."""
    site = tmp_path / "site"
    for caption in ("my_ops/plugin.py", "my_ops/kernels.py"):
        (site / caption).parent.mkdir(parents=True, exist_ok=True)
        (site / caption).write_text(PACKAGE[caption].code)
    (site / "my_ops" / "__init__.py").write_text("")
    info = site / "my_ops-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-ops\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[metrale]\nmy_ops = my_ops.plugin:plugin\n")
    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_my_ops.py").write_text(PACKAGE["tests/test_my_ops.py"].code)
    monkeypatch.syspath_prepend(str(site))
    yield site, tests
    for name in [name for name in sys.modules if name == "my_ops" or name.startswith("my_ops.")]:
        del sys.modules[name]


def test_the_my_ops_plugin_serves_its_op_and_its_kernels(my_ops):
    import numpy as np

    from metrale.backends.base import CpuBackend
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops import build_op_registry
    from metrale.ops.check import assert_kernels_match
    from metrale.testing.kernel_check import simulate_kernels

    registry = build_op_registry(get_plugin_manager())
    assert registry.ops["squared_relu"].origin == "my_ops"
    assert registry.serving("squared_relu", "cuda")[0] == "my_ops.squared_relu [my_ops]"
    assert registry.serving("rmsnorm", "cpu")[0] == "my_ops.rmsnorm_float64 [my_ops] when H <= 64"
    backend = CpuBackend()
    backend.use_ops(registry)
    x = np.array([[-1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(backend.ops.squared_relu(x), [[0.0, 4.0]])
    assert_kernels_match(registry, backend)
    report = simulate_kernels(registry)
    assert report.checked == ["my_ops.squared_relu"] and report.problems == []


def test_the_my_ops_kernel_checks_pass_without_a_gpu_as_the_page_says(my_ops):
    site, tests = my_ops
    result = run_pytest(tests, site, simulator=False)
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    assert re.search(r"\b2 passed\b", output) or re.search(r"1 passed, 1 skipped", output), output


@pytest.mark.gpu
def test_the_my_ops_kernels_match_their_references_on_the_gpu(my_ops):
    from metrale.backends.cuda import CudaBackend
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops import build_op_registry
    from metrale.ops.check import assert_kernels_match

    assert_kernels_match(build_op_registry(get_plugin_manager()), CudaBackend())
