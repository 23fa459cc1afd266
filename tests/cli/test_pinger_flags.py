"""`shmhb pinger` flags that decide the board it creates, and starts it refuses."""

from __future__ import annotations

import os
import subprocess
import sys

import shmhb
from shmhb.testing.loopback import child_env

from ..conftest import Procs, wait_until

ENV = child_env()
PINGER = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02"]


def test_a_pinger_refused_for_its_secret_leaves_no_board(board_name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 32)
    secret.chmod(0o644)  # readable by others: refused
    for path in (str(secret), str(tmp_path / "missing")):
        out = subprocess.run(PINGER + ["--board", board_name, "--secret-file", path], env=ENV,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "secret" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert not os.path.exists(f"/dev/shm/{board_name}")


def test_slots_sets_the_capacity_of_the_board_it_creates(board_name: str, procs: Procs) -> None:
    procs.spawn(PINGER + ["--board", board_name, "--slots", "200"], ready=False)
    wait_until(lambda: os.path.exists(f"/dev/shm/{board_name}"), what="the board is created")
    wait_until(lambda: _capacity(board_name) == 200, what="200 slots")
    out = subprocess.run(PINGER + ["--board", board_name + "-x", "--slots", "0"], env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "slots must be an integer in 1..4096" in out.stderr
    assert not os.path.exists(f"/dev/shm/{board_name}-x")


def _capacity(name: str) -> int | None:
    try:
        with shmhb.Board.attach(name) as b:
            return b.capacity.slots
    except shmhb.ShmhbError:
        return None  # still being created
