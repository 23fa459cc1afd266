"""One read of a whole board, as the node monitor's commands use it.

``read_view`` takes everything an operator's view needs from the board in one pass
(local slots, the agent, remote hosts, counters) and freezes it into a ``View``: the
table, the live view, the event stream and the Prometheus exporter all work from Views,
so each refresh or scrape reads the board exactly once, lock-free (``agent_held`` is the
one syscall).  ``events.diff`` compares two Views; it never touches a board.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..board import locks
from ..board.handle import Board
from ..board.core import board_words
from ..board.config import Policy
from ..board.layout import LOCK_DAEMON
from ..errors import InvalidConfig
from ..net.settings import load_config
from ..status import AgentStatus, NetworkStatus, PeerStatus, SlotStatus, Status
from .exits import EXIT_NETWORK, EXIT_NO_DAEMON, EXIT_NO_OBSERVER, EXIT_OK, EXIT_SLOTS

BAD_PREFIX = "bad_"
NO_AGENT = AgentStatus(0, Status.UNKNOWN, None, 0)
NO_NETWORK = NetworkStatus("unknown", True, False, None, "none", None, 0, None, 0, None, 0)

#: Version of ``shmhb status --json``: bumped when a field changes meaning or goes away
#: (new fields may appear without a bump).
STATUS_SCHEMA = 1
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
    network: NetworkStatus = NO_NETWORK
    #: a ``shmhb pinger`` daemon runs on this board (holding the role or waiting for it)
    daemon: bool = False
    #: a ``shmhb pinger`` stored its settings (--listen, --peer, ...) in this board
    pinger_configured: bool = False

    def bad_frames(self) -> dict[str, int]:
        """Bad-frame counters by reason (``bad_auth`` -> ``auth``)."""
        return {k[len(BAD_PREFIX):]: v for k, v in self.stats.items() if k.startswith(BAD_PREFIX)}

    def unhealthy(self) -> list[SlotStatus]:
        """Local slots that are neither alive nor left (what makes ``status`` exit 1)."""
        return [s for s in self.slots if s.status not in (Status.ALIVE, Status.LEFT)]

    def holder(self) -> str | None:
        """Who holds the agent role: "daemon" (``shmhb pinger``), "worker" (embedded in a
        registered worker), or None (no live holder, or none that can be told)."""
        a = self.agent
        if not self.agent_held or a.status is not Status.ALIVE or not a.pid:
            return None
        if any(s.pid == a.pid for s in self.slots if s.status in (Status.ALIVE, Status.SUSPECT)):
            return "worker"
        return "daemon" if self.daemon else None

    def daemon_problem(self) -> str | None:
        """Why a daemon that this board was set up for is missing (None: it runs, or no
        ``shmhb pinger`` ever stored settings here).  A worker's embedded agent keeps the
        host watched meanwhile, but not once the last worker is gone, and a daemon
        refused at each restart (a policy or secret it rejects) only shows here."""
        if not self.pinger_configured or self.daemon:
            return None
        who = (f"worker pid {self.agent.pid} holds the agent role embedded"
               if self.holder() == "worker" else "nothing runs the agent role")
        return (f"no `shmhb pinger` daemon runs on this board, though one stored its "
                f"settings here ({who}): see why it stopped (`systemctl status "
                f"shmhb-pinger`, `journalctl -u shmhb-pinger`, the pod's log)")

    def agent_problem(self) -> str | None:
        """Why no agent observes this board now (None: one runs and holds the role).
        The agent part of ``health``, and all that ``status --agent-only`` (the pinger's
        liveness probe) and the exporter's ``/readyz`` ask."""
        a = self.agent
        if a.status is Status.UNKNOWN:
            return ("no agent has run on this board: deaths are not detected; start "
                    "`shmhb pinger` or register a worker")
        if a.status is Status.LEFT:
            return ("the agent left and no process holds the role" if not self.agent_held
                    else "the agent role is changing hands")
        if a.status is not Status.ALIVE:
            return ("the agent is stalled (role still held)" if self.agent_held
                    else "the agent is gone; no standby took over")
        if not self.agent_held:
            return "the agent is gone (role not held)"
        return None

    def health(self) -> tuple[int, list[str]]:
        """``shmhb status``'s exit code (``EXIT_*``) and the problems behind it, worst
        first.  The one place that decides it, for the text and the JSON alike."""
        problems: list[tuple[int, str]] = []
        # No worker, or every one left (or was forgotten): nothing to watch, so a board
        # whose role nobody holds is not unhealthy if its agent never ran or left
        # cleanly, or died with the last worker that ran it embedded (and `forget`
        # cleared that worker).  A holder that stalled still is, and so is one that died
        # where a pinger was set up: the host no longer answers its peers.
        # Unless the board follows remote hosts: with no agent they all read unknown,
        # and so does this host to its peers (a pinger that stopped, or that is refused
        # at each start after an earlier run stored its settings and left).
        quiet = all(s.status is Status.LEFT for s in self.slots) and not self.peers
        a = self.agent
        idle = quiet and not self.agent_held and (
            a.status in (Status.UNKNOWN, Status.LEFT) or not self.pinger_configured)
        agent = self.agent_problem()
        if agent is not None and not idle:
            if self.peers:
                agent += (f"; the {len(self.peers)} remote host(s) this board follows read "
                          "unknown")
            problems.append((EXIT_NO_OBSERVER, agent))
        daemon = self.daemon_problem()
        # ... unless the host was wound down: every worker gone, the last holder left
        # cleanly (`systemctl stop` with no worker running), no remote host followed
        if daemon is not None and not (quiet and not self.agent_held
                                       and a.status is Status.LEFT):
            problems.append((EXIT_NO_DAEMON, daemon))
        n = self.network
        if not n.working:
            why = n.reason or "unknown reason"
            problems.append((EXIT_NETWORK, f"the network half is degraded ({why})"
                             + (f": {n.error}" if n.error else "")))
        for p in self.peers:
            if p.age_s is None and p.status in (Status.SUSPECT, Status.DEAD) \
                    and not p.auth_failing:
                problems.append((EXIT_NETWORK, f"host {p.address} has never answered, so it "
                                 f"reads {p.status.value}: check its address and port "
                                 "(--peer, the endpoint watched), that its name resolves on "
                                 "this host, and that its pinger runs and listens there"))
            if p.auth_failing:
                problems.append((EXIT_NETWORK, f"host {p.address}: authentication fails "
                                 f"({p.auth_failures} frame(s) refused), so whether it runs "
                                 f"cannot be told here (it reads {p.status.value}): give both hosts "
                                 "the same --secret-file (or each the other's CURVE key)"))
        bad = self.unhealthy()
        if bad:
            problems.append((EXIT_SLOTS, f"{len(bad)} local slot(s) not healthy: "
                             + ", ".join(f"{s.key} {s.status.value}" for s in bad[:8])
                             + (" ..." if len(bad) > 8 else "")))
        order = (EXIT_NO_OBSERVER, EXIT_NETWORK, EXIT_NO_DAEMON, EXIT_SLOTS)
        problems.sort(key=lambda p: order.index(p[0]))
        return (problems[0][0] if problems else EXIT_OK), [m for _, m in problems]


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
        agent_held=board_words(board).agent_held(),
        stats=board.stats(),
        lateness_ms=board_words(board).lateness_ms(),
        policy=board.policy,
        network=board.network(),
        daemon=daemon_runs(board),
        pinger_configured=pinger_configured(board),
    )


def daemon_runs(board: Board) -> bool:
    """Whether a ``shmhb pinger`` daemon runs on ``board``: every one holds LOCK_DAEMON
    (shared) for its life, holding the role or waiting for it (one syscall pair)."""
    fd = board_words(board).new_fd()
    try:
        return locks.is_held(fd, LOCK_DAEMON)
    finally:
        os.close(fd)


def pinger_configured(board: Board) -> bool:
    """Whether a ``shmhb pinger`` stored its settings in ``board`` (settings that do
    not validate were stored too)."""
    try:
        return load_config(board) is not None
    except InvalidConfig:
        return True
