"""Rate-limited warnings, for what outsiders can make us log over and over (bad rows
left by an older version, bad frames): the first of each kind at once, then at most
one per interval, with how many were suppressed meanwhile."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """``warn(kind, msg, *args)`` logs at most once per ``every_s`` per ``kind``."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self._log = logger
        self._every_ns = int(every_s * 1e9)
        self._last: dict[str, tuple[int, int]] = {}  # kind -> (last logged ns, suppressed)
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic_ns()
        with self._lock:
            last, skipped = self._last.get(kind, (None, 0))
            if last is not None and now - last < self._every_ns:
                self._last[kind] = (last, skipped + 1)
                return
            self._last[kind] = (now, 0)
        more = f" ({skipped} more since the last report)" if skipped else ""
        self._log.warning(msg + more + " [logged at most every %g s]", *args,
                          self._every_ns / 1e9)
