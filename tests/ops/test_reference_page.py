"""The checked-in op reference page (docs/reference/ops.rst) is what the op declarations render."""

from __future__ import annotations

from pathlib import Path

from metrale.ops.reference_page import REGENERATE, builtin_page, main, stale_difference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "ops.rst"


def test_the_checked_in_op_page_is_what_the_declarations_render():
    difference = stale_difference(PAGE)
    assert difference is None, difference


def test_a_stale_page_is_reported_with_the_command_that_regenerates_it(tmp_path, capsys):
    page = tmp_path / "ops.rst"
    page.write_text(builtin_page().replace("Rows of an embedding table.", "Rows of a table."))
    assert main(["--check", str(page)]) == 1
    message = capsys.readouterr().err
    assert REGENERATE in message
    assert "-Rows of a table." in message and "+Rows of an embedding table." in message
    assert "is missing" in stale_difference(tmp_path / "absent.rst")


def test_the_command_prints_the_page(capsys):
    assert main([]) == 0
    printed = capsys.readouterr().out
    assert printed == builtin_page()
    assert printed.startswith(f".. Generated from the op declarations; regenerate with: {REGENERATE}\n")
    assert main(["--check", str(PAGE)]) == 0
