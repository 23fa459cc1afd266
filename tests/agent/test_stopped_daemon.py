"""A stopped daemon holder, seen from another host: host B runs ``shmhb pinger`` and
workers whose embedded standbys replace it when it is stopped as a whole (SIGSTOP, a
frozen container).  The worker that takes the role listens beside the stopped daemon
(shmhb.net.listener), so host A, which follows B, hears B and its live workers again
while the daemon is still stopped, instead of reading them DEAD until it resumes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import shmhb
from shmhb import Status

from ..hosts import Cluster, Host, cluster_fixture
from ..stopping import stopped
from ..conftest import wait_until

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

#: local verdicts quick, remote ones and the agent's staleness at their defaults: the
#: stall bound (3 x agent_stale_s = 3 s) and the embedded standbys' grace (1 s) are what
#: they are in production, and so is the peer dead-after (5 s) they race against
POLICY = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5)
WORKERS = 3


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[Cluster]:
    yield from cluster_fixture(tmp_path)


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


def test_a_host_whose_daemon_is_stopped_is_heard_again_through_the_new_holder(
        cluster: Cluster) -> None:
    a, b, daemon = start_b(cluster)
    # takeover after the stall bound and the embedded grace (4 s), then a reconnect
    # of A's (at most a handshake timeout, 1 s); the rest is room for a loaded machine
    tl = watch_through_stop(a, b, daemon, 20.0, until_alive_again=True)
    assert tl.alive_again_s is not None, f"A never heard B again while its daemon was stopped: {tl}"
    print(f"A's view of B across the stop: {tl}")
    # and once the daemon resumes it stands down; A goes on reading B alive
    wait_until(lambda: "standing down" in cluster.log_tail(daemon, 200), timeout_s=20,
               what="the resumed daemon stands down")
    wait_until(lambda: all(s is Status.ALIVE for s in view(a, b)), timeout_s=20,
               what="A reads B alive after the daemon resumed")
