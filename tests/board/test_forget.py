"""Dead slots don't haunt the probe: ``Board.forget`` / ``shmhb forget`` and the policy's
``forget_after_s``, against real processes (SIGKILL, SIGSTOP, a graceful leave) and a
real agent; plus the lower doors (policy, mode, capacity, intervals, time and pid
namespaces)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.agent.role import Agent
from shmhb.testing.loopback import child_env

from ..children import child
from ..conftest import Procs, unlink_quietly, wait_until
from ..stopping import resume

ENV = child_env()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmhb", *args], env=ENV,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def agent(board: shmhb.Board) -> Iterator[Agent]:
    a = Agent(board.name, config=shmhb.AgentConfig(tick_s=0.02)).start()
    assert a.holding.wait(10), "agent never took the role"
    yield a
    a.stop()


def test_forget_clears_a_killed_slot_and_the_probe_recovers(
        board: shmhb.Board, procs: Procs, agent: Agent) -> None:
    ok = procs.worker(board.name, "healthy")
    w = procs.worker(board.name, "victim")
    wait_until(lambda: board.status("victim") is Status.ALIVE, what="victim alive")
    os.kill(w.pid, signal.SIGKILL)
    wait_until(lambda: board.status("victim") is Status.DEAD, what="victim dead")
    assert cli("status", "--board", board.name).returncode == 1
    out = cli("forget", "--board", board.name, "victim")
    assert out.returncode == 0, out.stderr
    assert "forgot 'victim': it was dead" in out.stdout
    assert board.slot("victim") is None and [s.key for s in board.slots()] == ["healthy"]
    assert cli("status", "--board", board.name).returncode == 0
    again = cli("forget", "--board", board.name, "victim")
    assert again.returncode == 2 and "no slot" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
    # the slot is free again for anyone, with a new incarnation
    with board.register("victim", agent=False) as hb:
        assert board.status("victim") is Status.ALIVE and hb.incarnation > 0
    assert ok.poll() is None


def test_forget_refuses_a_live_slot_and_a_hung_one(board: shmhb.Board, procs: Procs,
                                                    agent: Agent) -> None:
    w = procs.worker(board.name, "busy")
    wait_until(lambda: board.status("busy") is Status.ALIVE, what="alive")
    out = cli("forget", "--board", board.name, "busy")
    assert out.returncode == 2 and "is alive" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(shmhb.KeyInUse, match="alive"):
        board.forget("busy")
    os.kill(w.pid, signal.SIGSTOP)  # silent: DEAD after dead_after_s, yet its process lives
    try:
        wait_until(lambda: board.status("busy") is Status.DEAD, what="dead by silence")
        with pytest.raises(shmhb.KeyInUse, match="still holds the slot"):
            board.forget("busy")
        assert board.slot("busy") is not None
    finally:
        resume(w.pid)
    with pytest.raises(shmhb.KeyNotFound):
        board.forget("never-registered")


def test_forget_a_left_slot(board: shmhb.Board) -> None:
    hb = board.register("gone", agent=False)
    hb.close()
    assert board.status("gone") is Status.LEFT
    assert board.forget("gone").status is Status.LEFT
    assert board.slots() == []


def test_forget_after_s_clears_dead_slots_but_not_hung_ones(board_name: str, procs: Procs) -> None:
    pol = shmhb.Policy(suspect_after_s=0.2, dead_after_s=0.5, forget_after_s=1.0)
    b = shmhb.Board.create(board_name, policy=pol)
    a = Agent(b.name, config=shmhb.AgentConfig(tick_s=0.02)).start()
    try:
        assert a.holding.wait(10)
        assert b.policy.forget_after_s == 1.0
        assert shmhb.Board.attach(board_name).policy.forget_after_s == 1.0
        killed = procs.worker(b.name, "killed")
        hung = procs.worker(b.name, "hung")
        os.kill(hung.pid, signal.SIGSTOP)
        os.kill(killed.pid, signal.SIGKILL)
        wait_until(lambda: b.status("killed") is Status.DEAD, what="killed dead")
        wait_until(lambda: b.slot("killed") is None, timeout_s=15, what="killed forgotten")
        hung_slot = b.slot("hung")
        assert hung_slot is not None and hung_slot.status is Status.DEAD
        wait_until(lambda: (s := b.slot("hung")) is not None and s.age_s > 1.5, what="time")
        assert b.slot("hung") is not None, "a hung worker's slot was forgotten"
        resume(hung.pid)
    finally:
        a.stop()
        b.close()


# -- the lower doors -------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{"suspect_after_s": 0.0005, "dead_after_s": 1.0},
                                {"suspect_after_s": 0.5, "dead_after_s": 0.0009},
                                {"agent_stale_s": 1e-4}, {"peer_suspect_after_s": 0.0},
                                {"forget_after_s": 0.0001}, {"dead_after_s": float("inf")},
                                {"suspect_after_s": True}, {"dead_after_s": 1e9}])
def test_policy_under_the_time_unit_or_absurd_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(shmhb.InvalidConfig):
        shmhb.Policy(**kw)


@pytest.mark.parametrize("mode", [-1, 0o7777, 0o4600, 0o400, 0o200, 1 << 40, "0600", True])
def test_bad_modes_are_refused(board_name: str, mode: object) -> None:
    with pytest.raises(shmhb.InvalidConfig, match="mode"):
        shmhb.Board.create(board_name, mode=mode)  # type: ignore[arg-type]
    assert not os.path.exists(f"/dev/shm/{board_name}")


@pytest.mark.parametrize("kw", [{"peers": 0}, {"remote_slots": 0}, {"watches": 0}, {"slots": 0},
                                {"peers": -1}])
def test_zero_capacities_are_refused(board_name: str, kw: dict[str, int]) -> None:
    with pytest.raises(shmhb.InvalidConfig):
        shmhb.Board.create(board_name, **kw)  # type: ignore[arg-type]
    assert not os.path.exists(f"/dev/shm/{board_name}")


@pytest.mark.parametrize("interval", [0, -1, float("nan"), float("inf")])
def test_start_intervals_are_invalid_config(board: shmhb.Board, interval: float) -> None:
    with board.register("k", agent=False) as hb:
        with pytest.raises(shmhb.InvalidConfig):
            hb.start(interval_s=interval)
        with pytest.raises(shmhb.InvalidConfig):
            shmhb.LinkReaper(board).start(interval)


def _unshare(*flags: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


REGISTER = child("ns_register")


@pytest.mark.system
@pytest.mark.skipif(not _unshare("--time", "--monotonic=1000"),
                    reason="needs time namespaces (root and Linux >= 5.6)")
def test_a_worker_in_another_time_namespace_is_refused(board: shmhb.Board) -> None:
    out = subprocess.run(["unshare", "--time", "--monotonic=1000", sys.executable, REGISTER, board.name], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert "refused:" in out.stdout and "time namespace" in out.stdout, out.stdout + out.stderr
    assert board.slot("ns-worker") is None
    same = subprocess.run(["unshare", "--time", sys.executable, REGISTER, board.name],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert "registered" in same.stdout, same.stdout + same.stderr  # offset 0: same clock


WATCH_AND_DIE = child("watch_and_die")


@pytest.mark.system
@pytest.mark.skipif(not _unshare("--pid", "--fork"), reason="needs pid namespaces (root)")
def test_watch_rows_of_dead_owners_in_another_pid_namespace_are_reclaimed(board_name: str) -> None:
    b = shmhb.Board.create(board_name, watches=2)
    try:
        for k in range(2):
            subprocess.run(["unshare", "--pid", "--fork", sys.executable, WATCH_AND_DIE,
                            board_name, f"10.0.0.{k + 1}:1"], env=ENV, timeout=60)
        assert sorted(board_words(b).watches.watched_hosts()) == ["10.0.0.1", "10.0.0.2"]
        b.watch("10.0.0.9:1")  # the table was full of the dead: reclaimed, no WatchTableFull
        assert board_words(b).watches.watched_hosts() == {"10.0.0.9": 1}
    finally:
        b.close()
        unlink_quietly(board_name)


@pytest.mark.system
@pytest.mark.skipif(not _unshare("--pid", "--fork"), reason="needs pid namespaces (root)")
def test_watch_rows_of_live_owners_in_another_pid_namespace_are_kept(board_name: str) -> None:
    b = shmhb.Board.create(board_name, watches=1)
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable,
                          child("watch_until_line"), board_name,
                          "10.0.0.1:1"], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "watching"
        with pytest.raises(shmhb.WatchTableFull):
            b.watch("10.0.0.9:1")
        assert board_words(b).watches.watched_hosts() == {"10.0.0.1": 1}
    finally:
        assert p.stdin is not None
        p.stdin.close()  # the owner exits
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()  # --kill-child takes the namespace's process with it
            p.wait()
        b.close()
        unlink_quietly(board_name)


@pytest.mark.system
@pytest.mark.parametrize("argv,what", [
    (["status", "--board", "a/b"], "invalid board name"),
    (["pinger", "--listen", "*:1"], "invalid listen address"),
    (["pinger", "--peer", "host_a, host_b"], "invalid peer address"),
    (["pinger", "--listen", "decode-rank-3.decode-headless.llm-inference-prod.svc.cluster.local"],
     "the wire holds at most 63"),
    (["events", "--interval-s", "0"], "--interval-s"),
    (["pinger", "--tick-s", "nan"], "--tick-s"),
    (["monitor", "--refresh-hz", "-1"], "--refresh-hz"),
    (["exporter", "--port", "70000"], "--port"),
    (["exporter", "--addr", "a b"], "--addr"),
    (["gc", "--yes", "../x"], "invalid board name"),
])
def test_cli_refuses_bad_flags_in_one_line(argv: list[str], what: str, board_name: str) -> None:
    out = cli(*argv) if "--board" in argv or argv[0] == "gc" else cli(*argv, "--board", board_name)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert what in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not os.path.exists(f"/dev/shm/{board_name}")  # refused before any board was made
