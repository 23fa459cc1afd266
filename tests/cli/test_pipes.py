"""Every ``shmhb`` subcommand that prints stops quietly when its reader goes away
(``shmhb status | head``): no BrokenPipeError traceback, no "Exception ignored" at exit,
and exit status 141 (128 + SIGPIPE, what a shell reports for a command killed by it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import shmhb
from shmhb.cli.exits import EXIT_BROKEN_PIPE

from ..conftest import ME, ROOT

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)


@pytest.fixture
def busy_board(board: shmhb.Board) -> Iterator[shmhb.Board]:
    """A board with enough rows that every command has lines to print."""
    hbs = [board.register(f"pipe-w{i}", [f"127.0.0.1:{31000 + i}"], agent=False) for i in range(8)]
    for hb in hbs:
        hb.beat()
    yield board
    for hb in hbs:
        hb.close()


def run_into_closed_pipe(*args: str, env: dict[str, str] | None = None
                         ) -> subprocess.CompletedProcess[bytes]:
    """``shmhb ARGS`` with stdout a pipe whose reading end is already closed: its first
    write (or the flush at exit) meets EPIPE, as under ``| head`` once head has exited."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "shmhb", *args], cwd=ROOT, stdout=w,
                              stderr=subprocess.PIPE, timeout=60, env=env)
    finally:
        os.close(w)


@pytest.mark.parametrize("args", [
    ("status",), ("status", "--json"), ("events",), ("events", "--json"),
    ("events", "--follow"), ("instances",),
], ids=lambda a: " ".join(a))
def test_a_closed_pipe_ends_the_command_quietly(busy_board: shmhb.Board, args: tuple[str, ...]) -> None:
    p = run_into_closed_pipe(*args, "--board", busy_board.name)
    err = p.stderr.decode(errors="replace")
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert p.returncode == EXIT_BROKEN_PIPE, (p.returncode, err)


def test_a_closed_pipe_ends_units_quietly(tmp_path: object) -> None:
    from ..conftest import install_args, install_env
    p = run_into_closed_pipe("units", *install_args(), "--out", str(tmp_path), "--user", ME,
                             env=install_env())
    err = p.stderr.decode(errors="replace")
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert p.returncode == EXIT_BROKEN_PIPE, (p.returncode, err)
