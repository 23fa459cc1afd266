"""The local digest: what a new holder of the agent role answers with, and when it is
judged again."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

import shmhb
from shmhb import Status
from shmhb.clock import FakeClock
from shmhb.net.digest import LocalDigest
from shmhb.board.layout import TS_SHIFT
from shmhb.net.protocol import Ack, FrameRejected, Identity, decode, encode_ack_raw, encode_entries

from ..chaos.bigdigest import BULK
from ..children import child
from ..conftest import Procs, wait_until
from ..hosts import Cluster


def test_a_new_digest_lists_the_live_slots_before_its_first_flush(board: shmhb.Board) -> None:
    # A standby taking the role over answers pings before its first flush; a body built
    # empty read to every watcher as "all of this host's workers are gone".
    hbs = [board.register(f"rank-{i}", endpoints=(f"127.0.0.1:{7000 + i}",), agent=False)
           for i in range(3)]
    try:
        for hb in hbs:
            hb.beat()
        d = LocalDigest(board)
        frame = encode_ack_raw(1, Identity(os.urandom(16), 9), "127.0.0.1:1", d.gen, d.body, None)
        ack = decode(frame)
        assert isinstance(ack, Ack) and ack.entries is not None
        got = {e.key: e.incarnation for e in ack.entries}
        assert got == {hb.key: hb.incarnation for hb in hbs}
        assert d.rebuild() == []  # nothing new for the first flush to push
    finally:
        for hb in hbs:
            hb.close()


def _statuses(d: LocalDigest) -> dict[str, int]:
    ack = decode(encode_ack_raw(1, Identity(os.urandom(16), 9), "127.0.0.1:1", d.gen, d.body, None))
    assert isinstance(ack, Ack)
    return {e.key: e.status for e in ack.entries}


def test_the_digest_looks_again_at_once_on_a_change_and_within_its_period_on_age(
        board: shmhb.Board) -> None:
    """An idle pinger does not judge its board every tick: a registration (which moves
    the change counter) is in the digest at the next flush, a worker going stale by age
    alone within ``rejudge_ns``, and not a judgement sooner."""
    hb = board.register("rank-0", agent=False)
    hb.beat()
    clock = FakeClock(time.monotonic_ns())  # the beat's time, on a clock the test moves
    b = shmhb.Board.attach(board.name, clock=clock)
    others: list[shmhb.Heartbeat] = []
    try:
        d = LocalDigest(b)
        r = d.rejudge_ns
        suspect_ns = b.thresholds.suspect << TS_SHIFT
        assert 0 < r <= suspect_ns // 8
        clock.set_ns(clock.monotonic_ns() + suspect_ns - r // 4)
        d.rebuild(clock.monotonic_ns())  # judged: still ALIVE
        assert _statuses(d) == {"rank-0": Status.ALIVE.code}
        gen = d.gen
        clock.advance(r / 2 / 1e9)  # stale by age now, but the period has not passed
        assert d.rebuild(clock.monotonic_ns()) == [] and d.gen == gen
        clock.advance(r / 1e9)  # it has
        d.rebuild(clock.monotonic_ns())
        assert d.gen != gen and _statuses(d) == {"rank-0": Status.SUSPECT.code}
        gen = d.gen
        others.append(board.register("rank-1", agent=False))  # moves the change counter
        news = d.rebuild(clock.monotonic_ns())  # within the period: judged all the same
        assert [e.key for e in news] == ["rank-1"] and d.gen != gen
        assert set(_statuses(d)) == {"rank-0", "rank-1"}
    finally:
        for h in (hb, *others):
            h.close()
        b.close()


# -- past 256 entries (a host of more than 256 workers) ----------------------------------------

def test_a_kill_past_the_256th_slot_is_seen_on_the_other_host(procs: Procs,
                                                               cluster: Cluster) -> None:
    """260 dead slots (one process that registered them, SIGKILLed), 39 live ones, then
    the 300th worker: the other host sees it ALIVE, then DEAD at its kill.  A digest that
    stopped at 256 entries in slot order, dead ones included, would never show the 300th
    worker, nor tell its death."""
    a = cluster.host(slots=400)
    b = cluster.host()
    gone = procs.program(BULK, a.name, "gone-", "260", a.ip, "32000")
    gone.kill()
    gone.wait(10)
    wait_until(lambda: sum(s.status is Status.DEAD for s in a.board.slots()) == 260,
               timeout_s=30, what="260 dead slots on a")
    procs.program(BULK, a.name, "live-", "39", a.ip, "33000")
    w = a.worker("rank-300", a.endpoint(1))
    inc = int(w.ready_line.split()[1])  # type: ignore[attr-defined]
    assert int(w.ready_line.split()[2]) >= 256  # type: ignore[attr-defined]  # past the old cut
    b.watch(a)
    wait_until(lambda: (r := b.remote(a.endpoint(1))) is not None
               and r.status is Status.ALIVE and r.incarnation == inc,
               timeout_s=30, what="the 300th worker alive on b")
    peer = b.peer(a)
    assert peer is not None and len(peer.slots) == 300, len(peer.slots) if peer else None
    assert a.stats()["digest_cut"] == 0  # everything fitted: nothing was left out
    w.kill()
    wait_until(lambda: b.remote_status(a.endpoint(1)) is Status.DEAD, timeout_s=20,
               what="the 300th worker's kill seen on b")


def test_what_cannot_be_carried_is_said_and_live_slots_go_first(
        board_name: str, procs: Procs, caplog: Any) -> None:
    """Entries of the largest size a board holds (a 63-byte key, 255 bytes of
    endpoints): 447 fit in a digest.  60 dead and 520 live slots: the digest carries
    live ones only, as many as fit; what is left out is counted and logged."""
    from shmhb.net.protocol import MAX_DIGEST_BODY_BYTES, DigestEntry, encode_entries
    board = shmhb.Board.create(board_name, slots=600, suspect_after_s=0.5, dead_after_s=1.0)
    eps = [",".join(f"{'h' * 52}-{k}.x:{30000 + j}" for j in range(4)) for k in range(2)]
    dead = procs.program(child("dead_registrant"), board.name, eps[0])
    dead.kill()
    dead.wait(10)
    hbs = [board.register(f"live-{i:03d}-" + "k" * 54, endpoints=eps[1].split(","), agent=False)
           for i in range(520)]
    one = DigestEntry(hbs[0].key, 1, 1, 1, 0, tuple(eps[1].split(",")))
    fit = (MAX_DIGEST_BODY_BYTES - 2) // (len(encode_entries((one,))) - 2)
    assert 256 < fit < 520
    counted: dict[str, int] = {}
    try:
        # the dead process's 60 slots dead by age (the live ones may read dead too by
        # then, on a busy machine: they beat only below, so count the dead process's)
        wait_until(lambda: sum(s.status is Status.DEAD and s.key.startswith("dead-")
                               for s in board.slots()) == 60,
                   timeout_s=20, what="60 slots dead by age")
        for hb in hbs:
            hb.beat()
        with caplog.at_level("WARNING", logger="shmhb.net.digest"):
            d = LocalDigest(board, lambda stat, n=1: counted.__setitem__(stat, counted.get(stat, 0) + n))
        got = _statuses(d)
        assert len(got) == fit and set(got.values()) == {Status.ALIVE.code}
        assert d.cut == 580 - fit and counted == {"digest_cut": 580 - fit}
        assert f"{580 - fit} slot(s) left out of the digest" in caplog.text
    finally:
        for hb in hbs:
            hb.close()
        board.close()


def test_a_cut_digest_says_so_and_its_receiver_counts_it(procs: Procs, cluster: Cluster) -> None:
    """1,800 live slots of 60-byte keys: more than one ACK carries (about 1,560 of that
    size).  The ACK says it is cut (its ``full`` byte reads 2) and the host that follows
    counts it (``digest_cut_seen``) and warns: before, the receiver took the cut digest for
    the whole board and nothing on its side said why 240 live workers read GONE."""
    a = cluster.host(slots=2000)
    b = cluster.host()
    procs.program(BULK, a.name, "x" * 55 + "-", "1800", a.ip, "34000")
    b.watch(a)
    wait_until(lambda: b.stats()["digest_cut_seen"] >= 1, timeout_s=60,
               what="b counting a's cut digest")
    wait_until(lambda: a.stats()["digest_cut"] >= 1800 - 1600, timeout_s=60,
               what="a counting what it cut")

    def carried() -> list[shmhb.SlotStatus] | None:
        peer = b.peer(a)
        return peer.slots if peer is not None and len(peer.slots) > 1400 else None

    def all_alive() -> bool:
        got = carried()
        return got is not None and all(s.status is Status.ALIVE for s in got)
    slots = wait_until(carried, timeout_s=60, poll_s=0.1, what="b holding what fitted")
    assert len(slots) < 1800
    wait_until(all_alive, timeout_s=30, poll_s=0.1,
               what="every slot carried alive (live ones go first)")


def test_the_cut_byte_round_trips_and_nothing_past_it_is_accepted() -> None:
    ident = Identity(os.urandom(16), 9)
    body = encode_entries(())
    for cut in (False, True):
        ack = decode(encode_ack_raw(7, ident, "127.0.0.1:1", 3, body, None, cut=cut))
        assert isinstance(ack, Ack) and ack.full and ack.cut is cut
    plain = decode(encode_ack_raw(7, ident, "127.0.0.1:1", 3, None, None, cut=True))
    assert isinstance(plain, Ack) and not plain.full and not plain.cut  # no digest, no cut
    frame = bytearray(encode_ack_raw(7, ident, "127.0.0.1:1", 3, body, None, cut=True))
    assert frame[48] == 2
    frame[48] = 3
    with pytest.raises(FrameRejected, match="malformed"):
        decode(bytes(frame))


def test_a_board_holds_no_more_slots_than_one_ack_lists() -> None:
    """The door uses the wire's limit: a slot past 4,096 would never reach another host."""
    from shmhb.board.config import Capacity
    from shmhb.errors import InvalidConfig
    from shmhb.net.protocol import MAX_DIGEST_ENTRIES
    assert Capacity(slots=MAX_DIGEST_ENTRIES).slots == 4096
    with pytest.raises(InvalidConfig, match=r"slots must be an integer in 1\.\.4096"):
        Capacity(slots=MAX_DIGEST_ENTRIES + 1)
