"""The lease rule on SGLang's side, as pure bookkeeping (no SGLang, no board, no clock
of its own: every call is given ``now_ns``, ``time.monotonic_ns`` of the caller).

A decode's go-ahead is a promise for a bounded time (``shmhb.kv.grants``, "The lease"):

* the prefill writes a room's chunk to a decode rank only while its lease for that
  (room, rank) runs: ``PrefillLeases``, checked before every chunk, right before it is
  written (``manager``).  The lease counts from when the prefill *sent* its ask, and is
  shortened by twice the clock-rate slack (``fence.Ask.until_ns``);
* the decode does not hand a granted room's pages back to SGLang (fail the room) before
  its lease ran out, counted from when it *read* the ask, whoever asks it to (the board's
  drop, SGLang's own health check): ``DecodeHolds`` keeps such a room until then.

Why no write lands in pages given up: the ask is read after it was sent, so the
prefill's count starts no later than the decode's; both count durations on their own
monotonic clocks, whose rates differ by at most ``grants.CLOCK_RATE_SLACK``, so the
prefill's shortened lease ends, in real time, before the decode's.  A chunk the prefill
starts writing before its lease ends therefore starts before the decode may fail the
room and let SGLang reuse its pages.  What this does not bound is a write already
started when the prefill stops for longer than the rest of the lease (the copy of one
chunk takes milliseconds; docs/SGLANG.md, "Known limits").
"""

from __future__ import annotations

import enum
import heapq
import threading
from dataclasses import dataclass


class Lease(str, enum.Enum):
    """What a prefill's bookkeeping says of a (room, decode rank) before a chunk."""

    NOT_ASKED = "not asked"  # no go-ahead yet: ask before writing
    RUNS = "runs"  # granted, and its lease runs: write
    RAN_OUT = "ran out"  # granted, but the lease ran out: write nothing, fail the room


@dataclass(frozen=True)
class RoomRank:
    room: int
    endpoint: str  # the decode rank, "host:port"


class PrefillLeases:
    """Per (room, decode rank): when the prefill's lease of its go-ahead ends
    (``time.monotonic_ns``; None: granted with no lease, a decode without shmhb that
    only the board vouches for).  Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[RoomRank, int | None] = {}

    def granted(self, key: RoomRank, until_ns: int | None) -> None:
        with self._lock:
            self._until[key] = until_ns

    def check(self, key: RoomRank, now_ns: int) -> Lease:
        with self._lock:
            if key not in self._until:
                return Lease.NOT_ASKED
            until = self._until[key]
        if until is None or now_ns < until:
            return Lease.RUNS
        return Lease.RAN_OUT

    def until(self, key: RoomRank) -> int | None:
        with self._lock:
            return self._until.get(key)

    def forget(self, keys: list[RoomRank]) -> None:
        with self._lock:
            for k in keys:
                self._until.pop(k, None)

    def keys(self) -> list[RoomRank]:
        with self._lock:
            return list(self._until)

    def __len__(self) -> int:
        with self._lock:
            return len(self._until)


@dataclass(frozen=True)
class Held:
    """A granted room the decode was asked to fail: failed at ``until_ns``, with
    ``reason``, unless it concluded before."""

    room: int
    until_ns: int
    reason: str


class DecodeHolds:
    """The decode's granted rooms waiting for their lease to run out before they fail.
    ``hold`` keeps the latest end asked for a room (a room granted by several prefill
    ranks waits for the last lease); ``due`` hands out, once, those whose end has come;
    ``release`` forgets a room that concluded meanwhile (its write finished).
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._heap: list[tuple[int, int]] = []  # (until_ns, room); stale entries skipped

    def hold(self, room: int, until_ns: int, reason: str) -> Held:
        with self._lock:
            old = self._held.get(room)
            if old is not None and old.until_ns >= until_ns:
                return old
            h = self._held[room] = Held(room, until_ns, reason)
            heapq.heappush(self._heap, (until_ns, room))
            return h

    def held(self, room: int) -> Held | None:
        with self._lock:
            return self._held.get(room)

    def due(self, now_ns: int) -> list[Held]:
        out = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now_ns:
                until, room = heapq.heappop(self._heap)
                h = self._held.get(room)
                if h is not None and h.until_ns == until:
                    del self._held[room]
                    out.append(h)
        return out

    def release(self, room: int) -> bool:
        with self._lock:
            return self._held.pop(room, None) is not None  # its heap entry is skipped

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
