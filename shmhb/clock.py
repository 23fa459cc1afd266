"""Injected clocks.  Production code takes a ``Clock``; tests pass a ``FakeClock``."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic_ns(self) -> int: ...


class MonotonicClock:
    """CLOCK_MONOTONIC of this host: comparable across its processes, immune to wall-clock
    jumps, meaningless on another host (invariant 3)."""

    __slots__ = ()

    # The builtin itself, not a wrapper: heartbeats call it on their hot path.
    monotonic_ns = staticmethod(time.monotonic_ns)


MONOTONIC = MonotonicClock()


class FakeClock:
    """A clock that moves only when told, and never backwards."""

    def __init__(self, start_ns: int = 1_000_000_000_000) -> None:
        self._now = start_ns

    def monotonic_ns(self) -> int:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go backwards")
        self._now += int(seconds * 1e9)

    def set_ns(self, ns: int) -> None:
        if ns < self._now:
            raise ValueError("a monotonic clock does not go backwards")
        self._now = ns
