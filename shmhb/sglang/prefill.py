"""The prefill side: no write without the decode's go-ahead, none after its lease ran
out, and rooms of a decode the board drops are freed at once.

A transfer request read from a wrapped decode carries its incarnation, its go-ahead
endpoint and a token (``seen``).  Right before each chunk of a room is written
(``may_write``, on the transfer worker's thread, at its last look at the room before
the write: ``manager``), for each decode rank of the room:

* no go-ahead yet: the prefill asks that decode whether it still wants the room
  (``shmhb.kv.fence.GrantAsker``); no answer within ``grant_timeout_s``, a refusal, or
  a decode the board reports dead, left or restarted since it asked means no write;
* granted: the chunk is written only while the grant's lease runs on this process's
  clock (``shmhb.sglang.lease``: counted from the ask, shortened by the clock-rate
  slack); a chunk after it ran out is not written.

Either way a chunk not written fails its room here, so SGLang frees its pages (and,
for a lease that ran out, tells the decode, which then fails the room at once: the one
prefill rank that held the grant writes nothing more to it).  Why the lease makes this
safe: the decode fails a granted room no earlier than its own (longer, in real time)
lease after the grant (``shmhb.sglang.lease``, ``decode``), and every chunk is checked
in the one thread that writes it, right before the write.  A request from a stock decode
(no frame) is checked against the board only, before each chunk.

When the LinkReaper drops a decode rank, every room that waits to be sent to it fails.
Everything SGLang-specific goes through ``PrefillRooms``, which the manager implements.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..board.reaper import DropReason, Link
from ..kv.fence import Extra, GrantAsker
from ..ratelog import RateLimitedLog
from ..status import Status
from .lease import Lease, PrefillLeases, RoomRank
from .rank import RankInfo, RankSlot
from .settings import SglangSettings

log = logging.getLogger(__name__)

#: rooms' frames kept before concluded rooms are swept out
SWEEP_AT = 4096
_LOG_EVERY_S = 10.0


class PrefillRooms(Protocol):
    """What the prefill guard asks of SGLang's manager."""

    def targets(self, room: int) -> list[str]: ...  # the room's decode rank endpoints
    def rooms_for(self, ep: str) -> list[int]: ...  # rooms that wait to be sent to ``ep``
    def live(self, room: int) -> bool: ...
    def fail(self, room: int, reason: str) -> None: ...


@dataclass(frozen=True)
class WriteVerdict:
    """``why``: why a chunk must not be written (None: write it); ``lease_ran_out``: the
    go-ahead was given, and its lease ran out (the decode holds the room until its own
    lease ends, so it is told)."""

    why: str | None
    lease_ran_out: bool = False


WRITE = WriteVerdict(None)


async def _ask(asker: GrantAsker, x: Extra, req_id: str, timeout_s: float) -> int | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    a = await asker.post(x[1], x[0], x[2], [req_id], timeout_s)
    if a is None:
        return None
    got = await asker.result(a, [req_id], max(0.0, deadline - loop.time()))
    return a.until_ns if got else None  # ``result`` grants nothing past the lease


class _Asking(threading.local):
    """Each transfer worker thread asks on an event loop and connections of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.asker = GrantAsker()


class PrefillGuard:
    def __init__(self, settings: SglangSettings, rooms: PrefillRooms,
                 rank_info: RankInfo) -> None:
        self.settings = settings
        self.rooms = rooms
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._extras: dict[tuple[int, str], Extra | None] = {}
        self.leases = PrefillLeases()
        self._log = RateLimitedLog(log, _LOG_EVERY_S)
        self._gone: dict[str, int] = {}  # decode endpoint -> incarnation dropped (0: any)
        self._tracked: set[str] = set()
        self._asking = _Asking()
        self.rank = RankSlot(settings, rank_info, self._on_drop)

    # -- the bootstrap thread: a transfer request was read ------------------------------------

    def seen(self, room: int, ep: str, extra: Extra | None) -> None:
        with self._lock:
            if len(self._extras) >= SWEEP_AT:
                self._sweep()
            self._extras[(room, ep)] = extra
            new = ep not in self._tracked
            self._tracked.add(ep)
        if new and not self.rank.track(ep, "decode", None if extra is None else extra[0]):
            with self._lock:
                self._tracked.discard(ep)

    def _sweep(self) -> None:
        for key in [k for k in self._extras if not self.rooms.live(k[0])]:
            del self._extras[key]
        self.leases.forget([k for k in self.leases.keys() if not self.rooms.live(k.room)])

    # -- a transfer worker's thread, right before each chunk is written ----------------------

    def may_write(self, room: int) -> WriteVerdict:
        """Whether the chunk of ``room`` about to be written may be: every decode rank of
        the room wants it and the lease of its go-ahead still runs."""
        for ep in self.rooms.targets(room):
            key = RoomRank(room, ep)
            lease = self.leases.check(key, time.monotonic_ns())
            if lease is Lease.RUNS:
                continue
            if lease is Lease.RAN_OUT:
                self.counts["expired_leases"] += 1
                until = self.leases.until(key) or 0
                late_s = (time.monotonic_ns() - until) / 1e9
                self._log.warn("lease", "shmhb: the go-ahead of decode rank %s for room %d "
                               "ran out %.3f s before a chunk of it: not writing it, the "
                               "room fails", ep, room, late_s)
                return WriteVerdict(f"shmhb: the go-ahead of decode rank {ep} for room "
                                    f"{room} ran out before this chunk (its lease)",
                                    lease_ran_out=True)
            with self._lock:
                x = self._extras.get((room, ep))
            if self._consumer_gone(ep, x):
                self.counts["denied_writes"] += 1
                return WriteVerdict(f"shmhb: decode rank {ep} is gone (board)")
            if x is None:
                continue  # a decode without shmhb: the board is all there is to ask
            until_ns = self._ask(x, room)
            if until_ns is None:
                self.counts["denied_writes"] += 1
                return WriteVerdict(f"shmhb: decode rank {ep} gave room {room} up "
                                    "(no go-ahead)")
            self.leases.granted(key, until_ns)
        return WRITE

    def _ask(self, x: Extra, room: int) -> int | None:
        """When the lease of the go-ahead for ``room`` ends (``time.monotonic_ns``), or
        None where it was not granted (or its lease ran out before the answer was read)."""
        a = self._asking
        return a.loop.run_until_complete(_ask(a.asker, x, str(room),
                                              self.settings.grant_timeout_s))

    def _consumer_gone(self, ep: str, x: Extra | None) -> bool:
        with self._lock:
            gone_inc = self._gone.get(ep)
        if gone_inc is not None and (x is None or gone_inc in (0, x[0])):
            return True
        s = self.rank.board.remote(ep)
        if s is None or s.status is Status.UNKNOWN:
            return False
        return s.status in (Status.DEAD, Status.LEFT) or (x is not None and s.incarnation > x[0])

    # -- the reaper's thread ---------------------------------------------------------------------

    def _on_drop(self, link: Link, reason: DropReason) -> None:
        ep = link.endpoint
        self.counts[f"drops.{reason.value}"] += 1
        with self._lock:
            self._gone[ep] = link.incarnation
            self._tracked.discard(ep)
        rooms = self.rooms.rooms_for(ep)
        for room in rooms:
            self.rooms.fail(room, f"shmhb: decode rank {ep} is {reason.value} (board)")
        self.counts["freed_rooms"] += len(rooms)
        log.info("shmhb: decode rank %s dropped (%s): %d room(s) freed", ep, reason, len(rooms))

    def close(self) -> None:
        self.rank.close()
