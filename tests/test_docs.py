"""The documentation keeps up with the code: every hook spec, every environment variable, every
CLI option and every tool path.

These tests read files only; they never run Sphinx.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path

import pytest

from metrale import config, hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HOOKS_PAGE = DOCS / "reference" / "hooks.rst"
ENVIRONMENT_PAGE = DOCS / "environment.rst"
CLI_PAGE = DOCS / "cli.rst"
SOURCE_FOLDERS = ("metrale", "plugins", "kernels")

ENV_NAME = re.compile(r"METRALE_[A-Z_]+")

#: METRALE_* names in the source that are not environment variables.
NOT_ENVIRONMENT_VARIABLES = {
    "METRALE_CONTRACT_VERSION": "the plugin attribute stating the contract version it targets",
}

HOOK_SPECS = sorted(
    name
    for name, obj in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("metrale_")
)


def mentions(text: str, name: str) -> bool:
    """Whether ``name`` occurs in ``text`` as a whole name (not as part of a longer one)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text) is not None


def source_files() -> list[Path]:
    files = []
    for folder in SOURCE_FOLDERS:
        files.extend(p for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts)
    return files


@functools.lru_cache(maxsize=1)
def names_in_source() -> dict[str, list[str]]:
    """Every METRALE_* name in the source files, with the files that mention it."""
    found: dict[str, list[str]] = {}
    for path in source_files():
        for name in set(ENV_NAME.findall(path.read_text(encoding="utf-8"))):
            found.setdefault(name.rstrip("_"), []).append(str(path.relative_to(ROOT)))
    return found


# ------------------------------------------------------------------------------------ hooks


def test_hook_specs_are_found():
    assert len(HOOK_SPECS) >= 20, f"only {HOOK_SPECS} found in metrale.hookspecs"


@pytest.mark.parametrize("name", HOOK_SPECS)
def test_hook_spec_has_a_docstring(name):
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc and doc.strip(), f"metrale.hookspecs.{name} has no docstring"


@pytest.mark.parametrize("name", HOOK_SPECS)
def test_hook_spec_is_in_the_hook_reference(name):
    page = HOOKS_PAGE.read_text(encoding="utf-8")
    assert mentions(page, f"metrale.hookspecs.{name}"), (
        f"{HOOKS_PAGE.relative_to(ROOT)} does not document metrale.hookspecs.{name}; add "
        f"'.. autofunction:: metrale.hookspecs.{name}' to the section of its group"
    )


def test_hook_reference_names_only_existing_specs():
    page = HOOKS_PAGE.read_text(encoding="utf-8")
    documented = re.findall(r"^\.\. autofunction:: metrale\.hookspecs\.(\w+)\s*$", page, re.MULTILINE)
    stale = sorted(set(documented) - set(HOOK_SPECS))
    assert not stale, f"{HOOKS_PAGE.relative_to(ROOT)} documents hook specs that do not exist: {stale}"


# ------------------------------------------------------------------------ environment


def test_source_names_are_found():
    found = names_in_source()
    assert "METRALE_DEVICE" in found, "the scan of the source files found no METRALE_* variable"


@pytest.mark.parametrize("name", sorted(set(names_in_source()) - set(NOT_ENVIRONMENT_VARIABLES)))
def test_environment_variable_in_source_is_registered_and_documented(name):
    where = ", ".join(names_in_source()[name])
    assert name in config.ENVIRONMENT_VARIABLES, (
        f"{name} (in {where}) is missing from metrale.config.ENVIRONMENT_VARIABLES"
    )
    assert mentions(ENVIRONMENT_PAGE.read_text(encoding="utf-8"), name), (
        f"{name} (in {where}) is missing from {ENVIRONMENT_PAGE.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("name", sorted(config.ENVIRONMENT_VARIABLES))
def test_registered_environment_variable_is_documented(name):
    assert mentions(ENVIRONMENT_PAGE.read_text(encoding="utf-8"), name), (
        f"{name} of metrale.config.ENVIRONMENT_VARIABLES is missing from "
        f"{ENVIRONMENT_PAGE.relative_to(ROOT)}"
    )


def test_names_that_are_not_environment_variables_stay_out_of_the_registry():
    found = names_in_source()
    for name in NOT_ENVIRONMENT_VARIABLES:
        assert name in found, f"{name} no longer occurs in the source; drop it from NOT_ENVIRONMENT_VARIABLES"
        assert name not in config.ENVIRONMENT_VARIABLES, f"{name} is not an environment variable"


# -------------------------------------------------------------------------------- CLI


def test_every_cli_option_is_documented():
    import argparse

    from metrale.cli import build_parser

    page = CLI_PAGE.read_text(encoding="utf-8")
    parser = build_parser()
    parsers = {"metrale": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                assert mentions(page, f"metrale {name}"), f"{CLI_PAGE.relative_to(ROOT)} lacks 'metrale {name}'"
                parsers[f"metrale {name}"] = subparser
    for command, command_parser in parsers.items():
        for action in command_parser._actions:
            for option in action.option_strings:
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", page), (
                    f"option {option} of '{command}' is missing from {CLI_PAGE.relative_to(ROOT)}"
                )


# ------------------------------------------------------------------------------ tools

TOOL_PATH = re.compile(r"(?<![\w/.-])tools/[a-z0-9_/]+\.(?:py|sh)\b")


def pages_naming_tools() -> list[Path]:
    return sorted(DOCS.rglob("*.rst")) + [ROOT / "README.md", ROOT / "tools" / "README.md"]


def test_pages_name_tools():
    assert any(TOOL_PATH.search(page.read_text(encoding="utf-8")) for page in pages_naming_tools())


@pytest.mark.parametrize("page", pages_naming_tools(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_tool_path_in_the_docs_exists(page):
    missing = sorted({path for path in TOOL_PATH.findall(page.read_text(encoding="utf-8")) if not (ROOT / path).is_file()})
    assert not missing, f"{page.relative_to(ROOT)} names tools that do not exist: {missing}"
