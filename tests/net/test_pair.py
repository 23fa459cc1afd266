"""A pair of hosts that follow each other, against a real pinger process: a host's own
pings matched by its board identity whatever address they name (NAT, a name), a ping
that says our copy of its digest is behind answered by a ping at once, and a remote
worker's own beat age carried by pushes and full acks onto the board."""

from __future__ import annotations

import os
import signal
import time

from shmhb import Status
from shmhb.net.protocol import DigestEntry

from ..conftest import wait_until
from ..hosts import FAST, Cluster, Dealer, FakePeer, Host, entry, followed_fake
from ..stopping import resume


def _serve_a_while(fakes: list[FakePeer], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for f in fakes:
            got = f.poll_ping(0.005)
            if got is not None:
                f.ack(got)


def _followed_fake(cluster: Cluster, fake_peers: list[FakePeer]) -> tuple[Host, FakePeer, Dealer]:
    """``hosts.followed_fake``, and the fake's own pinging side."""
    a, fake = followed_fake(cluster, fake_peers)
    return a, fake, Dealer(fake, a.listen)


def test_a_hosts_own_pings_count_by_its_identity_whatever_address_they_name(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    """Behind a NAT, or followed by a name, a host's pings name an address we do not
    follow it by.  They count by the identity its acks established (and only with the
    echo: the address never mattered to the proof); the pair so halves its messages."""
    a, fake, d = _followed_fake(cluster, fake_peers)
    try:
        d.sync()
        ev0 = a.stats()["pings_evidence"]
        for _ in range(8):  # no echo, its internal address: counts for nothing
            d.ping(address="10.1.2.3:45645")
            fake.drain(0.05)
        d.sync()
        assert a.stats()["pings_evidence"] == ev0
        for _ in range(8):
            d.ping(echo=fake.challenge(), address="10.1.2.3:45645")
            fake.drain(0.05)
        d.sync()
        assert a.stats()["pings_evidence"] >= ev0 + 6
        # and they keep it ALIVE while it answers none of a's pings
        end = time.monotonic() + 2 * FAST.peer_dead_after_s
        while time.monotonic() < end:
            d.ping(echo=fake.challenge(), address="10.1.2.3:45645")
            fake.drain(0.1)
            assert a.peer_status(fake.ip) is Status.ALIVE
    finally:
        d.close()


def test_a_ping_saying_our_copy_of_its_digest_is_behind_makes_us_ask_at_once(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a, fake, d = _followed_fake(cluster, fake_peers)
    try:
        d.sync()
        held = fake.gen  # what a holds: its last full ack's
        c0 = a.stats()["pings_confirm"]
        for _ in range(5):  # its gen as a holds it: nothing to ask
            d.ping(echo=fake.challenge(), my_gen=held)
            fake.drain(0.06)
        d.sync()
        assert a.stats()["pings_confirm"] == c0
        d.ping(echo=fake.challenge(), my_gen=fake.gen + 1)
        wait_until(lambda: a.stats()["pings_confirm"] > c0 or fake.drain(0.01) < 0,
                   timeout_s=5, what="a confirming ping")
    finally:
        d.close()


def _beat_age(a: Host, ep: str) -> float | None:
    s = a.remote(ep)
    return None if s is None else s.beat_age_s


def test_a_remote_workers_own_beat_age_comes_from_full_acks_and_pushes(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a = cluster.host()
    fake = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(fake)
    ep, ep2 = f"{fake.ip}:30001", f"{fake.ip}:30002"
    fake.set(DigestEntry("hung", 3, Status.SUSPECT.code, 11, 2500, (ep,)),
             entry("fine", 4, Status.ALIVE, ep2))
    fake.body_age_ms = 1500  # its body was encoded 1.5 s before this ack
    a.board.watch(ep)
    a.board.watch(ep2)
    fake.serve_until(lambda: _beat_age(a, ep) is not None, what="hung's beat age on a")
    got = _beat_age(a, ep)
    assert got is not None and 3.9 <= got <= 4.0 + 1.0, got  # 1.5 s + 2.5 s, and the trip
    later = time.monotonic() + 0.5
    while time.monotonic() < later:
        fake.drain(0.05)
    got2 = _beat_age(a, ep)
    assert got2 is not None and got2 >= got + 0.4, (got, got2)  # it grows: it is not beating
    assert _beat_age(a, ep2) is None  # ALIVE: it beat since, by an amount no report tells
    # a full ack whose body age saturated says nothing of its body's age
    fake.body_age_ms = 2**32 - 1
    fake.set(DigestEntry("hung", 5, Status.SUSPECT.code, 12, 2500, (ep,)))
    fake.serve_until(lambda: (s := a.remote(ep)) is not None and s.incarnation == 5,
                     what="the new digest on a")
    _serve_a_while([fake], 0.5)
    assert _beat_age(a, ep) is None
    # a push's ages are taken when it is built: a death pushed with its age
    fake.send(fake.push_frame(2**62, DigestEntry("hung", 5, Status.DEAD.code, 12, 700, (ep,))))
    wait_until(lambda: (s := a.remote(ep)) is not None and s.status is Status.DEAD,
               what="the pushed death on a")
    got = _beat_age(a, ep)
    assert got is not None and 0.65 <= got <= 0.7 + 1.0, got


def test_a_stopped_remote_worker_shows_its_own_age_on_the_other_host(cluster: Cluster) -> None:
    """The operator's case: a rank on host b hangs; host a's board (and the monitor)
    shows how long since that rank itself beat, not how long since b last reported."""
    a, b = cluster.host(), cluster.host()
    w = b.worker("b-rank-0", b.endpoint(1))
    a.watch(b)
    b.watch(a)
    wait_until(lambda: a.remote_status(b.endpoint(1)) is Status.ALIVE, what="b's rank on a")
    os.kill(w.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_until(lambda: a.remote_status(b.endpoint(1)) is Status.DEAD, timeout_s=15,
                   what="b's stopped rank DEAD on a")
        s = a.remote(b.endpoint(1))
        since = time.monotonic() - t0
        assert s is not None and s.beat_age_s is not None, s
        # its own age: from its last beat (at most one beat interval before the stop)
        assert since - 0.5 <= s.beat_age_s <= since + 0.3, (s.beat_age_s, since)
        assert s.age_s < s.beat_age_s  # not its host's report: b keeps answering
    finally:
        resume(w.pid)
