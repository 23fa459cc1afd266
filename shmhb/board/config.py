"""Configuration: frozen dataclasses with units in their names, validated on creation."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from .address import (
    DEFAULT_PORT, MAX_ADDRESS_TEXT, Address, check_endpoint, check_host, format_address,
    is_canonical, is_endpoint, parse_address,
)
from ..errors import InvalidConfig, InvalidName
from .layout import MAX_DIGEST_ENTRIES, PATH_BYTES, TS_UNIT_NS

__all__ = [
    "BOARD_ENV", "DEFAULT_BOARD", "DEFAULT_PORT", "MAX_ADDRESS_TEXT", "Address", "AgentConfig",
    "Capacity", "PingerConfig", "Policy", "board_name", "check_endpoint", "check_host",
    "format_address", "format_hostport", "has_port", "is_canonical", "is_endpoint",
    "parse_address", "parse_hostport", "policy_differences", "positive_seconds",
]

DEFAULT_BOARD = "shmhb"
BOARD_ENV = "SHMHB_BOARD"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def board_name(name: str | None = None) -> str:
    """The board to use: ``name``, else ``$SHMHB_BOARD``, else ``shmhb``; validated."""
    chosen = name if name is not None else (os.environ.get(BOARD_ENV) or DEFAULT_BOARD)
    if not _NAME_RE.match(chosen) or chosen in (".", ".."):
        raise InvalidName(
            f"invalid board name {chosen!r}: use 1-200 characters from A-Z a-z 0-9 _ . -"
        )
    return chosen


#: Default total rate of pings, all followed hosts together (pings/s).  At the default
#: interval (0.2 s) it lets 10 hosts be pinged 5 times a second; from 84 hosts on, each
#: gets pingplan's floor (3 pings per 5 s window: one every 1.67 s).  Measured on two
#: shared cores, a ping costs the pinger ~0.1 ms of CPU (mostly pyzmq and libzmq's I/O
#: thread), and answering one about as much: 50 pings/s is ~0.5 % of a core.
DEFAULT_BUDGET_PPS = 50.0
MAX_BUDGET_PPS = 100_000.0

#: The board's time unit (its timestamps are monotonic ns >> TS_SHIFT): ~1.05 ms.
UNIT_S = TS_UNIT_NS / 1e9
#: The longest policy time: 2**31 units (~26 days) stays far inside every word's field.
MAX_POLICY_S = (1 << 31) * UNIT_S


def positive_seconds(name: str, value: object) -> float:
    """``value`` as a positive, finite number of seconds, or ``InvalidConfig``."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise InvalidConfig(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


_positive = positive_seconds


def _policy_time(name: str, value: object) -> None:
    v = positive_seconds(name, value)
    if not UNIT_S <= v <= MAX_POLICY_S:
        raise InvalidConfig(
            f"{name} = {v!r} s is outside what the board can time: give {UNIT_S * 1000:.2f} ms "
            f"(its time unit) to {MAX_POLICY_S / 86400:.0f} days; a shorter time rounds to "
            "0 and every slot would read DEAD")


@dataclass(frozen=True)
class Policy:
    """How every reader of a board judges silence.  Stored in the board's header, so all
    readers of one board judge a slot alike (invariant 6).

    Defaults: a Python worker beating every 0.1 s from a thread can be held off the GIL
    or the CPU for a second or more by a long C call, a GC pause or a loaded host, so
    SUSPECT waits 2 s (20 missed beats).  DEAD waits 10 s: a hang is declared well
    inside what the seed's design needed (4 s to suspect, ~60 s to purge) while a
    stall of a few seconds never convicts.  Kills do not wait for either: the agent sees
    them through pidfd within milliseconds.
    """

    suspect_after_s: float = 2.0
    dead_after_s: float = 10.0
    #: the agent's own heartbeat older than this: remote verdicts read UNKNOWN
    agent_stale_s: float = 1.0
    peer_suspect_after_s: float = 1.0
    peer_dead_after_s: float = 5.0
    #: a slot DEAD (or LEFT) this long is cleared by the agent, as ``shmhb forget``
    #: does, so a probe and its alert recover after a crash; None: never (the default)
    forget_after_s: float | None = None

    def __post_init__(self) -> None:
        for f in ("suspect_after_s", "dead_after_s", "agent_stale_s",
                  "peer_suspect_after_s", "peer_dead_after_s"):
            _policy_time(f, getattr(self, f))
        if self.dead_after_s < self.suspect_after_s:
            raise InvalidConfig("dead_after_s must be >= suspect_after_s")
        if self.peer_dead_after_s < self.peer_suspect_after_s:
            raise InvalidConfig("peer_dead_after_s must be >= peer_suspect_after_s")
        if self.forget_after_s is not None:
            _policy_time("forget_after_s", self.forget_after_s)


_POLICY_FIELDS = ("suspect_after_s", "dead_after_s", "agent_stale_s", "peer_suspect_after_s",
                  "peer_dead_after_s", "forget_after_s")


def policy_differences(have: Policy, want: Policy) -> list[str]:
    """What differs between a board's policy and the one asked for, as
    ``"dead_after_s: board 10, asked 30"`` lines (empty: the same).  Times are compared
    in the board's time unit: a board stores them in nanoseconds, so a value that reads
    back a few ns apart is the same policy."""
    out = []
    for f in _POLICY_FIELDS:
        a, b = getattr(have, f), getattr(want, f)
        if (a is None) != (b is None) or (a is not None and abs(a - b) >= UNIT_S / 2):
            out.append(f"{f}: board {'off' if a is None else format(a, 'g')}, "
                       f"asked {'off' if b is None else format(b, 'g')}")
    return out


@dataclass(frozen=True)
class Capacity:
    """Row counts of a board's tables, fixed at creation.  ``slots`` at most the entries
    one ACK's digest lists (4,096): other hosts never see a slot past that."""

    slots: int = 64
    peers: int = 256
    remote_slots: int = 4096
    watches: int = 512

    def __post_init__(self) -> None:
        for f, hi in (("slots", MAX_DIGEST_ENTRIES), ("peers", 4096), ("remote_slots", 1 << 17),
                      ("watches", 1 << 14)):
            v = getattr(self, f)
            if not isinstance(v, int) or not 1 <= v <= hi:
                raise InvalidConfig(f"{f} must be an integer in 1..{hi}, got {v!r}")


@dataclass(frozen=True)
class AgentConfig:
    """The local half of the agent role: how often it ticks and polls the election."""

    #: the loop's period: pings to us are answered, verdicts on hosts advanced and pings
    #: released once per tick (a local death wakes the loop at once, between ticks).
    #: 0.1 s: at 0.05 s an idle pinger spent 60 % more CPU on ticks alone.  At most the
    #: board's agent_stale_s / 4 (``shmhb.agent.election.check_tick``): a tick given
    #: longer is refused, the default is shortened to it.
    tick_s: float = 0.1
    election_poll_s: float = 0.2
    #: a holder whose loop makes no progress for this long (blocked in one call) gives
    #: the role up; readers already read its verdicts UNKNOWN after agent_stale_s, so
    #: this bounds how long the host goes without an observer, not the detection time.
    #: Loaded hosts starve loops for seconds: keep it well above that.
    watchdog_s: float = 10.0
    #: the network half, when it fails, is retried after this, doubling up to the max
    net_retry_min_s: float = 0.25
    net_retry_max_s: float = 10.0

    def __post_init__(self) -> None:
        for f in ("tick_s", "election_poll_s", "watchdog_s", "net_retry_min_s",
                  "net_retry_max_s"):
            _positive(f, getattr(self, f))
        if self.watchdog_s < 4 * self.tick_s:
            raise InvalidConfig("watchdog_s must be at least 4 ticks (4 * tick_s)")
        if self.net_retry_max_s < self.net_retry_min_s:
            raise InvalidConfig("net_retry_max_s must be >= net_retry_min_s")


def parse_hostport(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``"host"``, ``"host:port"`` or ``"[v6]:port"`` -> (host, port), validated by
    :func:`shmhb.board.address.parse_address` (``InvalidAddress`` if refused)."""
    a = parse_address(text, default_port=default_port)
    assert a.port is not None
    return a.host, a.port


def has_port(text: str) -> bool:
    """Whether ``text`` (a valid address) names a port."""
    return parse_address(text).port is not None


def format_hostport(host: str, port: int) -> str:
    return format_address(host, port)


@dataclass(frozen=True)
class PingerConfig:
    """The network half of the agent role.  Written into the board by ``shmhb pinger`` so
    that whoever holds the role (the daemon, or a worker after the daemon died) applies
    the same settings."""

    listen: str | None = None  # "host:port"; None: the network half is off
    peers: tuple[str, ...] = field(default_factory=tuple)
    interval_s: float = 0.2  # the shortest per-host interval (see shmhb.net.plan)
    secret_file: str | None = None
    curve_keys: str | None = None
    #: pings per second to all followed hosts together (see shmhb.net.plan)
    ping_budget_pps: float = DEFAULT_BUDGET_PPS

    def __post_init__(self) -> None:
        _positive("interval_s", self.interval_s)
        b = self.ping_budget_pps
        if not (isinstance(b, (int, float)) and math.isfinite(b) and 0 < b <= MAX_BUDGET_PPS):
            raise InvalidConfig(f"ping_budget_pps must be a number of pings/s in (0, "
                                f"{MAX_BUDGET_PPS:g}], got {b!r}")
        if self.listen is not None:
            object.__setattr__(self, "listen", str(parse_address(
                self.listen, what="listen address", default_port=DEFAULT_PORT)))
        # A peer given without a port is pinged at the cluster's port (that of --listen),
        # like the host behind a watch: keep it port-less here.  Normalising it with
        # DEFAULT_PORT made `--peer HOST` ping 45645 whatever port the cluster used.
        if isinstance(self.peers, str) or not isinstance(self.peers, (tuple, list)):
            raise InvalidConfig(f"peers must be a tuple of addresses, got {self.peers!r}")
        object.__setattr__(
            self, "peers", tuple(str(parse_address(p, what="peer address")) for p in self.peers))
        for name in ("secret_file", "curve_keys"):
            v = getattr(self, name)
            if v is not None:
                v = os.path.abspath(v)
                if len(v.encode()) >= PATH_BYTES:
                    raise InvalidConfig(f"{name} path too long: {v!r}")
                object.__setattr__(self, name, v)
        if self.secret_file and self.curve_keys:
            raise InvalidConfig("give either a secret file or CURVE keys, not both")
