"""The pinger across simulated hosts: real ``shmhb pinger`` processes on loopback
addresses, real workers, real sockets.

Every host has its own board and its own pinger on 127.0.0.N; they share one pinger
port.  Bounds on timings are loose on purpose (a busy 2-core machine); what they check
is the order of magnitude the design promises and, where it matters, that a verdict
does not come too early.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import zmq

import shmhb
from shmhb import Status
from shmhb.testing.loopback import child_env
from shmhb.net.protocol import (
    MAX_FRAME_BYTES, Ack, Identity, Ping, Push, encode_ack, encode_ping, encode_push,
)

from ..children import child
from ..conftest import wait_until
from ..hosts import (
    FAST, INTERVAL_S, Cluster, FakePeer, Host, NetNs, entry, netns_unavailable, rss_kb,
    write_secret,
)
from ..stopping import resume, stopped

SECRET = b"cluster-secret-0123456789abcdef!"
OTHER_SECRET = b"another-secret-0123456789abcdef!"
#: slack added to every "within X" bound for scheduling noise on a loaded machine
SLACK_S = 1.5


def alive_pair(cluster: Cluster, **kw: object) -> tuple[Host, Host]:
    """Host a watches host b (through b's endpoint 1)."""
    a = cluster.host(**kw)  # type: ignore[arg-type]
    b = cluster.host(**kw)  # type: ignore[arg-type]
    a.watch(b)
    return a, b


def wait_remote(h: Host, endpoint: str, status: Status, timeout_s: float = 10.0,
                poll_s: float = 0.002) -> shmhb.SlotStatus:
    return wait_until(lambda: (r := h.remote(endpoint)) is not None and r.status is status and r,
                      timeout_s=timeout_s, poll_s=poll_s, what=f"{endpoint} {status.value} on {h}")


def wait_peer(h: Host, other: Host | str, status: Status, timeout_s: float = 10.0,
              poll_s: float = 0.002) -> shmhb.PeerStatus:
    return wait_until(lambda: (p := h.peer(other)) is not None and p.status is status and p,
                      timeout_s=timeout_s, poll_s=poll_s, what=f"{other} {status.value} on {h}")


# -- deaths and restarts -------------------------------------------------------------------

def test_remote_worker_killed_is_dead_here_within_detection_plus_an_interval(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    w = b.worker("dec-0", b.endpoint(1))
    r = wait_remote(a, b.endpoint(1), Status.ALIVE)
    assert r.key == "dec-0" and r.pid == w.pid and r.endpoints == (b.endpoint(1),)
    p = a.peer(b)
    assert p is not None and p.status is Status.ALIVE and p.rtt_ms is not None
    assert [s.key for s in p.slots] == ["dec-0"]
    t0 = time.monotonic()
    w.kill()
    dead = wait_remote(a, b.endpoint(1), Status.DEAD, poll_s=0.0005)
    took = time.monotonic() - t0
    # B sees the kill through pidfd in ~ms; then at most one ping interval
    assert took < INTERVAL_S + SLACK_S, f"remote kill seen after {took:.3f} s"
    assert dead.incarnation == r.incarnation and dead.pid == w.pid
    assert a.peer_status(b) is Status.ALIVE  # the host itself is fine
    assert b.stats()["deaths_seen"] == 1
    # and `shmhb status --json` on a shows it under "peers"
    out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--json", "--board", a.name],
                         capture_output=True, text=True, timeout=60,
                         env=child_env())
    doc = json.loads(out.stdout)
    (peer,) = doc["peers"]
    assert peer["address"] == b.listen and peer["status"] == "alive"
    assert set(peer) >= {"address", "status", "rtt_ms", "age_s", "slots"}
    (slot,) = peer["slots"]
    assert (slot["key"], slot["status"], slot["incarnation"], slot["pid"], slot["endpoints"]) == (
        "dec-0", "dead", r.incarnation, w.pid, [b.endpoint(1)])
    assert doc["pinger"]["stats"]["acks_received"] > 0


def test_remote_pinger_killed_makes_its_host_and_workers_dead(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    b.worker("dec-1", b.endpoint(2))
    wait_remote(a, b.endpoint(1), Status.ALIVE)
    wait_remote(a, b.endpoint(2), Status.ALIVE)
    p0 = a.peer(b)
    assert p0 is not None and p0.age_s is not None
    t0 = time.monotonic()
    b.kill_pinger()
    seen: set[Status] = set()

    def dead() -> bool:
        s = a.peer_status(b)
        seen.add(s)
        return s is Status.DEAD
    wait_until(dead, timeout_s=10, poll_s=0.002, what="host DEAD")
    took = time.monotonic() - t0
    pol = a.board.policy
    assert took < pol.peer_dead_after_s + INTERVAL_S + SLACK_S, f"host DEAD after {took:.2f} s"
    # not before its time: dead-after of silence since the last ack, which came age_s
    # before the kill
    assert took > pol.peer_dead_after_s - p0.age_s - 0.05, \
        f"host DEAD too early: {took:.2f} s after the kill, {p0.age_s:.2f} s after the last ack"
    assert Status.SUSPECT in seen and Status.UNKNOWN not in seen
    # the workers still run, but their host is gone: they are dead to us
    for n in (1, 2):
        assert a.remote_status(b.endpoint(n)) is Status.DEAD
    p = a.peer(b)
    assert p is not None and all(s.status is Status.DEAD for s in p.slots) and len(p.slots) == 2


def test_remote_pinger_stopped_goes_suspect_dead_then_alive_again(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    r0 = wait_remote(a, b.endpoint(1), Status.ALIVE)
    assert b.pinger is not None
    with stopped(b.pinger.pid):
        wait_peer(a, b, Status.SUSPECT, timeout_s=5)
        assert a.remote_status(b.endpoint(1)) is Status.SUSPECT  # an alive worker on a suspect host
        wait_peer(a, b, Status.DEAD, timeout_s=5)
        assert a.remote_status(b.endpoint(1)) is Status.DEAD
    wait_peer(a, b, Status.ALIVE, timeout_s=5)
    r1 = wait_remote(a, b.endpoint(1), Status.ALIVE, timeout_s=5)
    assert r1.incarnation == r0.incarnation  # the worker never went away
    # the stopped pinger judged nobody while it was stopped: its own worker is alive
    assert b.board.slot("dec-0").status is Status.ALIVE
    assert b.stats()["deaths_seen"] == 0


def test_remote_worker_restarted_shows_a_new_incarnation(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    w1 = b.worker("dec-0", b.endpoint(1))
    r1 = wait_remote(a, b.endpoint(1), Status.ALIVE)
    w1.kill()
    wait_remote(a, b.endpoint(1), Status.DEAD)
    w2 = b.worker("dec-0", b.endpoint(1))
    r2 = wait_until(lambda: (r := a.remote(b.endpoint(1))) is not None
                    and r.incarnation != r1.incarnation and r, what="new incarnation")
    assert r2.incarnation > r1.incarnation and r2.pid == w2.pid and r2.key == "dec-0"
    wait_remote(a, b.endpoint(1), Status.ALIVE)
    p = a.peer(b)
    assert p is not None and len(p.slots) == 1  # the old incarnation is not listed beside it


def test_restarted_remote_pinger_keeps_worker_incarnations(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    b.worker("dec-1", b.endpoint(2))
    r = {n: wait_remote(a, b.endpoint(n), Status.ALIVE) for n in (1, 2)}
    b.kill_pinger()
    wait_peer(a, b, Status.SUSPECT, timeout_s=5)  # its pinger is gone, for a while
    b.start_pinger()
    wait_peer(a, b, Status.ALIVE, timeout_s=10)
    for n in (1, 2):
        got = wait_remote(a, b.endpoint(n), Status.ALIVE)
        assert (got.key, got.pid, got.incarnation) == (r[n].key, r[n].pid, r[n].incarnation), \
            "a pinger restart must not look like a worker restart"
    assert b.stats()["deaths_seen"] == 0


def test_worker_killed_while_its_hosts_pinger_was_down_is_seen_dead(cluster: Cluster) -> None:
    # B's pinger restarts with its worker gone: the new pinger's digest differs from
    # the one A holds, even if both happen to have the same generation number.
    a, b = alive_pair(cluster)
    w = b.worker("dec-0", b.endpoint(1))
    r = wait_remote(a, b.endpoint(1), Status.ALIVE)
    acks = a.stats()["acks_received"]
    wait_until(lambda: a.stats()["acks_received"] >= acks + 2, what="a holds b's digest")
    b.kill_pinger()
    w.kill()
    w.wait(10)
    b.start_pinger()
    wait_peer(a, b, Status.ALIVE, timeout_s=10)
    got = wait_remote(a, b.endpoint(1), Status.DEAD, timeout_s=3)
    assert got.incarnation == r.incarnation


def test_a_reborn_remote_board_does_not_repeat_an_incarnation(cluster: Cluster) -> None:
    # Host b starts over within seconds (everything stopped, its board removed and made
    # anew): its worker registers again under the same key.  Links made with the old
    # worker must not look valid: the incarnation a reader sees has to differ.
    from ..conftest import unlink_quietly

    a, b = alive_pair(cluster)
    w = b.worker("dec-0", b.endpoint(1))
    r0 = wait_remote(a, b.endpoint(1), Status.ALIVE)
    b.kill_pinger()
    w.kill()
    w.wait(10)
    b.board.close()
    unlink_quietly(b.name)
    b.board = shmhb.Board.create(b.name, policy=FAST)
    b.start_pinger()
    w2 = b.worker("dec-0", b.endpoint(1))
    r1 = wait_until(lambda: (r := a.remote(b.endpoint(1))) is not None and r.pid == w2.pid and r,
                    what="the new worker seen on a")
    assert r1.incarnation != r0.incarnation, \
        f"a reborn board's worker shows the old incarnation {r0.incarnation}: links look valid"


def test_local_pinger_killed_reads_unknown_then_a_standby_makes_it_fresh(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    r0 = wait_remote(a, b.endpoint(1), Status.ALIVE)
    stale_s = a.board.policy.agent_stale_s
    t0 = time.monotonic()
    a.kill_pinger()
    reads: list[tuple[float, Status | None, Status | None]] = []

    def unknown() -> bool:
        hs, ws = a.peer_status(b), a.remote_status(b.endpoint(1))
        reads.append((time.monotonic() - t0, hs, ws))
        return hs is Status.UNKNOWN and ws is Status.UNKNOWN
    wait_until(unknown, timeout_s=stale_s + SLACK_S, poll_s=0.005, what="UNKNOWN")
    # keep reading past the host's dead-after: nobody observes, so nothing is convicted
    end = time.monotonic() + a.board.policy.peer_dead_after_s
    while time.monotonic() < end:
        unknown()
        time.sleep(0.01)
    for t, hs, ws in reads:
        assert hs in (Status.ALIVE, Status.UNKNOWN) and ws in (Status.ALIVE, Status.UNKNOWN), (t, hs, ws)
        if hs is Status.ALIVE or ws is Status.ALIVE:
            assert t < stale_s + 0.2, f"stale ALIVE read {t:.2f} s after the pinger died"
    assert reads[-1][1:] == (Status.UNKNOWN, Status.UNKNOWN)
    # a standby with no options applies the settings the first pinger stored in the board
    t1 = time.monotonic()
    standby = a.start_pinger(configure=False)
    wait_peer(a, b, Status.ALIVE, timeout_s=10)
    r1 = wait_remote(a, b.endpoint(1), Status.ALIVE, timeout_s=5)
    assert time.monotonic() - t1 < 10
    assert r1.incarnation == r0.incarnation and r1.age_s < 1.0
    assert a.board.agent().pid == standby.pid


def test_a_new_holder_never_shows_the_previous_holders_verdicts(cluster: Cluster) -> None:
    # A holder that does not (or not yet) run the network half must not present the
    # dead holder's last verdicts as its own: they read UNKNOWN, not a stale ALIVE.
    from shmhb.agent.role import Agent

    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    wait_remote(a, b.endpoint(1), Status.ALIVE)
    a.kill_pinger()
    wait_until(lambda: a.peer_status(b) is Status.UNKNOWN, timeout_s=5)
    local = Agent(a.name, config=shmhb.AgentConfig(tick_s=0.02), network=False).start()
    try:
        assert local.holding.wait(10)
        wait_until(lambda: a.board.agent().status is Status.ALIVE, timeout_s=5)
        for _ in range(20):
            assert a.peer_status(b) is Status.UNKNOWN
            assert a.remote_status(b.endpoint(1)) is Status.UNKNOWN
            time.sleep(0.01)
    finally:
        local.stop()


def test_standby_pinger_takes_over_and_statuses_are_fresh_again(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    wait_remote(a, b.endpoint(1), Status.ALIVE)
    first = a.pinger
    standby = a.start_pinger(configure=False, wait=False)
    wait_until(lambda: "waiting for the agent role" in cluster.log_tail(standby), timeout_s=20,
               what="standby up")
    assert a.board.agent().pid == first.pid
    t0 = time.monotonic()
    a.kill_pinger()
    statuses: set[Status | None] = set()

    def fresh() -> bool:
        p = a.peer(b)
        statuses.add(None if p is None else p.status)
        return (p is not None and p.status is Status.ALIVE and a.board.agent().pid == standby.pid
                and p.age_s is not None and p.age_s < 0.5)
    wait_until(fresh, timeout_s=10, poll_s=0.005, what="fresh ALIVE from the standby")
    took = time.monotonic() - t0
    assert took < 1.0 + SLACK_S, f"takeover and fresh status after {took:.2f} s"
    assert statuses <= {Status.ALIVE, Status.UNKNOWN}, statuses
    wait_remote(a, b.endpoint(1), Status.ALIVE, timeout_s=5)


def test_local_pinger_stalled_reads_unknown_and_its_pause_convicts_nobody(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)
    b.worker("dec-0", b.endpoint(1))
    r0 = wait_remote(a, b.endpoint(1), Status.ALIVE)
    assert a.pinger is not None
    pol = a.board.policy
    os.kill(a.pinger.pid, signal.SIGSTOP)
    seen: list[tuple[Status | None, Status | None]] = []
    try:
        t0 = time.monotonic()
        wait_until(lambda: a.peer_status(b) is Status.UNKNOWN, timeout_s=pol.agent_stale_s + SLACK_S,
                   what="UNKNOWN while our pinger is stopped")
        assert a.remote_status(b.endpoint(1)) is Status.UNKNOWN
        # stay stopped well past the host's dead-after
        while time.monotonic() - t0 < pol.peer_dead_after_s + 0.5:
            seen.append((a.peer_status(b), a.remote_status(b.endpoint(1))))
            time.sleep(0.01)
    finally:
        resume(a.pinger.pid)
    assert set(seen) == {(Status.UNKNOWN, Status.UNKNOWN)}, set(seen)
    # resumed: the silence of its own pause is not held against b
    after: set[Status | None] = set()

    def fresh() -> bool:
        after.add(a.peer_status(b))
        p = a.peer(b)
        return p is not None and p.status is Status.ALIVE and p.age_s is not None and p.age_s < 0.5
    wait_until(fresh, timeout_s=5, poll_s=0.002, what="fresh ALIVE after the pause")
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        after.add(a.peer_status(b))
        time.sleep(0.01)
    assert after <= {Status.UNKNOWN, Status.ALIVE}, after
    r1 = wait_remote(a, b.endpoint(1), Status.ALIVE, timeout_s=2)
    assert r1.incarnation == r0.incarnation
    assert a.stats()["loop_late"] >= 1


def test_every_peer_silent_at_once_stops_at_suspect(cluster: Cluster) -> None:
    # A host that loses every peer at once while nobody pings it doubts itself (its own
    # network may be what failed): SUSPECT, not DEAD, until some peer answers again.
    a = cluster.host()
    b = cluster.host()
    c = cluster.host()
    a.watch(b)
    a.watch(c)
    wait_peer(a, b, Status.ALIVE)
    wait_peer(a, c, Status.ALIVE)
    b.kill_pinger()
    c.kill_pinger()
    t0 = time.monotonic()
    wait_until(lambda: a.peer_status(b) is Status.SUSPECT and a.peer_status(c) is Status.SUSPECT,
               timeout_s=5, what="both SUSPECT")
    while time.monotonic() - t0 < a.board.policy.peer_dead_after_s + 1.0:
        assert a.peer_status(b) is Status.SUSPECT and a.peer_status(c) is Status.SUSPECT
        time.sleep(0.01)
    # b answers again: a trusts itself once more, and c, still silent, is convicted
    b.start_pinger()
    wait_peer(a, b, Status.ALIVE, timeout_s=10)
    wait_peer(a, c, Status.DEAD, timeout_s=5)


def test_targets_follow_watches_and_the_peer_option(cluster: Cluster) -> None:
    b = cluster.host()
    c = cluster.host()
    a = cluster.host(peers=(c.ip,))  # follows c at the cluster's port, with no watch
    wait_peer(a, c, Status.ALIVE)
    assert a.peer(b) is None
    a.watch(b, 1)
    a.watch(b, 2)  # two endpoints of one host: one target
    wait_peer(a, b, Status.ALIVE)
    assert len(a.board.peers()) == 2
    a.board.unwatch(b.endpoint(1))
    a.board.unwatch(b.endpoint(2))
    wait_until(lambda: a.peer(b) is None, timeout_s=5, what="b no longer followed")
    assert a.peer_status(c) is Status.ALIVE


def test_a_watch_goes_with_the_process_that_held_it(cluster: Cluster) -> None:
    a, b = cluster.host(), cluster.host()
    w = cluster.procs.program(child("watcher"), a.name, b.endpoint(3))
    wait_peer(a, b, Status.ALIVE)
    w.kill()
    wait_until(lambda: a.peer(b) is None, timeout_s=3, what="the dead process's watch dropped")


# -- bad input -----------------------------------------------------------------------------

def _fuzz_frames(rng: random.Random) -> list[tuple[list[bytes], str]]:
    """A pool of bad messages for a ROUTER, each with the counter it must bump."""
    ident = Identity(os.urandom(16), 5)
    ping = encode_ping(Ping(ident, "127.0.0.9:1", 10**18))
    out: list[tuple[list[bytes], str]] = []
    for _ in range(200):  # garbage
        n = rng.randrange(8, 300)
        g = bytes(rng.getrandbits(8) for _ in range(n))
        if g[:4] == b"SHHB":
            continue
        out.append(([g], "bad_magic"))
    for n in range(len(ping)):  # every truncation of a valid ping
        out.append(([ping[:n]], "bad_truncated"))
    for v in (0, 2, 3, 7, 255):
        out.append(([ping[:4] + bytes([v]) + ping[5:]], "bad_version"))
    for t in (0, 4, 9, 255):
        out.append(([ping[:5] + bytes([t]) + ping[6:]], "bad_type"))
    # valid frames that a ROUTER must never act on: acks and pushes
    out.append(([encode_ack(Ack(1, ident, "127.0.0.9:1", 3, True, (entry("x", 1, Status.ALIVE),)))],
                "bad_type"))
    out.append(([encode_push(Push(ident, "127.0.0.9:1", 1, 2, (entry("x", 1, Status.DEAD),)))],
                "bad_type"))
    # a well-formed header with a broken body: flags, reserved, trailing bytes, NUL
    out.append(([ping[:6] + b"\x02" + ping[7:]], "bad_malformed"))
    out.append(([ping[:7] + b"\x01" + ping[8:]], "bad_malformed"))
    out.append(([ping + b"\x00"], "bad_malformed"))
    addr_end = 73 + len("127.0.0.9:1")  # the header and fixed fields, then the address
    out.append(([ping[:addr_end - 1] + b"\x00" + ping[addr_end:]], "bad_malformed"))  # NUL
    out.append(([ping[:72] + b"\x00" + ping[73:]], "bad_malformed"))  # address length 0
    # tagged frames at a pinger without a secret
    out.append(([encode_ping(Ping(ident, "127.0.0.9:1", 10**18), SECRET)], "bad_auth"))
    # more than one part
    out.append(([ping, ping], "bad_malformed"))
    out.append(([b"", ping], "bad_malformed"))
    return out


def test_fuzzing_flood_is_counted_and_dropped_while_good_pings_are_answered(cluster: Cluster) -> None:
    a, b = alive_pair(cluster)  # a: the honest watcher of b; b: the target of the flood
    b.worker("dec-0", b.endpoint(1))
    wait_remote(a, b.endpoint(1), Status.ALIVE)
    assert b.pinger is not None
    rng = random.Random(1234)
    pool = _fuzz_frames(rng)
    ident = Identity(os.urandom(16), 9)
    replayed = encode_ping(Ping(ident, "127.0.0.9:1", 5))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 10_000)
    s.setsockopt(zmq.RCVHWM, 10)
    s.connect(f"tcp://{b.listen}")
    try:
        # Without a secret there is no replay guard (its key, the identity, is anyone's to
        # claim: a guard would let a forger lock a host out), so every copy of
        # `replayed` is a good ping, answered; acks are matched to nonces by the pinger.
        s.send(replayed)
        wait_until(lambda: s.poll(0), timeout_s=10, what="the fuzzer's first ping answered")
        s.recv()
        before = b.stats()
        acks_before = a.stats()["acks_received"]
        want: dict[str, int] = {}
        rss0 = None
        sent = 0
        batch = 2000
        batches = 55
        t_flood = time.monotonic()

        def all_counted() -> bool:
            # Each reason on its own: a sum would also count the honest watcher's pings
            # (pings_answered) and could reach `sent` before the last bad frames are.
            now = b.stats()
            return all(now[r] - before[r] >= n for r, n in want.items())

        for k in range(batches):
            for _ in range(batch):
                parts, reason = pool[rng.randrange(len(pool))] if rng.random() > 0.05 else ([replayed], "pings_answered")
                s.send_multipart(parts)
                want[reason] = want.get(reason, 0) + 1
            sent += batch
            if k == 4:  # warmed up: the pinger has seen every kind of frame
                wait_until(all_counted, timeout_s=30, poll_s=0.01,
                           what="the pinger to drain the first batches")
                rss0 = rss_kb(b.pinger.pid)
            # the honest watcher keeps seeing b alive throughout
            assert a.peer_status(b) is Status.ALIVE, f"b not ALIVE after {sent} bad frames"
            assert b.pinger.poll() is None
        assert sent >= 100_000
        wait_until(all_counted, timeout_s=60, poll_s=0.01, what="every bad frame counted")
        after = b.stats()
        print(f"{sent} bad frames counted in {time.monotonic() - t_flood:.2f} s: "
              + ", ".join(f"{r} {n}" for r, n in sorted(want.items())))
        for reason, n in want.items():
            got = after[reason] - before[reason]
            # pings_answered also counts the honest watcher's pings
            assert got == n or reason == "pings_answered" and got >= n, (reason, n, got)
        assert after["bad_replay"] == before["bad_replay"]
        assert after["pings_answered"] > before["pings_answered"]
        assert a.stats()["acks_received"] > acks_before
        assert a.peer_status(b) is Status.ALIVE
        assert a.remote_status(b.endpoint(1)) is Status.ALIVE
        assert rss0 is not None
        grew_mb = (rss_kb(b.pinger.pid) - rss0) / 1024
        assert grew_mb < 50, f"pinger RSS grew by {grew_mb:.1f} MB under the flood"
    finally:
        s.close(0)
        ctx.term()


def test_oversized_frames_are_dropped_by_the_transport(cluster: Cluster) -> None:
    # MAXMSGSIZE makes libzmq drop a frame above the bound (and the connection that
    # sent it) before Python allocates it; the pinger keeps answering everyone else.
    a, b = alive_pair(cluster)
    wait_peer(a, b, Status.ALIVE)
    assert b.pinger is not None
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 10_000)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(f"tcp://{b.listen}")
    try:
        rss0 = rss_kb(b.pinger.pid)
        big = b"SHHB" + bytes(MAX_FRAME_BYTES + 1)
        answered = b.stats()["pings_answered"]
        for _ in range(2):  # each one costs its connection: libzmq reconnects
            s.send(big)
            s.send(b"\x00" * 64 * 2**20)  # 64 MiB
        # the oversized frames closed our connection; it reconnects and a good ping works
        ident = Identity(os.urandom(16), 3)
        got = None
        deadline = time.monotonic() + 10
        n = 0
        while got is None and time.monotonic() < deadline:
            n += 1
            s.send(encode_ping(Ping(ident, "127.0.0.9:1", n)))
            if s.poll(200):
                got = s.recv()
        assert got is not None, "the pinger stopped answering after oversized frames"
        assert mon.poll(0), "the pinger's side never dropped the connection that sent them"
        wait_until(lambda: b.stats()["pings_answered"] > answered + 1)
        assert a.peer_status(b) is Status.ALIVE
        assert b.stats()["bad_oversized"] == 0  # none reached the decoder
        assert (rss_kb(b.pinger.pid) - rss0) / 1024 < 50
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)
        ctx.term()


def test_forged_and_replayed_acks_never_make_a_host_alive(cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a = cluster.host()
    fake = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(fake)
    fake.set(entry("dec-0", 7, Status.ALIVE, f"{fake.ip}:30001"))
    a.board.watch(f"{fake.ip}:30001")
    bad0 = a.stats()["bad_unsolicited"]
    # acks for nonces a never sent (wrong nonce, off by one, zero, max)
    ping = fake.next_ping()
    for nonce in (ping.nonce + 1, ping.nonce - 100, 0, 2**64 - 1, random.getrandbits(64)):
        fake.send(fake.ack_frame(nonce))
    wait_until(lambda: a.stats()["bad_unsolicited"] >= bad0 + 5, what="5 unsolicited acks counted")
    assert a.peer_status(fake.ip) is Status.UNKNOWN
    assert a.remote(f"{fake.ip}:30001") is None
    # one genuine answer: the host is alive
    good = fake.ack(fake.next_ping())
    wait_peer(a, fake.ip, Status.ALIVE)
    wait_remote(a, f"{fake.ip}:30001", Status.ALIVE)
    # the same ack replayed twice: each counted, neither accepted
    bad1 = a.stats()["bad_unsolicited"]
    acks1 = a.stats()["acks_received"]
    fake.send(good)
    fake.send(good)
    wait_until(lambda: a.stats()["bad_unsolicited"] == bad1 + 2, what="2 replays counted")
    assert a.stats()["acks_received"] == acks1
    # from now on only replays and acks for the wrong nonce: silence, in effect
    seen: list[Status | None] = []

    def forge_until(status: Status) -> None:
        def pred() -> bool:
            seen.append(a.peer_status(fake.ip))
            return seen[-1] is status
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {status.value}"
            p = fake.poll_ping(0.005)
            if p is not None:
                fake.send(good)
                fake.send(fake.ack_frame(p.nonce + 1))
                fake.send(fake.ack_frame(p.nonce, identity=Identity(os.urandom(16), 1))[:-1])
    forge_until(Status.SUSPECT)
    forge_until(Status.DEAD)
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:  # and it stays dead under more forgeries
        p = fake.poll_ping(0.005)
        if p is not None:
            fake.send(good)
            # a nonce a never sent (nonces count up by one: ``p.nonce - 1`` is the last
            # ping's, still awaited, and an ack to it would be a genuine answer)
            fake.send(fake.ack_frame(p.nonce + 2**40))
        seen.append(a.peer_status(fake.ip))
    after_alive = seen[seen.index(Status.SUSPECT):]
    assert Status.ALIVE not in after_alive, "a forged or replayed ack revived the host"
    assert seen[-1] is Status.DEAD
    assert a.remote_status(f"{fake.ip}:30001") is Status.DEAD
    assert a.stats()["acks_received"] == acks1
    assert a.stats()["bad_unsolicited"] > bad1 + 4
    assert a.stats()["bad_truncated"] + a.stats()["bad_malformed"] > 0
    # and a genuine answer to a ping it sent brings it back (the fake is a fair peer)
    fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE, what="ALIVE again")


# -- authentication ------------------------------------------------------------------------

def test_shared_secret_lets_members_in_and_keeps_others_out(cluster: Cluster, tmp_path: object) -> None:
    good = write_secret(os.path.join(str(tmp_path), "secret"), SECRET)
    other = write_secret(os.path.join(str(tmp_path), "other"), OTHER_SECRET)
    a = cluster.host(secret_file=good)
    b = cluster.host(secret_file=good)
    c = cluster.host(secret_file=other)  # a different secret
    d = cluster.host()  # no secret at all
    for h in (a, c, d):
        h.watch(b)
    b.watch(d)  # b pings d: d (no secret) must reject b's tagged pings
    b.worker("dec-0", b.endpoint(1))
    wait_remote(a, b.endpoint(1), Status.ALIVE)
    bad_b = b.stats()["bad_auth"]
    wait_until(lambda: b.stats()["bad_auth"] >= bad_b + 4, what="b counts unauthenticated pings")
    wait_until(lambda: d.stats()["bad_auth"] >= 2, what="d counts b's tagged pings")
    # c and d never get an answer, only b's refusals: b's frames fail authentication
    # there, so b is unknown to them (named so), never alive, and never dead: it runs
    wait_until(lambda: all((p := h.peer(b)) is not None and p.auth_failing for h in (c, d)),
               timeout_s=10, what="c and d name b's frames as failing authentication")
    end = time.monotonic() + 2 * b.board.policy.peer_dead_after_s
    while time.monotonic() < end:
        for h in (c, d):
            assert h.peer_status(b) is Status.UNKNOWN, (h, h.peer(b))
        time.sleep(0.01)
    for h in (c, d):
        assert h.stats()["acks_received"] == 0
    assert c.remote(b.endpoint(1)) is None and d.remote(b.endpoint(1)) is None
    assert b.peer_status(d) in (Status.UNKNOWN, Status.SUSPECT, Status.DEAD)
    assert a.peer_status(b) is Status.ALIVE and a.stats()["bad_auth"] == 0


def test_secret_on_forged_ack_with_the_wrong_key_is_dropped(cluster: Cluster, tmp_path: object,
                                                            fake_peers: list[FakePeer]) -> None:
    a = cluster.host(secret_file=write_secret(os.path.join(str(tmp_path), "s"), SECRET))
    fake = FakePeer(cluster.spare_ip(), cluster.port, secret=SECRET)
    fake_peers.append(fake)
    a.board.watch(f"{fake.ip}:30001")
    deadline = time.monotonic() + a.board.policy.peer_dead_after_s + 1.0
    n = 0
    while time.monotonic() < deadline:  # right nonces, wrong keys or no tag at all
        p = fake.next_ping()
        fake.send(fake.ack_frame(p.nonce, secret=OTHER_SECRET))
        fake.send(fake.ack_frame(p.nonce, secret=None))
        n += 2
        assert a.peer_status(fake.ip) is not Status.ALIVE
    wait_until(lambda: a.stats()["bad_auth"] >= n - 2, what="forged acks counted")
    assert a.stats()["acks_received"] == 0
    wait_peer(a, fake.ip, Status.DEAD, timeout_s=3)
    fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE, what="a keyed ack accepted")


def test_curve_keys_authenticate_hosts(cluster: Cluster, tmp_path: object) -> None:
    import zmq.auth

    keys = os.path.join(str(tmp_path), "curve")
    strangers = os.path.join(str(tmp_path), "curve-other")
    os.makedirs(keys)
    os.makedirs(strangers)
    ips = [f"127.0.0.{2 + i}" for i in range(3)]
    for ip in ips[:2]:
        zmq.auth.create_certificates(keys, ip)
    # c has a key pair of its own that the cluster does not list, and b's public key
    zmq.auth.create_certificates(strangers, ips[2])
    import shutil
    shutil.copy(os.path.join(keys, f"{ips[1]}.key"), strangers)
    a = cluster.host(curve_keys=keys)
    b = cluster.host(curve_keys=keys)
    c = cluster.host(curve_keys=strangers)
    d = cluster.host()  # plain: no CURVE at all
    for h in (a, c, d):
        h.watch(b)
    b.worker("dec-0", b.endpoint(1))
    r = wait_remote(a, b.endpoint(1), Status.ALIVE)
    assert r.key == "dec-0"
    seen: set[Status | None] = set()

    def shut_out() -> bool:
        got = (c.peer_status(b), d.peer_status(b))
        seen.update(got)
        return got == (Status.DEAD, Status.DEAD)
    wait_until(shut_out, timeout_s=10, poll_s=0.01, what="b DEAD on c and d")
    assert Status.ALIVE not in seen
    assert c.stats()["acks_received"] == 0 and d.stats()["acks_received"] == 0
    assert b.stats()["pings_answered"] > 0 and a.peer_status(b) is Status.ALIVE


# -- a real partition ----------------------------------------------------------------------

@pytest.fixture
def netns() -> object:
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    ns = NetNs()
    try:
        yield ns
    finally:
        ns.close()


def test_partition_through_network_namespaces(cluster: Cluster, netns: NetNs) -> None:
    a = cluster.host(ip=netns.ip_a, netns=netns.a)
    b = cluster.host(ip=netns.ip_b, netns=netns.b)
    a.watch(b)
    b.watch(a)
    b.worker("dec-0", b.endpoint(1))
    r0 = wait_remote(a, b.endpoint(1), Status.ALIVE)
    wait_peer(b, a, Status.ALIVE)
    t0 = time.monotonic()
    netns.link(up=False)
    wait_peer(a, b, Status.DEAD, timeout_s=10)
    wait_peer(b, a, Status.DEAD, timeout_s=10)
    took = time.monotonic() - t0
    assert took < a.board.policy.peer_dead_after_s + INTERVAL_S + SLACK_S
    assert a.remote_status(b.endpoint(1)) is Status.DEAD
    netns.link(up=True)
    # TCP retransmits with backoff: the first ack may take a few seconds after the cut
    wait_peer(a, b, Status.ALIVE, timeout_s=15)
    wait_peer(b, a, Status.ALIVE, timeout_s=15)
    r1 = wait_remote(a, b.endpoint(1), Status.ALIVE, timeout_s=5)
    assert r1.incarnation == r0.incarnation


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_pinger_with_nothing_to_watch_waits_instead_of_spinning(cluster: Cluster) -> None:
    """No local worker (no pidfd) and no followed host (no client socket): the agent
    polls nothing, and pyzmq returns at once from a poll of nothing.  The loop must
    still wait for its tick (it spun a whole core).  Idle, it costs ~1 % of a core; a
    spinning loop takes all the CPU it is given, so 25 % has a wide margin both ways."""
    h = cluster.host()
    assert h.pinger is not None
    pid = h.pinger.pid
    c0, t0 = _cpu_s(pid), time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 2.0, timeout_s=5.0, poll_s=0.1, what="2 s")
    c1, t1 = _cpu_s(pid), time.monotonic()
    assert (c1 - c0) / (t1 - t0) < 0.25, f"idle pinger used {100 * (c1 - c0) / (t1 - t0):.0f} % of a core"
