"""Rate-limited logs, for what outsiders can make us log over and over (bad rows
left by an older version, bad frames, a network half that keeps failing): the first of
each kind at once, then at most one per interval, with how many were suppressed
meanwhile.  The one way this package rate-limits a log."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """``warn(kind, msg, *args)`` (or ``error``) logs at most once per ``every_s`` per
    ``kind``; ``now_ns``: the clock to time it by (a module's injected clock, where it
    has one)."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0,
                 now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._log = logger
        self._every_ns = int(every_s * 1e9)
        self._now_ns = now_ns
        self._last: dict[str, tuple[int, int]] = {}  # kind -> (last logged ns, suppressed)
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        self._emit(logging.WARNING, kind, msg, args)

    def error(self, kind: str, msg: str, *args: object) -> None:
        self._emit(logging.ERROR, kind, msg, args)

    def _emit(self, level: int, kind: str, msg: str, args: tuple[object, ...]) -> None:
        now = self._now_ns()
        with self._lock:
            last, skipped = self._last.get(kind, (None, 0))
            if last is not None and now - last < self._every_ns:
                self._last[kind] = (last, skipped + 1)
                return
            self._last[kind] = (now, 0)
        more = f" ({skipped} more since the last report)" if skipped else ""
        self._log.log(level, msg + more + " [logged at most every %g s]", *args,
                      self._every_ns / 1e9)
