"""What the pinger does with a frame it drops: count it, name the followed host whose
frames fail authentication in its row (a configuration problem, not a death), and log
the rest at most once per 10 s per kind.

A followed host whose own frames fail authentication here (acks on our connection to
it, a refusal of our ping, pings from its address) reads UNKNOWN, not SUSPECT or DEAD:
it answers, in a language we do not share, so its silence says nothing of its workers,
and readers (remote reads, a LinkReaper, the vLLM verdict) must not act on it.  That
holds while such frames keep coming (``AUTH_HOLD``: they come at every ping we send
it); once they stop, as when that host dies, its verdict is the one its silence earns.
A ping that only *claims* to be that host names the row's flag but holds no verdict:
anyone can send one.

An object the network half (``pinger.NetworkHalf``) constructs and owns, given the
agent's words, the row writer, the followed hosts (read only), the rate-limited log, the
clock and the peer dead-after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from .evidence import from_host
from .following import Target
from .state import AgentWords
from ..ratelog import RateLimitedLog
from .rowwriter import RowWriter
from ..status import Status

log = logging.getLogger("shmhb.net.pinger")

_SILENT = (Status.SUSPECT, Status.DEAD)  # verdicts of silence, which a mismatch explains
_NEVER = -(1 << 62)


class BadInput:
    """Dropped frames of the network half."""

    def __init__(self, writer: AgentWords, rows: RowWriter, targets: Mapping[str, Target],
                 ratelog: RateLimitedLog, now_ns: Callable[[], int], hold_ns: int) -> None:
        """``targets``: the followed hosts by address (``Following.targets``, read
        here, never changed); ``hold_ns``: how long after a host's last frame that
        failed authentication it still reads UNKNOWN rather than SUSPECT or DEAD (the
        peer dead-after: frames come at every ping, at least 3 per window)."""
        self.w = writer
        self.rows = rows
        self.targets = targets
        self._ratelog = ratelog
        self._now_ns = now_ns
        self._hold_ns = hold_ns
        self._held: set[str] = set()  # addresses read UNKNOWN for failing authentication

    def shown(self, t: Target, status: Status, now_ns: int) -> Status:
        """What ``t``'s row says for the verdict ``status``: UNKNOWN for SUSPECT or DEAD
        while its own frames fail authentication here (see the module's docstring)."""
        if status in _SILENT and now_ns - t.auth_failed_ns < self._hold_ns:
            return Status.UNKNOWN
        return status

    def auth_passed(self, t: Target) -> None:
        """A frame from ``t`` passed authentication: the flag clears (its count stays)."""
        t.auth_failed_ns = _NEVER
        self._held.discard(t.address)
        self.rows.peer_auth(t.row, t.gen, False)

    def expire(self, now_ns: int) -> None:
        """Hosts whose failing frames stopped (``hold_ns`` ago) read their verdict again."""
        if not self._held:
            return
        for a in list(self._held):
            t = self.targets.get(a)
            if t is None or now_ns - t.auth_failed_ns >= self._hold_ns:
                self._held.discard(a)
                if t is not None and t.state.status in _SILENT:
                    self.rows.peer_status(t.row, t.gen, t.state.status, t.state.last_ack_ns)
                    self.w.changed()

    def bad(self, reason: str, source: str) -> None:
        """Count and log a dropped frame; ``source``: the followed host's address (a
        frame on our connection to it) or which socket it came in on."""
        self.w.count(f"bad_{reason}")
        t = self.targets.get(source) if reason == "auth" else None
        if t is not None:  # on our connection to it: its own frame
            self._auth_failed(t, own=True)
            return
        self.rate_log(reason, "pinger: dropped a bad frame from %s (%s)", source, reason)

    def bad_auth_ping(self, source: str | None, claimed: str | None) -> None:
        """A ping to us failed authentication: named after the followed host its
        connection comes from, else (pings leave from any local address, 127.0.0.1 on
        loopback) the one it claims to be while that one is not ALIVE: an unauthenticated
        claim may explain a silence, never contradict a host that answers us."""
        self.w.count("bad_auth")
        t = next((x for x in self.targets.values() if from_host(source, x.ip)), None)
        c = self.targets.get(claimed) if t is None and claimed is not None else None
        if t is not None:
            self._auth_failed(t, own=True)
        elif c is not None and c.state.status is not Status.ALIVE:
            self._auth_failed(c, own=False)  # a claim: names the flag, holds no verdict
        else:
            self.rate_log("auth", "pinger: dropped a ping from %s that failed authentication",
                          source or "an unknown address")

    def _auth_failed(self, t: Target, *, own: bool) -> None:
        # Named in its row: to `status`, a host whose frames fail authentication is a
        # configuration problem, not a death (its silence follows from it).  ``own``:
        # the frame came from it (not a claim anyone could make): it reads UNKNOWN.
        self.rows.peer_auth(t.row, t.gen, True)
        if own:
            now = self._now_ns()
            t.auth_failed_ns = now
            self._held.add(t.address)
            if t.state.status in _SILENT:
                self.rows.peer_status(t.row, t.gen, Status.UNKNOWN, t.state.last_ack_ns)
                self.w.changed()
        self.rate_log(f"auth {t.address}", "pinger: frames from %s fail authentication: give "
                      "both hosts the same --secret-file", t.address)

    def rate_log(self, what: str, msg: str, *args: object) -> None:
        self._ratelog.warn(what, msg, *args)  # at most once per 10 s per kind
