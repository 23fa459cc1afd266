"""A secret that differs between two hosts is not a death, and a secret rotated host by
host leaves no moment in which two hosts read each other anything but alive; against
real pinger processes.

A host whose frames fail authentication here reads UNKNOWN with ``auth_failing`` (never
DEAD: we cannot tell), its workers UNKNOWN, and a LinkReaper drops none of their links;
once its answers stop altogether (it died), it reads DEAD on the usual schedule.  The
secret file holds the secret that signs and, on a second line, one more that is
accepted; a running pinger picks up a rewritten file."""

from __future__ import annotations

import os
import time
from typing import Any

from shmhb import LinkReaper, Status

from ..conftest import wait_until
from ..hosts import FAST, Cluster, Host, write_secret

OLD = b"cluster-secret-0123456789abcdef!"
NEW = b"rotated-secret-0123456789abcdef!"


def test_a_secret_mismatch_reads_unknown_not_dead_and_drops_no_link(
        cluster: Cluster, tmp_path: Any) -> None:
    b = cluster.host(secret_file=write_secret(os.path.join(str(tmp_path), "b"), NEW))
    ep = b.endpoint(1)
    w = b.worker("dec-0", ep)
    # a follows b, one way: b's answers are all a can go by
    a = cluster.host(secret_file=write_secret(os.path.join(str(tmp_path), "a"), OLD))
    dropped: list[Any] = []
    reaper = LinkReaper(a.board, lambda link, why: dropped.append((link.endpoint, why)))
    try:
        reaper.track(ep, incarnation=1)  # a.watch(b), as a connector's handshake would
        reaper.start(0.02)
        wait_until(lambda: (p := a.peer(b)) is not None and p.auth_failing,
                   timeout_s=20, what="a names b's frames as failing authentication")
        end = time.monotonic() + 2.5 * FAST.peer_dead_after_s
        while time.monotonic() < end:
            p = a.peer(b)
            assert p is not None and p.status is Status.UNKNOWN and p.auth_failing, p
            r = a.remote(ep)
            assert r is None or r.status is Status.UNKNOWN, r
            time.sleep(0.05)
        assert not dropped, dropped
        # its host gone for good: no frame from it at all, so DEAD on the usual schedule
        w.kill()
        b.kill_pinger()
        wait_until(lambda: (p := a.peer(b)) is not None and p.status is Status.DEAD,
                   timeout_s=4 * FAST.peer_dead_after_s + 5, what="a reads b dead once it is")
    finally:
        reaper.stop()


def _rewrite(path: str, *secrets: bytes) -> None:
    tmp = path + ".new"
    write_secret(tmp, b"\n".join(secrets) + b"\n")
    os.replace(tmp, path)


def _reloaded(cluster: Cluster, h: Host, n: int) -> None:
    assert h.pinger is not None
    wait_until(lambda: cluster.log_tail(h.pinger, 400).count("secret file reloaded") >= n,  # type: ignore[arg-type]
               timeout_s=20, what=f"{h} reloaded its secret file ({n})")


def _hold_alive(pairs: list[tuple[Host, Host]], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for h, o in pairs:
            p = h.peer(o)
            assert p is not None and p.status is Status.ALIVE and not p.auth_failing, (h, p)
        time.sleep(0.02)


def test_a_secret_rotated_host_by_host_never_reads_a_peer_anything_but_alive(
        cluster: Cluster, tmp_path: Any) -> None:
    fa, fb = (write_secret(os.path.join(str(tmp_path), n), OLD) for n in ("a", "b"))
    b = cluster.host(secret_file=fb, start=False)
    a = cluster.host(secret_file=fa, peers=(b.ip,))
    b.peers = (a.ip,)
    b.start_pinger()
    pairs = [(a, b), (b, a)]
    wait_until(lambda: all((p := h.peer(o)) is not None and p.status is Status.ALIVE
                           for h, o in pairs), timeout_s=20, what="both alive")
    steps = [(OLD, NEW), (NEW, OLD), (NEW,)]  # the next one accepted; it signs; the old one gone
    for n, secrets in enumerate(steps, 1):
        for h, f in ((a, fa), (b, fb)):  # one host, then the other: a window at each step
            _rewrite(f, *secrets)
            _reloaded(cluster, h, n)
            _hold_alive(pairs, 1.5 * FAST.peer_dead_after_s)
    # and the old secret is refused now
    c = cluster.host(secret_file=write_secret(os.path.join(str(tmp_path), "c"), OLD))
    c.watch(a)
    wait_until(lambda: (p := c.peer(a)) is not None and p.auth_failing, timeout_s=20,
               what="the old secret refused")
