"""The lease rule on SGLang's side (``shmhb.sglang.lease``), with SGLang 0.5.23's real
classes over Mooncake TCP: a decode's go-ahead is a promise for a bounded time.  The
prefill writes a granted room's chunks only while its lease runs, checking before each
chunk; the decode fails a granted room no earlier than its lease's end, whatever drops
its prefill, and then at once.  A short lease here (``LEASE_S``) so it runs out within
a test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import wait_until

from .conftest import make_stack, require_sglang

require_sglang()

from .engine import expected_digest, zeros_digest  # noqa: E402
from .stack import Rank, Stack, alive_on_decode_host, new_room  # noqa: E402

pytestmark = pytest.mark.system

LEASE_S = 4.0
#: the decode's lease (the prefill reads it from the go-ahead's reply); the wait for
#: an answer must stay under half of it
ENV = {"SHMHB_SGLANG_GRANT_LEASE_S": str(LEASE_S), "SHMHB_SGLANG_GRANT_TIMEOUT_S": "1"}
#: a held room fails within this of its lease's end (a hold is looked at every 20 ms;
#: the rest is load on a shared 2-core machine)
LATE_S = 1.5
PAGES, SPLIT = 64, 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True)


def ranks(stack: Stack, pages: int = PAGES) -> tuple[Rank, Rank]:
    """A fresh prefill and decode with the short lease, one room served."""
    for r in stack.ranks:
        r.close()
    stack.ranks.clear()
    p = stack.start("prefill", pages=pages, env=ENV)
    d = stack.start("decode", pages=pages, env=ENV)
    served(p, d, seed=1, pages=pages)
    alive_on_decode_host(stack, p)
    return p, d


def served(p: Rank, d: Rank, seed: int, pages: int = PAGES) -> None:
    room = new_room()
    p.send("prefill", room=room, seed=seed)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    ev = d.expect("received", "recv_failed", room=room, timeout_s=60)
    assert ev["ev"] == "received" and ev["digest"] == expected_digest(seed, pages), ev
    p.expect("sent", room=room)


def landed(d: Rank) -> int:
    return int(d.request("landed", "landed")["pages"])


def first_chunk_written(p: Rank, d: Rank, seed: int) -> tuple[int, float]:
    """A room sent in two chunks, its first written: the room, and a time before its
    go-ahead was asked (so before the decode's lease of it began)."""
    room = new_room()
    p.send("prefill", room=room, seed=seed, hold=True, split=SPLIT)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    t_go = p.send_at("go", room=room)
    wait_until(lambda: landed(d) == SPLIT, timeout_s=30, what="the first chunk written")
    return room, t_go


def test_a_prefill_stopped_after_its_grant_writes_nothing_once_the_lease_ran_out(
        stack: Stack) -> None:
    """SIGSTOP between the two chunks of a granted room: the board drops the prefill
    (dead-after, 2 s), the decode holds the room until the lease ends, then fails it;
    resumed after that, the prefill finds its lease run out before the second chunk,
    writes nothing and fails the room; then it serves again."""
    p, d = ranks(stack)
    room, t_go = first_chunk_written(p, d, seed=2)
    t_stop = p.stop()
    p.send("rest", room=room)  # read when it resumes: the chunk it was about to write
    ev = d.expect("received", "recv_failed", room=room, timeout_s=30)
    print(f"room failed {ev['t'] - t_stop:.3f} s after the stop, {ev['t'] - t_go:.3f} s "
          f"after the go: {ev['reason']}")
    assert ev["ev"] == "recv_failed", ev
    assert ev["t"] >= t_go + LEASE_S, "the room failed while its go-ahead's lease ran"
    assert ev["t"] < t_stop + LEASE_S + LATE_S, "the room was not failed at its lease's end"
    assert "lease" in ev["reason"], ev
    p.cont()
    sent = p.expect("sent", "send_failed", room=room, timeout_s=30)
    assert sent["ev"] == "send_failed" and "ran out" in sent["reason"], sent
    assert landed(d) == SPLIT, "a chunk was written after its lease ran out"
    assert d.request("digest", "digest", start=SPLIT, pages=PAGES - SPLIT)["digest"] \
        == zeros_digest(PAGES - SPLIT)
    alive_on_decode_host(stack, p)
    served(p, d, seed=3)


def test_a_prefill_killed_mid_granted_write_keeps_the_room_until_the_lease_ends(
        stack: Stack) -> None:
    """Killed between the chunks of a granted room: the board's verdict is at once, the
    dead rank's entries go at once (no later room is sent to it), but the room's pages
    stay out of SGLang's hands until the lease ran out (the board cannot tell a killed
    prefill from one that may resume and write), then it fails; a restarted prefill
    serves the next room."""
    p, d = ranks(stack)
    room, t_go = first_chunk_written(p, d, seed=4)
    t_kill = p.kill()
    wait_until(lambda: not any(k.startswith(p.bootstrap) for k in
                               d.request("state", "state")["connection_pool"]),
               timeout_s=2.0, what="the dead rank's entries evicted")
    ev = d.expect("received", "recv_failed", room=room, timeout_s=30)
    print(f"room failed {ev['t'] - t_kill:.3f} s after the kill: {ev['reason']}")
    assert ev["ev"] == "recv_failed", ev
    assert ev["t"] >= t_go + LEASE_S, "the room failed while its go-ahead's lease ran"
    assert ev["t"] < t_kill + LEASE_S + LATE_S, "the room was not failed at its lease's end"
    p2 = stack.start("prefill", env=ENV)
    served(p2, d, seed=5)


BIG = 2048  # pages of 64 KiB: a 128 MiB room, a few hundred ms over Mooncake's TCP


def test_a_prefill_killed_mid_transfer_the_room_fails_at_its_lease_end(stack: Stack) -> None:
    """Killed in the middle of one chunk's copy (a single 128 MiB chunk): the same rule
    as between chunks, and no later room goes to the dead rank."""
    try:
        p, d = ranks(stack, BIG)
        room = new_room()
        p.send("prefill", room=room, seed=6, hold=True)
        d.send("recv", room=room, bootstrap=p.bootstrap)
        p.expect("waiting", room=room)
        t_go = p.send_at("go", room=room)
        n = wait_until(lambda: landed(d), timeout_s=30, what="the first page of the write")
        t_kill = p.kill()
        print(f"killed with {n}..{landed(d)} of {BIG} pages landed")
        wait_until(lambda: not any(k.startswith(p.bootstrap) for k in
                                   d.request("state", "state")["connection_pool"]),
                   timeout_s=2.0, what="the dead rank's entries evicted")
        done = d.expect("received", "recv_failed", room=room, timeout_s=60)
        if done["ev"] == "received":
            pytest.skip("the write finished before the kill: nothing was cut (a faster machine)")
        print(f"room failed {done['t'] - t_kill:.3f} s after the kill: {done['reason']}")
        assert done["t"] >= t_go + LEASE_S, "the room failed while its go-ahead's lease ran"
        assert done["t"] < t_kill + LEASE_S + LATE_S
        p2 = stack.start("prefill", pages=BIG, env=ENV)
        served(p2, d, seed=7, pages=BIG)
    finally:  # the ranks of BIG rooms go
        for r in stack.ranks:
            r.close()
        stack.ranks.clear()
