"""Embedded agents: one per process and board, alive while the process holds a heartbeat
of that board (``shmhb.Board.register(..., agent=True)``, the default): its
registration joins it; the last heartbeat to close stops it.

``Board`` here is the package's public ``shmhb.Board``: the storage layer's board
(``shmhb.board.handle.Board``) whose ``register`` also joins the embedded agent.  The
agent module, and zmq with it, is imported on the first registration that wants it,
not by ``import shmhb``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..board import handle
from ..board.heartbeat import Heartbeat

if TYPE_CHECKING:
    from .role import Agent

__all__ = ["Board", "embedded_join", "embedded_leave", "embedded_register"]


class Board(handle.Board):
    """A handle on one host's board (``shmhb.board.handle.Board``), whose ``register``
    also joins the election for the host's agent role unless told not to."""

    def register(self, key: str, endpoints: Iterable[str] = (), *,
                 agent: bool = True) -> Heartbeat:
        """Claim a slot for ``key`` in this process and return its ``Heartbeat``.

        The slot of a key whose previous holder died or left is reused with a new
        incarnation.  ``KeyInUse`` if a live process holds the key, ``BoardFull`` if no
        slot is free.  ``agent``: also join the election for the host's agent role, so
        deaths are detected with no separate daemon (a registration whose agent cannot
        start is undone).
        """
        hb = super().register(key, endpoints)
        if agent:
            try:
                embedded_register(self, hb)
            except BaseException:
                hb.close()
                raise
        return hb


_embedded: dict[str, tuple[Agent, set[int]]] = {}
_embedded_lock = threading.Lock()


def embedded_join(board_name: str, hb: object) -> None:
    with _embedded_lock:
        entry = _embedded.get(board_name)
        if entry is None:
            from .role import Agent  # the agent, and zmq, on the first registration

            entry = (Agent(board_name).start(), set())
            _embedded[board_name] = entry
        entry[1].add(id(hb))


def embedded_leave(board_name: str, hb: object) -> None:
    _embedded_leave_id(board_name, id(hb))


def embedded_register(board: handle.Board, hb: Heartbeat) -> None:
    """Join the embedded agent of ``board`` for ``hb``, and leave it when ``hb`` closes
    (the last heartbeat of a board in this process stops its embedded agent)."""
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
