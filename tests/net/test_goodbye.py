"""A graceful stop says goodbye: a host whose pinger stops with no live worker reads
LEFT on the hosts that follow it, not SUSPECT and then DEAD.

Two real ``shmhb pinger`` processes on loopback hosts (tests/hosts.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time


from shmhb import Status
from shmhb.cli.events import EventLog
from shmhb.net.exchange import GOODBYE_GEN, is_goodbye
from shmhb.testing.loopback import child_env
from shmhb.net.protocol import Identity, Push, decode, encode_push
from shmhb.cli.view import read_view

from ..conftest import wait_until
from ..hosts import Cluster, Host


def _watch_statuses(h: Host, other: Host, until: float) -> set[Status | None]:
    seen: set[Status | None] = set()
    while time.monotonic() < until:
        seen.add(h.peer_status(other))
        time.sleep(0.01)
    return seen


def test_a_graceful_stop_reads_left_and_a_restart_alive_again(cluster: Cluster) -> None:
    b = cluster.host()
    a = cluster.host(peers=(b.ip,))
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, what="b alive on a")
    log = EventLog(keep=10)
    log.update(read_view(a.board))
    assert b.pinger is not None
    b.pinger.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert b.pinger.wait(10) == 0
    wait_until(lambda: a.peer_status(b) is Status.LEFT, timeout_s=5, what="b left on a")
    took = time.monotonic() - t0
    assert took < a.board.policy.peer_suspect_after_s, took  # told, not guessed by silence
    kinds = [e.kind.value for e in log.update(read_view(a.board))]
    assert "host_left" in kinds, kinds
    # silence after the goodbye convicts nothing: well past peer dead-after it stays LEFT
    seen = _watch_statuses(a, b, time.monotonic() + a.board.policy.peer_dead_after_s + 1.0)
    assert seen == {Status.LEFT}, seen
    rc = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", a.name],
                        capture_output=True, text=True, timeout=60, env=child_env()).returncode
    assert rc == 0  # a host that left is no problem
    b.start_pinger()
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, timeout_s=10, what="b back on a")


def test_no_goodbye_while_a_local_worker_lives(cluster: Cluster) -> None:
    b = cluster.host()
    a = cluster.host(peers=(b.ip,))
    w = cluster.procs.worker(b.name, "dec-0", agent=True, endpoints=b.endpoint(1))
    a.watch(b)
    wait_until(lambda: a.remote_status(b.endpoint(1)) is Status.ALIVE, what="dec-0 alive on a")
    assert b.pinger is not None
    b.pinger.send_signal(signal.SIGTERM)
    assert b.pinger.wait(10) == 0
    # the worker takes the role over (embedded) and answers: never LEFT, never DEAD
    wait_until(lambda: b.board.agent().pid == w.pid and b.board.agent().status is Status.ALIVE,
               timeout_s=10, what="the worker holds b's agent role")
    seen = _watch_statuses(a, b, time.monotonic() + 2.0)
    assert Status.LEFT not in seen and Status.DEAD not in seen, seen
    assert a.remote_status(b.endpoint(1)) is Status.ALIVE


def test_a_goodbye_is_a_push_an_older_receiver_applies_as_nothing() -> None:
    ident = Identity(bytes(range(16)), 7)
    frame = encode_push(Push(ident, "10.0.0.2:45645", 5, GOODBYE_GEN, ()), b"s" * 32)
    p = decode(frame, b"s" * 32)
    assert isinstance(p, Push) and is_goodbye(p) and p.entries == ()
    # a push with entries, or of a real generation, is none
    assert not is_goodbye(Push(ident, "10.0.0.2:45645", 6, 1, ()))
