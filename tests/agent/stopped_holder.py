"""Host B's pinger daemon stopped as a whole (SIGSTOP, a frozen container) while B's
workers, with embedded standbys, go on, seen from host A, which follows B and its
workers: what A reads through the stop.  Used by tests/agent/test_stopped_daemon.py
and ``python -m bench.stopped_holder``."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

import shmhb
from shmhb import Status

from ..conftest import wait_until
from ..hosts import Cluster, Host
from ..stopping import stopped

#: local verdicts quick, remote ones and the agent's staleness at their defaults: the
#: stall bound (3 x agent_stale_s = 3 s) and the embedded standbys' grace (1 s) are what
#: they are in production, and so is the peer dead-after (5 s) they race against
POLICY = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5)
WORKERS = 3


@dataclass
class Timeline:
    """Host A's view of host B and B's workers, sampled while B's daemon is stopped:
    seconds from the stop."""

    first_not_alive_s: float | None = None
    first_dead_s: float | None = None
    alive_again_s: float | None = None
    seen: list[tuple[float, str]] = field(default_factory=list)  # (s, view) on change

    def __str__(self) -> str:
        return " ".join(f"{t:.2f}s:{v}" for t, v in self.seen)


def view(a: Host, b: Host) -> tuple[Status | None, ...]:
    return (a.peer_status(b), *(a.remote_status(b.endpoint(n)) for n in range(1, WORKERS + 1)))


def start_b(cluster: Cluster) -> tuple[Host, Host, subprocess.Popen[bytes]]:
    """Hosts A and B; B's pinger daemon holds the role, B runs WORKERS workers with
    embedded standbys, A follows each of them and reads them alive."""
    a, b = cluster.host(policy=POLICY), cluster.host(policy=POLICY)
    daemon = b.pinger
    assert daemon is not None
    for n in range(1, WORKERS + 1):
        cluster.procs.worker(b.name, f"w{n}", interval_s=0.05, agent=True,
                             endpoints=b.endpoint(n))
        a.watch(b, n)
    wait_until(lambda: all(s is Status.ALIVE for s in view(a, b)), timeout_s=30,
               what="A reads B and its workers alive")
    assert b.board.agent().pid == daemon.pid
    return a, b, daemon


def watch_through_stop(a: Host, b: Host, daemon: subprocess.Popen[bytes], stop_s: float,
                       *, until_alive_again: bool = False) -> Timeline:
    """Stop B's daemon for ``stop_s`` (or, with ``until_alive_again``, until A reads B and
    its workers alive again, at most ``stop_s``), sampling A's view every 5 ms."""
    tl = Timeline()
    last: tuple[Status | None, ...] | None = None
    with stopped(daemon.pid):
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < stop_s:
            v = view(a, b)
            if v != last:
                tl.seen.append((now, ",".join("-" if s is None else s.value for s in v)))
                last = v
            alive = all(s is Status.ALIVE for s in v)
            if not alive and tl.first_not_alive_s is None:
                tl.first_not_alive_s = now
            if Status.DEAD in v and tl.first_dead_s is None:
                tl.first_dead_s = now
            if alive and tl.first_not_alive_s is not None and tl.alive_again_s is None:
                tl.alive_again_s = now
                if until_alive_again:
                    break
            time.sleep(0.005)
        assert daemon.poll() is None
        assert b.board.agent().pid != daemon.pid, "a worker should hold B's role by now"
    return tl
