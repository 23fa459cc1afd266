"""Hostile peers and a hostile host cannot switch death detection off.

Forged pings without a secret, spoofed endpoints and relayed acks, push floods,
connection floods at the fd limit a systemd unit gets, a stuck agent loop and an
unexpected ZMQ error: each with real processes, sockets and shared memory, and under
each a local SIGKILL must still be DEAD within 1 s.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import zmq

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.net.protocol import Ack, Identity, Ping, decode, encode_ping

from ..conftest import Procs, wait_until
from ..hosts import (
    FLOODER, KILL_BOUND_S, Cluster, FakePeer, entry, kill_is_dead_within_bound, open_fds, status,
    wait_held, wait_net, write_secret,
)
from ..children import child
from ..stopping import stopped

SECRET = b"cluster-secret-0123456789abcdef!"


def _dealer(ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{address}")
    return s


def _ask(s: zmq.Socket[Any], frame: bytes, secret: bytes | None = None) -> Ack | None:
    s.send(frame)
    if not s.poll(5000):
        return None
    msg = decode(s.recv(), secret)
    assert isinstance(msg, Ack)
    return msg


# -- forged pings without a secret are no lockout -------------------------------------------

def test_a_forged_ping_with_the_top_nonce_does_not_lock_a_host_out(cluster: Cluster) -> None:
    a = cluster.host()
    b = cluster.host()
    a.watch(b)
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, what="b alive on a")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        spy = _dealer(ctx, a.listen)  # learn a's identity from an ack
        ack = _ask(spy, encode_ping(Ping(Identity(os.urandom(16), 1), "127.0.0.9:1", 1)))
        assert ack is not None
        forger = _dealer(ctx, b.listen)  # then ping b as a, with the largest nonce
        assert _ask(forger, encode_ping(Ping(ack.identity, a.listen, 2**64 - 1))) is not None
        replays0, acks0 = b.stats()["bad_replay"], a.stats()["acks_received"]
        seen: set[Status | None] = set()
        end = time.monotonic() + 3 * 1.5  # three peer-dead periods
        while time.monotonic() < end:
            seen.add(a.peer_status(b))
            time.sleep(0.01)
        assert Status.DEAD not in seen, seen
        assert a.peer_status(b) is Status.ALIVE
        assert b.stats()["bad_replay"] == replays0
        assert a.stats()["acks_received"] > acks0 + 10
        spy.close(0)
        forger.close(0)
    finally:
        ctx.term()


def test_with_a_secret_a_replayed_ping_is_still_refused(cluster: Cluster, tmp_path: Any) -> None:
    sf = write_secret(os.path.join(str(tmp_path), "s"), SECRET)
    b = cluster.host(secret_file=sf)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        s = _dealer(ctx, b.listen)
        ping = encode_ping(Ping(Identity(os.urandom(16), 3), "127.0.0.9:1", 77), SECRET)
        assert _ask(s, ping, SECRET) is not None
        r0 = b.stats()["bad_replay"]
        s.send(ping)
        wait_until(lambda: b.stats()["bad_replay"] == r0 + 1, what="the replay counted")
        assert not s.poll(300)
        s.close(0)
    finally:
        ctx.term()


# -- spoofing across hosts ---------------------------------------------------------------

def test_a_host_cannot_vouch_for_anothers_endpoint_nor_relay_its_acks(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a = cluster.host()
    b = cluster.host()
    w = b.worker("dec-0", b.endpoint(1))
    a.watch(b)
    r = wait_until(lambda: (x := a.remote(b.endpoint(1))) is not None
                   and x.status is Status.ALIVE and x, what="b's worker alive on a")
    assert r.key == "dec-0"
    c = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(c)
    c.set(entry("mine", 5, Status.ALIVE, f"{c.ip}:30001"),
          entry("liar", 9, Status.ALIVE, b.endpoint(1), f"{c.ip}:30002"))
    a.board.watch(f"{c.ip}:30001")
    # relay: c answers a's ping with b's own ack to the same nonce
    ctx: zmq.Context[Any] = zmq.Context()
    relay = _dealer(ctx, b.listen)
    try:
        spoofed0 = a.stats()["bad_spoofed"]
        for _ in range(3):
            p = c.next_ping()
            relay.send(encode_ping(Ping(Identity(os.urandom(16), 4), "127.0.0.9:1", p.nonce)))
            assert relay.poll(5000)
            c.send(relay.recv())
        wait_until(lambda: a.stats()["bad_spoofed"] >= spoofed0 + 3, what="relayed acks refused")
        # never ALIVE on relayed acks: UNKNOWN, or SUSPECT once a busy machine has taken
        # longer than suspect_after over the three rounds (c never answered itself)
        assert a.peer_status(c.ip) in (Status.UNKNOWN, Status.SUSPECT)
        assert a.peer_status(b) is Status.ALIVE
    finally:
        relay.close(0)
        ctx.term()
    # c's own digest: its endpoint counts, the one naming b does not
    c.serve_until(lambda: a.remote(f"{c.ip}:30002") is not None, what="c's digest applied")
    assert a.remote(f"{c.ip}:30001").key == "mine"  # type: ignore[union-attr]
    assert a.remote(b.endpoint(1)).key == "dec-0"  # type: ignore[union-attr]
    w.kill()
    # c keeps answering every ping, its digest still listing b's endpoint ALIVE
    c.serve_until(lambda: (x := a.remote(b.endpoint(1))) is not None and x.status is Status.DEAD,
                  timeout_s=10, what="b's killed worker DEAD on a")
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        x = a.remote(b.endpoint(1))
        assert x is not None and x.key == "dec-0" and x.status is Status.DEAD, x
        got = c.poll_ping(0.01)
        if got is not None:
            c.ack(got)
    assert a.peer_status(c.ip) is Status.ALIVE
    assert a.stats()["bad_spoofed"] > spoofed0 + 3


# -- a push flood from one followed host -----------------------------------------------------

def test_a_push_flood_neither_delays_a_local_kill_nor_fills_the_remote_table(
        cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a = cluster.host()
    f = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(f)
    f.set(*(entry(f"real-{k}", 3, Status.ALIVE, f"{f.ip}:{30000 + k}") for k in range(4)))
    a.board.watch(f"{f.ip}:30000")
    f.serve_until(lambda: (p := a.peer(f.ip)) is not None and len(p.slots) == 4,
                  what="f's digest on a")
    victim = a.worker("victim", a.endpoint(1))
    wait_until(lambda: (s := a.board.slot("victim")) is not None and s.status is Status.ALIVE,
               what="victim alive")
    unlisted0 = a.stats()["push_unlisted"]
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        seq = time.time_ns()
        ctx_ok = True
        while not stop.is_set() and ctx_ok:
            seq += 1
            entries = [entry(f"flood-{seq}-{j}", 1, Status.DEAD, f"{f.ip}:{40000 + j}")
                       for j in range(64)]
            f.send(f.push_frame(seq, *entries))
            sent[0] += 1
    t = threading.Thread(target=flood, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        wait_until(lambda: sent[0] >= 300, timeout_s=30, what="300 pushes sent")
        took = kill_is_dead_within_bound(a, "during")
        victim.kill()
        wait_until(lambda: (s := a.board.slot("victim")) is not None and s.status is Status.DEAD,
                   timeout_s=KILL_BOUND_S, poll_s=0.001, what="victim DEAD within 1 s")
        wait_until(lambda: sent[0] >= 600, timeout_s=30, what="600 pushes sent")
    finally:
        stop.set()
        t.join(10)
    rate = sent[0] / (time.monotonic() - t0)
    print(f"{sent[0]} pushes of 64 new keys ({rate:.0f}/s); a kill during it DEAD after "
          f"{took * 1e3:.1f} ms; lateness {board_words(a.board).lateness_ms():.1f} ms")
    wait_until(lambda: a.stats()["push_unlisted"] > unlisted0 + 100, what="unlisted pushes counted")
    p = a.peer(f.ip)
    assert p is not None and len(p.slots) == 4, "a push created rows"
    assert a.pinger is not None and a.pinger.poll() is None
    f.serve_until(lambda: a.peer_status(f.ip) is Status.ALIVE, what="f still followed")


# -- a connection flood at RLIMIT_NOFILE 1024 -------------------------------------------------

def test_a_connection_flood_at_the_fd_limit_is_survived(cluster: Cluster, procs: Procs) -> None:
    b = cluster.host()
    a = cluster.host(start=False)
    b.watch(a)
    p = cluster.spawn(["prlimit", "--nofile=1024:1024", *a.pinger_cmd()], f"{a.name}-limited")
    a.wait_pinger(p)
    old = a.worker("old", a.endpoint(1))
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, what="a alive on b")
    flooder = cluster.spawn_text([sys.executable, FLOODER, a.ip, str(a.port), "1100"])
    assert flooder.stdout is not None and flooder.stdin is not None
    assert flooder.stdout.readline().startswith("ready")
    most = [0]

    def near_limit() -> bool:
        most[0] = max(most[0], open_fds(p.pid))
        return most[0] > 900
    try:
        wait_until(near_limit, timeout_s=20, poll_s=0.01, what="a's fds near the limit")
        took = kill_is_dead_within_bound(a, "new")  # a pidfd cannot be had: its slot lock
        old.kill()
        wait_until(lambda: (s := a.board.slot("old")) is not None and s.status is Status.DEAD,
                   timeout_s=KILL_BOUND_S, poll_s=0.001, what="old DEAD within 1 s")
        # half-open handshakes are timed out while the flooder still holds its sockets
        flooder.stdin.write("hold\n")
        flooder.stdin.flush()
        wait_until(lambda: open_fds(p.pid) < 300, timeout_s=30, poll_s=0.1,
                   what="the flood's connections dropped")
        assert p.poll() is None and a.board.agent().pid == p.pid
        wait_until(lambda: b.peer_status(a) is Status.ALIVE, timeout_s=15, what="a alive on b")
        print(f"kill during a 1100-connection flood at 1024 fds: DEAD after {took * 1e3:.1f} ms")
    finally:
        flooder.stdin.write("hold\nquit\n")
        flooder.stdin.flush()
    kill_is_dead_within_bound(a, "after")


# -- a stuck loop gives the role up; an unexpected ZMQ error restarts only the network half ----

STUCK_AGENT = child("stuck_agent")


def test_a_stuck_agent_loop_gives_the_role_up(board: shmhb.Board, procs: Procs,
                                             tmp_path: Any) -> None:
    from shmhb.agent.role import Agent

    flag = os.path.join(str(tmp_path), "stick")
    stuck = procs.program(STUCK_AGENT, board.name, flag)
    wait_until(lambda: board.agent().pid == stuck.pid, what="the doomed agent holds the role")
    standby = Agent(board.name, config=shmhb.AgentConfig(tick_s=0.02), network=False).start()
    try:
        open(flag, "w").close()
        t0 = time.monotonic()
        assert stuck.stdout is not None and stuck.stdout.readline().strip() == "deposed"
        assert standby.holding.wait(5), "no standby took the role over"
        took = time.monotonic() - t0
        wait_until(lambda: board.agent().pid == os.getpid(), what="the standby's words")
        term = board.agent().term
        w = procs.worker(board.name, "w")
        w.kill()
        wait_until(lambda: (s := board.slot("w")) is not None and s.status is Status.DEAD,
                   timeout_s=KILL_BOUND_S, poll_s=0.001, what="a kill DEAD within 1 s")
        assert board.agent().term == term and board.agent().pid == os.getpid()
        assert took < 5, f"the role changed hands {took:.2f} s after the loop stuck"
    finally:
        standby.stop()


ZMQ_FAULT = child("zmq_fault")


def test_an_unexpected_zmq_error_restarts_only_the_network_half(cluster: Cluster) -> None:
    b = cluster.host()
    a = cluster.host(start=False)
    b.watch(a)
    p = cluster.spawn([sys.executable, ZMQ_FAULT, *a.pinger_cmd()[3:]], f"{a.name}-fault")
    wait_held(a, p)
    wait_until(lambda: a.stats()["net_failures"] >= 1, what="the fault hit")
    wait_net(a, "listening")
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, what="a alive on b")
    assert p.poll() is None and a.board.agent().pid == p.pid and a.board.agent().term == 1
    assert "unexpected error" in cluster.log_tail(p, 200)
    kill_is_dead_within_bound(a, "w")
    assert status(a)[0] == 1


def test_a_stopped_holder_is_not_deposed_by_its_own_watchdog(cluster: Cluster) -> None:
    a = cluster.host(start=False)
    p = cluster.spawn([*a.pinger_cmd(), "--watchdog-s", "1"], f"{a.name}-wd1")
    a.wait_pinger(p)
    term = a.board.agent().term
    with stopped(p.pid):
        time.sleep(3.0)  # the fault itself: stopped past the 1 s watchdog bound
    wait_until(lambda: a.board.agent().status is Status.ALIVE, what="the holder beats again")
    kill_is_dead_within_bound(a, "w")
    assert p.poll() is None and a.board.agent().pid == p.pid and a.board.agent().term == term
    assert "no progress" not in cluster.log_tail(p, 200)
