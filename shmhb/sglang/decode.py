"""The decode side: rooms fail on the board's verdict on their prefill ranks, not on
SGLang's HTTP health polls.

Each transfer request a decode rank sends a prefill rank (``admit``) is checked against
the board first (a rank that is dead, left, restarted or already dropped gets no room:
the room fails there, and the prefill's entries are evicted so the next room asks the
bootstrap server again), then recorded as a WAITING load in the go-ahead table
(``shmhb.kv.loads``) and sent with the frame that lets that rank ask for it
(``shmhb.sglang.wire``).  When the LinkReaper drops a prefill rank, its WAITING loads
are given up first (no go-ahead for them after that), then every room of that prefill
that holds no granted load fails, and the prefill's entries are evicted.  A room whose
load was granted is left to finish: its write may be under way, and SGLang reuses a
failed room's pages at once (see docs/SGLANG.md, "A write already under way").

Everything SGLang-specific goes through ``DecodeRooms``, which the manager implements.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

from ..board.reaper import DropReason, Link
from ..kv.fence import FenceServer
from ..kv.loads import Load, LoadState, LoadTable
from ..status import Status
from .rank import RankInfo, RankSlot
from .settings import SglangSettings
from .wire import encode_extra

log = logging.getLogger(__name__)

#: dropped prefill rank endpoints remembered (rank ports are per process: a few per restart)
MAX_DROPPED = 4096


class DecodeRooms(Protocol):
    """What the decode guard asks of SGLang's manager."""

    def rooms_of(self, addr: str) -> list[int]: ...
    def fail(self, room: int, reason: str) -> None: ...
    def evict(self, addr: str, keep: set[int]) -> None: ...


class Admission(NamedTuple):
    """``reason``: why the message must not be sent (the room failed), or None.
    ``frame``: the shmhb frame to append to a transfer request, or None."""

    reason: str | None
    frame: bytes | None


class DecodeGuard:
    def __init__(self, settings: SglangSettings, rooms: DecodeRooms, host: str,
                 rank_info: Callable[[str], RankInfo]) -> None:
        """``host``: the address the go-ahead server binds; ``rank_info``: the rank's
        identity, given that server's endpoint."""
        self.settings = settings
        self.rooms = rooms
        self.loads = LoadTable()
        self.fence = FenceServer(host, 0, self.loads.states, self.loads.tokens)
        self.counts: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._addr_of: dict[str, str] = {}  # prefill rank endpoint -> bootstrap address
        self._room_eps: dict[int, set[str]] = {}
        self._dropped: OrderedDict[str, str] = OrderedDict()  # endpoint -> why
        self.rank = RankSlot(settings, rank_info(self.fence.endpoint), self._on_drop)
        self.fence.set_incarnation(self.rank.incarnation)

    # -- the scheduler's thread: before each message to a prefill rank ---------------------

    def admit(self, room: int, addr: str, ep: str, *, transfer: bool, dummy: bool) -> Admission:
        """Before a message for ``room`` goes to prefill rank ``ep`` of the prefill at
        ``addr``: a registration of this rank's buffers (``transfer`` False) or a
        transfer request (True; ``dummy``: one that moves no KV)."""
        with self._lock:
            why = self._verdict(ep)
            if why is not None:
                self.counts[f"vetoes.{why}"] += 1
                reason = f"shmhb: prefill rank {ep} ({addr}) is {why} (board)"
                self._drop(ep, addr, why)
                return Admission(reason, None)
            if ep not in self._addr_of and self.rank.track(ep, addr):
                self._addr_of[ep] = addr
            if not transfer:
                return Admission(None, None)
            if not dummy:
                self.loads.start([Load(str(room), ep, addr, frozenset(), room)])
                self._room_eps.setdefault(room, set()).add(ep)
            return Admission(None, encode_extra(self.rank.incarnation, self.fence.endpoint,
                                                self.fence.token_for(ep)))

    def _verdict(self, ep: str) -> str | None:
        """Why rank ``ep`` gets no message, or None.  A rank dropped before stays
        refused until the board reads it ALIVE again (a stopped rank resumed), where
        the board has a view of it."""
        s = self.rank.board.remote(ep)
        if s is not None and s.status is Status.ALIVE:
            self._dropped.pop(ep, None)
        why = self._dropped.get(ep)
        if why is not None:
            return why
        if s is None or s.status is Status.UNKNOWN:
            return None  # not seen yet, or nobody observes here: no verdict
        if s.status is Status.DEAD:
            return "dead"
        if s.status is Status.LEFT:
            return "left"
        if s.status is Status.SUSPECT and self.settings.act_on_suspect:
            return "suspect"
        return None

    def room_done(self, room: int) -> None:
        """The room concluded (its receiver is cleared): its loads end."""
        with self._lock:
            for ep in self._room_eps.pop(room, ()):
                self.loads.end([str(room)], ep)

    # -- the reaper's thread -----------------------------------------------------------------

    def _on_drop(self, link: Link, reason: DropReason) -> None:
        addr = link.payload
        if isinstance(addr, str):
            self.counts[f"drops.{reason.value}"] += 1
            with self._lock:
                self._drop(link.endpoint, addr, reason.value)

    def _drop(self, ep: str, addr: str, why: str) -> None:
        """Under the lock, so no load starts between the give-up and the failures."""
        self._dropped[ep] = why
        self._dropped.move_to_end(ep)
        while len(self._dropped) > MAX_DROPPED:
            self._dropped.popitem(last=False)
        self._addr_of.pop(ep, None)
        self.loads.abandon(endpoint=ep)  # no go-ahead for these from now on
        keep, failing = set(), []
        for room in self.rooms.rooms_of(addr):
            if any(ld.state is LoadState.GRANTED for ld in self.loads.by_token(room)):
                keep.add(room)  # a write may be under way: its own end settles it
            else:
                failing.append(room)
        # a room that loads from other ranks of the same prefill cannot complete either
        self.loads.abandon(req_ids={str(r) for r in failing})
        reason = f"shmhb: prefill rank {ep} ({addr}) is {why} (board)"
        for room in failing:
            self.rooms.fail(room, reason)
        self.rooms.evict(addr, keep)
        self.counts["failed_rooms"] += len(failing)
        log.info("shmhb: prefill rank %s of %s dropped (%s): %d room(s) failed, %d left to "
                 "finish their granted write, entries evicted", ep, addr, why, len(failing),
                 len(keep))

    def close(self) -> None:
        self.rank.close()
        self.fence.close()
