"""`shmhb pinger` flags that decide the board it creates, and starts it refuses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import shmhb
from shmhb import Status
from shmhb.testing.loopback import child_env, free_port

from ..conftest import Procs, wait_until

ENV = child_env()
PINGER = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02"]


@pytest.mark.system  # it starts processes (tests/tiers.py)
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


WORKER = """
import signal, sys, shmhb
b = shmhb.Board.attach(sys.argv[1])
hb = b.register("other-uid", agent=True).start(0.05)
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *a: (hb.close(), sys.exit(0)))
signal.pause()
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root to run a worker as another account")
def test_a_worker_of_the_boards_group_runs_the_network_half_with_a_group_secret(
        board_name: str, procs: Procs) -> None:
    gid = 42424
    where = Path(tempfile.mkdtemp(prefix="shmhb-test-"))  # a path the other account can walk
    try:
        where.chmod(0o755)
        _group_secret(board_name, procs, gid, where / "secret")
    finally:
        shutil.rmtree(where)


def _group_secret(board_name: str, procs: Procs, gid: int, secret: Path) -> None:
    secret.write_bytes(b"s" * 32)
    os.chown(secret, 0, gid)
    listen = f"127.0.0.1:{free_port(['127.0.0.1'])}"
    args = ["--board", board_name, "--board-mode", "0660", "--board-group", str(gid),
            "--listen", listen, "--secret-file", str(secret)]
    secret.chmod(0o644)  # readable by others: refused, shared board or not
    out = subprocess.run(PINGER + args, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "chmod 640" in out.stderr, out.stderr
    secret.chmod(0o640)  # the board's group alone: what its workers need to hold the role
    daemon = procs.spawn(PINGER + args, ready=False)
    wait_until(lambda: _network(board_name) == "listening", timeout_s=20, what="daemon listens")
    procs.spawn(["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--groups",
                 str(gid), sys.executable, "-c", WORKER, board_name])
    daemon.kill()
    daemon.wait()
    with shmhb.Board.attach(board_name) as b:
        wait_until(lambda: b.agent().pid not in (0, daemon.pid) and b.agent().status is Status.ALIVE,
                   timeout_s=20, what="the other account's worker holds the role")
        wait_until(lambda: b.network().state == "listening", timeout_s=20,
                   what="its network half runs with the group's secret")
        assert b.network().working


def _network(name: str) -> str | None:
    try:
        with shmhb.Board.attach(name) as b:
            return b.network().state
    except shmhb.ShmhbError:
        return None
