"""The local digest: what a new holder of the agent role answers with, and when it is
judged again."""

from __future__ import annotations

import os
import time

import shmhb
from shmhb import Status
from shmhb.clock import FakeClock
from shmhb.digest import LocalDigest
from shmhb.layout import TS_SHIFT
from shmhb.protocol import Ack, Identity, decode, encode_ack_raw


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
