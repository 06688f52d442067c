"""Extract the training corpus of the tiny checkpoints: docstrings of Python's standard library.

The corpus is every module, class and function docstring of the ``.py`` files of the running
interpreter's standard library (test suites excluded), in sorted file order, followed by the
language-reference topics that ``pydoc`` ships (``pydoc_data.topics``). Python's standard
library is distributed under the PSF License Agreement, which permits redistribution of derived
works. Files whose path hashes into the held-out bucket form the held-out split.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import sysconfig
from pathlib import Path

SEPARATOR = "<|endoftext|>"
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
HELD_OUT_BUCKETS = 20  # one file in twenty is held out


def stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_PARTS & set(relative.parts):
            continue
        files.append(path)
    return files


def docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                text = inspect.cleandoc(text).strip()
                if len(text) >= 20 and SEPARATOR not in text:
                    found.append(text)
    return found


def reference_topics() -> dict[str, str]:
    """The language-reference topics that ``pydoc`` ships in ``pydoc_data.topics``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return {}
    return {name: text.strip() for name, text in sorted(topics.items()) if text.strip()}


def is_held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def extract(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in stdlib_files(root):
        relative = path.relative_to(root).as_posix()
        texts = docstrings(path.read_text(encoding="utf-8", errors="replace"))
        (held_out if is_held_out(relative) else train).extend(texts)
    for name, text in reference_topics().items():
        (held_out if is_held_out(f"topics/{name}") else train).append(text)
    return train, held_out


if __name__ == "__main__":
    train, held_out = extract()
    size = sum(len(t) for t in train)
    print(f"python {sys.version.split()[0]}: {len(train)} training docs ({size / 1e6:.1f} MB), {len(held_out)} held out "
          f"({sum(len(t) for t in held_out) / 1e6:.2f} MB)")
