"""A worker's registration in the board, and its hot path: ``beat()``.

``beat()`` is one clock read and one aligned 8-byte store into the worker's own word
(``incarnation:24 | left:1 | ts:39``).  Nobody else writes that word, so no lock and no
fence are needed: a reader sees either the previous beat or this one, both complete.
With the C extension the store is a release store (``shmhb.board.native``; see layout.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from . import locks, native
from .config import positive_seconds
from ..errors import HeartbeatClosed, LockTimeout
from .layout import LOCK_SLOT_BASE, TS_SHIFT, pack_hb, ts_units
from ..periodic import Periodic

log = logging.getLogger(__name__)

#: how long close() waits for the registry lock to move the change counter (the lock is
#: held for microseconds, unless its holder is stopped or hung)
_BUMP_WAIT_S = 0.5


_CLOSED_MSG = ("heartbeat {key!r} is closed, or was inherited through fork(): register "
               "the child under its own key")


class _ClosedWords:
    """What a disarmed pure-path beat stores into: nothing; every store raises."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __setitem__(self, i: int, v: int) -> None:
        raise HeartbeatClosed(_CLOSED_MSG.format(key=self.key))


class HeartbeatBoard(Protocol):
    """What a heartbeat needs of its board's words (``shmhb.board.core.BoardWords`` has
    it).  A protocol, not an import: the core module imports the modules it builds on."""

    name: str

    @property
    def mapping(self) -> Any: ...

    @property
    def now_ns(self) -> Callable[[], int]: ...

    @property
    def extension(self) -> ModuleType | None: ...

    def bump_changes(self, timeout_s: float | None = None) -> None: ...


class Heartbeat:
    """The slot of one registered worker.  Get one from ``Board.register``."""

    def __init__(self, board: HeartbeatBoard, index: int, key: str, incarnation: int,
                 endpoints: tuple[str, ...], lock_fd: int, word_index: int) -> None:
        self.key = key
        self.incarnation = incarnation
        self.endpoints = endpoints
        self.index = index
        self._board = board
        self._lock_fd = lock_fd
        self._word_index = word_index
        # Our own view of the segment's words: storing q[i] is one aligned 8-byte write.
        self._q = memoryview(board.mapping).cast("B").cast("Q")
        assert np.frombuffer(self._q, np.uint64, count=1).ctypes.data % 64 == 0
        self._base = pack_hb(incarnation, 0)  # the word less its timestamp
        self._now_ns = board.now_ns
        self._beater: Any = None  # the C Beater behind ``beat`` (None: pure path)
        self._cell: Any = None  # the pure path's closure cell holding the words' view
        self.beat = self._make_beat()  # type: ignore[method-assign]
        self._ticker = Periodic(f"shmhb-beat-{key}")
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []
        locks.on_fork(self)

    def beat(self) -> None:
        """Record that this worker is alive now.  Call it often (every step) or use
        ``start()``: one clock read and one store, no syscall, no lock, no allocation
        beyond the int it stores.  (Each instance replaces this method with what
        ``_make_beat`` builds: the C extension's beat -- one C call, a release store --
        or, on the pure-Python path, a closure doing the same with every name bound once.)"""
        self._q[self._word_index] = self._base | ts_units(self._now_ns())

    def _make_beat(self) -> Callable[[], None]:
        ext = self._board.extension
        if ext is not None:
            # the same word, one C call: clock read and one release store (shmhb.board.native)
            self._beater = ext.Beater(self._board.mapping, self._word_index, self._base,
                                      native.clock_arg(self._now_ns))
            fast: Callable[[], None] = self._beater.beat
            return fast
        q, i, base, now, shift = self._q, self._word_index, self._base, self._now_ns, TS_SHIFT

        def beat() -> None:
            # pack_hb(inc, ts_units(now())), inlined: a call would cost ~20 % of a beat
            q[i] = base | (now() >> shift)

        beat.__doc__ = Heartbeat.beat.__doc__
        assert beat.__closure__ is not None
        self._cell = beat.__closure__[beat.__code__.co_freevars.index("q")]
        return beat

    def _disarm(self) -> None:
        """Make every ``beat`` bound from this heartbeat (``beat = hb.beat`` taken before
        a ``close()`` or a ``fork()``) raise ``HeartbeatClosed`` instead of storing into
        the slot: replacing ``self.beat`` reaches only later look-ups, and a bound beat
        left armed would keep a closed slot's next registrant (or, in a forked child,
        the hung parent's slot) ALIVE.  Free on the hot path: the C Beater already tests
        its ``held`` flag on every call; the pure closure's words view is swapped, in
        its cell, for one whose every store raises."""
        if self._beater is not None:
            self._beater.release(HeartbeatClosed, _CLOSED_MSG.format(key=self.key))
        if self._cell is not None:
            self._cell.cell_contents = _ClosedWords(self.key)

    def start(self, interval_s: float = 0.1) -> Heartbeat:
        """Beat every ``interval_s`` from a daemon thread until ``stop()`` or ``close()``."""
        if self._closed:
            raise HeartbeatClosed(f"heartbeat {self.key!r} is closed; register again")
        positive_seconds("interval_s", interval_s)  # InvalidConfig, before any thread
        self.beat()
        self._ticker.start(self.beat, interval_s)
        return self

    def stop(self) -> None:
        """Stop the background thread (the slot stays registered and will go stale)."""
        self._ticker.stop()

    def close(self) -> None:
        """Leave gracefully: the slot reads LEFT and its key may be registered again."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        self._disarm()
        self._q[self._word_index] = pack_hb(self.incarnation, ts_units(self._now_ns()), left=True)
        self.beat = self._closed_beat  # type: ignore[method-assign]
        try:
            self._board.bump_changes(timeout_s=_BUMP_WAIT_S)
        except LockTimeout:
            # The leave is done: the word above reads LEFT.  Only the change counter
            # could not be moved, because some process is stopped (or hung) while holding
            # the registry lock; the agent moves its own counter when it sees the slot
            # leave.  A graceful shutdown must not wait seconds, then fail, for that.
            log.warning("board %s: %r left, but the registry lock is held by another "
                        "process: the change counter was not moved", self._board.name, self.key)
        finally:
            locks.unlock(self._lock_fd, LOCK_SLOT_BASE + self.index)
            os.close(self._lock_fd)
            self._lock_fd = -1
            hooks, self._close_hooks = self._close_hooks, []
            for hook in hooks:  # e.g. leaving the embedded agent (shmhb/__init__)
                hook()
        log.info("board %s: %r left (incarnation %d)", self._board.name, self.key, self.incarnation)

    def _closed_beat(self) -> None:
        raise HeartbeatClosed(_CLOSED_MSG.format(key=self.key))

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once when this heartbeat closes (after its slot lock is
        dropped): how the layer above the board ties the embedded agent's lifetime to
        the process's heartbeats without the board knowing of agents.  On a heartbeat
        already closed, ``hook()`` runs now."""
        if self._closed:
            hook()
            return
        self._close_hooks.append(hook)

    def after_fork_in_child(self) -> None:
        """In a forked child: never beat for the parent, never hold its slot lock."""
        self._closed = True
        self._close_hooks = []  # the parent's: its agent is not this process's
        self._disarm()  # the child's copies of the beat objects; the parent's stay armed
        self._ticker.after_fork_in_child()
        self._q = memoryview(bytearray(8)).cast("Q")
        self._word_index = 0
        self.beat = self._closed_beat  # type: ignore[method-assign]
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the parent's description keeps its lock
            self._lock_fd = -1

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<shmhb.Heartbeat {self.key!r} incarnation={self.incarnation} slot={self.index}>"

