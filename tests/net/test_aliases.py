"""A host reached under two addresses, or by a name, against real pinger processes: a
host that answers our nonces is alive under every address we reach it at.

A pinger listening on every address (``0.0.0.0``), followed as two of them (a ``--peer``
on one network, the watch of a worker's endpoint on another), and a pinger on its own
address followed by a name (resolved through a private ``/etc/hosts`` in a mount
namespace of the follower's own: no DNS, no traffic past loopback).  Each address reads
ALIVE, each endpoint reads its worker, a LinkReaper drops nothing, and a killed worker
reads DEAD under every address."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

import pytest

from shmhb import LinkReaper, Status
from shmhb.testing.loopback import free_port

from ..conftest import wait_until
from ..hosts import FAST, Cluster, Host, listening


def _hold_alive(a: Host, peers: list[str], endpoints: list[str], seconds: float) -> None:
    """Every peer and every endpoint reads ALIVE on ``a`` for ``seconds`` (past a
    peer dead-after window: a DEAD would have come by then)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for p in peers:
            got = a.peer(p)
            assert got is not None and got.status is Status.ALIVE, (p, got)
        for ep in endpoints:
            r = a.remote(ep)
            assert r is not None and r.status is Status.ALIVE, (ep, r)
        time.sleep(0.05)


def _kill_reads_dead(a: Host, w: subprocess.Popen[str], endpoints: list[str]) -> None:
    w.kill()
    for ep in endpoints:
        wait_until(lambda ep=ep: (r := a.remote(ep)) is not None and r.status is Status.DEAD,
                   timeout_s=10, what=f"the killed worker DEAD at {ep}")
    w.wait(10)


def test_a_wildcard_listener_followed_under_two_addresses_reads_alive_under_both(
        cluster: Cluster) -> None:
    port = cluster.port
    b = cluster.host(start=False)  # 127.0.0.2, but listening on every address
    b.listen = f"0.0.0.0:{port}"
    pb = b.start_pinger(wait=False)
    wait_until(lambda: b.board.agent().pid == pb.pid and listening(pb.pid, "0.0.0.0", port),
               timeout_s=20, what="b listening on 0.0.0.0")
    eps = ["127.0.0.2:30001", "127.0.0.3:30001"]
    w = b.worker("dec-0", *eps)
    # a listens on another port: 0.0.0.0 holds the cluster's port on every address
    a = cluster.host(start=False, ip="127.0.0.4")
    a.port = free_port(["127.0.0.4"])
    a.listen = f"127.0.0.4:{a.port}"
    a.peers = (f"127.0.0.2:{port}", f"127.0.0.3:{port}")
    a.start_pinger()
    dropped: list[Any] = []
    reaper = LinkReaper(a.board, lambda link, why: dropped.append((link.endpoint, why)))
    try:
        for ep in eps:
            wait_until(lambda ep=ep: (r := a.remote(ep)) is not None and r.status is Status.ALIVE,
                       timeout_s=20, what=f"b's worker alive at {ep}")
            reaper.track(ep)
        reaper.start(0.02)
        _hold_alive(a, ["127.0.0.2", "127.0.0.3"], eps, 2.5 * FAST.peer_dead_after_s)
        assert not dropped, dropped
        assert a.stats()["bad_spoofed"] == 0
        _kill_reads_dead(a, w, eps)
        wait_until(lambda: len(dropped) == 2, timeout_s=10, what="both links dropped")
    finally:
        reaper.stop()


def _name_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a name needs a private /etc/hosts, which needs root (a mount namespace)"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    return None


def test_a_host_followed_by_a_name_reads_alive_and_its_endpoints_count(
        cluster: Cluster, tmp_path: Any) -> None:
    why = _name_unavailable()
    if why:
        pytest.skip(why)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.2 shmhb-b.test\n")
    resolv = tmp_path / "resolv.conf"  # nothing past loopback, should a lookup get this far
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    b = cluster.host()  # 127.0.0.2, on its own address
    ep = b.endpoint(1)
    w = b.worker("dec-0", ep)
    a = cluster.host(start=False)
    a.peers = ("shmhb-b.test",)
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf '
           '&& shift 2 && exec "$@"', "sh", str(hosts), str(resolv), *a.pinger_cmd()]
    a.wait_pinger(cluster.spawn(cmd, f"{a.name}-pinger-named"))
    wait_until(lambda: (r := a.remote(ep)) is not None and r.status is Status.ALIVE,
               timeout_s=20, what="b's worker alive on a, b followed by its name")
    a.board.watch(ep)  # and a connector follows it by its address too
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, timeout_s=20,
               what="b alive under its address")
    _hold_alive(a, ["shmhb-b.test", b.ip], [ep], 2.5 * FAST.peer_dead_after_s)
    assert a.stats()["bad_spoofed"] == 0
    _kill_reads_dead(a, w, [ep])
