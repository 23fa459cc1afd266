"""The agent role inside a worker.  A running ``shmhb pinger`` daemon
takes the role from a worker's embedded agent, so a worker stopped (SIGSTOP) or stuck
holding the GIL cannot take the host's agent with it; workers leave a free role to a
waiting daemon, but not for ever."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import shmhb
from shmhb import Status
from shmhb.agent import role
from shmhb.agent.role import Agent
from shmhb.board.config import AgentConfig

from ..conftest import Procs, wait_until
from ..stopping import resume, stopped

PINGER = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02"]


def test_a_daemon_takes_the_role_from_an_embedded_holder_and_survives_its_stop(
        board: shmhb.Board, procs: Procs) -> None:
    holder = procs.worker(board.name, "holder", agent=True)
    wait_until(lambda: board.agent().pid == holder.pid and board.agent().status is Status.ALIVE,
               what="the embedded agent holds the role")
    other = procs.worker(board.name, "other", agent=True)  # an embedded standby
    daemon = procs.spawn(PINGER + ["--board", board.name], ready=False)
    wait_until(lambda: board.agent().pid == daemon.pid and board.agent().status is Status.ALIVE,
               timeout_s=10, what="the daemon holds the role")
    os.kill(holder.pid, signal.SIGSTOP)  # the worker that held the role stalls
    try:
        victim = procs.worker(board.name, "victim")
        victim.kill()
        wait_until(lambda: board.status("victim") is Status.DEAD, timeout_s=1.0, poll_s=0.001,
                   what="a kill DEAD within 1 s while the old holder is stopped")
        assert board.agent().status is Status.ALIVE and board.status("other") is Status.ALIVE
    finally:
        resume(holder.pid)
    assert board.agent().pid == daemon.pid
    # the daemon gone, a worker takes the role again
    daemon.kill()
    daemon.wait()
    wait_until(lambda: board.agent().pid in (holder.pid, other.pid)
               and board.agent().status is Status.ALIVE, timeout_s=10,
               what="an embedded standby took the role back")


def test_a_stopped_waiting_daemon_does_not_leave_the_host_without_an_agent(
        board: shmhb.Board, procs: Procs) -> None:
    holder = procs.worker(board.name, "holder", agent=True)
    wait_until(lambda: board.agent().pid == holder.pid, what="the embedded agent holds it")
    standby = procs.worker(board.name, "standby", agent=True)
    daemon = procs.spawn(PINGER + ["--board", board.name], ready=False)
    wait_until(lambda: board.agent().pid == daemon.pid, timeout_s=10, what="daemon holds it")
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait()
    second = procs.spawn(PINGER + ["--board", board.name], ready=False)
    wait_until(lambda: board.agent().pid == second.pid, timeout_s=10, what="second daemon")
    # a daemon that waits for the role but is stopped: the workers still run an agent
    third = procs.spawn(PINGER + ["--board", board.name], ready=False)
    wait_until(lambda: board.agent().pid == second.pid and third.poll() is None, timeout_s=5)
    wait_until(lambda: _standby_polled(third.pid), timeout_s=10, what="third is a standby")
    with stopped(third.pid):
        second.kill()
        second.wait()
        wait_until(lambda: board.agent().pid in (holder.pid, standby.pid)
                   and board.agent().status is Status.ALIVE, timeout_s=10,
                   what="a worker took the role past the stopped daemon")
        victim = procs.worker(board.name, "victim")
        victim.kill()
        wait_until(lambda: board.status("victim") is Status.DEAD, timeout_s=1.0, poll_s=0.001)


def _standby_polled(pid: int) -> bool:
    """Whether ``pid`` has the board open twice (its handle and its election fd)."""
    try:
        return sum(1 for f in os.listdir(f"/proc/{pid}/fd")
                   if "shmhb-test" in os.readlink(f"/proc/{pid}/fd/{f}")) >= 2
    except OSError:
        return False


def test_a_restarted_daemon_gets_the_role_from_long_running_workers_at_once(
        board: shmhb.Board, monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers that lived through an earlier daemon's takeover must leave the role to the
    # next daemon too: a standby that remembered the free spell it saw then took the
    # role at the next handover at once, and kept it from the daemon for a minute.
    monkeypatch.setattr(role, "DAEMON_GRACE_NS", 50_000_000)
    cfg = AgentConfig(election_poll_s=0.01)
    holder, standby = (Agent(board.name, config=cfg, network=False) for _ in range(2))
    first, second = (Agent(board.name, config=cfg, network=False, daemon=True) for _ in range(2))
    loops = []
    try:
        loop = holder.elect(board)
        assert loop is not None
        assert first.elect(board) is None  # the first daemon waits for the role
        holder.resign(loop)  # ... and the embedded holder hands it over
        assert standby.elect(board) is None  # free, a daemon waits: the standby leaves it
        loops.append(first.elect(board))
        assert loops[-1] is not None  # the daemon holds it
        assert standby.elect(board) is None
        deadline = time.monotonic() + 2 * role.DAEMON_GRACE_NS / 1e9
        while time.monotonic() < deadline:  # the grace runs out while the daemon holds it
            assert standby.elect(board) is None
        first.resign(loops.pop())  # the daemon stops (a restart) ...
        loop = holder.elect(board)  # ... an embedded agent keeps the host watched
        assert loop is not None
        assert second.elect(board) is None  # the restarted daemon waits for the role
        holder.resign(loop)  # the holder hands it over
        assert standby.elect(board) is None, "a standby took the role from the daemon"
        loops.append(second.elect(board))
        assert loops[-1] is not None
    finally:
        for agent, loop in zip((first, second), loops):
            if loop is not None:
                agent.resign(loop)
