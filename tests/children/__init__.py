"""The programs that tests run as child processes, one module each (so linters and
readers see them as code): each is run by its path, ``[sys.executable, child("worker"),
ARGS...]``, imports only the package under test and the standard library, and says its
arguments and what it prints in its docstring."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(name: str) -> str:
    """The path of the child program ``name`` (this folder's ``name.py``)."""
    path = HERE / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no child program {name!r} in {HERE}")
    return str(path)
