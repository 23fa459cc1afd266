"""Verdicts on remote hosts: the one place that decides their transitions.

Pure logic, driven by the pinger's loop with its clock readings; tested with a fake
clock.  The rule, and why:

* Silence accrues only while this pinger is healthy.  A tick that ran late (we were
  paused, starved of CPU, swapped out) adds nothing: the missing acks are evidence
  about us, not about the peers (Cassandra refuses to convict after its own pause).
* A host is SUSPECT after ``peer_suspect_after`` of healthy silence and DEAD after
  ``peer_dead_after`` -- unless we doubt ourselves: our loop was late within the last
  ``peer_suspect_after``, or at least two hosts are followed and every one of them went
  silent while nobody pinged us either.  Then the verdict stops at SUSPECT until some
  host answers again (Lifeguard asks "is it me?" before accusing others).
* A host never heard from reads UNKNOWN, not ALIVE, until its first ack; it can still
  be convicted by silence.
* An ack (to one of our own pings) is the only thing that makes a host ALIVE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .judge import Thresholds, peer_verdict
from .layout import TS_SHIFT
from .status import Status

log = logging.getLogger(__name__)


@dataclass
class PeerState:
    """What this pinger knows about one remote host."""

    address: str
    status: Status = Status.UNKNOWN
    silent_ns: int = 0
    acked: bool = False
    last_ack_ns: int = 0
    rtt_ns: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


class Suspicion:
    """Advances every peer's verdict once per pinger tick."""

    def __init__(self, th: Thresholds, *, late_ns: int) -> None:
        self.th = th
        self.late_ns = late_ns
        self._last_tick_ns: int | None = None
        self._last_late_ns: int | None = None
        self._last_inbound_ns: int | None = None

    def inbound(self, now_ns: int) -> None:
        """Someone pinged us: our own network and loop work."""
        self._last_inbound_ns = now_ns

    def on_ack(self, p: PeerState, now_ns: int, rtt_ns: int) -> Status | None:
        """An ack to our own ping; returns the old status if it changed."""
        p.silent_ns = 0
        p.acked = True
        p.last_ack_ns = now_ns
        p.rtt_ns = rtt_ns
        if p.status is not Status.ALIVE:
            old, p.status = p.status, Status.ALIVE
            return old
        return None

    def doubting_self(self, peers: list[PeerState], now_ns: int) -> bool:
        suspect_ns = self.th.peer_suspect << TS_SHIFT
        if self._last_late_ns is not None and now_ns - self._last_late_ns < suspect_ns:
            return True
        if len(peers) < 2:
            return False
        if self._last_inbound_ns is not None and now_ns - self._last_inbound_ns < suspect_ns:
            return False
        return all(p.silent_ns >= suspect_ns for p in peers)

    def tick(self, peers: list[PeerState], now_ns: int) -> list[tuple[PeerState, Status, Status]]:
        """Accrue silence since the last tick and return the transitions it caused."""
        last, self._last_tick_ns = self._last_tick_ns, now_ns
        elapsed = 0 if last is None else max(0, now_ns - last)
        healthy = elapsed <= self.late_ns
        if not healthy:
            self._last_late_ns = now_ns
            log.info("pinger loop ran %.0f ms late: silence in that gap is not held against peers",
                     elapsed / 1e6)
        for p in peers:
            if healthy:
                p.silent_ns += elapsed
        doubt = self.doubting_self(peers, now_ns)
        changes = []
        for p in peers:
            new = peer_verdict(p.silent_ns >> TS_SHIFT, self.th, self_suspect=doubt)
            if new is Status.ALIVE and not p.acked:
                new = Status.UNKNOWN
            if new is not p.status:
                changes.append((p, p.status, new))
                p.status = new
        return changes
