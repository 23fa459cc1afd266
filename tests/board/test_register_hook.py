"""``Board.register`` starts this process's embedded agent through the hook that the
package installs (the board itself never imports the agent), and the last heartbeat's
close stops it."""

from __future__ import annotations

import os

import pytest

from shmhb.board.handle import Board, set_register_hook
from shmhb.board.heartbeat import Heartbeat
from shmhb.status import Status

from ..conftest import wait_until



def test_register_starts_the_embedded_agent_and_the_last_close_stops_it(board: Board) -> None:
    a = board.register("hook-a")
    b = board.register("hook-b")
    try:
        wait_until(lambda: board.agent().status is Status.ALIVE
                   and board.agent().pid == os.getpid(), what="the embedded agent holds the role")
        a.close()
        assert board.agent().status is Status.ALIVE  # b still beats in this process
        assert board.agent_held()
    finally:
        b.close()
        a.close()
    # the last heartbeat of this board in this process is gone: so is the agent
    assert not board.agent_held()
    assert board.agent().status is Status.LEFT


def test_the_hook_runs_only_when_asked_and_a_failed_hook_undoes_the_registration(
        board: Board) -> None:
    calls: list[tuple[Board, Heartbeat]] = []
    closed: list[str] = []

    def record(b: Board, hb: Heartbeat) -> None:
        calls.append((b, hb))
        hb.on_close(lambda: closed.append(hb.key))

    prev = set_register_hook(record)
    try:
        with board.register("quiet", agent=False):
            assert calls == []
        hb = board.register("loud")
        assert calls == [(board, hb)] and closed == []
        hb.close()
        assert closed == ["loud"]
        hb.on_close(lambda: closed.append("late"))  # on a closed heartbeat: at once
        assert closed == ["loud", "late"]

        def refuse(b: Board, hb: Heartbeat) -> None:
            raise RuntimeError("no agent today")

        set_register_hook(refuse)
        with pytest.raises(RuntimeError, match="no agent today"):
            board.register("refused")
        got = board.slot("refused")
        assert got is not None and got.status is Status.LEFT  # undone, not left held
        set_register_hook(None)
        board.register("refused").close()  # the key is free again; nothing starts
    finally:
        set_register_hook(prev)
    assert prev is not None  # the package's own hook, installed by ``import shmhb``
    assert not board.agent_held()
