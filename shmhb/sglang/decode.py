"""The decode side: rooms fail on the board's verdict on their prefill ranks, not on
SGLang's HTTP health polls, and a granted room's pages stay out of SGLang's hands until
its go-ahead's lease ran out.

Each transfer request a decode rank sends a prefill rank (``admit``) is checked against
the board first (a rank that is dead, left, restarted or already dropped gets no room:
the room fails there, and the prefill's entries are evicted so the next room asks the
bootstrap server again), then recorded as a WAITING load in the go-ahead table
(``shmhb.kv.loads``, its grants under the lease ``grant_lease_s``) and sent with the
frame that lets that rank ask for it (``shmhb.sglang.wire``).

When the LinkReaper drops a prefill rank (``_drop``), or SGLang's own health check fails
the prefill (``node_failed``, before SGLang's ``_handle_node_failure``), every room of
that prefill is settled under one lock:

1. its WAITING loads are given up first (``LoadTable.abandon``): one move out of WAITING
   in the states table, so of a grant and a give-up exactly one wins, and after this no
   load of these rooms is ever granted;
2. then its GRANTED loads are ended, each with when its lease ends on this clock
   (counted from when the ask was read: ``grants``, "The lease");
3. a room with no lease still running fails now; a room with one is held
   (``lease.DecodeHolds``) and fails once the last of its leases ran out, unless it
   concluded first (its write finished and the prefill said so).  SGLang never fails a
   held room itself: it is out of the prefill's rooms (``untrack``/``evict``).

Why no write lands in pages SGLang reuses: a failed room's pages go back to SGLang
(reused at once).  A room failed at step 3 without a hold was never granted after step 1
(so the prefill, which writes only granted rooms, writes nothing), or its lease ran out
here; the prefill's own lease of that grant ends earlier in real time (it counts from
the ask's send, shortened by the clock-rate slack: ``shmhb.sglang.lease``), and it
checks it before every chunk, so no chunk starts after.  A failure the prefill itself
reports (a failed write, a lease it saw run out) is SGLang's to apply at once: that
rank writes nothing more to the room.

Everything SGLang-specific goes through ``DecodeRooms``, which the manager implements.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

from ..board.reaper import DropReason, Link
from ..kv import grants
from ..kv.fence import FenceServer
from ..kv.loads import Load, LoadState, LoadTable
from ..periodic import Periodic
from ..status import Status
from .lease import DecodeHolds, Held
from .rank import RankInfo, RankSlot
from .settings import SglangSettings
from .wire import encode_extra

log = logging.getLogger(__name__)

#: dropped prefill rank endpoints remembered (rank ports are per process: a few per restart)
MAX_DROPPED = 4096
#: how often held rooms are looked at (a held room fails at most this late)
HOLD_POLL_S = 0.02


class DecodeRooms(Protocol):
    """What the decode guard asks of SGLang's manager."""

    def rooms_of(self, addr: str) -> list[int]: ...
    def fail(self, room: int, reason: str) -> None: ...
    def untrack(self, addr: str, rooms: set[int]) -> None: ...
    def evict(self, addr: str) -> None: ...


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
        self.loads = LoadTable(grants.new_states(lease_ms=round(settings.grant_lease_s * 1000)))
        self.holds = DecodeHolds()
        self.fence = FenceServer(host, 0, self.loads.states, self.loads.tokens)
        self.counts: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._addr_of: dict[str, str] = {}  # prefill rank endpoint -> bootstrap address
        self._room_eps: dict[int, set[str]] = {}
        self._dropped: OrderedDict[str, str] = OrderedDict()  # endpoint -> why
        self.rank = RankSlot(settings, rank_info(self.fence.endpoint), self._on_drop)
        self.fence.set_incarnation(self.rank.incarnation)
        self._holding = Periodic("shmhb-sglang-holds")
        self._holding.start(self._release_due, HOLD_POLL_S)

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
        """The room concluded (its receiver is cleared): its loads end, its hold goes."""
        with self._lock:
            self.holds.release(room)
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
        """Under the lock (the module docstring's steps 1 to 3)."""
        self._dropped[ep] = why
        self._dropped.move_to_end(ep)
        while len(self._dropped) > MAX_DROPPED:
            self._dropped.popitem(last=False)
        self._addr_of.pop(ep, None)
        self.loads.abandon(endpoint=ep)  # no go-ahead for these from now on
        reason = f"shmhb: prefill rank {ep} ({addr}) is {why} (board)"
        failed, held = self._settle(self.rooms.rooms_of(addr), reason)
        self.rooms.evict(addr)
        log.info("shmhb: prefill rank %s of %s dropped (%s): %d room(s) failed, %d held "
                 "until their go-ahead's lease ends, entries evicted", ep, addr, why,
                 len(failed), len(held))

    # -- SGLang's health check thread ---------------------------------------------------------

    def node_failed(self, addr: str) -> None:
        """SGLang's health check is about to fail every room of the prefill at ``addr``
        (``_handle_node_failure``): its granted rooms whose lease runs are held instead,
        and taken out of its reach; the others it fails itself."""
        with self._lock:
            rooms = self.rooms.rooms_of(addr)
            self.loads.abandon(req_ids={str(r) for r in rooms})
            held = {h.room for h in self._hold_granted(rooms, f"shmhb: prefill {addr} lost "
                                                           "(SGLang's health check)")}
            self.rooms.untrack(addr, held)
        if held:
            log.info("shmhb: SGLang's health check failed prefill %s: %d granted room(s) "
                     "held until their go-ahead's lease ends", addr, len(held))

    # -- settling rooms (under the lock) -----------------------------------------------------

    def _settle(self, rooms: list[int], reason: str) -> tuple[list[int], list[Held]]:
        """Fail ``rooms`` now, or hold those with a lease running (steps 1 to 3)."""
        self.loads.abandon(req_ids={str(r) for r in rooms})  # step 1: no grant after this
        held = self._hold_granted(rooms, reason)
        kept = {h.room for h in held}
        failed = [r for r in rooms if r not in kept]
        for room in failed:
            self.rooms.fail(room, reason)
        self.counts["failed_rooms"] += len(failed)
        return failed, held

    def _hold_granted(self, rooms: list[int], reason: str) -> list[Held]:
        """Steps 2 and 3, after step 1: the holds of ``rooms`` (new, or already held)."""
        now = time.monotonic_ns()
        lease_ns = round(self.settings.grant_lease_s * 1e9)
        out = []
        for room in rooms:
            h = self.holds.held(room)
            if h is None:
                ends = [ld.lease_until_ns or now + lease_ns  # 0: no lease known: a whole one
                        for ep in self._room_eps.pop(room, ())
                        for ld in self.loads.end([str(room)], ep)
                        if ld.state is LoadState.GRANTED]
                if not ends or max(ends) <= now:
                    continue
                h = self.holds.hold(room, max(ends), reason)
                self.counts["held_rooms"] += 1
            out.append(h)
        return out

    # -- the holds' thread --------------------------------------------------------------------

    def _release_due(self) -> None:
        """Fail each held room whose leases ran out (a room that concluded meanwhile was
        released by ``room_done``, and ``fail`` leaves a concluded room alone)."""
        due = self.holds.due(time.monotonic_ns())
        for h in due:
            self.rooms.fail(h.room, f"{h.reason}; failed once its go-ahead's lease ran out")
        if due:
            self.counts["failed_rooms"] += len(due)
            log.info("shmhb: %d granted room(s) failed at the end of their go-ahead's lease",
                     len(due))

    def close(self) -> None:
        self._holding.stop()
        self.rank.close()
        self.fence.close()
