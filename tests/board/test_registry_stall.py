"""A process stopped while it holds a board's registry lock (found by the chaos harness:
its ``registry_stall`` fault).

The registry lock is held for microseconds at a time, but the kernel releases it only
when its holder dies, not when it is stopped (SIGSTOP, a debugger, a frozen cgroup).
Registrations and watch changes then wait and fail with LockTimeout, as documented.
Nothing else may wait for it: the agent role (its takeover, its periodic reclaim of dead
processes' watches), a LinkReaper's drops, a graceful leave.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any


import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb import DropReason, LinkReaper, Status
from shmhb.agent.role import Agent
from shmhb.testing.loopback import child_env

from ..children import child
from ..conftest import Procs, Stall, wait_until
from ..hosts import Cluster

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

WATCHER = child("watcher")


def refs(board: shmhb.Board, host: str) -> int:
    """How many watches of ``host`` the board counts, over all processes."""
    rows = board_words(board).watch_table.copy()
    return sum(int(r["refs"]) for r in rows if int(r["checksum"]) and bytes(r["address"]) == host.encode())


def test_a_graceful_leave_neither_waits_nor_fails(board: shmhb.Board, procs: Procs, agent: Any) -> None:
    w = procs.worker(board.name, "rank-0")
    wait_until(lambda: board.status("rank-0") is Status.ALIVE)
    before = board.changes()
    stall = Stall(board.name)
    try:
        t0 = time.monotonic()
        w.terminate()  # the conftest worker closes its heartbeat on SIGTERM
        assert w.stdout is not None and w.stdout.readline().strip() == "closed"
        took = time.monotonic() - t0
        assert w.wait(10) == 0
        assert board.status("rank-0") is Status.LEFT
        assert took < 3.5, f"close() took {took:.2f} s"  # it waited 5 s, then raised
        # the agent moved the change counter that the leaver could not
        wait_until(lambda: board.changes() != before, timeout_s=5, what="the change counter")
    finally:
        stall.release()


def test_a_takeover_does_not_wait_for_the_registry_lock(board: shmhb.Board) -> None:
    cfg = shmhb.AgentConfig(tick_s=0.02, election_poll_s=0.05)
    first = Agent(board.name, config=cfg, network=False).start()
    standby = Agent(board.name, config=cfg, network=False)
    try:
        assert first.holding.wait(5)
        standby.start()  # attached, polling the election
        wait_until(lambda: standby._fd >= 0, what="the standby attached")
        term = board.agent().term
        stall = Stall(board.name)
        try:
            first.stop()
            t0 = time.monotonic()
            assert standby.holding.wait(5), "the standby never took the role"
            wait_until(lambda: board.agent().term > term and board.agent().status is Status.ALIVE,
                       timeout_s=5, what="the new term")
            took = time.monotonic() - t0
            assert took < 3.5, f"takeover took {took:.2f} s"  # it waited 5 s, then died
            time.sleep(0.01)  # pacing only: the new agent keeps running under the stall
            assert standby._thread is not None and standby._thread.is_alive()
        finally:
            stall.release()
        assert standby._thread is not None and standby._thread.is_alive()
    finally:
        standby.stop()
        first.stop()


def test_the_pinger_survives_reclaiming_watches_under_a_held_lock(cluster: Cluster) -> None:
    a = cluster.host()
    b = cluster.host()
    a.watch(b)
    env = child_env()
    w = subprocess.Popen([sys.executable, WATCHER, a.name, b.endpoint(7)],
                         stdout=subprocess.PIPE, env=env)
    assert w.stdout is not None and w.stdout.readline().strip() == b"ready"
    w.stdout.close()
    stall = Stall(a.name)
    try:
        w.kill()  # it dies watching: the agent will want to reclaim its watch
        w.wait(10)
        t0 = time.monotonic()
        worst = 0.0
        while time.monotonic() - t0 < 6.5:  # past the 5 s a wait for the lock would take
            ag = a.board.agent()
            worst = max(worst, ag.age_s or 0.0)
            assert a.pinger is not None and a.pinger.poll() is None, "the pinger died"
            time.sleep(0.01)
        assert worst < 3.0, f"the agent loop stalled for {worst:.2f} s"  # 5 s, then it died
    finally:
        stall.release()

    def reclaimed() -> bool:
        rows = board_words(a.board).watch_table.copy()
        return not any(int(r["checksum"]) and int(r["owner_pid"]) == w.pid for r in rows)
    wait_until(reclaimed, timeout_s=5, what="the dead process's watch reclaimed")


def test_reaper_drops_on_time_and_gives_watches_back_later(cluster: Cluster) -> None:
    a = cluster.host()
    b = cluster.host()
    a.watch(b)  # followed whatever the reaper does
    w = b.worker("dec-0", b.endpoint(1))
    inc = int(w.ready_line.split()[1])  # type: ignore[attr-defined]
    dropped: list[tuple[str, DropReason]] = []
    reaper = LinkReaper(shmhb.Board.attach(a.name),
                        on_drop=lambda lk, why: dropped.append((lk.endpoint, why)))
    try:
        reaper.track(b.endpoint(1), incarnation=inc)
        wait_until(lambda: (r := a.remote(b.endpoint(1))) is not None and r.status is Status.ALIVE,
                   what="the worker alive on a")
        n = refs(a.board, b.ip)
        assert n == 2  # ours, and the link's
        reaper.start(interval_s=0.02)
        stall = Stall(a.name)
        try:
            t0 = time.monotonic()
            w.kill()
            wait_until(lambda: dropped, timeout_s=5, what="the drop")
            took = time.monotonic() - t0
            assert dropped == [(b.endpoint(1), DropReason.DEAD)]
            assert took < 3.5, f"the drop took {took:.2f} s"  # it waited 5 s, then was lost
            time.sleep(0.2)  # pacing only: polls go on while the watch is still owed
            assert reaper.running
            assert refs(a.board, b.ip) == n  # not given back yet: the lock is held
        finally:
            stall.release()
        # given back at a later poll, once the lock is free
        wait_until(lambda: refs(a.board, b.ip) == n - 1, timeout_s=5,
                   what="the link's watch given back")
        assert reaper.running
        assert dropped == [(b.endpoint(1), DropReason.DEAD)]
    finally:
        reaper.stop()
        reaper.board.close()
