"""One read of a whole board, as the node monitor's commands use it.

``read_view`` takes everything an operator's view needs from the board in one pass
(local slots, the agent, remote hosts, counters) and freezes it into a ``View``: the
table, the live view, the event stream and the Prometheus exporter all work from Views,
so each refresh or scrape reads the board exactly once, lock-free (``agent_held`` is the
one syscall).  ``events.diff`` compares two Views; it never touches a board.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .board import Board
from .config import Policy
from .status import AgentStatus, PeerStatus, SlotStatus, Status

BAD_PREFIX = "bad_"
NO_AGENT = AgentStatus(0, Status.UNKNOWN, None, 0)
_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> tuple[object, ...]:
    """Sort key that puts ``rank-2`` before ``rank-10``."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(key))


@dataclass(frozen=True)
class View:
    """A board as seen at wall-clock time ``t`` (seconds since the epoch).

    ``t`` is for display and event times only; every age inside comes from the board's
    monotonic clock (invariant 3), so a wall-clock jump never changes a verdict.
    """

    t: float
    slots: tuple[SlotStatus, ...] = ()
    agent: AgentStatus = NO_AGENT
    peers: tuple[PeerStatus, ...] = ()
    board: str = ""
    agent_held: bool = False
    stats: Mapping[str, int] = field(default_factory=dict)
    lateness_ms: float = 0.0
    policy: Policy | None = None

    def bad_frames(self) -> dict[str, int]:
        """Bad-frame counters by reason (``bad_auth`` -> ``auth``)."""
        return {k[len(BAD_PREFIX):]: v for k, v in self.stats.items() if k.startswith(BAD_PREFIX)}

    def unhealthy(self) -> list[SlotStatus]:
        """Local slots that are neither alive nor left (what makes ``status`` exit 1)."""
        return [s for s in self.slots if s.status not in (Status.ALIVE, Status.LEFT)]


def read_view(board: Board, *, wall: Callable[[], float] = time.time) -> View:
    """Read ``board`` once into a View (slots and each host's workers in natural key
    order, hosts by address)."""
    peers = tuple(p._replace(slots=sorted(p.slots, key=lambda s: natural_key(s.key)))
                  for p in board.peers())
    return View(
        t=wall(),
        slots=tuple(sorted(board.slots(), key=lambda s: natural_key(s.key))),
        agent=board.agent(),
        peers=peers,
        board=board.name,
        agent_held=board.agent_held(),
        stats=board.stats(),
        lateness_ms=board.lateness_ms(),
        policy=board.policy,
    )
