"""Hostile inputs and faults from the network: a forger on a followed host's address, a
wall clock stepped back, a flood of stranger connections.

1. A process that connects from a followed host's own address (another process on that
   host, a container behind its NAT) pings us as that host: without a secret it must
   not keep the host, nor its killed worker, ALIVE.
2. The wall clock steps back, then the pinger restarts or a standby takes over: peers
   must not drop its pings (with a secret) nor its pushes as replays.
3. A flood of stranger connections fills the watcher table before a followed host
   connects: that host must still get our pushes.

Real pingers on loopback addresses, real sockets, real shared memory.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import zmq

import shmhb
from shmhb import Status
from shmhb.net.protocol import Ack, Identity, Ping, decode, encode_ping
from shmhb.net.exchange import COUNTER_WORD, RESERVE, SendCounter

from ..conftest import wait_until
from ..hosts import FAST, Cluster, write_secret
from ..stopping import resume

SECRET = b"cluster-secret-0123456789abcdef!"


def _dealer(ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{address}")  # from 127.0.0.1, the kernel's choice on loopback
    return s


def _ask(s: zmq.Socket[Any], frame: bytes, timeout_ms: int = 5000) -> Ack | None:
    """Send ``frame``; the next ack that comes back (pushes to a watcher are skipped)."""
    s.send(frame)
    end = time.monotonic() + timeout_ms / 1000
    while s.poll(max(0, int((end - time.monotonic()) * 1000))):
        msg = decode(s.recv())
        if isinstance(msg, Ack):
            return msg
    return None


# -- a forger on the followed host's own address --------------------------------------------

def test_a_forger_on_the_hosts_own_address_does_not_keep_it_alive(cluster: Cluster) -> None:
    """b listens on 127.0.0.1, so on loopback every connection, the forger's too, comes
    from b's address, as a container behind b's NAT connects from b's.  The forger
    learns b's identity from b's ack and a's digest generation from a's acks, and pings
    a as b every 0.2 s; b's pinger is stopped and its worker killed.  a must read b DEAD
    (and the worker not ALIVE) about when it would without the forger."""
    b = cluster.host(ip="127.0.0.1")
    a = cluster.host()  # 127.0.0.2: if passive (mutual_roles), it relies on b's own pings
    w = b.worker("b-rank-0", b.endpoint(1))
    a.watch(b)
    b.watch(a)
    wait_until(lambda: a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE,
               what="both ALIVE")
    wait_until(lambda: a.remote_status(b.endpoint(1)) is Status.ALIVE, what="b's worker on a")
    # b's pings count on a (every turn if b is the active side, once per refresh if not)
    wait_until(lambda: a.stats()["pings_evidence"] >= 2, timeout_s=20, what="b's pings counted on a")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        to_b = _dealer(ctx, b.listen)
        spy = _ask(to_b, encode_ping(Ping(Identity(os.urandom(16), 1), "127.0.0.9:1", 1)))
        assert spy is not None
        b_id = spy.identity
        to_a = _dealer(ctx, a.listen)
        got = _ask(to_a, encode_ping(Ping(b_id, b.listen, 1)))
        assert got is not None
        a_id, a_gen = got.identity, got.gen
        assert b.pinger is not None
        os.kill(b.pinger.pid, signal.SIGSTOP)  # b's pinger stops answering, holding its port
        w.kill()
        w.wait(10)
        nonce = time.time_ns()
        ev0 = a.stats()["pings_evidence"]
        t0 = time.monotonic()
        seen: list[Status | None] = []
        while a.peer_status(b) is not Status.DEAD:
            assert time.monotonic() - t0 < 4 * FAST.peer_dead_after_s + 2, \
                f"b kept alive by the forger: {seen[-5:]}"
            nonce += 1
            ack = _ask(to_a, encode_ping(Ping(b_id, b.listen, nonce, a_gen, a_id)), 500)
            if ack is not None:
                a_gen = ack.gen  # a's current generation, as b's pinger would hold it
            seen.append(a.peer_status(b))
            time.sleep(0.2)
        assert a.stats()["pings_evidence"] == ev0
        assert a.remote_status(b.endpoint(1)) is not Status.ALIVE
    finally:
        assert b.pinger is not None
        resume(b.pinger.pid)
        ctx.destroy(0)


# -- the wall clock stepped back, then a takeover -------------------------------------------

def test_the_send_counter_only_grows_across_holders_whatever_the_wall_clock() -> None:
    words = memoryview(bytearray(4096)).cast("Q")
    first = SendCounter(words, COUNTER_WORD, wall_ns=10**18)
    used = [first.next() for _ in range(5)]
    assert used == sorted(set(used)) and used[0] == 10**18
    assert int(words[COUNTER_WORD]) >= used[-1]  # reserved before it was used
    stepped_back = SendCounter(words, COUNTER_WORD, wall_ns=10**18 - 3600 * 10**9)
    assert stepped_back.next() > used[-1]
    ahead = SendCounter(words, COUNTER_WORD, wall_ns=2 * 10**18)  # the clock went forward
    assert ahead.next() == 2 * 10**18
    c = SendCounter(words, COUNTER_WORD, wall_ns=0)
    stored0 = int(words[COUNTER_WORD])
    vals = [c.next() for _ in range(3)]
    assert int(words[COUNTER_WORD]) >= vals[-1] > stored0  # one store per RESERVE values
    assert int(words[COUNTER_WORD]) - vals[0] == RESERVE


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "no-secret"])
def test_a_standby_that_takes_over_with_the_clock_stepped_back_is_heard(
        cluster: Cluster, tmp_path: Any, secret: bool) -> None:
    """a's standby runs with CLOCK_REALTIME an hour behind, then takes the role over.
    Its pings (checked for replay with a secret) and its pushes (always) must pass at
    b: b reads a ALIVE, a reads b ALIVE, and a kill on a reaches b as a push."""
    sf = write_secret(os.path.join(str(tmp_path), "s"), SECRET) if secret else None
    a = cluster.host(secret_file=sf)
    b = cluster.host(secret_file=sf)
    w = a.worker("a-rank-0", a.endpoint(1))
    first = a.worker("a-rank-1", a.endpoint(2))
    a.watch(b)
    b.watch(a)
    wait_until(lambda: a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE,
               what="both ALIVE")
    wait_until(lambda: b.remote_status(a.endpoint(2)) is Status.ALIVE, what="a's workers on b")
    pushes0 = b.stats()["pushes_received"]
    first.kill()  # a push from the first holder: b's guard holds its seq from now on
    first.wait(10)
    wait_until(lambda: b.stats()["pushes_received"] > pushes0, what="the first kill pushed")
    old = a.pinger
    assert old is not None
    standby = a.start_pinger(configure=False, wait=False, wall_offset_s=-3600.0)
    wait_until(lambda: "waiting for the agent role" in cluster.log_tail(standby),
               what="the standby waiting for the role")
    assert a.board.agent().pid == old.pid
    old.kill()
    old.wait(10)
    a.wait_pinger(standby)
    replay0 = b.stats()["bad_replay"]
    acks0 = a.stats()["acks_received"]
    wait_until(lambda: a.stats()["acks_received"] > acks0 + 3, timeout_s=10,
               what="b answering the standby's pings")
    assert a.peer_status(b) is Status.ALIVE
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, what="a ALIVE on b")
    answered0 = a.stats()["pings_answered"]  # b pinged the new holder: b watches it
    wait_until(lambda: a.stats()["pings_answered"] > answered0 + 1, what="b watching the standby")
    pushes0 = b.stats()["pushes_received"]
    w.kill()
    w.wait(10)
    wait_until(lambda: b.remote_status(a.endpoint(1)) is Status.DEAD, what="a's kill on b")
    wait_until(lambda: b.stats()["pushes_received"] > pushes0, what="the kill pushed to b")
    assert b.stats()["bad_replay"] == replay0


# -- stranger connections fill the watcher table --------------------------------------------

def test_strangers_filling_the_watcher_table_do_not_displace_a_followed_host(
        cluster: Cluster) -> None:
    """a's board has 4 peer rows, so it keeps 16 watchers of each kind.  20 stranger
    connections ping a first (no secret: anyone can), then b, which a follows, starts
    and follows a: a kill on a must reach b as a push."""
    a = cluster.host(board_peers=4)
    w = a.worker("a-rank-0", a.endpoint(1))
    ctx: zmq.Context[Any] = zmq.Context()
    strangers = []
    try:
        for i in range(20):
            s = _dealer(ctx, a.listen)
            assert _ask(s, encode_ping(Ping(Identity(os.urandom(16), 1), f"127.0.0.9:{100 + i}",
                                            1))) is not None
            strangers.append(s)
        b = cluster.host()
        a.watch(b)
        b.watch(a)
        wait_until(lambda: a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE,
                   what="both ALIVE")
        wait_until(lambda: b.remote_status(a.endpoint(1)) is Status.ALIVE, what="a's worker on b")
        # b pings a (its first ping plain, the next ones echoing a's challenge): by its
        # third, b is a watcher that a verified as its own
        answered0 = a.stats()["pings_answered"]
        wait_until(lambda: a.stats()["pings_answered"] >= answered0 + 3, what="b pinging a")
        for n, s in enumerate(strangers):  # still there, still pinging
            assert _ask(s, encode_ping(Ping(Identity(os.urandom(16), 1), "127.0.0.9:1",
                                            2 + n))) is not None
        pushes0 = b.stats()["pushes_received"]
        w.kill()
        w.wait(10)
        wait_until(lambda: b.remote_status(a.endpoint(1)) is Status.DEAD, what="a's kill on b")
        wait_until(lambda: b.stats()["pushes_received"] > pushes0, timeout_s=5,
                   what="the kill pushed to b")
    finally:
        ctx.destroy(0)


def test_the_board_counts_its_peers_rows_as_asked(cluster: Cluster) -> None:
    """The bound the previous test relies on: 4 peer rows, so 16 watchers per kind."""
    h = cluster.host(board_peers=4, start=False)
    assert h.board.sizes.npeers == 4
    assert isinstance(h.board, shmhb.Board)
