"""Events: pure diffs of synthetic views (no board, no sleeps), then the same events
from real processes killed, stopped and restarted, and the ``shmhb events`` command."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import pytest

import shmhb
from shmhb import AgentStatus, PeerStatus, SlotStatus, Status
from shmhb.cli.events import Event, EventLog, Kind, diff
from shmhb.testing.loopback import child_env, free_port
from shmhb.cli.view import View, read_view

from ..conftest import Procs, unlink_quietly, wait_until
from ..stopping import resume

A, S, D, L, U = Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT, Status.UNKNOWN
AGENT = AgentStatus(100, A, 0.01, 1)


#: conftest's board with slow suspicion (5 s): these tests are not about hangs
pytestmark = pytest.mark.slow_suspicion


def slot(key: str, st: Status = A, inc: int = 1, pid: int = 10, age: float = 0.01) -> SlotStatus:
    return SlotStatus(key, pid, inc, st, age, (f"10.0.0.1:{30000 + inc}",))


def view(t: float, *slots: SlotStatus, agent: AgentStatus = AGENT, peers: tuple[PeerStatus, ...] = (),
         held: bool = True) -> View:
    return View(t, tuple(slots), agent, peers, "b", held)


def kinds(evs: list[Event]) -> list[tuple[str, str]]:
    return [(e.kind.value, e.where()) for e in evs]


# -- pure: local workers ------------------------------------------------------------------


def test_initial_state_is_described_as_events() -> None:
    v = view(5.0, slot("a"), slot("b", S, 2), slot("c", D, 3), slot("d", L, 4))
    evs = diff(None, v)
    assert kinds(evs) == [("agent_changed", "agent"), ("registered", "a"), ("hung", "b"),
                          ("died", "c"), ("left", "d")]
    assert all(e.initial and e.t == 5.0 for e in evs)
    assert "at start" in evs[1].text()


def test_each_transition_of_a_local_worker() -> None:
    steps = [
        (view(1, slot("w")), []),
        (view(2, slot("w", S)), [("hung", "w")]),
        (view(3, slot("w", S)), []),  # nothing changed but time
        (view(4, slot("w", D)), [("died", "w")]),
        (view(5, slot("w", A)), [("recovered", "w")]),
        (view(6, slot("w", D, age=0.002)), [("died", "w")]),
        (view(7, slot("w", A, inc=9, pid=11)), [("restarted", "w")]),
        (view(8, slot("w", L, inc=9, pid=11)), [("left", "w")]),
        (view(9, slot("w", A, inc=9, pid=11), slot("x")), [("recovered", "w"), ("registered", "x")]),
        (view(10, slot("x")), [("removed", "w")]),
    ]
    prev = view(0, slot("w"))
    for v, want in steps:
        evs = diff(prev, v)
        assert kinds(evs) == want, (v.t, evs)
        assert all(e.t == v.t and not e.initial for e in evs)
        prev = v


def test_restart_names_both_incarnations_and_a_dead_restart_says_so() -> None:
    evs = diff(view(1, slot("w", D, inc=3, pid=10)), view(2, slot("w", A, inc=7, pid=20)))
    (e,) = evs
    assert e.kind is Kind.RESTARTED and e.incarnation == 7 and e.previous_incarnation == 3
    assert e.pid == 20 and e.previous is D
    assert "inc 7" in str(e) and "was inc 3" in str(e)
    # restarted and already dead again before the next look
    evs = diff(view(1, slot("w", A, inc=3)), view(2, slot("w", D, inc=4)))
    assert kinds(evs) == [("restarted", "w"), ("died", "w")]


def test_event_json_and_text() -> None:
    (e,) = diff(view(1, slot("w")), view(1_700_000_000.25, slot("w", D, pid=42, age=0.004)))
    j = e.to_json()
    assert j["kind"] == "died" and j["subject"] == "w" and j["host"] is None
    assert j["status"] == "dead" and j["previous"] == "alive" and j["pid"] == 42
    assert j["incarnation"] == 1 and j["t"] == 1_700_000_000.25 and j["initial"] is False
    assert j["time"].startswith("2023-11-1")  # ISO 8601 with the local offset
    json.dumps(j)
    assert str(e).endswith("died w pid 42 inc 1 (was alive; last beat 4 ms ago)")
    assert e.severity is D


# -- pure: remote hosts --------------------------------------------------------------------


def peer(addr: str, st: Status, *slots: SlotStatus, rtt: float | None = 0.5) -> PeerStatus:
    return PeerStatus(addr, st, rtt, 0.05, list(slots))


def test_host_transitions_fold_the_workers_that_follow_their_host() -> None:
    h = "10.0.0.2:45645"
    v1 = view(1, peers=(peer(h, A, slot("d0"), slot("d1")),))
    evs = diff(view(0), v1)
    assert kinds(evs) == [("host_added", f"@{h}"), ("registered", f"d0@{h}"),
                          ("registered", f"d1@{h}")]
    assert evs[0].status is A
    # the host goes silent: its alive workers read suspect; one event, not three
    v2 = view(2, peers=(peer(h, S, slot("d0", S), slot("d1", S), rtt=None),))
    assert kinds(diff(v1, v2)) == [("host_suspect", f"@{h}")]
    v3 = view(3, peers=(peer(h, D, slot("d0", D), slot("d1", D)),))
    assert kinds(diff(v2, v3)) == [("host_dead", f"@{h}")]
    # back: d0 is as it was, d1 was restarted meanwhile (a new incarnation is news)
    v4 = view(4, peers=(peer(h, A, slot("d0"), slot("d1", inc=5)),))
    assert kinds(diff(v3, v4)) == [("host_back", f"@{h}"), ("restarted", f"d1@{h}")]
    # a worker of a healthy host dies on its own: reported
    v5 = view(5, peers=(peer(h, A, slot("d0", D), slot("d1", inc=5)),))
    (e,) = diff(v4, v5)
    assert (e.kind, e.subject, e.host) == (Kind.DIED, "d0", h)
    assert "last report" in e.detail
    # no longer followed
    assert kinds(diff(v5, view(6))) == [("host_removed", f"@{h}")]


def test_a_newly_followed_host_is_added_then_up() -> None:
    h = "h:1"
    v1 = view(1, peers=(PeerStatus(h, U, None, None, []),))  # not heard from yet
    evs = diff(view(0), v1)
    assert kinds(evs) == [("host_added", f"@{h}")] and evs[0].status is U
    v2 = view(2, peers=(peer(h, A, slot("d0")),))
    assert kinds(diff(v1, v2)) == [("host_up", f"@{h}"), ("registered", f"d0@{h}")]
    # a host first seen dead (the initial state) says so
    evs = diff(None, view(3, peers=(peer(h, D, slot("d0", D)),)))
    assert kinds(evs)[1:] == [("host_added", f"@{h}"), ("host_dead", f"@{h}"), ("died", f"d0@{h}")]


def test_a_worker_first_seen_unknown_is_registered_once() -> None:
    h = "h:1"
    v1 = view(1, peers=(peer(h, U, slot("d0", U)),))
    evs = diff(view(0), v1)
    assert kinds(evs) == [("host_added", f"@{h}"), ("registered", f"d0@{h}")]
    assert evs[1].status is U
    v2 = view(2, peers=(peer(h, A, slot("d0")),))
    assert kinds(diff(v1, v2)) == [("host_back", f"@{h}")]


def test_our_agent_stalling_makes_hosts_unknown_not_dead() -> None:
    h = "h:1"
    v1 = view(1, peers=(peer(h, A, slot("d0")),))
    v2 = view(2, agent=AgentStatus(100, S, 1.5, 1), peers=(peer(h, U, slot("d0", U)),))
    assert kinds(diff(v1, v2)) == [("agent_stalled", "agent"), ("host_unknown", f"@{h}")]


# -- pure: the agent -----------------------------------------------------------------------


def test_agent_changes_stalls_and_comes_back() -> None:
    none = AgentStatus(0, U, None, 0)
    (e,) = diff(None, view(0, agent=none, held=False))
    assert e.kind is Kind.AGENT_UNKNOWN and "no agent" in e.detail
    a1 = AgentStatus(100, A, 0.01, 1)
    steps = [
        (a1, True, [Kind.AGENT_CHANGED]),
        (AgentStatus(100, S, 1.2, 1), True, [Kind.AGENT_STALLED]),
        (a1, True, [Kind.AGENT_BACK]),
        (AgentStatus(100, S, 1.2, 1), False, [Kind.AGENT_STALLED]),  # killed: role free
        (AgentStatus(200, A, 0.0, 2), True, [Kind.AGENT_CHANGED]),
        (AgentStatus(200, L, 0.1, 2), False, [Kind.AGENT_LEFT]),
        (AgentStatus(300, S, 2.0, 3), True, [Kind.AGENT_CHANGED, Kind.AGENT_STALLED]),
    ]
    prev = view(0, agent=none, held=False)
    for a, held, want in steps:
        v = view(prev.t + 1, agent=a, held=held)
        evs = diff(prev, v)
        assert [e.kind for e in evs] == want, (a, evs)
        prev = v
    stalled = diff(view(0, agent=a1), view(1, agent=AgentStatus(100, S, 1.2, 1), held=False))[0]
    assert "holder died" in stalled.detail
    changed = diff(view(0, agent=a1), view(1, agent=AgentStatus(200, A, 0.0, 2)))[0]
    assert changed.pid == 200 and "term 2" in changed.detail


def test_event_log_keeps_the_latest() -> None:
    log = EventLog(keep=3)
    log.update(view(0))
    for k in range(5):
        log.update(view(k + 1, *(slot(f"w{i}") for i in range(k + 1))))
    assert [e.subject for e in log.recent] == ["w2", "w3", "w4"]
    assert log.last is not None and log.last.t == 5


# -- real processes --------------------------------------------------------------------------


class Follower:
    """An EventLog fed from a real board each time a test polls it."""

    def __init__(self, board: shmhb.Board) -> None:
        self.board = board
        self.log = EventLog(keep=10_000)
        self.log.update(read_view(board))

    def seen(self, key: str, host: str | None = None) -> bool:
        """Whether any event named worker ``key`` (of ``host``) yet."""
        self.log.update(read_view(self.board))
        return any(e.subject == key and e.host == host for e in self.log.recent)

    def saw(self, kind: Kind, key: str) -> Event | None:
        self.log.update(read_view(self.board))
        for e in self.log.recent:
            if e.kind is kind and e.subject == key and not e.initial:
                return e
        return None


@pytest.fixture
def roomy_board(board_name: str) -> Iterator[shmhb.Board]:
    """A board whose SUSPECT window (0.5 s to 4 s of silence) is wide enough for a test
    process starved of CPU on a busy machine still to look at it during a hang."""
    from shmhb.agent.role import Agent

    b = shmhb.Board.create(board_name, suspect_after_s=0.5, dead_after_s=4.0)
    a = Agent(board_name, config=shmhb.AgentConfig(tick_s=0.02), network=False).start()
    assert a.holding.wait(5)
    yield b
    a.stop()
    b.close()


def test_events_from_real_kills_hangs_and_restarts(roomy_board: shmhb.Board, procs: Procs) -> None:
    board = roomy_board
    f = Follower(board)
    killed = procs.worker(board.name, "killed")
    hung = procs.worker(board.name, "hung")
    # first sight is "registered" (or "hung", should load starve a beat just then)
    wait_until(lambda: f.seen("killed") and f.seen("hung"), what="the workers seen")
    wait_until(lambda: (board.slot("killed").status is A  # type: ignore[union-attr]
                        and board.slot("hung").status is A), what="both alive")  # type: ignore[union-attr]
    killed.kill()
    e = wait_until(lambda: f.saw(Kind.DIED, "killed"), what="died event")
    assert e.pid == killed.pid and e.previous in (A, S)  # S: its beats starved by load
    os.kill(hung.pid, signal.SIGSTOP)
    wait_until(lambda: f.saw(Kind.HUNG, "hung"), what="hung event")
    wait_until(lambda: f.saw(Kind.DIED, "hung"), timeout_s=20, what="died after dead-after")
    resume(hung.pid)
    wait_until(lambda: f.saw(Kind.RECOVERED, "hung"), what="recovered event")
    old = board.slot("killed")
    assert old is not None
    again = procs.worker(board.name, "killed")
    e = wait_until(lambda: f.saw(Kind.RESTARTED, "killed"), what="restarted event")
    assert e.previous_incarnation == old.incarnation and e.incarnation > old.incarnation
    assert e.pid == again.pid
    again.terminate()
    wait_until(lambda: f.saw(Kind.LEFT, "killed"), what="left event")


def test_agent_events_from_a_real_pinger_killed(board: shmhb.Board, procs: Procs) -> None:
    f = Follower(board)
    p = procs.spawn([sys.executable, "-m", "shmhb", "pinger", "--board", board.name,
                     "--tick-s", "0.02"], ready=False)
    e = wait_until(lambda: f.saw(Kind.AGENT_CHANGED, "agent"), what="agent_changed")
    assert e.pid == p.pid
    p.kill()
    e = wait_until(lambda: f.saw(Kind.AGENT_STALLED, "agent"), what="agent_stalled")
    assert e.pid == p.pid


def test_host_events_from_a_real_remote_pinger(board: shmhb.Board, procs: Procs) -> None:
    """Two boards on loopback, each with its own ``shmhb pinger``: the remote one is
    stopped and resumed, and the local view says its host went silent and came back."""
    remote = f"shmhb-test-{uuid.uuid4().hex[:12]}"
    pa, pb = free_port(["127.0.0.1"]), free_port(["127.0.0.1"])
    try:
        shmhb.Board.create(remote, suspect_after_s=5.0, dead_after_s=10.0).close()
        pinger = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02", "--interval-s", "0.1"]
        procs.spawn(pinger + ["--board", board.name, "--listen", f"127.0.0.1:{pa}",
                              "--peer", f"127.0.0.1:{pb}"], ready=False)
        rp = procs.spawn(pinger + ["--board", remote, "--listen", f"127.0.0.1:{pb}",
                                   "--peer", f"127.0.0.1:{pa}"], ready=False)
        procs.worker(remote, "decode-0", endpoints="127.0.0.1:31000")
        f = Follower(board)
        host = f"127.0.0.1:{pb}"

        def saw_host(kind: Kind) -> Event | None:
            f.saw(kind, host)
            return next((e for e in f.log.recent if e.kind is kind and e.subject == host), None)

        wait_until(lambda: saw_host(Kind.HOST_ADDED), timeout_s=30, what="host_added")
        # first sight is "registered", or "hung" if load starved its beats just then
        wait_until(lambda: f.seen("decode-0", host), timeout_s=30, what="remote worker")
        os.kill(rp.pid, signal.SIGSTOP)
        e = wait_until(lambda: saw_host(Kind.HOST_SUSPECT), timeout_s=30, what="host went silent")
        assert e.status is S and not e.initial
        # the worker turned suspect with its host: folded into the host's event
        assert not any(x.host == host and x.kind is Kind.HUNG for x in f.log.recent)
        resume(rp.pid)
        wait_until(lambda: saw_host(Kind.HOST_BACK), timeout_s=30, what="host back")
    finally:
        unlink_quietly(remote)


# -- the command ------------------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shmhb", *args]


def test_events_command_prints_the_state_once(board: shmhb.Board, procs: Procs, agent) -> None:  # type: ignore[no-untyped-def]
    procs.worker(board.name, "w0")
    dead = procs.worker(board.name, "w1")
    dead.kill()
    wait_until(lambda: (s := board.slot("w1")) and s.status is D)
    out = subprocess.run(_cli("events", "--board", board.name), capture_output=True, text=True,
                         timeout=60, env=child_env())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(" registered w0 " in ln for ln in lines), lines
    assert any(" died w1 " in ln for ln in lines), lines
    assert any(" agent_changed agent " in ln for ln in lines), lines
    out = subprocess.run(_cli("events", "--board", board.name, "--json"), capture_output=True,
                         text=True, timeout=60, env=child_env())
    docs = [json.loads(ln) for ln in out.stdout.splitlines()]
    assert {(d["kind"], d["subject"]) for d in docs} >= {("registered", "w0"), ("died", "w1")}
    assert all(d["initial"] for d in docs)


def _reader(p: subprocess.Popen[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """Lines of ``p``'s stdout as they come, from a thread that ends at EOF."""
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            q.put(line)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return q, t


def test_events_follow_json_reports_a_kill(board: shmhb.Board, procs: Procs, agent) -> None:  # type: ignore[no-untyped-def]
    w = procs.worker(board.name, "victim")
    p = procs.spawn(_cli("events", "--board", board.name, "--follow", "--json",
                         "--interval-s", "0.02"), ready=False)
    lines, pump = _reader(p)
    seen: list[dict[str, object]] = []

    def got(kind: str, subject: str) -> bool:
        while True:
            try:
                seen.append(json.loads(lines.get_nowait()))
            except queue.Empty:
                break
        return any(d["kind"] == kind and d["subject"] == subject for d in seen)

    wait_until(lambda: got("registered", "victim"), timeout_s=30, what="initial state")
    w.kill()
    wait_until(lambda: got("died", "victim"), what="died line")
    died = next(d for d in seen if d["kind"] == "died")
    assert died["initial"] is False and died["pid"] == w.pid
    p.terminate()
    assert p.wait(30) == 0
    pump.join(30)  # EOF read before the fixture closes the pipe


@pytest.mark.system
@pytest.mark.parametrize("bad", ["0", "-1"])
def test_events_rejects_a_bad_interval(board: shmhb.Board, bad: str) -> None:
    out = subprocess.run(_cli("events", "--board", board.name, "--follow", "--interval-s", bad),
                         capture_output=True, text=True, timeout=60, env=child_env())
    assert out.returncode == 2 and "interval" in out.stderr
