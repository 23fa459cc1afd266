"""The child programs of the tests (tests/children/): each compiles, says in its
docstring how it is called, and is run by some test (none left behind)."""

from __future__ import annotations

import ast
import re

import pytest

from .children import HERE, child

TESTS = HERE.parent


def test_every_child_program_compiles_says_its_use_and_is_run_by_a_test() -> None:
    programs = sorted(p for p in HERE.glob("*.py") if p.name != "__init__.py")
    assert programs
    users = "\n".join(p.read_text() for p in TESTS.rglob("*.py") if HERE not in p.parents)
    unused = []
    for p in programs:
        tree = ast.parse(p.read_text(), str(p))  # a syntax error fails here
        assert ast.get_docstring(tree), f"{p.name}: say its arguments and output in a docstring"
        if not re.search(rf"""child\(["']{p.stem}["']\)""", users):
            unused.append(p.name)
    assert not unused, f"child programs no test runs (remove them): {unused}"


def test_a_missing_child_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        child("no-such-program")
