"""The documentation keeps up with the code: every hook spec and every environment variable, the
command line, the ``metrale plugins`` samples, the dependencies, the sampling fields and every
tool path.

These tests read files and run ``metrale plugins`` in this process; they never run Sphinx.
"""

from __future__ import annotations

import configparser
import dataclasses
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
QUICKSTART_PAGE = DOCS / "quickstart.rst"
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
    assert len(HOOK_SPECS) >= 20, f"only {HOOK_SPECS} found in metrale.model.hookspecs"


@pytest.mark.parametrize("name", HOOK_SPECS)
def test_hook_spec_has_a_docstring(name):
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc and doc.strip(), f"metrale.model.hookspecs.{name} has no docstring"


@pytest.mark.parametrize("name", HOOK_SPECS)
def test_hook_spec_is_in_the_hook_reference(name):
    page = HOOKS_PAGE.read_text(encoding="utf-8")
    assert mentions(page, f"metrale.model.hookspecs.{name}"), (
        f"{HOOKS_PAGE.relative_to(ROOT)} does not document metrale.model.hookspecs.{name}; add "
        f"'.. autofunction:: metrale.model.hookspecs.{name}' to the section of its group"
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

    from metrale.entrypoints.cli import build_parser

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


def subcommands() -> list[str]:
    import argparse

    from metrale.entrypoints.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return [name for action in actions for name in action.choices]


def test_the_cli_page_counts_the_subcommands():
    numbers = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    page = " ".join(CLI_PAGE.read_text(encoding="utf-8").split())
    match = re.search(r"It has (\w+) subcommands: (.+?)\.", page)
    assert match, f"{CLI_PAGE.relative_to(ROOT)} no longer says 'It has N subcommands: ...'"
    names = subcommands()
    listed = re.findall(r"``([\w-]+)``", match.group(2))
    assert sorted(listed) == sorted(names), f"{CLI_PAGE.relative_to(ROOT)} lists {listed}; the parser has {names}"
    assert match.group(1) == numbers[len(names)], f"{CLI_PAGE.relative_to(ROOT)} counts {match.group(1)} subcommands"


# ------------------------------------------------------------------------ metrale plugins

#: The pages that show ``metrale plugins``, with the third-party distributions installed in their
#: example (the built-in plugins are always there).
PLUGINS_SAMPLES = {"cli.rst": (), "quickstart.rst": (), "writing-plugins.rst": ("metrale-example-family",)}


def console_outputs(text: str, command: str) -> list[list[str]]:
    """What the console blocks of ``text`` show after each ``$ command`` line, line by line."""
    outputs = []
    for block in re.findall(r"^\.\. code-block:: console\n\n((?:(?:   .*)?\n)+)", text, re.MULTILINE):
        lines = [line[3:] for line in block.rstrip("\n").split("\n")]
        for index, line in enumerate(lines):
            if line == f"$ {command}":
                rest = lines[index + 1 :]
                end = next((i for i, later in enumerate(rest) if later.startswith("$ ")), len(rest))
                outputs.append(rest[:end])
    return outputs


def shows(sample: list[str], output: list[str]) -> bool:
    """Whether ``sample`` is ``output``, with runs of lines left out where a line says ``...``."""
    parts: list[list[str]] = [[]]
    for line in sample:
        if line.strip() == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    if len(parts) == 1:
        return sample == output
    first, middle, last = parts[0], parts[1:-1], parts[-1]
    if output[: len(first)] != first:
        return False
    position = len(first)
    for part in middle:
        starts = [i for i in range(position, len(output) - len(part) + 1) if output[i : i + len(part)] == part]
        if not starts:
            return False
        position = starts[0] + len(part)
    return len(output) - len(last) >= position and output[len(output) - len(last) :] == last


def test_shows_reads_the_left_out_lines():
    output = ["a", "b", "c", "d"]
    assert shows(output, output)
    assert shows(["a", "b", "..."], output)
    assert shows(["a", "...", "c", "..."], output)
    assert shows(["a", "...", "d"], output)
    assert not shows(["a", "b"], output)
    assert not shows(["a", "c", "..."], output)
    assert not shows(["a", "...", "c"], output)


def plugins_output(distributions: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> list[str]:
    """``metrale plugins`` as it prints with the built-ins and ``distributions``' plugins only
    (the command as installed: its console script)."""
    from importlib import metadata

    every = metadata.entry_points

    def entry_points(**selection: str) -> object:
        found = every(**selection)
        if selection.get("group") != "metrale":
            return found
        return [entry for entry in found if entry.dist is not None and entry.dist.name in distributions]

    chosen = {entry.dist.name for entry in entry_points(group="metrale")}  # type: ignore[attr-defined]
    if set(distributions) - chosen:
        pytest.skip(f"{sorted(set(distributions) - chosen)} not installed")
    (script,) = [entry for entry in every(group="console_scripts") if entry.name == "metrale"]
    main = script.load()
    monkeypatch.setattr(metadata, "entry_points", entry_points)
    monkeypatch.delenv("METRALE_BLOCKED_PLUGINS", raising=False)
    monkeypatch.delenv("METRALE_NO_ENTRY_POINTS", raising=False)
    capsys.readouterr()
    assert main(["plugins"]) == 0
    return capsys.readouterr().out.rstrip("\n").split("\n")


@pytest.mark.parametrize("page", sorted(PLUGINS_SAMPLES))
def test_metrale_plugins_samples_are_its_output(page, monkeypatch, capsys):
    samples = console_outputs((DOCS / page).read_text(encoding="utf-8"), "metrale plugins")
    assert samples, f"docs/{page} shows no '$ metrale plugins'; drop it from PLUGINS_SAMPLES"
    output = plugins_output(PLUGINS_SAMPLES[page], monkeypatch, capsys)
    for sample in samples:
        assert shows(sample, output), (
            f"the 'metrale plugins' sample of docs/{page} is not the command's output; it prints:\n" + "\n".join(output)
        )


def test_every_metrale_plugins_sample_is_checked():
    pages = [path.name for path in sorted(DOCS.glob("*.rst"))
             if console_outputs(path.read_text(encoding="utf-8"), "metrale plugins")]
    assert sorted(pages) == sorted(PLUGINS_SAMPLES), f"pages with a 'metrale plugins' sample: {pages}"


# ------------------------------------------------------------------------ the quickstart


def requirement_names(value: str) -> list[str]:
    names = []
    for line in value.splitlines():
        line = line.split("#")[0].strip()
        if line:
            match = re.match(r"[A-Za-z0-9_.\-]+", line)
            assert match, f"cannot read the requirement {line!r} of setup.cfg"
            names.append(match.group(0))
    return names


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """setup.cfg's ``install_requires`` and ``extras_require``, by distribution name."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    extras = {name: requirement_names(value) for name, value in parser["options.extras_require"].items()}
    return requirement_names(parser["options"]["install_requires"]), extras


def test_the_quickstart_names_every_dependency():
    page = QUICKSTART_PAGE.read_text(encoding="utf-8")
    install, extras = setup_requirements()
    missing = [name for name in install if f"``{name}``" not in page]
    assert not missing, f"{QUICKSTART_PAGE.relative_to(ROOT)} does not name the runtime dependencies {missing}"
    rows = dict(re.findall(r"^   \* - ``([\w-]+)``\n     - ((?:.|\n)*?)\n     - ", page, re.MULTILINE))
    assert sorted(rows) == sorted(extras), (
        f"{QUICKSTART_PAGE.relative_to(ROOT)}'s table of extras has rows {sorted(rows)}; setup.cfg has {sorted(extras)}"
    )
    for extra, names in extras.items():
        listed = re.findall(r"``([A-Za-z0-9_.\-]+)``", rows[extra])
        assert sorted(listed) == sorted(names), f"extra {extra}: the quickstart lists {listed}, setup.cfg {names}"


def test_the_quickstart_lists_every_sampling_field_with_its_default():
    from metrale.params import SamplingParams

    page = QUICKSTART_PAGE.read_text(encoding="utf-8")
    start = page.index(":class:`~metrale.SamplingParams` fields")
    section = page[start : page.index(":class:`~metrale.RequestOutput` holds", start)]
    terms = re.findall(r"^``(\w+)``(?: \(default (.+?)\))?$", section, re.MULTILINE)
    fields = [field for field in dataclasses.fields(SamplingParams) if not field.name.startswith("_")]
    assert [name for name, _ in terms] == [field.name for field in fields], (
        f"{QUICKSTART_PAGE.relative_to(ROOT)} lists the fields {[name for name, _ in terms]}"
    )
    for (name, documented), field in zip(terms, fields):
        value = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        if documented:
            assert documented == repr(value), f"{name}: the quickstart says default {documented}, the code {value!r}"
        else:
            assert not value, f"{name}: the quickstart gives no default; the code's is {value!r}"


def test_the_quickstart_names_every_engine_option():
    from metrale.config import CacheConfig, EngineConfig

    page = " ".join(QUICKSTART_PAGE.read_text(encoding="utf-8").split())
    start = page.index("Engine options are keyword arguments")
    sentence = page[start : page.index(":class:`~metrale.config.CacheConfig`)", start)]
    options = [field.name for config in (EngineConfig, CacheConfig) for field in dataclasses.fields(config)
               if field.name not in ("cache", "environment", "device")]
    missing = [name for name in options if f"``{name}``" not in sentence]
    assert not missing, f"{QUICKSTART_PAGE.relative_to(ROOT)} does not name the engine options {missing}"


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
