"""A rolling upgrade: hosts of the previous release and of this one, side by
side, each see the other's deaths, pushes, restarts and host deaths, and each release
opens the other's boards.

Two loopback hosts: an old one (127.0.0.2: its board created, its pinger and workers
run by ``PREVIOUS_RELEASE``, see ``tests/oldrelease.py``) and a new one (127.0.0.3),
each following the other through its pinger's ``--peer``.  Every check is made both
ways (the new host watching the old one, and the old watching the new) and reads only
what a host's board shows of the other: statuses, never wire details, so it holds
whatever the two pingers negotiate between them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shmhb
from shmhb import Status
from shmhb.testing.loopback import child_env

from .conftest import wait_until
from .hosts import FAST, INTERVAL_S, Host
from .oldrelease import (
    PREVIOUS_RELEASE, MixedCluster, OldHost, OldRelease, Unavailable, build_old_release,
    mixed_fixture, start_pinger_of,
)

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

#: added to every bound derived from the policy, for a loaded 2-core machine
SLACK_S = 3.0
#: a worker SIGKILLed: its host sees it at once (pidfd) or, at worst, after dead-after of
#: silence; the other host hears it by push, or at the latest at the next ping
KILL_BOUND_S = FAST.dead_after_s + INTERVAL_S + SLACK_S
#: a host's pinger killed: the other host reads it DEAD after peer-dead-after of silence
HOST_DEAD_BOUND_S = FAST.peer_dead_after_s + INTERVAL_S + SLACK_S


@pytest.fixture(scope="session")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> OldRelease:
    try:
        rel = build_old_release(str(tmp_path_factory.mktemp("previous-release")))
    except Unavailable as e:
        pytest.skip(str(e))
    print(f"previous release {(PREVIOUS_RELEASE or '')[:12]} built in {rel.build_s:.1f} s "
          f"({'C' if rel.native else 'pure-Python'} hot path) at {rel.package}")
    return rel


@pytest.fixture
def mixed(tmp_path: Any, old_release: OldRelease) -> Iterator[MixedCluster]:
    yield from mixed_fixture(tmp_path, old_release)


def both_ways(o: OldHost, n: Host) -> list[tuple[Host, Host, str]]:
    """(watcher, watched, label) for each direction."""
    return [(n, o, "new watching old"), (o, n, "old watching new")]


def wait_remote(a: Host, ep: str, pred: Any, what: str, timeout_s: float = 15.0) -> shmhb.SlotStatus:
    return wait_until(lambda: (r := a.remote(ep)) is not None and pred(r) and r,
                      timeout_s=max(timeout_s, 0.0), poll_s=0.002, what=what)


def wait_peer(a: Host, b: Host, status: Status, what: str, timeout_s: float = 15.0) -> None:
    wait_until(lambda: a.peer_status(b) is status, timeout_s=max(timeout_s, 0.0), poll_s=0.002,
               what=what)


def alive_both_ways(o: OldHost, n: Host, key: str, ep: dict[Host, str],
                    ws: dict[Host, subprocess.Popen[str]]) -> dict[Host, shmhb.SlotStatus]:
    """Each host's worker ``key`` seen ALIVE, with its pid, on the other host's board."""
    seen = {}
    for a, b, way in both_ways(o, n):
        r = wait_remote(a, ep[b], lambda r: r.status is Status.ALIVE,
                        f"{way}: {key} ALIVE on {a}")
        assert (r.key, r.pid) == (key, ws[b].pid), way
        seen[b] = r
    return seen


def acks_later(a: Host, n: int = 2) -> None:
    """Until ``a`` has taken ``n`` more acks (fresh digests of the hosts it follows)."""
    start = a.stats()["acks_received"]
    wait_until(lambda: a.stats()["acks_received"] >= start + n, timeout_s=10,
               what=f"{n} more acks on {a}")


def test_worker_deaths_and_restarts_are_seen_both_ways(mixed: MixedCluster) -> None:
    o, n = mixed.pair()
    ep = {o: o.endpoint(1), n: n.endpoint(1)}
    ws = {h: h.worker("dec-0", ep[h]) for h in (o, n)}
    first = alive_both_ways(o, n, "dec-0", ep, ws)

    # 1. killed, both at once: DEAD on the other host, same incarnation and pid
    t0 = time.monotonic()
    for w in ws.values():
        w.kill()
    for a, b, way in both_ways(o, n):
        dead = wait_remote(a, ep[b], lambda r: r.status is Status.DEAD,
                           f"{way}: dec-0 DEAD within {KILL_BOUND_S} s of the kill",
                           timeout_s=t0 + KILL_BOUND_S - time.monotonic())
        print(f"{way}: kill seen after {(time.monotonic() - t0) * 1e3:.0f} ms")
        assert (dead.incarnation, dead.pid) == (first[b].incarnation, first[b].pid), way
    for w in ws.values():
        w.wait(10)

    # 2. restarted under the same key and endpoint: the new incarnation ALIVE there
    ws = {h: h.worker("dec-0", ep[h]) for h in (o, n)}
    inc = {h: int(w.ready_line.split()[1]) for h, w in ws.items()}  # type: ignore[attr-defined]
    for a, b, way in both_ways(o, n):
        new = wait_remote(a, ep[b], lambda r, b=b: r.incarnation == inc[b] and r.status is Status.ALIVE,
                          f"{way}: the restarted dec-0 ALIVE on {a}")
        assert new.incarnation > first[b].incarnation and new.pid == ws[b].pid, way
    # ...and the dead incarnation never comes back, whatever the next digests carry
    for a, b, way in both_ways(o, n):
        acks_later(a)
        r, p = a.remote(ep[b]), a.peer(b)
        assert r is not None and (r.status, r.incarnation) == (Status.ALIVE, inc[b]), (way, r)
        assert p is not None, way
        assert [s.incarnation for s in p.slots if s.key == "dec-0"] == [inc[b]], (way, p.slots)
        assert p.status is Status.ALIVE, way  # the host itself was never in doubt


def test_host_deaths_are_seen_both_ways(mixed: MixedCluster) -> None:
    o, n = mixed.pair()
    ep = {o: o.endpoint(1), n: n.endpoint(1)}
    ws = {h: h.worker("dec-0", ep[h]) for h in (o, n)}
    before = alive_both_ways(o, n, "dec-0", ep, ws)
    for a, b, way in both_ways(o, n):
        # 3. the other host's pinger killed: that host DEAD, its (running) workers not alive
        t0 = time.monotonic()
        b.kill_pinger()
        wait_peer(a, b, Status.DEAD, f"{way}: {b} DEAD within {HOST_DEAD_BOUND_S} s",
                  timeout_s=HOST_DEAD_BOUND_S)
        print(f"{way}: host death seen after {(time.monotonic() - t0) * 1e3:.0f} ms")
        assert a.remote_status(ep[b]) is Status.DEAD, way
        # its pinger restarted (the same release): ALIVE again, the worker unchanged
        b.start_pinger()
        wait_peer(a, b, Status.ALIVE, f"{way}: {b} ALIVE again")
        r = wait_remote(a, ep[b], lambda r: r.status is Status.ALIVE, f"{way}: dec-0 ALIVE again")
        assert (r.pid, r.incarnation) == (before[b].pid, before[b].incarnation), \
            f"{way}: a pinger restart must not look like a worker restart"
    for h in (o, n):
        assert h.stats()["deaths_seen"] == 0


def status_doc(cmd: list[str], h: Host, **kw: Any) -> dict[str, Any]:
    """``shmhb status --json`` of ``h``'s board, run by ``cmd`` (either release)."""
    out = subprocess.run([*cmd, "-m", "shmhb", "status", "--json", "--board", h.name],
                         capture_output=True, text=True, timeout=60, **kw)
    assert out.returncode == 0, f"{cmd[0]} status of {h}: rc {out.returncode}\n{out.stdout}{out.stderr}"
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_each_release_opens_the_others_boards(mixed: MixedCluster) -> None:
    """4. Board compatibility, the layout being unchanged.  The old host's board was made
    by the old release and this process reads it all along; on top of that: a worker
    of each release registers on the other's board, each release's ``status`` reads the
    other's board, and each host's pinger is replaced by the other release's, started
    bare so that it applies the settings the first one stored in the board (the
    upgrade itself, and its rollback)."""
    o, n = mixed.pair()
    old = mixed.old
    ep = {o: o.endpoint(1), n: n.endpoint(1)}
    ws = {o: o.worker("own-0", ep[o]), n: n.worker("own-0", ep[n])}
    cross = {o: Host.worker(o, "cross-0", o.endpoint(2)),        # this release, old board
             n: mixed.old_worker(n, "cross-0", n.endpoint(2))}   # the old release, new board
    for h in (o, n):
        for key in ("own-0", "cross-0"):
            wait_until(lambda: (s := h.board.slot(key)) is not None and s.status is Status.ALIVE,
                       what=f"{key} ALIVE on its own host {h}")
    seen = alive_both_ways(o, n, "cross-0", {h: h.endpoint(2) for h in (o, n)}, cross)
    seen_own = alive_both_ways(o, n, "own-0", ep, ws)

    # each release's status reads the other's board
    for doc, h in ((status_doc([sys.executable], o, env=child_env()), o),
                   (status_doc(old.cmd(), n, env=old.env(), cwd=old.cwd), n)):
        assert {s["key"]: s["status"] for s in doc["slots"]} == {"own-0": "alive", "cross-0": "alive"}
        assert h.pinger is not None and doc["pinger"]["pid"] == h.pinger.pid, doc["pinger"]
        assert [p["status"] for p in doc["peers"]] == ["alive"], doc["peers"]

    # the upgrade of the old host and the rollback of the new one
    o.kill_pinger()
    start_pinger_of(o, Host.pinger_cmd(o, configure=False))
    n.kill_pinger()
    start_pinger_of(n, old.cmd(*n.pinger_cmd(configure=False)[1:]))
    for a, b, way in both_ways(o, n):
        wait_peer(a, b, Status.ALIVE, f"{way}, pingers swapped: {b} ALIVE")
        for e, before in ((ep[b], seen_own[b]), (b.endpoint(2), seen[b])):
            r = wait_remote(a, e, lambda r: r.status is Status.ALIVE,
                            f"{way}, pingers swapped: {e} ALIVE")
            assert (r.key, r.pid, r.incarnation) == (before.key, before.pid, before.incarnation), way
    for h in (o, n):
        assert h.stats()["deaths_seen"] == 0
