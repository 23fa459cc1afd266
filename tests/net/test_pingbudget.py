"""The ping budget end to end: the stored setting, and inbound pings as
evidence in a mutual pair, with real pingers, real sockets and a hand-driven fake peer.
The pure parts (plan, verdict bounds) are in test_pingplan.py."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import zmq

import shmhb
from shmhb import Status
from shmhb.board.config import PingerConfig
from shmhb.errors import InvalidConfig
from shmhb.board.layout import checksum
from shmhb.net.pinger import load_config, store_config
from shmhb.net.plan import DEFAULT_BUDGET_PPS
from shmhb.net.protocol import Identity

from ..conftest import wait_until
from ..hosts import (
    FAST, Cluster, Dealer, FakePeer, entry, followed_fake, mutual_roles, write_secret,
)
from ..stopping import stopped

SECRET = b"cluster-secret-0123456789abcdef!"


# -- the stored setting --------------------------------------------------------------------

def test_budget_is_stored_with_the_pinger_settings(board: shmhb.Board) -> None:
    store_config(board, PingerConfig(listen="127.0.0.2:45645", ping_budget_pps=37.5))
    got = load_config(board)
    assert got is not None and got[1].ping_budget_pps == 37.5


def test_a_bad_stored_budget_is_refused_with_a_clear_error(board: shmhb.Board) -> None:
    store_config(board, PingerConfig(listen="127.0.0.2:45645"))
    h = board._head
    h["cfg_checksum"] = 0
    h["cfg_budget_mpps"] = np.uint64(2**63)  # a corrupt word: far above the maximum
    h["cfg_checksum"] = checksum(int(h["cfg_gen"]), bytes(h["cfg_listen"]), bytes(h["cfg_secret_path"]),
                                 bytes(h["cfg_curve_dir"]), int(h["cfg_interval_ns"]),
                                 int(h["cfg_budget_mpps"]))
    with pytest.raises(InvalidConfig, match="ping_budget_pps"):
        load_config(board)


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), 1e12])
def test_pinger_config_refuses_a_bad_budget(bad: float) -> None:
    with pytest.raises(InvalidConfig, match="ping_budget_pps"):
        PingerConfig(ping_budget_pps=bad)


# -- inbound pings as evidence ---------------------------------------------------------------

def rate(h: Any, stat: str, seconds: float) -> float:
    s0 = h.stats()[stat]
    time.sleep(seconds)
    return (h.stats()[stat] - s0) / seconds


def test_with_a_secret_one_side_of_a_mutual_pair_pings_and_a_death_is_still_seen(
        cluster: Cluster, tmp_path: object) -> None:
    secret = write_secret(os.path.join(str(tmp_path), "secret"), SECRET)
    a, b = mutual_roles(cluster.host(secret_file=secret), cluster.host(secret_file=secret))
    a.watch(b)  # a: the active side, b: passive, it relies on a's pings
    b.watch(a)
    wait_until(lambda: a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE,
               what="both ALIVE")
    wait_until(lambda: b.stats()["pings_evidence"] >= 5, what="a's pings counted as evidence on b")
    sent_a, sent_b = rate(a, "pings_sent", 3.0), rate(b, "pings_sent", 3.0)
    # a: every interval (0.2 s); b: one refresh per peer dead-after window (1.5 s)
    assert sent_a >= 2.5, sent_a
    assert sent_b <= 1.5, sent_b
    assert a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE
    # evidence counts on both sides; only the passive side skips turns for it
    assert 0 < a.stats()["pings_evidence"] <= b.stats()["pings_sent"]
    # a's host dies: b's own turns come back and convict it in time
    t0 = time.monotonic()
    a.kill_pinger()
    wait_until(lambda: b.peer_status(a) is Status.DEAD, timeout_s=10, poll_s=0.005, what="a DEAD on b")
    took = time.monotonic() - t0
    assert took <= FAST.peer_dead_after_s + 3 * a.interval_s + 1.5, took


def test_without_a_secret_pings_that_echo_our_challenge_are_evidence(cluster: Cluster) -> None:
    """No secret: a ping counts only if it echoes a challenge we sent in our own pings
    to that host (shmhb.net.evidence); the source address plays no part (all these
    pingers connect from 127.0.0.1).  The pair halves its messages as it does with a
    secret, and a death is still seen."""
    a, b = mutual_roles(cluster.host(), cluster.host())  # a active, b passive
    a.watch(b)
    b.watch(a)
    wait_until(lambda: a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE,
               what="both ALIVE")
    wait_until(lambda: b.stats()["pings_evidence"] >= 5, what="a's pings counted as evidence on b")
    sent_a, sent_b = rate(a, "pings_sent", 3.0), rate(b, "pings_sent", 3.0)
    assert sent_a >= 2.5, sent_a
    assert sent_b <= 1.5, sent_b
    assert a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE
    t0 = time.monotonic()
    a.kill_pinger()
    wait_until(lambda: b.peer_status(a) is Status.DEAD, timeout_s=10, poll_s=0.005, what="a DEAD on b")
    took = time.monotonic() - t0
    assert took <= FAST.peer_dead_after_s + 3 * a.interval_s + 1.5, took


def test_the_passive_side_of_a_mutual_pair_hears_of_a_hung_worker_within_intervals(
        cluster: Cluster) -> None:
    """A passive side hears the other host's acks only once per peer dead-after; a
    worker there going SUSPECT (not pushed as a verdict) still reaches it at once: the
    change is pushed, and the push makes its next turn a ping."""
    slow = shmhb.Policy(suspect_after_s=0.5, dead_after_s=30.0, peer_suspect_after_s=1.0,
                        peer_dead_after_s=20.0)  # a refresh only every 20 s
    a, b = mutual_roles(cluster.host(policy=slow), cluster.host(policy=slow))  # a active
    w = a.worker("a-rank-1", a.endpoint(1))
    a.watch(b)
    b.watch(a)
    wait_until(lambda: a.peer_status(b) is Status.ALIVE and b.peer_status(a) is Status.ALIVE,
               what="both ALIVE")
    wait_until(lambda: (r := b.remote(a.endpoint(1))) is not None and r.status is Status.ALIVE,
               what="a's worker ALIVE on b")
    wait_until(lambda: b.stats()["pings_evidence"] >= 5, what="b passive")
    sent0 = b.stats()["pings_sent"]
    with stopped(w.pid):
        t0 = time.monotonic()
        wait_until(lambda: (r := b.remote(a.endpoint(1))) is not None and r.status is Status.SUSPECT,
                   timeout_s=8, poll_s=0.01, what="a's stopped worker SUSPECT on b")
        took = time.monotonic() - t0
        assert b.stats()["pings_sent"] - sent0 <= 3  # b stayed passive: one asked-for ping
    assert took < 8, took
    wait_until(lambda: (r := b.remote(a.endpoint(1))) is not None and r.status is Status.ALIVE,
               timeout_s=8, poll_s=0.01, what="a's resumed worker ALIVE again on b")


def test_forged_and_replayed_inbound_pings_never_keep_a_dead_host_alive(
        cluster: Cluster, tmp_path: object, fake_peers: list[FakePeer]) -> None:
    a = cluster.host(secret_file=write_secret(os.path.join(str(tmp_path), "s"), SECRET))
    fake = FakePeer(cluster.spare_ip(), cluster.port, secret=SECRET)
    fake_peers.append(fake)
    fake.set(entry("dec-0", 7, Status.ALIVE, f"{fake.ip}:30001"))
    a.board.watch(f"{fake.ip}:30001")
    fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE, what="fake ALIVE on a")
    d = Dealer(fake, a.listen)
    try:
        d.sync()
        # control: a genuine ping of the followed host counts, and keeps it ALIVE without acks
        ev0 = a.stats()["pings_evidence"]
        end = time.monotonic() + 3 * FAST.peer_dead_after_s
        while time.monotonic() < end:
            d.ping()
            fake.drain(0.1)  # its pings to us go unanswered
            assert a.peer_status(fake.ip) is Status.ALIVE
        assert a.stats()["pings_evidence"] > ev0 + 10
        # from now on only forgeries and replays: the host must die all the same
        d.sync()
        ev_last = a.stats()["pings_evidence"]
        replayed = d.ping()
        wait_until(lambda: a.stats()["pings_evidence"] > ev_last, timeout_s=5,
                   what="the last good ping counted")
        ev1 = a.stats()["pings_evidence"]
        bad_auth0, replay0 = a.stats()["bad_auth"], a.stats()["bad_replay"]
        t0 = time.monotonic()
        seen: list[Status | None] = []
        wrong_secret = b"another-secret-0123456789abcdef!"
        while a.peer_status(fake.ip) is not Status.DEAD:
            assert time.monotonic() - t0 < 10, f"not DEAD: {seen[-5:]}"
            d.s.send(replayed)  # the very frame that counted: the nonce is spent
            d.ping(nonce=d.nonce - 1000)  # an old nonce, freshly signed
            d.ping(gen=d.known[0] + 1)  # does not name our current digest
            d.ping(gen=0, known=None)  # names no digest at all
            d.ping(identity=Identity(os.urandom(16), 1))  # another board claiming its address
            d.ping(secret=wrong_secret)  # forged without the secret
            d.ping(secret=None)  # unauthenticated
            fake.drain(0.05)
            seen.append(a.peer_status(fake.ip))
        assert Status.ALIVE not in seen[seen.index(Status.SUSPECT):], seen
        assert a.stats()["pings_evidence"] == ev1
        assert a.stats()["bad_auth"] > bad_auth0 and a.stats()["bad_replay"] > replay0
        took = time.monotonic() - t0
        assert took >= FAST.peer_dead_after_s - 0.3, took
    finally:
        d.close()


def test_inbound_evidence_from_a_previous_process_of_ours_does_not_count(
        cluster: Cluster, tmp_path: object, fake_peers: list[FakePeer]) -> None:
    """A ping recorded before our pinger restarted names the old process's digest
    generation (random at start): replayed, in order and with fresh nonces even, to the
    new process, it never counts."""
    a = cluster.host(secret_file=write_secret(os.path.join(str(tmp_path), "s"), SECRET))
    fake = FakePeer(cluster.spare_ip(), cluster.port, secret=SECRET)
    fake_peers.append(fake)
    a.board.watch(f"{fake.ip}:30001")
    fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE, what="fake ALIVE on a")
    d = Dealer(fake, a.listen)
    try:
        d.sync()
        recorded = [d.ping() for _ in range(30)]  # what an eavesdropper kept
        time.sleep(0.2)
        assert a.pinger is not None
        a.pinger.send_signal(signal.SIGKILL)
        a.pinger.wait()
        a.start_pinger()
        deadline = time.monotonic() + 10
        while True:  # pings the old process sent before it died get no route back: skip them
            try:
                fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE, what="fake ALIVE again")
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
        ev0 = a.stats()["pings_evidence"]
        d.close()
        d = Dealer(fake, a.listen)  # a new connection, as after the restart
        seen = []
        t0 = time.monotonic()
        for frame in recorded:  # a's new process never saw these nonces
            d.s.send(frame)
            fake.drain(0.1)
            seen.append(a.peer_status(fake.ip))
        wait_until(lambda: a.peer_status(fake.ip) is Status.DEAD or fake.drain(0.05) < 0,
                   timeout_s=10, what="fake DEAD on a")
        assert a.stats()["pings_evidence"] == ev0, "a recorded ping counted after our restart"
        assert time.monotonic() - t0 >= FAST.peer_dead_after_s - 0.3
    finally:
        d.close()


@pytest.mark.system
def test_the_command_line_refuses_a_bad_budget_and_stores_a_good_one(board: shmhb.Board) -> None:
    import subprocess
    import sys

    from shmhb.cli.main import build_parser
    from shmhb.cli.boardopts import store_pinger_args

    from ..conftest import ROOT

    argv = ["pinger", "--board", board.name, "--listen", "127.0.0.2:45645"]
    bad = subprocess.run([sys.executable, "-m", "shmhb", *argv, "--ping-budget-pps", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "ping_budget_pps" in bad.stderr, bad
    assert load_config(board) is None  # nothing was stored
    store_pinger_args(build_parser().parse_args([*argv, "--ping-budget-pps", "12.5"]))
    got = load_config(board)
    assert got is not None and got[1].ping_budget_pps == 12.5


def test_without_a_secret_only_a_ping_echoing_our_challenge_keeps_a_silent_host_alive(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    """No secret: a ping names the followed host, its board identity and our current
    digest, as an outsider who pinged both of us can; even over a connection from the
    host's own address (another process there, a container behind its NAT) it never
    counts unless it echoes a challenge from our own pings to that host, which only
    whoever receives them knows.  The control: the same pings with
    the echo count, while the host answers none of ours."""
    a, fake = followed_fake(cluster, fake_peers)
    own = Dealer(fake, a.listen, source=fake.ip)
    outsiders = [Dealer(fake, a.listen), Dealer(fake, a.listen, source=fake.ip)]
    try:
        own.sync()
        ev0 = a.stats()["pings_evidence"]
        end = time.monotonic() + 3 * FAST.peer_dead_after_s
        while time.monotonic() < end:
            own.ping(echo=fake.challenge())
            fake.drain(0.1)  # its pings to us go unanswered
            assert a.peer_status(fake.ip) is Status.ALIVE
        assert a.stats()["pings_evidence"] > ev0 + 10
        for d in outsiders:
            d.sync()
        ev1 = a.stats()["pings_evidence"]
        t0 = time.monotonic()
        seen: list[Status | None] = []
        while a.peer_status(fake.ip) is not Status.DEAD:
            assert time.monotonic() - t0 < 10, f"not DEAD: {seen[-5:]}"
            for d in outsiders:
                d.known = own.known  # the current digest, as the host itself holds it
                d.ping()  # no echo: a v1 ping, from its address or not
                d.ping(echo=int.from_bytes(os.urandom(8), "little") | 1)  # a guessed one
            fake.drain(0.05)
            seen.append(a.peer_status(fake.ip))
        assert a.stats()["pings_evidence"] == ev1
        assert Status.ALIVE not in seen[seen.index(Status.SUSPECT):], seen
        assert time.monotonic() - t0 >= FAST.peer_dead_after_s - 0.3
    finally:
        for d in (own, *outsiders):
            d.close()


def test_without_a_secret_a_peer_that_echoes_no_challenge_is_pinged_in_full(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    """Without a secret, a peer's own pings that echo none of our challenges never
    count: we keep pinging it every interval, as if it did not ping us at all."""
    a = cluster.host()
    fake = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(fake)
    a.board.watch(f"{fake.ip}:30001")
    fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE, what="fake ALIVE on a")
    fake.serve_until(lambda: len(fake.pings) >= 10, what="ten pings")
    assert all(p.challenge for p in fake.pings)  # it was challenged: echoing would count
    d = Dealer(fake, a.listen, source=fake.ip)
    try:
        d.sync()
        ev0 = a.stats()["pings_evidence"]
        for _ in range(5):
            d.ping()
        d.sync()  # its ack comes after every earlier ping was handled
        assert a.stats()["pings_evidence"] == ev0
    finally:
        d.close()
