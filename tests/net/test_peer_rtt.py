"""A host that comes back reads no round trip until one is measured: the pings it left
unanswered while it was stopped or restarting are no round trip (counted as one, they
would show ``host_back ... rtt 1469.82 ms`` on loopback right after a restart).

Two real ``shmhb pinger`` processes on loopback hosts (tests/hosts.py).
"""

from __future__ import annotations

import time


from shmhb import Status

from ..conftest import wait_until
from ..hosts import Cluster
from ..stopping import stopped


def test_no_inflated_rtt_when_a_stopped_host_comes_back(cluster: Cluster) -> None:
    b = cluster.host()
    a = cluster.host(peers=(b.ip,))
    wait_until(lambda: (p := a.peer(b)) is not None and p.status is Status.ALIVE
               and p.rtt_ms is not None, what="b alive on a, with an rtt")
    assert b.pinger is not None
    with stopped(b.pinger.pid):
        wait_until(lambda: a.peer_status(b) is Status.DEAD, timeout_s=10, what="b dead on a")
        stopped_s = a.board.policy.peer_dead_after_s
    seen: list[float | None] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        p = a.peer(b)
        if p is not None and p.status is Status.ALIVE:
            seen.append(p.rtt_ms)
            if p.rtt_ms is not None and len(seen) > 5:
                break
        time.sleep(0.001)
    assert seen, "b never came back"
    measured = [r for r in seen if r is not None]
    assert measured, seen  # a real round trip follows
    # b was stopped for over peer-dead-after: a ping it answered late would read that long
    assert max(measured) < stopped_s * 1000 / 3, (seen, stopped_s)
