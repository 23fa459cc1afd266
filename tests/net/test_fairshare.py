"""One followed host cannot fill the remote table for the others, against a real pinger:
each followed host is stored up to its fair share of the table, the rest of a bigger
host's workers are not stored (named, counted), and readers of those say UNKNOWN, never
GONE or DEAD; a LinkReaper drops none of their links."""

from __future__ import annotations

import time
from typing import Any

from shmhb import LinkReaper, Status

from ..conftest import wait_until
from ..hosts import FAST, Cluster, FakePeer, entry

SLOTS = 64  # the watcher's remote table


def _serve(fakes: list[FakePeer], pred: Any, timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < end, f"timed out after {timeout_s} s waiting for {what}"
        for f in fakes:
            got = f.poll_ping(0.002)
            if got is not None:
                f.ack(got)


def test_a_big_host_is_stored_up_to_its_share_and_the_rest_reads_unknown(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a = cluster.host(remote_slots=SLOTS)
    b = FakePeer("127.0.0.8", cluster.port)  # as many workers as a's whole table
    c = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers += [b, c]
    b.set(*(entry(f"b-{k}", 3, Status.ALIVE, f"{b.ip}:{30000 + k}") for k in range(SLOTS)))
    c.set(entry("c-0", 5, Status.ALIVE, f"{c.ip}:30000"))
    a.board.watch(f"{b.ip}:30000")
    # b first, alone: it may take the whole table
    _serve([b], lambda: (p := a.peer(b.ip)) is not None and len(p.slots) == SLOTS, 20,
           "b's workers stored on a")
    a.board.watch(f"{c.ip}:30000")

    def settled() -> bool:
        # at every read on the way: each of b's workers is stored or counted as not
        p = a.peer(b.ip)
        assert p is not None and len(p.slots) + p.rows_capped >= SLOTS, p and (
            len(p.slots), p.rows_capped)
        r = a.remote(f"{c.ip}:30000")
        return r is not None and r.status is Status.ALIVE and len(p.slots) <= SLOTS // 2
    # then c: its row is stored, b gives rows back down to its share
    _serve([b, c], settled, 20, "c's worker stored, b down to its share")
    pb = a.peer(b.ip)
    assert pb is not None and pb.status is Status.ALIVE and pb.rows_capped == SLOTS - len(pb.slots)
    stored = {s.key for s in pb.slots}
    unstored = [f"{b.ip}:{30000 + k}" for k in range(SLOTS) if f"b-{k}" not in stored]
    assert unstored and a.stats()["remote_capped"] > 0
    dropped: list[Any] = []
    reaper = LinkReaper(a.board, lambda link, why: dropped.append((link.endpoint, why)))
    try:
        reaper.track(unstored[0], incarnation=3)
        reaper.track(f"{c.ip}:30000", incarnation=5)
        reaper.start(0.02)
        end = time.monotonic() + 2.5 * FAST.peer_dead_after_s  # past a dead-after window
        _serve([b, c], lambda: time.monotonic() >= end, 10, "a window")
        assert not dropped, dropped
        assert a.remote(unstored[0]) is None  # not stored: no verdict, and UNKNOWN to a reaper
    finally:
        reaper.stop()
