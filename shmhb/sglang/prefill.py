"""The prefill side: no write without the decode's go-ahead, and rooms of a decode the
board drops are freed at once.

A transfer request read from a wrapped decode carries its incarnation, its go-ahead
endpoint and a token (``seen``).  Before the first write of a room to a decode rank
(``may_write``, on the transfer worker's thread, after the chunk left the queue and
before any byte is sent) the prefill asks that decode whether it still wants the room
(``shmhb.kv.fence.GrantAsker``); no answer within ``grant_timeout_s``, a refusal, or a
decode the board reports dead, left or restarted since it asked means no write, and the
room fails here so SGLang frees its pages.  A grant is the decode's promise to hold
the pages until the write ends, so a prefill stopped after it may still write.  A
request from a stock decode (no frame) is checked against the board only.

When the LinkReaper drops a decode rank, every room that waits to be sent to it fails.
Everything SGLang-specific goes through ``PrefillRooms``, which the manager implements.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from ..board.reaper import DropReason, Link
from ..kv.fence import Extra, GrantAsker
from ..status import Status
from .rank import RankInfo, RankSlot
from .settings import SglangSettings

log = logging.getLogger(__name__)

#: rooms' frames kept before concluded rooms are swept out
SWEEP_AT = 4096


class PrefillRooms(Protocol):
    """What the prefill guard asks of SGLang's manager."""

    def targets(self, room: int) -> list[str]: ...  # the room's decode rank endpoints
    def rooms_for(self, ep: str) -> list[int]: ...  # rooms that wait to be sent to ``ep``
    def live(self, room: int) -> bool: ...
    def fail(self, room: int, reason: str) -> None: ...


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
        self._granted: set[tuple[int, str]] = set()
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
            self._granted.discard(key)

    # -- a transfer worker's thread, before the room's first write ----------------------------

    def may_write(self, room: int) -> str | None:
        """None if every decode rank of ``room`` wants it written, else why not."""
        for ep in self.rooms.targets(room):
            with self._lock:
                if (room, ep) in self._granted:
                    continue
                x = self._extras.get((room, ep))
            if self._consumer_gone(ep, x):
                self.counts["denied_writes"] += 1
                return f"shmhb: decode rank {ep} is gone (board)"
            if x is None:
                continue  # a decode without shmhb: the board is all there is to ask
            a = self._asking
            got = a.loop.run_until_complete(a.asker.ask(
                x[1], x[0], x[2], [str(room)], self.settings.grant_timeout_s))
            if not got:
                self.counts["denied_writes"] += 1
                return f"shmhb: decode rank {ep} gave room {room} up (no go-ahead)"
            with self._lock:
                self._granted.add((room, ep))
        return None

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
