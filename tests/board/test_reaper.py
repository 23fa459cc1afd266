"""The LinkReaper against real processes on real boards.

Every drop reason comes from a real process event (SIGKILL, a graceful close, a restart,
a slot taken by another key), both for a LOCAL endpoint (a worker on the board the reaper
reads) and for a REMOTE one (a worker on a second simulated host: its own board and its
own ``shmhb pinger`` on 127.0.0.3, watched through this host's pinger on 127.0.0.2).
Then the contract's hard parts: exactly once under restarts, flapping, UNKNOWN, untrack
and poll from other threads and from the callback, a callback that raises.

No fixed sleeps: every wait has a deadline, with loose bounds for a busy 2-core machine.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb import DropReason, Link, LinkReaper, Status
from shmhb.testing.loopback import free_port

from ..conftest import Procs, unlink_quietly, wait_until
from ..stopping import resume, stopped

#: every test here runs on the C and on the pure-Python hot path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("hot_path")

#: Quick verdicts on slots and hosts; the agent is stale (remote rows read UNKNOWN)
#: after 0.5 s without a tick.
FAST = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5, agent_stale_s=0.5,
                    peer_suspect_after_s=1.0, peer_dead_after_s=3.0)
#: A wide gap between SUSPECT and DEAD, so a flap can be held SUSPECT safely on a
#: loaded machine.
FLAPPY = shmhb.Policy(suspect_after_s=0.3, dead_after_s=4.0, agent_stale_s=0.5,
                      peer_suspect_after_s=1.0, peer_dead_after_s=3.0)
#: For a watcher whose view of a stopped remote pinger must stay ALIVE meanwhile.
PATIENT = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5, agent_stale_s=0.5,
                       peer_suspect_after_s=8.0, peer_dead_after_s=30.0)

PINGER = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02", "--interval-s", "0.05"]


class Site:
    """Where a link's peers live, as seen from ``board`` (the board the reaper reads).

    ``local``: the workers register on ``board`` itself, watched by an in-process agent.
    ``remote``: the workers register on a second host's board (``peer_board``, with its
    own ``shmhb pinger`` on 127.0.0.3); ``board`` has its own pinger on 127.0.0.2.
    """

    def __init__(self, procs: Procs, kind: str, *, slots: int = 64, policy: shmhb.Policy = FAST,
                 watcher_policy: shmhb.Policy | None = None) -> None:
        self.procs = procs
        self.kind = kind
        self._names: list[str] = []
        self._boards: list[shmhb.Board] = []
        self.agent: Any = None
        self.pinger: subprocess.Popen[str] | None = None
        self.peer_pinger: subprocess.Popen[str] | None = None
        try:
            if kind == "local":
                self.ip = "127.0.0.1"
                self.board = self.peer_board = self._board(slots, policy)
                from shmhb.agent.role import Agent
                self.agent = Agent(self.board.name, config=shmhb.AgentConfig(tick_s=0.02)).start()
                assert self.agent.holding.wait(10), "agent never took the role"
            else:
                self.ip = "127.0.0.3"
                port = free_port(["127.0.0.2", "127.0.0.3"])
                self.board = self._board(64, watcher_policy or policy)
                self.peer_board = self._board(slots, policy)
                self.pinger = self._pinger(self.board, f"127.0.0.2:{port}")
                self.peer_pinger = self._pinger(self.peer_board, f"127.0.0.3:{port}")
        except BaseException:
            self.close()
            raise

    def _board(self, slots: int, policy: shmhb.Policy) -> shmhb.Board:
        name = f"shmhb-test-{uuid.uuid4().hex[:12]}"
        self._names.append(name)
        b = shmhb.Board.create(name, slots=slots, policy=policy)
        self._boards.append(b)
        return b

    def _pinger(self, board: shmhb.Board, listen: str) -> subprocess.Popen[str]:
        p = self.procs.spawn(PINGER + ["--board", board.name, "--listen", listen], ready=False)
        wait_until(lambda: p.poll() is not None or (board.agent().pid == p.pid
                                                    and board.agent().status is Status.ALIVE),
                   timeout_s=20, what=f"pinger on {listen}")
        assert p.poll() is None, f"pinger on {listen} exited with {p.returncode}"
        return p

    def close(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        for b in self._boards:
            b.close()
        for n in self._names:
            unlink_quietly(n)

    # -- workers and what the reaper's board sees -------------------------------------------

    def ep(self, n: int) -> str:
        return f"{self.ip}:{30000 + n}"

    def worker(self, key: str, *eps: str) -> subprocess.Popen[str]:
        return self.procs.worker(self.peer_board.name, key, interval_s=0.02, endpoints=",".join(eps))

    def follow(self) -> None:
        """Keep following the remote host whatever the reaper tracks, as a connector's
        other links to that host would (the reaper's own watch goes with its link)."""
        if self.kind == "remote":
            self.board.watch(self.ep(0))

    def seen(self, ep: str) -> shmhb.SlotStatus | None:
        """The newest worker advertising ``ep``, as the reaper's board shows it."""
        if self.kind == "remote":
            return self.board.remote(ep)
        got = [s for s in self.board.slots() if ep in s.endpoints]
        return max(got, key=lambda s: s.incarnation) if got else None

    def wait_seen(self, ep: str, inc: int, status: Status = Status.ALIVE, timeout_s: float = 15) -> None:
        def ok() -> bool:
            s = self.seen(ep)
            return s is not None and s.incarnation == inc and s.status is status
        wait_until(ok, timeout_s=timeout_s, poll_s=0.005,
                   what=f"{ep} seen as incarnation {inc} {status} ({self.kind})")


def inc_of(p: subprocess.Popen[str]) -> int:
    return int(p.ready_line.split()[1])  # type: ignore[attr-defined]


class Recorder:
    """An on_drop callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Link, DropReason]] = []
        self.lock = threading.Lock()

    def __call__(self, link: Link, reason: DropReason) -> None:
        with self.lock:
            self.calls.append((link, reason))

    def endpoints(self) -> list[str]:
        with self.lock:
            return [lk.endpoint for lk, _ in self.calls]


@pytest.fixture
def make_site(procs: Procs) -> Iterator[Callable[..., Site]]:
    made: list[Site] = []

    def make(kind: str, **kw: Any) -> Site:
        s = Site(procs, kind, **kw)
        made.append(s)
        return s

    yield make
    procs.cleanup()  # the processes first: an agent thread must not outlive its board
    for s in made:
        s.close()


@pytest.fixture(params=["local", "remote"])
def site(request: pytest.FixtureRequest, make_site: Callable[..., Site]) -> Site:
    return make_site(request.param)


def poll_until(reaper: LinkReaper, timeout_s: float = 15, what: str = "a drop"
               ) -> list[tuple[Link, DropReason]]:
    return wait_until(reaper.poll, timeout_s=timeout_s, poll_s=0.005, what=what)  # type: ignore[no-any-return]


def tracked(site: Site, reaper: LinkReaper, ep: str, inc: int, payload: Any = None) -> Link:
    """Track ``ep`` as a connector does right after its handshake (which told it the
    peer's incarnation), and wait until this host's board reports the peer; the first
    poll after that completes the link and drops nothing."""
    link = reaper.track(ep, payload, incarnation=inc)
    site.wait_seen(ep, inc)
    assert reaper.poll() == []
    assert reaper.links()[0].key is not None
    return link


# -- every reason, from a real event, local and remote ----------------------------------------

def test_sigkill_drops_dead(site: Site) -> None:
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w = site.worker("rank-0", site.ep(1))
    link = tracked(site, reaper, site.ep(1), inc_of(w), payload={"kv_base": 0x7F00})
    assert link.local is (site.kind == "local") and link.incarnation == inc_of(w)
    w.kill()
    dropped = poll_until(reaper)
    assert [(lk.endpoint, lk.incarnation, r) for lk, r in dropped] == [(site.ep(1), inc_of(w), DropReason.DEAD)]
    assert dropped[0][0].payload == {"kv_base": 0x7F00}
    assert rec.calls == dropped and reaper.links() == []
    assert reaper.poll() == []


def test_graceful_close_drops_left(site: Site) -> None:
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w = site.worker("rank-0", site.ep(1))
    tracked(site, reaper, site.ep(1), inc_of(w))
    w.terminate()  # the conftest worker closes its heartbeat on SIGTERM
    assert w.stdout is not None and w.stdout.readline().strip() == "closed"
    dropped = poll_until(reaper)
    assert [(lk.endpoint, r) for lk, r in dropped] == [(site.ep(1), DropReason.LEFT)]
    assert rec.calls == dropped


def test_restart_drops_restarted(site: Site) -> None:
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w1 = site.worker("rank-0", site.ep(1))
    tracked(site, reaper, site.ep(1), inc_of(w1))
    # No poll from here until the new incarnation is visible: what the reaper then finds
    # is a restart, whatever it would have said in between.
    w1.kill()
    w1.wait()
    w2 = site.worker("rank-0", site.ep(1))
    assert inc_of(w2) > inc_of(w1)
    site.wait_seen(site.ep(1), inc_of(w2))
    dropped = reaper.poll()
    assert [(lk.incarnation, r) for lk, r in dropped] == [(inc_of(w1), DropReason.RESTARTED)]
    assert rec.calls == dropped


def test_reregistered_with_other_endpoints_drops_gone(site: Site) -> None:
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w1 = site.worker("rank-0", site.ep(1), site.ep(2))
    tracked(site, reaper, site.ep(1), inc_of(w1))
    reaper.track(site.ep(2), incarnation=inc_of(w1))
    w1.kill()
    w1.wait()
    w2 = site.worker("rank-0", site.ep(2), site.ep(3))  # the same key, ep(1) no longer served
    site.wait_seen(site.ep(3), inc_of(w2))
    dropped = sorted(reaper.poll(), key=lambda d: d[0].endpoint)
    assert [(lk.endpoint, r) for lk, r in dropped] == [
        (site.ep(1), DropReason.GONE), (site.ep(2), DropReason.RESTARTED)]
    assert sorted(rec.calls, key=lambda d: d[0].endpoint) == dropped


def test_slot_reused_by_another_key_drops_gone(make_site: Callable[..., Site], kind: str) -> None:
    site = make_site(kind, slots=1)
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w1 = site.worker("rank-0", site.ep(1))
    tracked(site, reaper, site.ep(1), inc_of(w1))
    w1.kill()
    w1.wait()
    w2 = site.worker("other", site.ep(9))  # the only slot: rank-0's
    assert w2.ready_line.split()[2] == w1.ready_line.split()[2]  # type: ignore[attr-defined]
    site.wait_seen(site.ep(9), inc_of(w2))
    wait_until(lambda: site.seen(site.ep(1)) is None, what="rank-0 gone from the board's view")
    dropped = reaper.poll()
    assert [(lk.endpoint, r) for lk, r in dropped] == [(site.ep(1), DropReason.GONE)]
    assert rec.calls == dropped


@pytest.fixture(params=["local", "remote"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- exactly once ----------------------------------------------------------------------------

def test_exactly_once_under_restarts_and_many_polls(site: Site) -> None:
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    site.follow()
    w = site.worker("rank-0", site.ep(1))
    tracked(site, reaper, site.ep(1), inc_of(w))
    polled: list[tuple[Link, DropReason]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            polled.extend(reaper.poll())
            time.sleep(0.0005)

    t = threading.Thread(target=hammer)
    reaper.start(interval_s=0.002)  # and the reaper's own thread besides
    t.start()
    try:
        incs = [inc_of(w)]
        for _ in range(2):  # the peer restarts, then restarts again
            w.kill()
            w.wait()
            w = site.worker("rank-0", site.ep(1))
            incs.append(inc_of(w))
            site.wait_seen(site.ep(1), incs[-1])
        wait_until(lambda: rec.calls, what="the drop")
        for _ in range(50):
            polled.extend(reaper.poll())
    finally:
        stop.set()
        t.join()
        reaper.stop()
    assert len(rec.calls) == 1, rec.calls
    link, reason = rec.calls[0]
    assert link.incarnation == incs[0] and reason in (DropReason.DEAD, DropReason.RESTARTED)
    assert len(polled) <= 1 and reaper.links() == []  # the other copy went to the thread


def test_retracking_after_a_drop_starts_afresh(make_site: Callable[..., Site], kind: str) -> None:
    # The watcher's verdicts on the remote host stay ALIVE while that host's pinger is
    # stopped below, so the only thing that can delay the new report is the stop itself.
    site = make_site(kind, watcher_policy=PATIENT)
    site.follow()
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w1 = site.worker("rank-0", site.ep(1))
    tracked(site, reaper, site.ep(1), inc_of(w1))
    w1.kill()
    assert [r for _, r in poll_until(reaper)] == [DropReason.DEAD]

    # The connector handshakes with the restarted peer and tracks the new link at once,
    # before this host has heard of the new incarnation (the remote pinger is stopped:
    # the board still shows the old, dead one), and with a brand-new key besides.
    if site.peer_pinger is not None:
        os.kill(site.peer_pinger.pid, signal.SIGSTOP)
    try:
        w2 = site.worker("rank-0", site.ep(1))
        w3 = site.worker("rank-new", site.ep(2))
        link2 = reaper.track(site.ep(1), "second", incarnation=inc_of(w2))
        reaper.track(site.ep(2), "new key", incarnation=inc_of(w3))
        assert link2.incarnation == inc_of(w2) > inc_of(w1)
        for _ in range(20):
            assert reaper.poll() == [], "a fresh link was judged by an older report"
    finally:
        if site.peer_pinger is not None:
            resume(site.peer_pinger.pid)
    site.wait_seen(site.ep(1), inc_of(w2))
    site.wait_seen(site.ep(2), inc_of(w3))
    assert reaper.poll() == []
    assert {lk.endpoint: lk.key for lk in reaper.links()} == {site.ep(1): "rank-0", site.ep(2): "rank-new"}
    w2.kill()
    dropped = poll_until(reaper)
    assert [(lk.payload, lk.incarnation, r) for lk, r in dropped] == [("second", inc_of(w2), DropReason.DEAD)]
    assert [r for _, r in rec.calls] == [DropReason.DEAD, DropReason.DEAD]
    assert [lk.endpoint for lk in reaper.links()] == [site.ep(2)]


# -- flapping and UNKNOWN ----------------------------------------------------------------------

def test_flap_drops_nothing_unless_drop_suspect(make_site: Callable[..., Site], kind: str) -> None:
    site = make_site(kind, policy=FLAPPY)
    patient, strict = Recorder(), Recorder()
    r1 = LinkReaper(site.board, on_drop=patient)
    r2 = LinkReaper(site.board, on_drop=strict, drop_suspect=True)
    w = site.worker("rank-0", site.ep(1))
    tracked(site, r1, site.ep(1), inc_of(w))
    tracked(site, r2, site.ep(1), inc_of(w))
    with stopped(w.pid):
        dropped = poll_until(r2, what="the SUSPECT drop")
        assert [r for _, r in dropped] == [DropReason.SUSPECT]
        assert site.seen(site.ep(1)).status is Status.SUSPECT  # type: ignore[union-attr]
        for _ in range(20):
            assert r1.poll() == []
    site.wait_seen(site.ep(1), inc_of(w), Status.ALIVE)
    assert r1.poll() == [] and patient.calls == []
    assert len(r1.links()) == 1 and r2.links() == []
    assert [r for _, r in strict.calls] == [DropReason.SUSPECT]


def test_unknown_never_drops(make_site: Callable[..., Site]) -> None:
    site = make_site("remote")
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    w = site.worker("rank-0", site.ep(1))
    tracked(site, reaper, site.ep(1), inc_of(w))
    assert site.pinger is not None
    os.kill(site.pinger.pid, signal.SIGSTOP)  # this host's own observer stalls
    try:
        site.wait_seen(site.ep(1), inc_of(w), Status.UNKNOWN)
        w.kill()  # meanwhile the peer dies, and its own host knows it at once
        wait_until(lambda: site.peer_board.status("rank-0") is Status.DEAD, what="remote DEAD")
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert reaper.poll() == [], "dropped while this host could not know"
            assert site.seen(site.ep(1)).status is Status.UNKNOWN  # type: ignore[union-attr]
            time.sleep(0.005)
    finally:
        resume(site.pinger.pid)
    dropped = poll_until(reaper, what="the drop once the observer is back")
    assert [r for _, r in dropped] == [DropReason.DEAD] and rec.calls == dropped


# -- threads, callbacks ------------------------------------------------------------------------

def _workers(site: Site, n: int, per: int) -> tuple[list[subprocess.Popen[str]], list[str]]:
    ws = [site.worker(f"rank-{i}", *(site.ep(i * per + j) for j in range(per))) for i in range(n)]
    return ws, [site.ep(k) for k in range(n * per)]


def test_concurrent_polls_deliver_each_link_once(make_site: Callable[..., Site]) -> None:
    site = make_site("local")
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    ws, eps = _workers(site, 4, 8)
    for ep in eps:
        reaper.track(ep)
    assert reaper.poll() == [] and len(reaper.links()) == 32
    returned: list[list[tuple[Link, DropReason]]] = [[] for _ in range(4)]
    stop = threading.Event()

    def poller(k: int) -> None:
        while not stop.is_set():
            returned[k].extend(reaper.poll())
            time.sleep(0.0001)

    threads = [threading.Thread(target=poller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for w in ws:
            w.kill()
        wait_until(lambda: len(rec.calls) >= 32, what="32 drops")
        for _ in range(20):
            reaper.poll()
    finally:
        stop.set()
        for t in threads:
            t.join()
    got = sorted(lk.endpoint for lk, _ in rec.calls)
    assert got == sorted(eps), "each link dropped exactly once"
    flat = [d for r in returned for d in r]
    assert sorted(lk.endpoint for lk, _ in flat) == sorted(eps)  # returned once in total
    assert {r for _, r in flat} == {DropReason.DEAD}
    assert reaper.links() == []


def test_untrack_from_another_thread_during_polls(make_site: Callable[..., Site]) -> None:
    site = make_site("local")
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    ws, eps = _workers(site, 4, 8)
    for ep in eps:
        reaper.track(ep)
    assert reaper.poll() == []
    reaper.start(interval_s=0.0005)
    try:
        untracked: list[str] = []
        random.shuffle(eps)
        for w in ws:
            w.kill()
        for ep in eps:  # races the reaper's thread, which is dropping the same links
            if reaper.untrack(ep) is not None:
                untracked.append(ep)
            time.sleep(0.0005)  # pacing only: let the kills land in the middle of the loop
        # every link is out of the table now; the thread may still be calling back
        wait_until(lambda: len(untracked) + len(rec.calls) >= len(eps), what="all callbacks")
        dropped = rec.endpoints()
        assert not set(untracked) & set(dropped), "a link both untracked and dropped"
        assert sorted(untracked + dropped) == sorted(eps), "a link neither untracked nor dropped"
        assert reaper.links() == []
        assert all(r is DropReason.DEAD for _, r in rec.calls)
    finally:
        reaper.stop()
    n = len(rec.calls)
    assert reaper.poll() == [] and len(rec.calls) == n


def test_untrack_and_track_from_the_callback(make_site: Callable[..., Site]) -> None:
    site = make_site("local")
    (w1, w2), _ = _workers(site, 2, 1)
    ep1, ep2 = site.ep(0), site.ep(1)
    seen: list[tuple[str, Any]] = []
    done = threading.Event()

    def on_drop(link: Link, reason: DropReason) -> None:
        # on the reaper's own thread: untrack itself (already gone) and a sibling that is
        # still alive, look at the links, and track a new link: no deadlock, no error
        seen.append((link.endpoint, reaper.untrack(link.endpoint)))
        seen.append((ep2, reaper.untrack(ep2)))
        seen.append(("links", [lk.endpoint for lk in reaper.links()]))
        w3 = site.worker("rank-new", site.ep(7))
        reaper.track(site.ep(7), incarnation=inc_of(w3))
        seen.append(("poll", reaper.poll()))
        done.set()

    reaper = LinkReaper(site.board, on_drop=on_drop)
    reaper.track(ep1)
    reaper.track(ep2)
    reaper.start(interval_s=0.002)
    try:
        w1.kill()
        assert done.wait(20), "the callback did not run"
    finally:
        reaper.stop()
    assert seen[0] == (ep1, None)
    assert seen[1][0] == ep2 and isinstance(seen[1][1], Link)
    assert seen[2] == ("links", []) and seen[3] == ("poll", [])
    w2.kill()  # untracked: nothing to drop
    wait_until(lambda: site.board.status("rank-1") is Status.DEAD)
    assert reaper.poll() == []
    assert [lk.endpoint for lk in reaper.links()] == [site.ep(7)]


def test_a_raising_callback_is_logged_and_loses_nothing(make_site: Callable[..., Site],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    site = make_site("local")
    (w1, w2), (ep1, ep2) = _workers(site, 2, 1)
    calls: list[str] = []

    def on_drop(link: Link, reason: DropReason) -> None:
        calls.append(link.endpoint)
        raise RuntimeError(f"connector bug on {link.endpoint}")

    reaper = LinkReaper(site.board, on_drop=on_drop)
    reaper.track(ep1)
    reaper.track(ep2)
    caplog.set_level(logging.ERROR, logger="shmhb.board.reaper")
    reaper.start(interval_s=0.002)
    try:
        w1.kill()
        w2.kill()
        wait_until(lambda: len(calls) == 2, what="both callbacks")
        assert reaper.running
    finally:
        reaper.stop()
    assert sorted(calls) == sorted([ep1, ep2])
    failed = [r for r in caplog.records if "on_drop callback failed" in r.getMessage()]
    assert len(failed) == 2
    for r in failed:
        assert r.exc_info is not None and r.exc_info[0] is RuntimeError
        assert "Traceback" in caplog.text and "connector bug on" in caplog.text
    assert reaper.links() == []


# -- links tracked without an incarnation; remote() on a long-lived handle ---------------------

def quiet_polls(reaper: LinkReaper, n: int = 50) -> int:
    """Poll ``n`` times while the board does not change (retrying a burst in which it
    did); returns how many of those polls judged every link."""
    def burst() -> int | None:
        c, j = reaper.board.changes(), reaper.judges
        for _ in range(n):
            assert reaper.poll() == []
        return reaper.judges - j + 1 if reaper.board.changes() == c else None
    return wait_until(burst, timeout_s=15, what="a quiet burst of polls") - 1  # type: ignore[no-any-return]


def test_link_without_incarnation_unnamed_is_dropped_when_its_host_dies(make_site: Callable[..., Site]) -> None:
    site = make_site("remote")
    site.follow()
    w = site.worker("rank-0", site.ep(1))  # the host reports, but never names ep(7)
    site.wait_seen(site.ep(1), inc_of(w))
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    reaper.track(site.ep(7))  # as docs/LIBRARY.md shows: no incarnation
    assert reaper.poll() == [] and reaper.pending
    # Pending, but no poll judges every link again until the board changes.
    assert quiet_polls(reaper) == 0
    assert site.peer_pinger is not None
    site.peer_pinger.kill()  # the host goes silent: DEAD after peer_dead_after_s
    dropped = poll_until(reaper, timeout_s=30, what="the drop of a link whose host died")
    assert [(lk.endpoint, r) for lk, r in dropped] == [(site.ep(7), DropReason.DEAD)]
    assert rec.calls == dropped and reaper.links() == []


def test_an_endpoint_its_live_host_never_names_is_dropped_gone(make_site: Callable[..., Site]) -> None:
    site = make_site("remote")
    site.follow()
    w = site.worker("rank-0", site.ep(1))  # the host reports, but never names ep(7)
    site.wait_seen(site.ep(1), inc_of(w))
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    t0 = time.monotonic()
    reaper.track(site.ep(7))
    assert reaper.poll() == [] and reaper.pending
    assert quiet_polls(reaper) == 0  # waiting costs one counter read per poll
    dropped = poll_until(reaper, timeout_s=30, what="the unnamed link dropped GONE")
    took = time.monotonic() - t0
    assert [(lk.endpoint, r) for lk, r in dropped] == [(site.ep(7), DropReason.GONE)]
    # not before its host had reported for a peer dead-after window since the handshake
    assert took >= site.board.policy.peer_dead_after_s, took
    assert site.board.peer(site.ip).status is Status.ALIVE  # the host never died
    assert rec.calls == dropped and reaper.links() == []


def test_remote_sees_the_next_holder_of_an_endpoint(make_site: Callable[..., Site]) -> None:
    site = make_site("remote")
    site.follow()
    ep = site.ep(1)
    a = site.worker("rank-a", ep)
    site.wait_seen(ep, inc_of(a))  # this handle caches the row that serves ep
    a.kill()
    site.wait_seen(ep, inc_of(a), Status.DEAD)
    rec = Recorder()
    reaper = LinkReaper(site.board, on_drop=rec)
    # A re-handshake after the death, before the board heard of a successor: the dead
    # row must not be adopted (it would drop this link at once, and at every re-track).
    reaper.track(ep)
    assert reaper.links()[0].incarnation == 0
    assert reaper.poll() == [] and reaper.pending
    assert quiet_polls(reaper, 5) == 0 and rec.calls == []
    b = site.worker("rank-b", ep)  # another key starts serving ep
    site.wait_seen(ep, inc_of(b))  # the long-lived handle's remote(ep) moves on to it
    wait_until(lambda: reaper.poll() == [] and reaper.links()[0].incarnation == inc_of(b),
               timeout_s=15, what="the link adopting the new holder")
    assert reaper.links()[0].key == "rank-b" and rec.calls == []
    assert quiet_polls(reaper) == 0 and rec.calls == []
    b.kill()
    dropped = poll_until(reaper)
    assert [(lk.incarnation, r) for lk, r in dropped] == [(inc_of(b), DropReason.DEAD)]


# -- the door: endpoint text is canonicalised ---------------------------------------------

def test_track_canonicalises_endpoint_text_or_refuses_it(board: shmhb.Board) -> None:
    """No agent runs on ``board``: the watches this makes send nothing anywhere."""
    reaper = LinkReaper(board)
    link = reaper.track("[FD00:0::1]:30001", incarnation=7)
    assert link.endpoint == "[fd00::1]:30001"
    assert [lk.endpoint for lk in reaper.links()] == ["[fd00::1]:30001"]
    w = board_words(board).watch_table
    assert [bytes(a).rstrip(b"\0") for a in w[w["checksum"] != 0]["address"]] == [b"[fd00::1]"]
    assert reaper.track("Node-A:30002", incarnation=3).endpoint == "node-a:30002"
    assert reaper.untrack("NODE-a:30002") is not None  # the same endpoint, however written
    assert reaper.untrack("[fd00:0:0::1]:30001") is not None and reaper.links() == []
    for bad in ("node_a:30002", "[fd00::1]", "1.2.3:4", "node-a:0", "x" * 64 + ":1"):
        with pytest.raises(shmhb.InvalidAddress):
            reaper.track(bad)
        assert reaper.untrack(bad) is None
    assert reaper.links() == []


def test_a_link_tracked_as_uncanonical_text_is_dropped_when_its_worker_dies(procs: Procs) -> None:
    """A host that names itself ``localhost`` (127.0.0.1), a connector that met its worker
    as ``LocalHost:30001``: the link is judged against that worker and dropped DEAD at its
    kill.  Before, the text matched no report: the live worker's link waited for ever and
    was finally dropped GONE, the kill unseen."""
    port = free_port(["127.0.0.1", "127.0.0.3"])
    names = [f"shmhb-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    boards = [shmhb.Board.create(n, slots=16, policy=FAST) for n in names]
    try:
        watcher, peer = boards
        pingers = []
        for b, listen in ((watcher, f"127.0.0.3:{port}"), (peer, f"localhost:{port}")):
            p = procs.spawn(PINGER + ["--board", b.name, "--listen", listen], ready=False)
            wait_until(lambda b=b, p=p: p.poll() is not None or (
                b.agent().pid == p.pid and b.agent().status is Status.ALIVE),
                timeout_s=20, what=f"pinger on {listen}")
            assert p.poll() is None, f"pinger on {listen} exited with {p.returncode}"
            pingers.append(p)
        w = procs.worker(peer.name, "rank-0", interval_s=0.02, endpoints="localhost:30001")
        rec = Recorder()
        reaper = LinkReaper(watcher, on_drop=rec)
        link = reaper.track("LocalHost:30001", incarnation=inc_of(w))
        assert link.endpoint == "localhost:30001"
        def judged() -> bool:
            assert reaper.poll() == [], f"the live worker's link was dropped: {rec.calls}"
            return reaper.links()[0].key == "rank-0"
        wait_until(judged, timeout_s=20, poll_s=0.01, what="the link judged against rank-0")
        w.kill()
        dropped = poll_until(reaper, timeout_s=20, what="the drop of the killed worker's link")
        assert [(lk.endpoint, r) for lk, r in dropped] == [("localhost:30001", DropReason.DEAD)]
    finally:
        procs.cleanup()
        for b in boards:
            b.close()
        for n in names:
            unlink_quietly(n)
