"""A beat bound before ``fork()`` (``beat = hb.beat`` in a step loop,
then a helper forked) must not let the child keep the hung parent's slot ALIVE; nor may
a beat bound before ``close()`` store into a slot its next registrant owns."""

from __future__ import annotations

import sys

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.status import Status
from tests.conftest import Procs, wait_until
from ..children import child

BOUND_FORKER = child("bound_forker")


@pytest.mark.parametrize("pure", ["0", "1"], ids=["native", "pure"])
def test_child_of_a_bound_beat_cannot_keep_the_hung_parent_alive(
        board: shmhb.Board, procs: Procs, agent: object, pure: str) -> None:
    p = procs.spawn([sys.executable, BOUND_FORKER, board.name], ready=False,
                    env={"SHMHB_PURE_PYTHON": pure})
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line == "ready child-beat-refused", line
    # The parent is alive and holds its slot; only its silence convicts it.
    wait_until(lambda: (s := board.slot("parent")) is not None and s.status is Status.DEAD,
               timeout_s=10, what="the silent parent reads DEAD despite its child")
    assert p.poll() is None


@pytest.mark.usefixtures("hot_path")
def test_a_beat_bound_before_close_cannot_store_into_the_next_registrant(
        board_name: str) -> None:
    b = shmhb.Board.create(board_name, slots=1)
    try:
        hb = b.register("w", agent=False)
        beat = hb.beat
        hb.close()
        with pytest.raises(shmhb.HeartbeatClosed):
            beat()
        hb2 = b.register("other", agent=False)
        assert hb2.index == hb.index
        before = int(board_words(b).words[board_words(b).hb_index(hb2.index)])
        with pytest.raises(shmhb.HeartbeatClosed):
            beat()
        assert int(board_words(b).words[board_words(b).hb_index(hb2.index)]) == before
        hb2.close()
    finally:
        b.close()
