"""Which hot path runs: the C extension ``shmhb._native`` or the pure-Python one.

``native`` is True when the extension was built (``pip install .`` with a C compiler)
and ``SHMHB_PURE_PYTHON`` is not set to ``1``.  Both paths read and write the same words
and judge them by the same rule (``shmhb/include/shmhb.h`` mirrors ``shmhb.board.judge``; the
tests check they agree bit for bit), so processes on either path share a board.

The factories below are the one place that chooses: ``Heartbeat`` asks for its beat
callable, ``Board`` for its word loader, slot reader and per-endpoint memos,
``judge.judge_local_array`` for the extension itself (its whole-board judge).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

PURE_ENV = "SHMHB_PURE_PYTHON"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") == "1":
        return None
    try:
        from .. import _native  # type: ignore[attr-defined]
    except ImportError:  # built without a compiler: the pure-Python path
        return None
    return _native  # type: ignore[no-any-return]


_ext = _load()

#: whether the C hot path is active in this process
native: bool = _ext is not None


def extension(use_native: bool | None = None) -> ModuleType | None:
    """The extension module if the native path is to be used, else None.  ``use_native``
    overrides the process-wide choice (tests run both paths side by side); asking for
    it where it was not built raises ``ImportError``."""
    if use_native is None:
        return _ext
    if not use_native:
        return None
    if _ext is not None:
        return _ext
    from .. import _native  # type: ignore[attr-defined]
    return _native  # type: ignore[no-any-return]


def clock_arg(now_ns: Callable[[], int]) -> Callable[[], int] | None:
    """What the extension takes as a clock: None for CLOCK_MONOTONIC (read in C; it is
    the clock ``time.monotonic_ns`` reads), else the injected callable."""
    import time

    return None if now_ns is time.monotonic_ns else now_ns


class WordMemo:
    """Pure-Python twin of ``_native.WordMemo``: the answer memoised for three words of
    the board and a clock unit.  ``get(now)`` returns it while the words and ``now``
    are what it was stored for, else None (remembering what it saw, and for which
    thread); ``put(now, answer)`` stores it only for that thread and only if the words
    still read what its ``get`` saw, so the answer was computed from those very words."""

    __slots__ = ("_q", "_i", "_j", "_k", "_hit", "_seen")

    def __init__(self, q: memoryview, i: int, j: int, k: int) -> None:
        self._q, self._i, self._j, self._k = q, i, j, k
        # each replaced whole (one attribute store), so a thread never pairs the words
        # of one store with the answer of another
        self._hit: tuple[tuple[int, int, int, int], Any] | None = None
        self._seen: tuple[tuple[int, int, int, int], int] | None = None

    def get(self, now: int) -> Any:
        q = self._q
        w = (q[self._i], q[self._j], q[self._k], now)
        hit = self._hit
        if hit is not None and hit[0] == w:
            return hit[1]
        self._seen = (w, threading.get_ident())
        return None

    def put(self, now: int, answer: Any) -> Any:
        q = self._q
        w = (q[self._i], q[self._j], q[self._k], now)
        if answer is not None and self._seen == (w, threading.get_ident()):
            self._hit = (w, answer)
        return answer
