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
* Silence is also counted in pings: a host is neither SUSPECT nor DEAD before it has
  missed ``MISSED_IN_A_ROW`` pings in a row.  A ping counts as missed once the next one
  has been sent (or attempted while its connection was down), or once it has waited
  ``peer_suspect_after`` unanswered: an answer takes a round trip plus up to one tick
  of the other pinger, so a ping that waited that long was missed whether or not the
  next turn has come.  Under a ping budget a host may be pinged every 1.67 s; judged in
  seconds alone, one ack that arrives just after ``peer_suspect_after`` would make a
  live host flap, and a single lost ping never makes it SUSPECT.  The budget
  (``shmhb.net.plan``) gives each host at least ``MIN_PINGS_PER_WINDOW`` (3) pings per
  ``peer_dead_after``, so the count never delays DEAD past ``peer_dead_after`` plus one
  interval after the last evidence: by then the first two pings after it were missed.
  At the defaults with 250 followed hosts (a ping every 1.67 s) a silent host is
  SUSPECT 4.3 s after its last ack and DEAD at 5 s.
* A host never heard from reads UNKNOWN, not ALIVE, until its first ack; it can still
  be convicted by silence.
* A host that said goodbye (its pinger stopped gracefully with no live worker) is LEFT
  and stays LEFT, silent, until an ack makes it ALIVE again (``on_leave``).
* An ack (to one of our own pings) makes a host ALIVE.  So does its own ping to us,
  authenticated or from its own address, once an ack established its identity
  (``on_evidence``; the rules that make it unforgeable are the pinger's, see
  docs/PROTOCOL.md): it proves that its pinger runs, which is what a host's ALIVE means.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..board.judge import Thresholds, peer_verdict
from ..board.layout import ts_units, units_to_ns
from ..status import Status

log = logging.getLogger(__name__)

#: A host is not SUSPECT (nor DEAD) before it missed this many pings in a row.
MISSED_IN_A_ROW = 2


@dataclass
class PeerState:
    """What this pinger knows about one remote host."""

    address: str
    status: Status = Status.UNKNOWN
    silent_ns: int = 0
    acked: bool = False
    last_ack_ns: int = 0
    rtt_ns: int | None = None
    unanswered: int = 0  # pings due since the last evidence (the latest may still be answered)
    last_ping_ns: int = 0  # when the latest of them was due
    extra: dict[str, object] = field(default_factory=dict)


class Suspicion:
    """Advances every peer's verdict once per pinger tick."""

    def __init__(self, th: Thresholds, *, late_ns: int) -> None:
        self.th = th
        self.late_ns = late_ns
        self._last_tick_ns: int | None = None
        self._last_late_ns: int | None = None
        self._last_inbound_ns: int | None = None
        self._suspect_ns = units_to_ns(th.peer_suspect)

    def inbound(self, now_ns: int) -> None:
        """Someone pinged us: our own network and loop work."""
        self._last_inbound_ns = now_ns

    @staticmethod
    def on_ping(p: PeerState, now_ns: int) -> None:
        """A ping to ``p`` was due and sent (or its connection was down)."""
        p.unanswered += 1
        p.last_ping_ns = now_ns

    def missed(self, p: PeerState, now_ns: int) -> int:
        """Pings ``p`` missed in a row: every one since its last evidence but the
        latest, and the latest too once it has waited ``peer_suspect_after``."""
        if not p.unanswered:
            return 0
        waited = now_ns - p.last_ping_ns >= self._suspect_ns
        return p.unanswered if waited else p.unanswered - 1

    def on_ack(self, p: PeerState, now_ns: int, rtt_ns: int) -> Status | None:
        """An ack to our own ping; returns the old status if it changed."""
        p.rtt_ns = rtt_ns
        p.acked = True
        return self.on_evidence(p, now_ns)

    @staticmethod
    def on_evidence(p: PeerState, now_ns: int) -> Status | None:
        """Evidence that ``p``'s pinger runs: an ack, or (see the module text) its own
        ping, authenticated or from its own address, once an ack came; returns the old
        status if it changed."""
        p.silent_ns = 0
        p.unanswered = 0
        p.last_ack_ns = now_ns
        if p.status is not Status.ALIVE and p.acked:  # never heard: stays UNKNOWN
            old, p.status = p.status, Status.ALIVE
            return old
        return None

    @staticmethod
    def on_leave(p: PeerState) -> Status | None:
        """``p`` said goodbye (its pinger stops, none of its workers lives): LEFT, and
        it stays LEFT through the silence that follows until evidence of a running
        pinger (an ack) makes it ALIVE again.  Returns the old status if it changed."""
        p.unanswered = 0
        p.silent_ns = 0
        if p.status is Status.LEFT:
            return None
        old, p.status = p.status, Status.LEFT
        return old

    def doubting_self(self, peers: list[PeerState], now_ns: int) -> bool:
        suspect_ns = self._suspect_ns
        if self._last_late_ns is not None and now_ns - self._last_late_ns < suspect_ns:
            return True
        active = [p for p in peers if p.status is not Status.LEFT]  # silent by their word
        if len(active) < 2:
            return False
        if self._last_inbound_ns is not None and now_ns - self._last_inbound_ns < suspect_ns:
            return False
        return all(p.silent_ns >= suspect_ns and self.missed(p, now_ns) >= MISSED_IN_A_ROW
                   for p in active)

    def tick(self, peers: list[PeerState], now_ns: int) -> list[tuple[PeerState, Status, Status]]:
        """Accrue silence since the last tick and return the transitions it caused."""
        last, self._last_tick_ns = self._last_tick_ns, now_ns
        elapsed = 0 if last is None else max(0, now_ns - last)
        healthy = elapsed <= self.late_ns
        if not healthy:
            self._last_late_ns = now_ns
            log.info("pinger loop ran %.0f ms late: silence in that gap is not held against peers",
                     elapsed / 1e6)
        if healthy and elapsed:
            for p in peers:
                p.silent_ns += elapsed
        doubt: bool | None = None  # computed once, and only if some host missed pings
        changes = []
        alive, unknown, left = Status.ALIVE, Status.UNKNOWN, Status.LEFT
        for p in peers:
            if p.status is left:
                continue  # it said goodbye: its silence is no evidence (on_evidence ends it)
            # (the count first: missed never exceeds it, and it spares most hosts a call)
            if p.unanswered >= MISSED_IN_A_ROW and self.missed(p, now_ns) >= MISSED_IN_A_ROW:
                if doubt is None:
                    doubt = self.doubting_self(peers, now_ns)
                new = peer_verdict(ts_units(p.silent_ns), self.th, self_suspect=doubt)
                if new is alive and not p.acked:
                    new = unknown
            elif p.status is (alive if p.acked else unknown):
                continue  # the common case: answering, and nothing to change
            else:
                new = alive if p.acked else unknown
            if new is not p.status:
                changes.append((p, p.status, new))
                p.status = new
        return changes
