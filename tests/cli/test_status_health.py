"""What `shmhb status` says about the daemon: whether one runs, who holds the agent
role, and that a host set up with a daemon but left to its workers' embedded agent is
not reported healthy."""

from __future__ import annotations

import json
import subprocess
import sys

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.cli.exits import EXIT_NETWORK, EXIT_NO_DAEMON, EXIT_OK
from shmhb.cli.view import read_view
from shmhb.testing.loopback import child_env, free_port

from ..conftest import Procs, wait_until

ENV = child_env()
PINGER = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmhb", *args], env=ENV,
                          capture_output=True, text=True, timeout=60)


def _holder(board: shmhb.Board) -> str | None:
    return read_view(board).holder()


def test_a_stopped_daemon_is_reported_and_a_restarted_one_gets_the_role_back(
        board: shmhb.Board, procs: Procs) -> None:
    worker = procs.worker(board.name, "w", agent=True)
    listen = f"127.0.0.1:{free_port(['127.0.0.1'])}"
    daemon = procs.spawn(PINGER + ["--board", board.name, "--listen", listen], ready=False)
    wait_until(lambda: _holder(board) == "daemon", timeout_s=10, what="the daemon holds the role")
    wait_until(lambda: read_view(board).health()[0] == EXIT_OK, timeout_s=10, what="healthy")
    doc = json.loads(cli("status", "--board", board.name, "--json").stdout)
    assert doc["pinger"]["holder"] == "daemon" and doc["pinger"]["daemon"] is True

    daemon.kill()  # a pinger gone for good: the worker's embedded agent stands in
    daemon.wait()
    wait_until(lambda: _holder(board) == "worker", timeout_s=10, what="the worker holds the role")
    out = cli("status", "--board", board.name, "--json")
    assert out.returncode == EXIT_NO_DAEMON, out
    doc = json.loads(out.stdout)
    assert doc["pinger"]["holder"] == "worker" and doc["pinger"]["daemon"] is False
    assert any("no `shmhb pinger` daemon runs" in p for p in doc["health"]["problems"])
    text = cli("status", "--board", board.name)
    assert text.returncode == EXIT_NO_DAEMON and "embedded in a worker" in text.stdout
    assert "problem: no `shmhb pinger` daemon runs" in text.stdout
    assert board.status("w") is Status.ALIVE and worker.poll() is None

    again = procs.spawn(PINGER + ["--board", board.name, "--listen", listen], ready=False)
    wait_until(lambda: _holder(board) == "daemon" and board.agent().pid == again.pid,
               timeout_s=5, what="the restarted daemon holds the role again")
    wait_until(lambda: cli("status", "--board", board.name).returncode == EXIT_OK,
               timeout_s=10, what="healthy again")


def test_a_board_whose_last_worker_was_killed_and_forgotten_is_healthy_again(
        board: shmhb.Board, procs: Procs) -> None:
    w = procs.worker(board.name, "last", agent=True)
    wait_until(lambda: board.agent().pid == w.pid and board.agent().status is Status.ALIVE,
               what="the worker holds the role")
    w.kill()
    w.wait()
    wait_until(lambda: not board_words(board).agent_held(), what="the role is free")
    out = cli("status", "--board", board.name)
    assert out.returncode == 3, out
    agent_line = next(ln for ln in out.stdout.splitlines() if ln.lstrip().startswith("agent "))
    assert "alive" not in agent_line, out.stdout  # not "alive" above "the agent is gone"
    wait_until(lambda: board.status("last") is Status.DEAD, timeout_s=10, what="DEAD")
    assert cli("forget", "--board", board.name, "last").returncode == 0
    out = cli("status", "--board", board.name)
    assert out.returncode == EXIT_OK, out


def test_a_followed_host_that_never_answered_is_a_problem(board_name: str, procs: Procs) -> None:
    # nothing listens on the peer's port (as for a name that does not resolve): its row
    # reads suspect, and status says so instead of exiting 0
    port = free_port(["127.0.0.1"], span=2)
    procs.spawn(PINGER + ["--board", board_name, "--listen", f"127.0.0.1:{port}",
                          "--peer", f"127.0.0.1:{port + 1}", "--peer-suspect-after-s", "0.5",
                          "--peer-dead-after-s", "2"], ready=False)
    wait_until(lambda: _peer_status(board_name) in (Status.SUSPECT, Status.DEAD), timeout_s=20,
               what="the silent host reads suspect")
    out = cli("status", "--board", board_name)
    assert out.returncode == EXIT_NETWORK, out
    assert f"problem: host 127.0.0.1:{port + 1} has never answered" in out.stdout, out.stdout


def _peer_status(name: str) -> Status | None:
    try:
        with shmhb.Board.attach(name) as b:
            peers = b.peers()
    except shmhb.BoardNotFound:
        return None
    return peers[0].status if peers else None
