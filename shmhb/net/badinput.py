"""What the pinger does with a frame it drops: count it, name the followed host whose
frames fail authentication in its row (to ``status`` a configuration problem, not a
death), and log the rest at most once per 10 s per kind.

An object the network half (``pinger.NetworkHalf``) constructs and owns, given the
agent's words, the row writer, the followed hosts (read only) and the rate-limited log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .evidence import from_host
from .following import Target
from .state import AgentWords
from ..ratelog import RateLimitedLog
from .rowwriter import RowWriter
from ..status import Status

log = logging.getLogger("shmhb.net.pinger")


class BadInput:
    """Dropped frames of the network half."""

    def __init__(self, writer: AgentWords, rows: RowWriter, targets: Mapping[str, Target],
                 ratelog: RateLimitedLog) -> None:
        """``targets``: the followed hosts by address (``Following.targets``, read
        here, never changed)."""
        self.w = writer
        self.rows = rows
        self.targets = targets
        self._ratelog = ratelog

    def bad(self, reason: str, source: str) -> None:
        """Count and log a dropped frame; ``source``: the followed host's address (a
        frame on our connection to it) or which socket it came in on."""
        self.w.count(f"bad_{reason}")
        t = self.targets.get(source) if reason == "auth" else None
        if t is not None:
            self._auth_failed(t)
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
        if c is not None and c.state.status is not Status.ALIVE:
            t = c
        if t is not None:
            self._auth_failed(t)
        else:
            self.rate_log("auth", "pinger: dropped a ping from %s that failed authentication",
                          source or "an unknown address")

    def _auth_failed(self, t: Target) -> None:
        # Named in its row: to `status`, a host whose frames fail authentication is a
        # configuration problem, not a death (its silence follows from it).
        self.rows.peer_auth(t.row, t.gen, True)
        self.rate_log(f"auth {t.address}", "pinger: frames from %s fail authentication: give "
                      "both hosts the same --secret-file", t.address)

    def rate_log(self, what: str, msg: str, *args: object) -> None:
        self._ratelog.warn(what, msg, *args)  # at most once per 10 s per kind
