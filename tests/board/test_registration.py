"""Registration without the registry lock (``shmhb.board.registration``):
many processes registering at once while a stopped process holds the registry lock get
distinct, growing incarnations, and a key is held by one live process at most."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.testing.loopback import child_env
from shmhb.board.registration import issue_incarnation, key_bucket

from ..children import child
from ..conftest import Procs, Stall
from ..stopping import resume

RACER = child("racer")


def _race(board: shmhb.Board, keysets: list[list[str]]) -> list[list[list]]:  # type: ignore[type-arg]
    ps = [subprocess.Popen([sys.executable, RACER, board.name, ",".join(ks)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env=child_env()) for ks in keysets]
    try:
        for p in ps:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in ps:
            assert p.stdout is not None
            out.append(json.loads(p.stdout.readline()))
        return out
    finally:
        for p in ps:
            p.kill()
            p.wait(10)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


@pytest.mark.system
@pytest.mark.parametrize("stalled", [True, False], ids=["lock-stalled", "lock-free-to-take"])
def test_racing_registrants_get_distinct_incarnations_and_one_holder_per_key(
        board_name: str, stalled: bool) -> None:
    board = shmhb.Board.create(board_name, slots=256)
    stall = Stall(board.name) if stalled else None
    try:
        # six processes; every key is asked for by two of them at once
        keys = [f"k{i}" for i in range(30)]
        sets = [keys[j::3] for j in range(3)] * 2
        got = [r for out in _race(board, sets) for r in out]
        won = [r for r in got if r[1] >= 0]
        assert sorted(r[0] for r in won) == sorted(keys), "each key held exactly once"
        incs = [r[2] for r in won]
        assert len(set(incs)) == len(incs), "incarnations are distinct"
        assert len({r[1] for r in won}) == len(won), "one slot per registration"
        for key, slot, inc in won:
            s = board.slot(key)
            assert s is not None and s.incarnation == inc and s.status is not Status.LEFT
        if stalled:
            assert min(incs) > int(board_words(board).header["inc_counter"])  # issued above it, not written
    finally:
        if stall is not None:
            stall.release()
        board.close()
        board.unlink()
    # the racers are gone: their slots are dead or left, and a registration under the
    # lock reads newer than all of them


@pytest.mark.system
def test_after_a_stall_registrations_with_the_lock_read_newer(board: shmhb.Board) -> None:
    stall = Stall(board.name)
    try:
        with board.register("past", agent=False) as hb:  # waits 1 s, then goes on without
            past = hb.incarnation
    finally:
        stall.release()
    with board.register("next", agent=False) as hb2, board.register("past", agent=False) as hb3:
        assert past < hb2.incarnation < hb3.incarnation


HOLD_BUCKET = child("hold_bucket")


def test_a_registrant_stopped_mid_way_delays_only_its_key_and_is_named(
        board: shmhb.Board, procs: Procs) -> None:
    """A registrant stopped while it claims ``x`` (it holds ``x``'s bucket): ``x`` cannot
    be registered meanwhile, and the error names the stopped process; every other key
    can (a key of another bucket, which is all but 1 in 65,536)."""
    p = procs.program(HOLD_BUCKET, board.name, "x", ready=False)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    other = next(k for k in (f"y{i}" for i in range(100))
                 if key_bucket(k.encode()) != key_bucket(b"x"))
    with board.register(other, agent=False):
        assert board.status(other) is Status.ALIVE
    with pytest.raises(shmhb.LockTimeout, match=rf"pid {p.pid} \(stopped\)"):
        board.register("x", agent=False)
    resume(p.pid)
    p.wait(10)
    with board.register("x", agent=False):
        assert board.status("x") is Status.ALIVE


def test_an_issued_incarnation_keeps_its_slot_and_skips_bad_tags() -> None:
    for floor in (0, 5, 1 << 40, (1 << 24) - 3):
        for index in (0, 1, 63):
            inc = issue_incarnation(floor, index, 64, prev=0)
            assert inc > floor and inc % 64 == index and inc & 0xFFFFFF != 0
    prev = issue_incarnation(100, 3, 64, prev=0)
    # a floor whose next value in slot 3 carries prev's tag is stepped past
    nxt = issue_incarnation(prev + (1 << 24) - 1, 3, 64, prev=prev)
    assert nxt & 0xFFFFFF != prev & 0xFFFFFF and nxt % 64 == 3
