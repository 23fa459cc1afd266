"""``Board.remote`` against a whole read of the same rows.

A handle memoises its choice of row per endpoint and, when the memo misses, judges the
row again from its status words alone (``RemoteReads._rejudge``).  Whatever the pinger
writes in between -- a new status, a beat, a stale peer, a row or peer row reused, a
row caught in the middle of its rewrite -- a kept handle must read exactly what a fresh
handle, which reads every row whole, reads.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.board import layout as L
from shmhb.clock import FakeClock
from shmhb.net.protocol import DigestEntry
from shmhb.net.rowwriter import RemoteRow, RowWriter
from shmhb.status import Status

EP = "10.0.0.2:30003"


class Rows:
    """The board, its pinger's row writer and a kept reader, on one fake clock."""

    def __init__(self, name: str) -> None:
        self.clock = FakeClock()
        self.name = name
        self.b = shmhb.Board.create(name, slots=8, clock=self.clock)
        self.w = RowWriter(self.b)
        self.kept = shmhb.Board.attach(name, clock=self.clock)

    def close(self) -> None:
        self.kept.close()
        self.b.close()

    def now_ns(self) -> int:
        return self.clock.monotonic_ns()

    def agent_beat(self) -> None:
        board_words(self.b).words[L.header_index("agent_hb")] = L.pack_hb(1, self.now_ns() >> L.TS_SHIFT)

    def entry(self, key: str, inc: int, status: Status) -> DigestEntry:
        return DigestEntry(key, inc, status.code, 40 + inc, 0, (EP,))

    def follow(self) -> tuple[int, int, RemoteRow]:
        """An observing agent, a followed host ALIVE and its worker "r0" at ``EP``:
        the peer row, its generation, and the worker's remote row."""
        self.agent_beat()
        p, pgen = self.w.new_peer("10.0.0.2:45645")  # type: ignore[misc]
        self.w.peer_status(p, pgen, Status.ALIVE, self.now_ns())
        held = self.w.put_remote(p, pgen, None, self.entry("r0", 11, Status.ALIVE), self.now_ns())
        assert held is not None
        return p, pgen, held

    def check(self) -> Any:
        """The kept handle reads what a fresh one reads, floats bit for bit."""
        kept = self.kept.remote(EP)
        fresh = shmhb.Board.attach(self.name, clock=self.clock)
        try:
            whole = fresh.remote(EP)
        finally:
            fresh.close()
        assert kept == whole
        if kept is not None:
            for x, y in zip(kept, whole):  # type: ignore[arg-type]
                if isinstance(x, float):
                    assert struct.pack("<d", x) == struct.pack("<d", y)
        return kept


@pytest.fixture
def rows(board_name: str) -> Iterator[Rows]:
    r = Rows(board_name)
    try:
        yield r
    finally:
        r.close()


def test_a_kept_reader_reads_what_a_whole_read_reads(rows: Rows) -> None:
    w = rows.w
    p, pgen, held = rows.follow()
    first = rows.check()
    assert first.key == "r0" and first.status is Status.ALIVE
    rows.clock.advance(0.004)  # the clock moves: the memo misses, the words do not
    moved = rows.check()
    assert moved.age_s > first.age_s
    # a stale report with the worker's own beat, then a stale host
    w.remote_status(held, Status.SUSPECT.code, rows.now_ns(), beat_ns=rows.now_ns() - 10**9)
    rows.clock.advance(0.003)
    s = rows.check()
    assert s.status is Status.SUSPECT and s.beat_age_s is not None and s.beat_age_s > 1.0
    w.peer_status(p, pgen, Status.SUSPECT, rows.now_ns() - 10**9)
    rows.clock.advance(0.002)
    assert rows.check().status is Status.SUSPECT
    rows.clock.advance(2.0)  # nobody observes: UNKNOWN, whatever the rows say
    assert rows.check().status is Status.UNKNOWN
    rows.agent_beat()
    w.peer_status(p, pgen, Status.ALIVE, rows.now_ns())
    w.remote_status(held, Status.ALIVE.code, rows.now_ns())
    assert rows.check().status is Status.ALIVE
    # the row freed and reused by another worker at the same endpoint
    w.free_remote(held.row)
    assert rows.check() is None
    again = w.put_remote(p, pgen, None, rows.entry("r1", 5, Status.ALIVE), rows.now_ns())
    assert again is not None and again.row == held.row and again.gen != held.gen
    s = rows.check()
    assert s.key == "r1" and s.incarnation == 5
    rows.clock.advance(0.002)
    assert rows.check().key == "r1"


def test_a_reused_peer_row_is_never_read_as_the_old_host(rows: Rows) -> None:
    w = rows.w
    p, pgen, _ = rows.follow()
    assert rows.check().status is Status.ALIVE
    w.free_peer(p)
    p2, pgen2 = w.new_peer("10.0.0.9:45645")  # type: ignore[misc]
    assert (p2, pgen2 != pgen) == (p, True)  # the same row, a new generation
    w.peer_status(p2, pgen2, Status.ALIVE, rows.now_ns())
    rows.clock.advance(0.002)
    assert rows.check() is None  # the remote row names the old peer generation


def test_a_row_caught_mid_rewrite_reads_as_its_old_record_or_not_at_all(rows: Rows) -> None:
    b = rows.b
    _, _, held = rows.follow()
    old = rows.check()
    # the writer's steps for a new generation, stopped after each (rowwriter.put_remote):
    # the reader sees the old record whole, or nothing; never the new key under the old
    row = board_words(b).remote_table[held.row]
    steps = [("checksum", 0), ("gen", held.gen + 1), ("incarnation", 12), ("pid", 52),
             ("key", b"r9")]
    for field, value in steps:
        row[field] = value
        rows.clock.advance(0.002)
        got = rows.kept.remote(EP)
        assert got is None or got[:3] == old[:3], (field, got)
        rows.check()
