"""The state model: one ``Status`` enum and the read-only views the board hands out."""

from __future__ import annotations

import enum
from typing import NamedTuple


class Status(str, enum.Enum):
    """What the board knows about a worker or a host.

    ALIVE    it beats (or its host answers) within suspect-after.
    SUSPECT  silent for longer than suspect-after, not yet dead-after.
    DEAD     evidence of death: its process is gone, or silence for dead-after while
             the observer was itself running.
    LEFT     it closed its registration gracefully.
    UNKNOWN  whoever should observe it (the host's agent) is absent or stalled, or (a
             remote host and its workers) its frames fail authentication here: no verdict.
    """

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"
    UNKNOWN = "unknown"

    @property
    def code(self) -> int:
        return _CODES[self]

    @classmethod
    def from_code(cls, code: int) -> Status:
        return _BY_CODE.get(code, Status.UNKNOWN)

    def __str__(self) -> str:
        return self.value


_CODES = {Status.ALIVE: 1, Status.SUSPECT: 2, Status.DEAD: 3, Status.LEFT: 4, Status.UNKNOWN: 5}
_BY_CODE = {v: k for k, v in _CODES.items()}


class SlotStatus(NamedTuple):
    """One worker as a reader sees it now.  ``age_s``: time since its last beat (local
    slot) or since the ack that reported it (remote slot).  ``beat_age_s`` (remote slots
    only): the worker's own time since its last beat, where its host's reports tell it
    -- a worker its host reported SUSPECT, DEAD or LEFT, through a push or a v2 ack
    (docs/PROTOCOL.md) -- else None (a live remote worker beat within its host's
    suspect-after as of that host's last report, ``age_s`` ago)."""

    key: str
    pid: int
    incarnation: int
    status: Status
    age_s: float
    endpoints: tuple[str, ...]
    beat_age_s: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "pid": self.pid,
            "incarnation": self.incarnation,
            "status": self.status.value,
            "age_s": round(self.age_s, 3),
            "endpoints": list(self.endpoints),
            **({} if self.beat_age_s is None else {"beat_age_s": round(self.beat_age_s, 3)}),
        }


class PeerStatus(NamedTuple):
    """A remote host as this host's pinger sees it.  ``age_s``: since its last ack.

    ``auth_failing``: the last frame from that host (an ack on our connection to it, or
    a ping from its address) failed authentication and none has passed since: the two
    hosts do not share a secret (or CURVE keys), so its silence is no sign of death.
    While its own frames keep failing, ``status`` is UNKNOWN, never SUSPECT or DEAD.
    ``auth_failures``: frames from it that failed authentication, ever (this row).
    ``rows_capped``: workers its last digest listed that this board did not store (its
    share of the remote table was spent): those have no ``slots`` entry and
    ``Board.remote`` returns None for them, which says nothing of them (a LinkReaper
    reads them unknown), not that they are gone."""

    address: str
    status: Status
    rtt_ms: float | None
    age_s: float | None
    slots: list[SlotStatus]
    auth_failing: bool = False
    auth_failures: int = 0
    rows_capped: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "address": self.address,
            "status": self.status.value,
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "auth_failing": self.auth_failing,
            "auth_failures": self.auth_failures,
            "rows_capped": self.rows_capped,
            "slots": [s.to_json() for s in self.slots],
        }


class AgentStatus(NamedTuple):
    """The host agent (local watcher and pinger) as the board shows it."""

    pid: int
    status: Status
    age_s: float | None
    term: int

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "status": self.status.value,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
            "term": self.term,
        }


class NetworkStatus(NamedTuple):
    """The host agent's network half (the pinger) as the board shows it.

    ``state``: "not configured", "starting", "listening", "degraded" or "unknown" (no
    holder has written it, or the holder that did is gone).  ``reason`` names why it is
    degraded; ``error`` is the last error's text; ``listen``: the address it listens on
    (None when not listening or not known); ``auth``: none, hmac or curve;
    ``skipped_hosts``: followed hosts it cannot ping (no key, unusable address);
    ``settings_gen``: the stored settings generation it applied."""

    state: str
    working: bool
    listening: bool
    listen: str | None
    auth: str
    reason: str | None
    errno: int
    error: str | None
    skipped_hosts: int
    settings_gen: int | None
    term: int

    def to_json(self) -> dict[str, object]:
        return dict(self._asdict())
