"""Pushes: a host sends its local deaths, leaves and restarts at once to the hosts that
watch it.

The real-process tests use a ping interval of 2 s, so that anything seen on the
watching host well within 1 s can only have come from a push.  The fake-peer tests
craft pushes by hand (``shmhb.net.protocol.encode_push``) from a ROUTER standing at the
watched host's address, to check that duplicated, reordered, replayed and forged
pushes are harmless.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import shmhb
from shmhb import Status
from shmhb.net.protocol import Identity

from ..conftest import wait_until
from ..hosts import (
    FORKED_WORKERS, Cluster, FakePeer, Host, entry, write_secret,
)

LONG_INTERVAL_S = 2.0
#: peers judged on timeouts longer than the interval (else they would flap between pings)
SLOW_PEERS = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5,
                          peer_suspect_after_s=5.0, peer_dead_after_s=10.0)
#: "well before one ping interval", with room for a loaded 2-core machine (typically
#: 1-25 ms here; over 1 s seen only at a load average of 70).  The proof that a push
#: brought the news is that no ack arrived in between, not this bound.
PUSH_BOUND_S = 1.5
BURST_BOUND_S = 1.5  # 32 processes to tear down first
SECRET = b"cluster-secret-0123456789abcdef!"
OTHER_SECRET = b"another-secret-0123456789abcdef!"


def push_pair(cluster: Cluster) -> tuple[Host, Host]:
    a = cluster.host(policy=SLOW_PEERS, interval_s=LONG_INTERVAL_S)
    b = cluster.host(policy=SLOW_PEERS, interval_s=LONG_INTERVAL_S)
    a.watch(b)
    return a, b


def timed(pred: object, what: str, timeout_s: float = 5.0) -> tuple[object, float]:
    t0 = time.monotonic()
    v = wait_until(pred, timeout_s=timeout_s, poll_s=0.0005, what=what)  # type: ignore[arg-type]
    return v, time.monotonic() - t0


def just_acked(a: Host) -> int:
    """Wait for a's next ack from its peer and return the ack count: the following ping
    is a whole interval away, so what a learns in the next second came by push."""
    n = a.stats()["acks_received"]
    return wait_until(lambda: (m := a.stats()["acks_received"]) > n and m,
                      timeout_s=LONG_INTERVAL_S + 5, poll_s=0.001, what="an ack")


def test_kill_restart_and_close_are_pushed_well_within_an_interval(cluster: Cluster) -> None:
    a, b = push_pair(cluster)
    ep = b.endpoint(1)
    w1 = b.gated_worker("dec-0", ep)
    w2 = b.gated_worker("dec-0", ep)  # the restart, started early: registers on cue
    inc1 = w1.go()
    r1 = wait_until(lambda: (r := a.remote(ep)) and r.status is Status.ALIVE and r, timeout_s=10,
                    what="dec-0 ALIVE on a")
    assert r1.incarnation == inc1
    pushes = (b.stats()["pushes_sent"], a.stats()["pushes_received"])

    # killed: DEAD, same incarnation
    acks = just_acked(a)
    os.kill(w1.pid, signal.SIGKILL)
    dead, took = timed(lambda: (r := a.remote(ep)) and r.status is Status.DEAD and r, "DEAD")
    print(f"remote kill seen after {took * 1e3:.1f} ms")
    assert a.stats()["acks_received"] == acks, "an ack, not a push, brought the news"
    assert took < PUSH_BOUND_S, f"remote kill seen after {took:.3f} s (interval {LONG_INTERVAL_S} s)"
    assert dead.incarnation == inc1 and dead.pid == w1.pid

    # restarted: a new incarnation, alive
    acks = just_acked(a)
    t0 = time.monotonic()
    inc2 = w2.go()
    new, _ = timed(lambda: (r := a.remote(ep)) and r.incarnation == inc2 and r, "new incarnation")
    took = time.monotonic() - t0
    print(f"remote restart seen after {took * 1e3:.1f} ms")
    assert a.stats()["acks_received"] == acks, "an ack, not a push, brought the news"
    assert took < PUSH_BOUND_S, f"remote restart seen after {took:.3f} s"
    assert inc2 > inc1 and new.status is Status.ALIVE and new.pid == w2.pid

    # closed gracefully: LEFT
    acks = just_acked(a)
    w2.p.terminate()
    left, took = timed(lambda: (r := a.remote(ep)) and r.status is Status.LEFT and r, "LEFT")
    print(f"remote leave seen after {took * 1e3:.1f} ms")
    assert a.stats()["acks_received"] == acks, "an ack, not a push, brought the news"
    assert took < PUSH_BOUND_S, f"remote leave seen after {took:.3f} s"
    assert left.incarnation == inc2
    assert w2.p.wait(10) == 0

    assert b.stats()["pushes_sent"] >= pushes[0] + 3
    assert a.stats()["pushes_received"] >= pushes[1] + 3
    assert a.peer_status(b) is Status.ALIVE  # the host itself was never in doubt
    # the next ack agrees with what the pushes said
    just_acked(a)
    r = a.remote(ep)
    assert r is not None and (r.status, r.incarnation) == (Status.LEFT, inc2)


def test_a_burst_of_32_deaths_travels_as_a_few_messages(cluster: Cluster) -> None:
    a, b = push_pair(cluster)
    n = 32
    p = cluster.procs.spawn([sys.executable, FORKED_WORKERS, b.name, str(n), b.ip],
                            ready=True)
    pgid = int(p.ready_line.split()[1])  # type: ignore[attr-defined]
    a.board.watch(f"{b.ip}:31000")

    def all_are(status: Status) -> bool:
        peer = a.peer(b)
        return (peer is not None and len(peer.slots) == n
                and all(s.status is status for s in peer.slots))
    wait_until(lambda: all_are(Status.ALIVE), timeout_s=15, what=f"{n} workers ALIVE on a")
    # their registrations were pushed too (batched): let that settle, so the burst of
    # deaths starts after a quiet spell, as a real one would
    quiet = [b.stats()["pushes_sent"], time.monotonic()]

    def quiet_for(s: float) -> bool:
        n_now = b.stats()["pushes_sent"]
        if n_now != quiet[0]:
            quiet[:] = [n_now, time.monotonic()]
        return time.monotonic() - quiet[1] >= s
    wait_until(lambda: quiet_for(0.3), timeout_s=10, poll_s=0.01, what="no pushes for 0.3 s")
    sent0, got0 = b.stats()["pushes_sent"], a.stats()["pushes_received"]
    deaths0 = b.stats()["deaths_seen"]
    acks = just_acked(a)
    t0 = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    wait_until(lambda: all_are(Status.DEAD), timeout_s=10, poll_s=0.001, what=f"{n} DEAD on a")
    took = time.monotonic() - t0
    assert a.stats()["acks_received"] == acks, "an ack, not a push, brought the news"
    assert took < BURST_BOUND_S, f"{n} remote deaths seen after {took:.3f} s"
    assert b.stats()["deaths_seen"] - deaths0 == n
    sent = b.stats()["pushes_sent"] - sent0
    got = a.stats()["pushes_received"] - got0
    print(f"{n} deaths: {sent} pushes sent, {got} received, all DEAD on a after {took * 1e3:.1f} ms")
    assert 1 <= sent <= 4, f"{n} deaths took {sent} push messages"
    assert got <= sent
    assert p.stdout.readline().strip() == "reaped"


def test_a_new_key_at_a_dead_workers_endpoint_is_confirmed_at_once(cluster: Cluster) -> None:
    """A restarted engine registers under a new key (vLLM: a new engine id) at the
    address its dead predecessor served.  The push names a key the last ack did not
    list, which only an ack may add: the watcher pings at once instead of at the next
    turn, so the new key arrives one round trip after the push, not an interval later."""
    a, b = push_pair(cluster)
    ep = b.endpoint(1)
    old = b.gated_worker("vllm/engine-a/dp0/tp0/pp0", ep)
    new = b.gated_worker("vllm/engine-b/dp0/tp0/pp0", ep)
    inc_old = old.go()
    wait_until(lambda: (r := a.remote(ep)) and r.status is Status.ALIVE, timeout_s=10,
               what="engine-a ALIVE on a")
    os.kill(old.pid, signal.SIGKILL)
    wait_until(lambda: (r := a.remote(ep)) and r.status is Status.DEAD, timeout_s=5,
               what="engine-a DEAD on a")
    just_acked(a)
    confirms = a.stats()["pings_confirm"]
    t0 = time.monotonic()
    inc_new = new.go()
    got, _ = timed(lambda: (r := a.remote(ep)) and r.incarnation == inc_new and r,
                   "engine-b at the endpoint")
    took = time.monotonic() - t0
    print(f"a new key at a dead worker's endpoint seen after {took * 1e3:.1f} ms")
    assert took < PUSH_BOUND_S, f"new key seen after {took:.3f} s (interval {LONG_INTERVAL_S} s)"
    assert got.key == "vllm/engine-b/dp0/tp0/pp0" and got.status is Status.ALIVE
    assert inc_new > inc_old
    assert a.stats()["pings_confirm"] > confirms, "no ping confirmed the pushed key"


# -- crafted pushes from a fake peer ---------------------------------------------------------

@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
def test_duplicated_reordered_replayed_and_forged_pushes_are_harmless(
        cluster: Cluster, fake_peers: list[FakePeer], tmp_path: object, secret: bytes | None) -> None:
    sf = write_secret(os.path.join(str(tmp_path), "s"), secret) if secret else None
    a = cluster.host(secret_file=sf)
    f = FakePeer(cluster.spare_ip(), cluster.port, secret=secret)
    fake_peers.append(f)
    ep = {k: f"{f.ip}:{30000 + k}" for k in range(1, 5)}
    f.set(entry("w1", 10, Status.ALIVE, ep[1]), entry("w2", 20, Status.ALIVE, ep[2]),
          entry("w3", 30, Status.ALIVE, ep[3]))
    a.board.watch(ep[1])
    st = a.stats

    def view() -> dict[str, tuple[Status, int] | None]:
        out: dict[str, tuple[Status, int] | None] = {}
        for k in range(1, 5):
            r = a.remote(ep[k])
            out[f"w{k}"] = None if r is None else (r.status, r.incarnation)
        return out

    def counted(name: str, n: int) -> None:
        wait_until(lambda: st()[name] >= n, timeout_s=5, what=f"{name} >= {n}")

    # a push from a board we have no ack from yet: dropped, the host stays UNKNOWN
    f.next_ping()
    f.send(f.push_frame(100, entry("w1", 10, Status.DEAD, ep[1])))
    counted("bad_unsolicited", 1)
    assert a.peer_status(f.ip) is Status.UNKNOWN and a.remote(ep[1]) is None

    # acks make it ALIVE with its three workers
    f.serve_until(lambda: view()["w3"] == (Status.ALIVE, 30), what="fake peer's workers ALIVE")
    assert a.peer_status(f.ip) is Status.ALIVE

    # a death: applied at once
    got0 = st()["pushes_received"]
    death = f.push_frame(200, entry("w1", 10, Status.DEAD, ep[1]))
    f.send(death)
    f.set(entry("w1", 10, Status.DEAD, ep[1]))  # what later acks say too
    wait_until(lambda: view()["w1"] == (Status.DEAD, 10), what="pushed death applied")
    assert st()["pushes_received"] == got0 + 1

    # duplicated: counted as a replay, nothing changes
    replays = st()["bad_replay"]
    f.send(death)
    f.send(death)
    counted("bad_replay", replays + 2)

    # reordered: seq 400 (w2 LEFT) arrives before seq 300 (w1 and w2 ALIVE): 300 is dropped
    late = f.push_frame(300, entry("w1", 10, Status.ALIVE, ep[1]), entry("w2", 20, Status.ALIVE, ep[2]))
    f.send(f.push_frame(400, entry("w2", 20, Status.LEFT, ep[2])))
    f.send(late)
    f.set(entry("w2", 20, Status.LEFT, ep[2]))
    counted("bad_replay", replays + 3)
    wait_until(lambda: view()["w2"] == (Status.LEFT, 20), what="w2 LEFT")
    assert view()["w1"] == (Status.DEAD, 10)

    # fresh seq, same incarnations, claiming ALIVE: a push never resurrects anyone
    got1 = st()["pushes_received"]
    f.send(f.push_frame(500, entry("w1", 10, Status.ALIVE, ep[1]), entry("w2", 20, Status.ALIVE, ep[2])))
    counted("pushes_received", got1 + 1)
    assert view()["w1"] == (Status.DEAD, 10) and view()["w2"] == (Status.LEFT, 20)

    # a restart: the new incarnation is recorded at once; an older one never replaces it
    f.send(f.push_frame(600, entry("w3", 31, Status.ALIVE, ep[3])))
    f.set(entry("w3", 31, Status.ALIVE, ep[3]))
    wait_until(lambda: view()["w3"] == (Status.ALIVE, 31), what="w3 restarted")
    f.send(f.push_frame(700, entry("w3", 30, Status.DEAD, ep[3])))
    counted("pushes_received", got1 + 3)
    assert view()["w3"] == (Status.ALIVE, 31)

    # another board's identity at the same address: not the board we hold acks from
    unsol = st()["bad_unsolicited"]
    f.send(f.push_frame(800, entry("w3", 31, Status.DEAD, ep[3]), identity=Identity(os.urandom(16), 3)))
    counted("bad_unsolicited", unsol + 1)
    if secret:
        # forged: a wrong key, or no tag at all
        auth = st()["bad_auth"]
        f.send(f.push_frame(900, entry("w3", 31, Status.DEAD, ep[3]), secret=OTHER_SECRET))
        f.send(f.push_frame(901, entry("w3", 31, Status.DEAD, ep[3]), secret=None))
        counted("bad_auth", auth + 2)
    assert view()["w3"] == (Status.ALIVE, 31)

    # some more acks: they agree with what the genuine pushes said
    acks = st()["acks_received"]
    f.serve_until(lambda: st()["acks_received"] >= acks + 2, what="two more acks")
    assert view() == {"w1": (Status.DEAD, 10), "w2": (Status.LEFT, 20), "w3": (Status.ALIVE, 31),
                      "w4": None}

    # the host goes silent and is DEAD; pushes (a new worker, a restart) do not revive it
    f.serve_until(lambda: a.peer_status(f.ip) is Status.DEAD, answer=False, what="fake peer DEAD")
    got2 = st()["pushes_received"]
    f.send(f.push_frame(1000, entry("w4", 40, Status.ALIVE, ep[4]), entry("w3", 32, Status.ALIVE, ep[3])))
    counted("pushes_received", got2 + 1)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        f.drain(0.01)  # its pings go unanswered
        assert a.peer_status(f.ip) is Status.DEAD
        v = view()
        assert v["w3"] is not None and v["w3"][0] is Status.DEAD
        assert v["w4"] is None or v["w4"][0] is Status.DEAD
    # and once it answers again, the truth comes from its acks
    f.set(entry("w3", 32, Status.ALIVE, ep[3]), entry("w4", 40, Status.ALIVE, ep[4]))
    f.serve_until(lambda: a.peer_status(f.ip) is Status.ALIVE, what="ALIVE again")
    wait_until(lambda: view()["w4"] == (Status.ALIVE, 40))
