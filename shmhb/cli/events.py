"""Events: what changed between two successive Views of a board.

Pure logic: ``diff(old, new)`` compares two ``View``s (see ``shmhb.cli.view``) and returns
typed ``Event``s stamped with the new View's time; no board, no clock, no I/O, so it is
tested with synthetic Views.  ``diff(None, view)`` describes the current state as events
(``initial=True``): what ``shmhb events`` prints without ``--follow``.

What is reported:

- a worker (local, or remote with ``host`` set) registered, restarted with a new
  incarnation, hung (suspect), died, recovered, left, became unknown, or was removed;
- a remote host was added (first followed), answered for the first time (up), went
  silent (suspect), dead, unknown or left, came back, or was removed.  Worker transitions that merely follow their host (every worker of a
  dead host reads dead) are folded into the host's event;
- the agent role changed holder (new term), stalled, came back, or was released.
"""

from __future__ import annotations

import datetime as _dt
import enum
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..board.records import shown
from ..status import AgentStatus, PeerStatus, SlotStatus, Status
from .view import View


class Kind(str, enum.Enum):
    """Event kinds; the value is the stable name used in text and JSON output."""

    REGISTERED = "registered"
    RESTARTED = "restarted"
    RECOVERED = "recovered"
    HUNG = "hung"
    DIED = "died"
    LEFT = "left"
    UNKNOWN = "unknown"
    REMOVED = "removed"
    HOST_ADDED = "host_added"
    HOST_UP = "host_up"
    HOST_BACK = "host_back"
    HOST_SUSPECT = "host_suspect"
    HOST_DEAD = "host_dead"
    HOST_UNKNOWN = "host_unknown"
    HOST_LEFT = "host_left"
    HOST_REMOVED = "host_removed"
    AGENT_CHANGED = "agent_changed"
    AGENT_STALLED = "agent_stalled"
    AGENT_BACK = "agent_back"
    AGENT_LEFT = "agent_left"
    AGENT_UNKNOWN = "agent_unknown"

    def __str__(self) -> str:
        return self.value


#: the event a worker's move into each status makes
WORKER_KIND = {Status.ALIVE: Kind.RECOVERED, Status.SUSPECT: Kind.HUNG, Status.DEAD: Kind.DIED,
               Status.LEFT: Kind.LEFT, Status.UNKNOWN: Kind.UNKNOWN}
HOST_KIND = {Status.ALIVE: Kind.HOST_BACK, Status.SUSPECT: Kind.HOST_SUSPECT,
             Status.DEAD: Kind.HOST_DEAD, Status.LEFT: Kind.HOST_LEFT,
             Status.UNKNOWN: Kind.HOST_UNKNOWN}
AGENT_KIND = {Status.ALIVE: Kind.AGENT_BACK, Status.SUSPECT: Kind.AGENT_STALLED,
              Status.LEFT: Kind.AGENT_LEFT, Status.UNKNOWN: Kind.AGENT_UNKNOWN,
              Status.DEAD: Kind.AGENT_STALLED}

#: how bad an event is, for colouring: the Status it is most like
SEVERITY: dict[Kind, Status] = {
    Kind.REGISTERED: Status.ALIVE, Kind.RESTARTED: Status.ALIVE, Kind.RECOVERED: Status.ALIVE,
    Kind.HUNG: Status.SUSPECT, Kind.DIED: Status.DEAD, Kind.LEFT: Status.LEFT,
    Kind.UNKNOWN: Status.UNKNOWN, Kind.REMOVED: Status.LEFT,
    Kind.HOST_ADDED: Status.ALIVE, Kind.HOST_UP: Status.ALIVE, Kind.HOST_BACK: Status.ALIVE,
    Kind.HOST_SUSPECT: Status.SUSPECT, Kind.HOST_DEAD: Status.DEAD,
    Kind.HOST_UNKNOWN: Status.UNKNOWN, Kind.HOST_LEFT: Status.LEFT,
    Kind.HOST_REMOVED: Status.LEFT,
    Kind.AGENT_CHANGED: Status.ALIVE, Kind.AGENT_STALLED: Status.SUSPECT,
    Kind.AGENT_BACK: Status.ALIVE, Kind.AGENT_LEFT: Status.LEFT,
    Kind.AGENT_UNKNOWN: Status.UNKNOWN,
}

AGENT_SUBJECT = "agent"


@dataclass(frozen=True)
class Event:
    """One change.  ``subject``: a worker key, a host address, or ``"agent"``; ``host``:
    the remote host of a remote worker (None for local workers, hosts and the agent)."""

    t: float
    kind: Kind
    subject: str
    host: str | None = None
    status: Status | None = None
    previous: Status | None = None
    incarnation: int | None = None
    previous_incarnation: int | None = None
    pid: int | None = None
    detail: str = ""
    initial: bool = False

    @property
    def severity(self) -> Status:
        return SEVERITY[self.kind]

    def where(self) -> str:
        """The subject as shown to people: ``key``, ``key@host``, ``@host`` or ``agent``."""
        subject = shown(self.subject)  # escaped: no key may steer a terminal
        if self.host is not None:
            return f"{subject}@{shown(self.host)}"
        if self.kind.value.startswith("host_"):
            return f"@{subject}"
        return subject

    def time_str(self, date: bool = True) -> str:
        d = _dt.datetime.fromtimestamp(self.t).astimezone()
        return d.isoformat(timespec="milliseconds") if date else d.strftime("%H:%M:%S.%f")[:-3]

    def text(self) -> str:
        """The event without its time: ``died rank-1 pid 42 inc 7 (was alive; ...)``."""
        return f"{self.kind.value} {self.body()}"

    def body(self) -> str:
        """The event without its time and kind: ``rank-1 pid 42 inc 7 (was alive; ...)``."""
        parts = [self.where()]
        if self.pid:
            parts.append(f"pid {self.pid}")
        if self.incarnation is not None:
            parts.append(f"inc {self.incarnation}")
        notes = []
        if self.previous is not None and self.previous is not self.status:
            notes.append(f"was {self.previous.value}")
        if self.previous_incarnation is not None:
            notes.append(f"was inc {self.previous_incarnation}")
        if self.detail:
            notes.append(shown(self.detail))
        if self.initial:
            notes.append("at start")
        return " ".join(parts) + (f" ({'; '.join(notes)})" if notes else "")

    def __str__(self) -> str:
        return f"{self.time_str()} {self.text()}"

    def to_json(self) -> dict[str, object]:
        return {
            "time": self.time_str(),
            "t": round(self.t, 6),
            "kind": self.kind.value,
            "subject": self.subject,
            "host": self.host,
            "status": None if self.status is None else self.status.value,
            "previous": None if self.previous is None else self.previous.value,
            "incarnation": self.incarnation,
            "previous_incarnation": self.previous_incarnation,
            "pid": self.pid,
            "detail": self.detail,
            "initial": self.initial,
        }


# -- the diff ----------------------------------------------------------------------------


def _fmt_age(age_s: float | None) -> str:
    if age_s is None:
        return "never"
    return f"{age_s * 1000:.0f} ms ago" if age_s < 1 else f"{age_s:.1f} s ago"


def _by_key(slots: Iterable[SlotStatus]) -> dict[str, SlotStatus]:
    """Slots by key; should a key appear twice (a torn pair of reads), the newest
    incarnation wins."""
    out: dict[str, SlotStatus] = {}
    for s in slots:
        o = out.get(s.key)
        if o is None or s.incarnation > o.incarnation:
            out[s.key] = s
    return out


def _worker_event(t: float, kind: Kind, s: SlotStatus, host: str | None, initial: bool,
                  previous: Status | None = None, previous_inc: int | None = None) -> Event:
    verb = "last report" if host is not None else "last beat"
    return Event(t, kind, s.key, host, s.status, previous, s.incarnation, previous_inc,
                 s.pid or None, f"{verb} {_fmt_age(s.age_s)}", initial)


def _diff_workers(old: Mapping[str, SlotStatus], new: Mapping[str, SlotStatus], t: float,
                  host: str | None, initial: bool, follows_host: tuple[Status, Status] | None,
                  ) -> list[Event]:
    """Events for one set of workers (the local slots, or one remote host's).

    ``follows_host``: (old, new) status of the remote host when it changed in this step;
    a worker move into the host's new status, or out of its old one, is the host's doing
    and is not reported separately.
    """
    out = []
    for key, s in new.items():
        o = old.get(key)
        if o is None:
            # first sight: a registration, unless it is already hung, dead or gone
            kind = (Kind.REGISTERED if s.status in (Status.ALIVE, Status.UNKNOWN)
                    else WORKER_KIND[s.status])
            out.append(_worker_event(t, kind, s, host, initial))
        elif s.incarnation != o.incarnation:
            out.append(_worker_event(t, Kind.RESTARTED, s, host, initial, o.status, o.incarnation))
            if s.status is not Status.ALIVE:
                out.append(_worker_event(t, WORKER_KIND[s.status], s, host, initial))
        elif s.status is not o.status:
            if follows_host is not None and (
                    (s.status is follows_host[1] and s.status is not Status.ALIVE)
                    or (o.status is follows_host[0] and o.status is not Status.ALIVE)):
                continue
            out.append(_worker_event(t, WORKER_KIND[s.status], s, host, initial, o.status))
    for key, o in old.items():
        if key not in new:
            out.append(Event(t, Kind.REMOVED, key, host, None, o.status, o.incarnation, None,
                             o.pid or None, "slot reused or host stopped reporting it", initial))
    return out


def _host_detail(p: PeerStatus) -> str:
    bits = []
    if p.rtt_ms is not None:
        bits.append(f"rtt {p.rtt_ms:.2f} ms")
    bits.append(f"last ack {_fmt_age(p.age_s)}")
    bits.append(f"{len(p.slots)} worker" + ("" if len(p.slots) == 1 else "s"))
    return ", ".join(bits)


def _diff_hosts(old: Iterable[PeerStatus], new: Iterable[PeerStatus], t: float, initial: bool
                ) -> list[Event]:
    olds = {p.address: p for p in old}
    out = []
    for p in new:
        o = olds.pop(p.address, None)
        if o is None:
            out.append(Event(t, Kind.HOST_ADDED, p.address, None, p.status,
                             detail=f"{p.status.value}, {_host_detail(p)}", initial=initial))
            if p.status in (Status.SUSPECT, Status.DEAD, Status.LEFT):
                out.append(Event(t, HOST_KIND[p.status], p.address, None, p.status,
                                 detail=_host_detail(p), initial=initial))
            out.extend(_diff_workers({}, _by_key(p.slots), t, p.address, initial, None))
            continue
        moved = p.status is not o.status
        if moved:
            kind = HOST_KIND[p.status]
            if kind is Kind.HOST_BACK and o.status is Status.UNKNOWN and o.age_s is None:
                kind = Kind.HOST_UP  # the first answer from a host we just started to follow
            out.append(Event(t, kind, p.address, None, p.status, o.status,
                             detail=_host_detail(p), initial=initial))
        out.extend(_diff_workers(_by_key(o.slots), _by_key(p.slots), t, p.address, initial,
                                 (o.status, p.status) if moved else None))
    for o in olds.values():
        out.append(Event(t, Kind.HOST_REMOVED, o.address, None, None, o.status,
                         detail="no longer followed", initial=initial))
    return out


def _agent_detail(a: AgentStatus, held: bool) -> str:
    bits = [f"term {a.term}"]
    if a.status is not Status.UNKNOWN:
        bits.append(f"last beat {_fmt_age(a.age_s)}")
    if a.status is Status.SUSPECT:
        bits.append("role still held: stalled" if held else "role free: its holder died")
    return ", ".join(bits)


def _diff_agent(old: View | None, new: View, initial: bool) -> list[Event]:
    a = new.agent
    det = _agent_detail(a, new.agent_held)
    pid = a.pid or None
    if old is None or a.term != old.agent.term:
        if a.status is Status.UNKNOWN:
            return [Event(new.t, Kind.AGENT_UNKNOWN, AGENT_SUBJECT, None, a.status, pid=pid,
                          detail="no agent has run on this board", initial=initial)]
        prev = None if old is None else old.agent.status
        out = [Event(new.t, Kind.AGENT_CHANGED, AGENT_SUBJECT, None, a.status, prev, pid=pid,
                     detail=det, initial=initial)]
        if a.status is not Status.ALIVE:
            out.append(Event(new.t, AGENT_KIND[a.status], AGENT_SUBJECT, None, a.status,
                             pid=pid, detail=det, initial=initial))
        return out
    if a.status is not old.agent.status:
        return [Event(new.t, AGENT_KIND[a.status], AGENT_SUBJECT, None, a.status,
                      old.agent.status, pid=pid or old.agent.pid or None, detail=det,
                      initial=initial)]
    return []


def diff(old: View | None, new: View) -> list[Event]:
    """The events that lead from ``old`` to ``new``; with ``old`` None, the state of
    ``new`` described as events (each marked ``initial``).  Order: agent, local workers
    (by key), remote hosts and their workers."""
    initial = old is None
    out = _diff_agent(old, new, initial)
    out += _diff_workers({} if old is None else _by_key(old.slots), _by_key(new.slots), new.t,
                         None, initial, None)
    out += _diff_hosts(() if old is None else old.peers, new.peers, new.t, initial)
    return out


class EventLog:
    """Feeds successive Views through ``diff`` and keeps the latest ``keep`` events
    (the monitor's scrolling list)."""

    def __init__(self, keep: int = 500) -> None:
        self.last: View | None = None
        self.recent: deque[Event] = deque(maxlen=keep)

    def update(self, view: View) -> list[Event]:
        evs = diff(self.last, view)
        self.last = view
        self.recent.extend(evs)
        return evs
