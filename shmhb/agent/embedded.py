"""Embedded agents: one per process and board, alive while the process holds a heartbeat
of that board (``Board.register(..., agent=True)``, the default).  The register hook
``shmhb/__init__`` installs joins it; the last heartbeat to close stops it."""

from __future__ import annotations

import os
import threading

from .role import Agent
from ..board.handle import Board
from ..board.heartbeat import Heartbeat

__all__ = ["embedded_join", "embedded_leave", "embedded_register"]


_embedded: dict[str, tuple[Agent, set[int]]] = {}
_embedded_lock = threading.Lock()


def embedded_join(board_name: str, hb: object) -> None:
    with _embedded_lock:
        entry = _embedded.get(board_name)
        if entry is None:
            entry = (Agent(board_name).start(), set())
            _embedded[board_name] = entry
        entry[1].add(id(hb))


def embedded_leave(board_name: str, hb: object) -> None:
    _embedded_leave_id(board_name, id(hb))


def embedded_register(board: Board, hb: Heartbeat) -> None:
    """The register hook (``board.set_register_hook``, installed by ``shmhb/__init__``):
    join the embedded agent of ``board`` for ``hb``, and leave it when ``hb`` closes (the
    last heartbeat of a board in this process stops its embedded agent)."""
    name = board.name
    embedded_join(name, hb)
    token = id(hb)  # the hook must not keep ``hb`` alive through its own close hooks
    hb.on_close(lambda: _embedded_leave_id(name, token))


def _embedded_leave_id(board_name: str, token: int) -> None:
    with _embedded_lock:
        entry = _embedded.get(board_name)
        if entry is None:
            return
        entry[1].discard(token)
        if entry[1]:
            return
        del _embedded[board_name]
    entry[0].stop()


def _reset_after_fork() -> None:
    global _embedded_lock
    _embedded_lock = threading.Lock()
    _embedded.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
