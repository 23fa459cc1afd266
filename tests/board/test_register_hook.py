"""``shmhb.Board.register`` starts this process's embedded agent (the storage layer's
``shmhb.board.handle.Board`` never imports the agent), and the last heartbeat's close
stops it."""

from __future__ import annotations

import os

import pytest

import shmhb
from shmhb.agent import embedded
from shmhb.board import handle
from shmhb.board.core import board_words
from shmhb.board.heartbeat import Heartbeat
from shmhb.status import Status

from ..conftest import wait_until



def test_register_starts_the_embedded_agent_and_the_last_close_stops_it(board: shmhb.Board) -> None:
    a = board.register("hook-a")
    b = board.register("hook-b")
    try:
        wait_until(lambda: board.agent().status is Status.ALIVE
                   and board.agent().pid == os.getpid(), what="the embedded agent holds the role")
        a.close()
        assert board.agent().status is Status.ALIVE  # b still beats in this process
        assert board_words(board).agent_held()
    finally:
        b.close()
        a.close()
    # the last heartbeat of this board in this process is gone: so is the agent
    assert not board_words(board).agent_held()
    assert board.agent().status is Status.LEFT


def test_the_agent_joins_only_when_asked_and_a_failed_join_undoes_the_registration(
        board: shmhb.Board, monkeypatch: pytest.MonkeyPatch) -> None:
    assert shmhb.Board is embedded.Board and issubclass(shmhb.Board, handle.Board)
    with board.register("quiet", agent=False):
        assert not board_words(board).agent_held()
    with handle.Board.attach(board.name) as storage:  # the storage layer's board
        with storage.register("storage"):
            assert not board_words(board).agent_held()

    def refuse(b: handle.Board, hb: Heartbeat) -> None:
        raise RuntimeError("no agent today")

    monkeypatch.setattr(embedded, "embedded_register", refuse)  # the agent cannot start
    with pytest.raises(RuntimeError, match="no agent today"):
        board.register("refused")
    got = board.slot("refused")
    assert got is not None and got.status is Status.LEFT  # undone, not left held
    board.register("refused", agent=False).close()  # the key is free again
    assert not board_words(board).agent_held()
