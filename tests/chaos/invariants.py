"""The invariants of a chaos run, checked against the ground truth the harness records.

Ground truth (``Truth``) is what the harness did, with CLOCK_MONOTONIC timestamps taken
around each action: which incarnation of which worker ran when, when it was killed,
stopped, continued or told to leave, when a pinger was stopped or killed, when the CPU
was hogged or the veth between the namespaced hosts was down.  Workers also report
their own beat gaps (a stopped or starved worker that did not beat), which is ground
truth about silence the harness did not cause.

Observations are what each host's board says, read lock-free every poll through the
board's public readers (``slots``, ``peers``, ``agent``) as connectors read them.

Checks (``Checker``), and how each case is modelled:

* **Every death is seen by every observer within its bound.**  An incarnation that was
  killed or left must read DEAD or LEFT (or be replaced by a newer incarnation, or its
  host read DEAD) on its own host within ``local_bound`` and on every host of its group
  within ``remote_bound``.  The bound is measured in *healthy time*: the clock of a check
  pauses while the subject's or the observer's agent is disturbed (stopped, killed and
  not yet replaced, stale as read from its own heartbeat word), while the CPU is hogged,
  while the harness itself ran late (then the whole machine was starved), while the two
  hosts are partitioned, and for a recovery margin after each.  So a bound is "this long
  while both ends could have known".
* **A host whose agent is gone is declared DEAD within its bound** (peer-dead-after +
  interval + slack of healthy observer time), when the observer follows another host
  that still answers (otherwise its pinger rightly doubts itself and stops at SUSPECT).
* **No living worker is reported DEAD** unless the ground truth explains it:
  - local verdict word (pidfd conviction) on a live incarnation: never explained;
  - local DEAD by staleness: the worker's own heartbeat word is that old, so the worker
    really was silent (stopped by us, or starved): recorded as a stall, never a breach;
  - a remote row reported DEAD: explained only by a silence of that worker (a stop or a
    reported beat gap) at least dead-after long that ended less than a reporting lag
    before (longer if either agent was disturbed since);
  - the remote *host* DEAD: explained only if the subject's or the observer's agent was
    disturbed, the CPU hogged, the harness late or the hosts partitioned within
    peer-dead-after + lag before.  (That is: a remote DEAD of a live worker is a breach
    only if both pingers were alive, unstopped and unstarved during the whole window.)
  These are judged a few seconds after the observation, once the worker's gap reports
  for that time have arrived.
* **No stale ALIVE**: once the bound of a dead incarnation has passed on an observer, the
  observer never reads it ALIVE or SUSPECT again.
* **Links**: each host's LinkReaper tracks a link to every worker of the other hosts of
  its group.  Every link to an incarnation that died, left or was replaced must be
  dropped within the death bound plus the reaper's poll slack, exactly once, with a
  reason that fits (killed: DEAD or RESTARTED; left: LEFT, RESTARTED, or DEAD when its
  host was legitimately DEAD).  A link to a live incarnation may be dropped only as DEAD
  and only when a remote DEAD of that worker would have been explained (above): a worker
  stopped past dead-after, or a host whose agent was gone that long, is legitimately dead
  to its watchers, and its links go.  The harness re-tracks (re-handshakes) after a drop:
  a new incarnation at once, the same one once the observer reads it ALIVE again.
* **No torn or invalid row** (``shmhb.cli.check.check_rows``, which ``shmhb gc``
  uses too): every registered slot's record has a valid checksum and the incarnation its
  heartbeat word names; the agent's two words name the same term; every peer and remote row with a non-zero checksum has a valid one, and its
  status word (and rtt word) carries the row's generation; remote rows point at a live
  peer row of the generation they name.  A row may be caught mid-write, so each is read
  again for a while, and only a problem seen in two scans in a row while its writer is
  not stopped is a breach.
* **Leaks** (``Snapshot``): /dev/shm holds none of the run's boards afterwards, and the
  harness process has the file descriptors, threads and child processes it had before.
"""

from __future__ import annotations

from shmhb.board.core import board_words

import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmhb import Board, Status
from shmhb.cli.check import Finding
from shmhb.board.layout import INC_SHIFT, TS_SHIFT, inc_tag

from .schedule import Timing

NS = 1_000_000_000
ALIVE, SUSPECT, DEAD, LEFT, UNKNOWN = (Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT,
                                       Status.UNKNOWN)


def now_ns() -> int:
    return time.monotonic_ns()


def actor_result(out: str, rc: int) -> dict[str, Any]:
    """What a fault's actor process reported: the JSON object of its last line (``ok``,
    and ``why`` when not), or a failure naming its exit status and output's tail."""
    try:
        got = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "why": f"no result (rc {rc}): {out[-300:]!r}"}
    return got if isinstance(got, dict) else {"ok": False, "why": f"not an object: {got!r}"}


# -- intervals -------------------------------------------------------------------------------

@dataclass
class Interval:
    kind: str
    start: int
    end: int | None = None  # None: still open
    margin: int = 0  # after ``end``, still counted as disturbed for this long

    def overlaps(self, a: int, b: int) -> bool:
        return self.start <= b and (self.end is None or self.end + self.margin >= a)

    def length(self, now: int) -> int:
        return (self.end if self.end is not None else now) - self.start


class Timeline:
    """Intervals of one subject, in order of start."""

    HORIZON = 120 * NS  # no closed interval (with its margin) is longer than this

    def __init__(self) -> None:
        self.items: list[Interval] = []
        self.open: dict[str, Interval] = {}
        self._unended: list[Interval] = []  # added without an end (some get one later)

    def add(self, kind: str, start: int, end: int | None = None, margin: int = 0) -> Interval:
        iv = Interval(kind, start, end, margin)
        self.items.append(iv)
        if end is None:
            self._unended.append(iv)
        if len(self.items) > 1 and self.items[-2].start > start:
            self.items.sort(key=lambda x: x.start)
        return iv

    def open_(self, kind: str, start: int, margin: int = 0) -> Interval:
        """Open an interval of ``kind`` unless one is open already."""
        iv = self.open.get(kind)
        if iv is None:
            iv = self.open[kind] = self.add(kind, start, None, margin)
        return iv

    def close(self, kind: str, end: int) -> Interval | None:
        iv = self.open.pop(kind, None)
        if iv is not None:
            iv.end = max(end, iv.start)
        return iv

    def is_open(self, kind: str) -> bool:
        return kind in self.open

    def overlapping(self, a: int, b: int) -> Iterable[Interval]:
        """Intervals that overlap [a, b] (with their margins).  Scans back only
        ``HORIZON`` from ``a``, plus the intervals still without an end, so a check costs
        the same in the thirtieth minute of a run as in the first."""
        self._unended = [iv for iv in self._unended if iv.end is None]
        seen = set()
        for iv in self._unended:
            if iv.start <= b:
                seen.add(id(iv))
                yield iv
        for iv in reversed(self.items):
            if iv.start < a - self.HORIZON:
                break
            if id(iv) not in seen and iv.overlaps(a, b):
                yield iv

    def any(self, a: int, b: int) -> bool:
        return next(iter(self.overlapping(a, b)), None) is not None


# -- ground truth ----------------------------------------------------------------------------

@dataclass
class Inc:
    """One incarnation of one worker slot, as the harness ran it."""

    host: int
    widx: int
    key: str
    endpoint: str
    inc: int
    pid: int
    t_ready: int
    # When its register() began: the board may show it from then on (the first register
    # in a process also starts the embedded agent before it returns), so a peer may
    # rightly call its predecessor "restarted" before t_ready.
    t_reg: int | None = None
    t_killed: int | None = None
    t_term: int | None = None  # SIGTERM sent: leaving
    t_closed: int | None = None  # the worker's own time right after close()
    crashed: bool = False
    silences: Timeline = field(default_factory=Timeline)  # stops and beat gaps

    @property
    def slot(self) -> str:
        return f"h{self.host}/w{self.widx}"

    def ended_by(self, t: int) -> bool:
        """Killed, or told to leave, at or before ``t``: a DEAD or LEFT is legitimate."""
        return ((self.t_killed is not None and self.t_killed <= t)
                or (self.t_term is not None and self.t_term <= t))

    @property
    def t_end(self) -> int | None:
        """When the incarnation was over for sure (the clock of its bounds starts)."""
        if self.t_killed is not None:
            return self.t_killed
        return self.t_closed

    @property
    def end_kind(self) -> str | None:
        if self.t_killed is not None:
            return "killed"
        if self.t_closed is not None or self.t_term is not None:
            return "left"
        return None


class Truth:
    """Everything the harness did, and an event log for breach timelines."""

    def __init__(self, t0: int, n_hosts: int, groups: list[int]) -> None:
        self.t0 = t0
        self.groups = groups
        self.log: list[tuple[int, str, frozenset[str]]] = []
        self.incs: dict[int, Inc] = {}
        self.by_slot: dict[tuple[int, int], list[Inc]] = defaultdict(list)
        self.host: list[Timeline] = [Timeline() for _ in range(n_hosts)]
        self.glob = Timeline()
        self.part: dict[frozenset[int], Timeline] = defaultdict(Timeline)
        self.pinger_stopped: list[bool] = [False] * n_hosts  # the holder is SIGSTOPped now
        self.reg: list[Timeline] = [Timeline() for _ in range(n_hosts)]  # registry lock held
        self._lock = threading.Lock()

    def note(self, t: int, text: str, *tags: str) -> None:
        with self._lock:
            self.log.append((t, text, frozenset(tags)))

    def rel(self, t: int) -> float:
        return (t - self.t0) / NS

    def new_inc(self, inc: Inc) -> None:
        self.incs[inc.inc] = inc
        self.by_slot[(inc.host, inc.widx)].append(inc)

    def current(self, host: int, widx: int) -> Inc | None:
        got = self.by_slot.get((host, widx))
        return got[-1] if got else None

    def observers(self, s: int) -> list[int]:
        """Hosts whose boards report on host ``s``: itself and the rest of its group."""
        return [o for o, g in enumerate(self.groups) if g == self.groups[s]]

    def followed(self, o: int) -> list[int]:
        return [s for s in self.observers(o) if s != o]

    def disturbed(self, h: int, a: int, b: int) -> bool:
        return self.host[h].any(a, b)

    def partitioned(self, o: int, s: int, a: int, b: int) -> bool:
        tl = self.part.get(frozenset((o, s)))
        return tl is not None and tl.any(a, b)


# -- observations ------------------------------------------------------------------------------

@dataclass
class View:
    """One board as read at ``t``.  ``local``: key -> (incarnation, status, age_s,
    convicted by the agent's verdict word).  ``remote``: host index -> (host status,
    key -> (incarnation, status))."""

    t: int
    agent_pid: int
    agent_status: Status
    agent_age_s: float | None
    agent_term: int
    local: dict[str, tuple[int, Status, float, bool]]
    remote: dict[int, tuple[Status, dict[str, tuple[int, Status]]]]
    answered: int = 0  # the board's ``pings_answered`` counter (every holder adds to it)


def read_view(board: Board, host_of_ip: dict[str, int]) -> View:
    from shmhb.board.config import parse_hostport
    from shmhb.board.judge import judge_local

    t = now_ns()
    a = board.agent()
    local: dict[str, tuple[int, Status, float, bool]] = {}
    hbs = board._hb.copy()
    vs = board._verdict.copy()
    nowu = board._now_ns() >> TS_SHIFT
    for i in np.flatnonzero(hbs):
        info = board_words(board).read_slot(int(i))
        if info is None:
            continue
        key, _pid, inc, _eps = info
        hb, v = int(hbs[i]), int(vs[i])
        if hb >> INC_SHIFT != inc_tag(inc):
            continue
        st, age = judge_local(hb, v, nowu, board.thresholds)
        vdead = bool(v) and v >> INC_SHIFT == hb >> INC_SHIFT
        local[key] = (inc, st, age * (1 << TS_SHIFT) / NS, vdead)
    remote: dict[int, tuple[Status, dict[str, tuple[int, Status]]]] = {}
    for p in board.peers():
        h = host_of_ip.get(parse_hostport(p.address)[0])
        if h is None:
            continue
        slots: dict[str, tuple[int, Status]] = {}
        for s in p.slots:
            old = slots.get(s.key)
            if old is None or s.incarnation > old[0]:
                slots[s.key] = (s.incarnation, s.status)
        remote[h] = (p.status, slots)
    return View(t, a.pid, a.status, a.age_s, a.term, local, remote,
                board.stats().get("pings_answered", 0))


# -- breaches --------------------------------------------------------------------------------

@dataclass
class Breach:
    kind: str
    t: int
    msg: str
    tags: frozenset[str]
    timeline: list[str] = field(default_factory=list)
    t_rel: float = 0.0  # seconds since the run's start


@dataclass
class Bounds:
    """Bounds in healthy seconds (see the module docstring), from a Timing and a slack."""

    local_s: float
    remote_s: float
    host_dead_s: float
    link_s: float
    lag_s: float  # how long a remote report may trail the truth
    margin_s: float  # recovery after a disturbance ends
    tol_s: float = 0.25  # timestamp granularity and the gap between beats

    @classmethod
    def of(cls, t: Timing, slack_s: float) -> Bounds:
        # A kill is seen through pidfd within milliseconds: 1 s, plus half the slack,
        # stays well below dead-after, so detection by staleness alone would breach it.
        local = 1.0 + slack_s / 2
        return cls(
            local_s=local,
            remote_s=local + 2 * t.interval_s + slack_s / 2,
            host_dead_s=t.peer_dead_after_s + t.interval_s + slack_s,
            link_s=local + 2 * t.interval_s + slack_s / 2 + 0.5,
            lag_s=3 * t.interval_s + slack_s,
            margin_s=t.interval_s + 1.0,
        )


@dataclass
class _Seen:
    """Observer ``o`` must see the end of ``inc`` within ``bound`` healthy seconds."""

    o: int
    inc: Inc
    t_end: int
    bound_ns: int
    healthy: int = 0
    seen_at: int | None = None
    breached: bool = False

    @property
    def expired(self) -> bool:
        return self.healthy >= self.bound_ns


@dataclass
class _HostDead:
    o: int
    s: int
    t0: int
    why: str
    bound_ns: int
    healthy: int = 0
    done: bool = False


@dataclass
class _Candidate:
    """A DEAD (or a link drop) about a live incarnation, judged later."""

    t: int
    o: int
    inc: Inc
    what: str  # "local-verdict", "remote-row", "remote-host", "drop", "restarted"
    detail: str
    judge_at: int


@dataclass
class LinkRec:
    id: int
    o: int
    inc: Inc
    endpoint: str
    t_track: int
    t_drop: int | None = None
    reason: str | None = None
    healthy: int = 0  # once its incarnation ended
    breached: bool = False


class Checker:
    def __init__(self, truth: Truth, timing: Timing, bounds: Bounds, seed: int) -> None:
        self.truth = truth
        self.timing = timing
        self.b = bounds
        self.seed = seed
        self.breaches: list[Breach] = []
        self.seen: list[_Seen] = []
        self.expired: set[tuple[int, int]] = set()  # (observer, incarnation) past its bound
        self.host_dead: list[_HostDead] = []
        self.cands: list[_Candidate] = []
        self.links: dict[int, LinkRec] = {}
        self.live_links: dict[tuple[int, int, int], LinkRec] = {}  # (o, s, widx) -> link
        self.last: dict[tuple[int, int, str], tuple[int, Status]] = {}  # (o, s, key) -> view
        self.last_host: dict[tuple[int, int], Status] = {}
        self.stats: Counter[str] = Counter()
        self.lat: dict[str, list[float]] = defaultdict(list)
        self._last_accrue: int | None = None
        self._torn: dict[tuple[int, str], int] = {}  # (host, row) -> first seen
        self._torn_reported: set[tuple[int, str]] = set()

    # -- breaches ---------------------------------------------------------------------------

    def breach(self, kind: str, t: int, msg: str, *tags: str) -> None:
        self.breaches.append(Breach(kind, t, msg, frozenset(tags)))
        self.truth.note(t, f"BREACH {kind}: {msg}", *tags)

    # -- ground-truth hooks ---------------------------------------------------------------------

    def on_end(self, inc: Inc, t_end: int) -> None:
        """``inc`` is over (killed at ``t_end``, or closed then): every observer must see
        it, and every link to it must go."""
        for o in self.truth.observers(inc.host):
            bound = self.b.local_s if o == inc.host else self.b.remote_s
            self.seen.append(_Seen(o, inc, t_end, int(bound * NS)))
        for lk in self.live_links.values():
            if lk.inc is inc:
                lk.healthy = 0

    def on_host_down(self, s: int, t: int, why: str) -> None:
        """Host ``s`` has no working agent from ``t`` (stopped, killed, partitioned ...):
        the hosts that follow it must declare it DEAD unless it comes back first."""
        for o in self.truth.followed(s):
            if why == "partition" and frozenset((o, s)) not in self.truth.part:
                continue
            self.host_dead.append(_HostDead(o, s, t, why, int(self.b.host_dead_s * NS)))

    def on_host_up(self, s: int, why: str) -> None:
        for hd in self.host_dead:
            if hd.s == s and hd.why == why and not hd.done:
                hd.done = True

    # -- healthy time -------------------------------------------------------------------------

    def _pair_ok(self, o: int, s: int, a: int, b: int, glob: bool) -> bool:
        tr = self.truth
        return not (glob or tr.disturbed(o, a, b) or tr.disturbed(s, a, b)
                    or (o != s and tr.partitioned(o, s, a, b)))

    def accrue(self, t: int, harness_late: bool) -> None:
        a = self._last_accrue
        self._last_accrue = t
        if a is None:
            return
        dt = t - a
        tr = self.truth
        glob = harness_late or tr.glob.any(a, t)
        ok: dict[tuple[int, int], bool] = {}

        def pair(o: int, s: int) -> bool:
            k = (o, s)
            if k not in ok:
                ok[k] = self._pair_ok(o, s, a, t, glob)
            return ok[k]

        keep = []
        for c in self.seen:
            if pair(c.o, c.inc.host):
                c.healthy += dt
            if c.expired and (c.seen_at is not None or c.breached):
                if c.seen_at is not None:  # from now on, ALIVE for it is stale
                    self.expired.add((c.o, c.inc.inc))
                continue
            keep.append(c)
        self.seen = keep
        for lk in self.live_links.values():
            if lk.inc.t_end is not None and pair(lk.o, lk.inc.host):
                lk.healthy += dt
        for hd in self.host_dead:
            if hd.done:
                continue
            if glob or tr.disturbed(hd.o, a, t):
                hd.healthy = 0  # the observer's own verdicts restart (a new holder, a late loop)
                continue
            others = [h for h in tr.followed(hd.o) if h != hd.s]
            if others and not any(not tr.disturbed(h, a, t) and not tr.partitioned(hd.o, h, a, t)
                                  for h in others):
                continue  # every host it follows is silent: it rightly doubts itself
            hd.healthy += dt
        self.host_dead = [hd for hd in self.host_dead if not hd.done]

    # -- observations -------------------------------------------------------------------------

    def observe(self, o: int, v: View) -> None:
        tr = self.truth
        t = v.t
        # local slots
        for key, (inc_n, st, age, vdead) in v.local.items():
            self._entry(o, o, key, inc_n, st, t, local_age=age, vdead=vdead)
        for s, (hst, slots) in v.remote.items():
            if self.last_host.get((o, s)) is not hst:
                tr.note(t, f"h{o} reads host h{s} {hst.value}", f"h{o}", f"h{s}")
                self.last_host[(o, s)] = hst
                if hst is DEAD:
                    self._host_dead_seen(o, s, t)
            for key, (inc_n, st) in slots.items():
                self._entry(o, s, key, inc_n, st, t, host_status=hst)
        # deaths to be seen
        for c in self.seen:
            if c.o != o or c.seen_at is not None:
                continue
            if self._is_seen(o, c.inc, v):
                c.seen_at = t
                lat = (t - c.t_end) / NS
                self.lat["local" if o == c.inc.host else "remote"].append(lat)
                self.lat["healthy-local" if o == c.inc.host else "healthy-remote"].append(c.healthy / NS)
                if lat > 2.0:
                    self.truth.note(t, f"slow: h{o} saw {c.inc.slot} inc {c.inc.inc} "
                                    f"{c.inc.end_kind} after {lat:.2f} s ({c.healthy / NS:.2f} s healthy)",
                                    f"h{o}", c.inc.slot)
            elif c.expired and not c.breached:
                c.breached = True
                got = self._view_of(o, c.inc, v)
                self.breach("late-detection", t,
                            f"h{o} still reads {c.inc.slot} inc {c.inc.inc} as {got} "
                            f"{(t - c.t_end) / NS:.2f} s after it was {c.inc.end_kind} "
                            f"(bound {c.bound_ns / NS:.1f} s of healthy time)",
                            f"h{o}", c.inc.slot, f"h{c.inc.host}")
        for hd in self.host_dead:
            if hd.o == o and not hd.done and v.remote.get(hd.s, (None,))[0] is DEAD:
                # already DEAD here (it may have been before this outage began)
                hd.done = True
                self.lat["host-dead"].append((t - hd.t0) / NS)
            if hd.o == o and not hd.done and hd.healthy >= hd.bound_ns:
                hd.done = True
                hs = v.remote.get(hd.s, (None,))[0]
                self.breach("host-not-dead", t,
                            f"h{o} reads host h{hd.s} as {hs} {(t - hd.t0) / NS:.2f} s after "
                            f"its agent went ({hd.why}); bound {hd.bound_ns / NS:.1f} s healthy",
                            f"h{o}", f"h{hd.s}")

    def _host_dead_seen(self, o: int, s: int, t: int) -> None:
        for hd in self.host_dead:
            if hd.o == o and hd.s == s and not hd.done:
                hd.done = True
                self.lat["host-dead"].append((t - hd.t0) / NS)
        # a DEAD host: each of its live workers reads DEAD here; judged like any other
        for w in self._slots_of(s):
            inc = self.truth.current(s, w)
            if inc is not None and not inc.ended_by(t):
                self._candidate(t, o, inc, "remote-host", f"h{o} reads host h{s} DEAD")

    def _slots_of(self, s: int) -> list[int]:
        return sorted({w for (h, w) in self.truth.by_slot if h == s})

    def _entry(self, o: int, s: int, key: str, inc_n: int, st: Status, t: int, *,
               local_age: float | None = None, vdead: bool = False,
               host_status: Status | None = None) -> None:
        tr = self.truth
        k = (o, s, key)
        prev = self.last.get(k)
        if prev != (inc_n, st):
            self.last[k] = (inc_n, st)
            where = "locally" if o == s else f"on h{o}"
            tr.note(t, f"{key} inc {inc_n} reads {st.value} {where}", f"h{o}", f"h{s}",
                    self._slot_tag(s, key))
        inc = tr.incs.get(inc_n)
        if inc is None:
            return  # an incarnation the harness has not heard of yet (ready line unread)
        changed = prev != (inc_n, st)
        if st is DEAD and changed and not inc.ended_by(t):
            if o == s:
                if vdead:
                    self._candidate(t, o, inc, "local-verdict",
                                    f"the agent of h{s} convicted live {inc.slot} inc {inc.inc}")
                else:
                    self.stats["stall-dead-local"] += 1
                    stopped = any(iv.kind == "stop" for iv in inc.silences.overlapping(t, t))
                    if not stopped:
                        self.stats["stall-dead-unstopped"] += 1
                    # the worker's own heartbeat word is that old: it really was silent
                    inc.silences.add("stale", t - int((local_age or 0) * NS), t)
            elif host_status is not DEAD:
                self._candidate(t, o, inc, "remote-row",
                                f"h{o} reads live {inc.slot} inc {inc.inc} DEAD (host {host_status})")
        if st in (ALIVE, SUSPECT) and inc.t_end is not None and (o, inc_n) in self.expired:
            self.breach("stale-alive", t,
                        f"h{o} reads {inc.slot} inc {inc_n} {st.value} "
                        f"{(t - inc.t_end) / NS:.2f} s after it was {inc.end_kind}",
                        f"h{o}", inc.slot)
            self.expired.discard((o, inc_n))  # once per (observer, incarnation)

    @staticmethod
    def _slot_tag(s: int, key: str) -> str:
        return f"h{s}/w{key.rsplit('-w', 1)[-1]}"

    def _view_of(self, o: int, inc: Inc, v: View) -> str:
        if o == inc.host:
            e = v.local.get(inc.key)
            return "nothing" if e is None else f"inc {e[0]} {e[1].value}"
        r = v.remote.get(inc.host)
        if r is None:
            return "no such host"
        e = r[1].get(inc.key)
        return f"host {r[0].value}, " + ("no row" if e is None else f"inc {e[0]} {e[1].value}")

    @staticmethod
    def _is_seen(o: int, inc: Inc, v: View) -> bool:
        if o == inc.host:
            e = v.local.get(inc.key)
        else:
            r = v.remote.get(inc.host)
            if r is None:
                return False
            if r[0] is DEAD:
                return True
            e = r[1].get(inc.key)
        if e is None:
            return False
        return e[0] > inc.inc or (e[0] == inc.inc and e[1] in (DEAD, LEFT))

    # -- links ----------------------------------------------------------------------------

    def on_track(self, lk: LinkRec) -> None:
        self.links[lk.id] = lk
        self.live_links[(lk.o, lk.inc.host, lk.inc.widx)] = lk
        self.stats["links-tracked"] += 1
        self.truth.note(lk.t_track, f"h{lk.o} tracks link {lk.id} to {lk.inc.slot} inc {lk.inc.inc}",
                        f"h{lk.o}", lk.inc.slot)

    def on_drop(self, t: int, link_id: int, reason: str) -> None:
        lk = self.links.get(link_id)
        if lk is None:
            self.breach("unknown-drop", t, f"a link the harness never tracked was dropped ({reason})")
            return
        inc = lk.inc
        self.truth.note(t, f"h{lk.o} drops link {lk.id} to {inc.slot} inc {inc.inc}: {reason}",
                        f"h{lk.o}", inc.slot)
        if lk.t_drop is not None:
            self.breach("dropped-twice", t, f"h{lk.o}: link {lk.id} to {inc.slot} inc {inc.inc} "
                        f"dropped again ({reason}; first {lk.reason})", f"h{lk.o}", inc.slot)
            return
        lk.t_drop, lk.reason = t, reason
        k = (lk.o, inc.host, inc.widx)
        if self.live_links.get(k) is lk:
            del self.live_links[k]
        self.stats[f"drop-{reason}"] += 1
        if inc.ended_by(t):
            if inc.t_end is not None:
                self.lat["link"].append((t - inc.t_end) / NS)
            newer = self._successor_registered(inc, t)
            kind = inc.end_kind
            ok = {"killed": {"dead"} | ({"restarted"} if newer else set()),
                  "left": {"left"} | ({"restarted"} if newer else set())}[kind or "killed"]
            if reason not in ok:
                if reason == "dead" and kind == "left":
                    # legitimate if its host was legitimately DEAD here: judged later
                    self._candidate(t, lk.o, inc, "drop", f"link {lk.id} of a left worker dropped DEAD")
                    return
                if reason == "restarted":
                    # A successor can be seen on another host before the harness hears
                    # of it (a worker reports its registration once register() has
                    # returned and it is ready): judged later, on what was known by then.
                    self._candidate(t, lk.o, inc, "restarted",
                                    f"h{lk.o}: link {lk.id} to {inc.slot} inc {inc.inc} ({kind}) "
                                    "dropped as restarted")
                    return
                self.breach("wrong-drop-reason", t,
                            f"h{lk.o}: link {lk.id} to {inc.slot} inc {inc.inc} ({kind}) dropped "
                            f"as {reason}", f"h{lk.o}", inc.slot)
            return
        if reason != "dead":
            self.breach("wrong-drop-reason", t, f"h{lk.o}: link {lk.id} to live {inc.slot} inc "
                        f"{inc.inc} dropped as {reason}", f"h{lk.o}", inc.slot)
            return
        self._candidate(t, lk.o, inc, "drop", f"h{lk.o} dropped link {lk.id} to live {inc.slot}")

    def check_links(self, t: int) -> None:
        for lk in self.live_links.values():
            if lk.inc.t_end is None or lk.breached:
                continue
            if lk.healthy >= int(self.b.link_s * NS):
                lk.breached = True
                self.breach("link-not-dropped", t,
                            f"h{lk.o}: link {lk.id} to {lk.inc.slot} inc {lk.inc.inc} still tracked "
                            f"{(t - lk.inc.t_end) / NS:.2f} s after it was {lk.inc.end_kind}",
                            f"h{lk.o}", lk.inc.slot)

    # -- deferred judgements --------------------------------------------------------------------

    def _candidate(self, t: int, o: int, inc: Inc, what: str, detail: str) -> None:
        delay = int((self.b.lag_s + 3.0) * NS)
        self.cands.append(_Candidate(t, o, inc, what, detail, t + delay))

    def judge(self, t: int, final: bool = False) -> None:
        keep = []
        for c in self.cands:
            if not final and t < c.judge_at:
                keep.append(c)
                continue
            self._judge(c)
        self.cands = keep

    def _successor_registered(self, inc: Inc, t: int) -> bool:
        """Whether a later incarnation of ``inc``'s slot had begun registering by ``t``."""
        return any(i.inc > inc.inc and (i.t_ready if i.t_reg is None else i.t_reg) <= t
                   for i in self.truth.by_slot[(inc.host, inc.widx)])

    def _judge(self, c: _Candidate) -> None:
        inc, t = c.inc, c.t
        if c.what == "restarted":
            if self._successor_registered(inc, t):
                self.stats["excused-restarted-late-news"] += 1
            else:
                self.breach("wrong-drop-reason", t, c.detail + ", and no successor had begun "
                            "registering by then", f"h{c.o}", inc.slot)
            return
        if inc.ended_by(t):
            if c.what == "drop" and inc.end_kind == "left":
                if self._host_excuse(c.o, inc.host, t):
                    self.stats["excused-drop-left-dead"] += 1
                    return
                self.breach("wrong-drop-reason", t, f"{c.detail}, and its host was not "
                            "legitimately DEAD", f"h{c.o}", inc.slot)
            return
        if inc.crashed:
            return  # reported as its own breach
        if c.what == "local-verdict":
            self.breach("false-dead", t, c.detail, f"h{c.o}", inc.slot)
            return
        row = self._row_excuse(c.o, inc, t)
        host = self._host_excuse(c.o, inc.host, t)
        if c.what == "remote-row" and row:
            self.stats["excused-remote-dead-stall"] += 1
            return
        if c.what == "remote-host" and host:
            self.stats["excused-host-dead"] += 1
            return
        if c.what == "drop" and (row or host):
            self.stats["excused-drop-live"] += 1
            return
        self.breach("false-dead" if c.what != "drop" else "live-link-dropped", t,
                    c.detail + " with no stop, stall, outage or partition to explain it",
                    f"h{c.o}", inc.slot, f"h{inc.host}")

    def _row_excuse(self, o: int, inc: Inc, t: int) -> bool:
        """A silence of the worker at least dead-after long, whose DEAD could still be
        what ``o`` reads at ``t``."""
        tr = self.truth
        dead = int((self.timing.dead_after_s - self.b.tol_s) * NS)
        lag = int(self.b.lag_s * NS)
        for iv in inc.silences.overlapping(t - 60 * NS, t):
            if iv.start + dead > t:
                continue
            end = iv.end if iv.end is not None else t
            if iv.length(t) < dead and iv.kind != "stale":
                continue
            if end >= t - lag:
                return True
            # the report could trail longer if either agent was disturbed meanwhile
            if (tr.disturbed(inc.host, end, t) or tr.disturbed(o, end, t) or tr.glob.any(end, t)):
                return True
        return False

    def _host_excuse(self, o: int, s: int, t: int) -> bool:
        """Could ``o`` rightly read host ``s`` DEAD at ``t``?  Only if ``s`` went silent
        towards ``o`` for about peer-dead-after: one span, ending less than a reporting lag
        before ``t``, during which the agent of ``s`` was stopped, killed and not yet
        replaced by a holder that answers pings (the harness closes the span at the new
        holder's first answered ping), or stale; or the CPU was hogged or the harness itself starved (then
        ``s`` was starved too); or the two were partitioned.  The observer's own
        troubles never excuse it: a pinger that was paused or starved must not convict
        others for it (its late loop accrues no silence), and a new holder starts its
        verdicts afresh."""
        tr = self.truth
        horizon = t - 60 * NS
        join = int(0.15 * NS)
        spans = [(iv.start, iv.end if iv.end is not None else t)
                 for tl in (tr.host[s], tr.glob, tr.part.get(frozenset((o, s))) or Timeline())
                 for iv in tl.overlapping(horizon, t)]
        spans.sort()
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1] + join:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        need = int((self.timing.peer_dead_after_s - self.timing.interval_s - self.b.tol_s) * NS)
        lag = int(self.b.lag_s * NS)
        for a, b in merged:
            if a <= t and b >= t - lag and b - a >= need:
                return True
            if a <= t and b - a >= need and tr.disturbed(o, b, t):
                return True  # the observer could not hear the recovery yet
        return False

    # -- torn rows -------------------------------------------------------------------------

    def torn(self, h: int, t: int, problems: list[Finding], writer_stopped: bool) -> None:
        now_bad = {f.row for f in problems}
        for key in [k for k in self._torn if k[0] == h and k[1] not in now_bad]:
            del self._torn[key]
        for f in problems:
            row, what = f.row, f.problem
            k = (h, row)
            if k not in self._torn:
                self._torn[k] = t
                self.stats["torn-suspect"] += 1
                continue
            if writer_stopped and not row.startswith("slot"):
                continue
            if k in self._torn_reported:
                continue
            self._torn_reported.add(k)  # once per row
            self.breach("torn-row", t, f"board of h{h}: {row}: {what}", f"h{h}")

    # -- the end ------------------------------------------------------------------------------

    def finish(self, t: int) -> None:
        for c in self.seen:
            if c.seen_at is None and not c.breached:
                self.breach("never-seen", t, f"h{c.o} never saw {c.inc.slot} inc {c.inc.inc} "
                            f"{c.inc.end_kind} ({c.healthy / NS:.1f} s healthy time had passed)",
                            f"h{c.o}", c.inc.slot)
        self.check_links(t)
        for lk in self.live_links.values():
            if lk.inc.t_end is not None and not lk.breached:
                self.breach("link-not-dropped", t, f"h{lk.o}: link {lk.id} to {lk.inc.slot} inc "
                            f"{lk.inc.inc} never dropped ({lk.healthy / NS:.1f} s healthy)",
                            f"h{lk.o}", lk.inc.slot)
        self.judge(t, final=True)

    def timelines(self, before_s: float = 10.0, after_s: float = 1.5, limit: int = 50) -> None:
        log = self.truth.log
        for br in self.breaches:
            a, b = br.t - int(before_s * NS), br.t + int(after_s * NS)
            slots = {x for x in br.tags if "/" in x}
            hosts = {x for x in br.tags if "/" not in x}
            lines = []
            for t, text, tags in sorted(log, key=lambda e: e[0]):
                if t < a or t > b:
                    continue
                if ("*" in tags or tags & slots or (tags & hosts and any(
                        w in text for w in ("FAULT", "BREACH", "agent", "pinger", "reads host",
                                            "partition", "holder", "outage")))):
                    lines.append(f"  {self.truth.rel(t):9.3f}  {text}")
            if len(lines) > limit:
                lines = lines[:5] + [f"  ... {len(lines) - limit} lines ..."] + lines[-(limit - 5):]
            br.timeline = lines


# -- leaks -----------------------------------------------------------------------------------

@dataclass
class Snapshot:
    fds: int
    threads: int
    children: set[int]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(len(os.listdir("/proc/self/fd")), threading.active_count(), child_pids())


def child_pids() -> set[int]:
    me = os.getpid()
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me:
            out.add(int(d))
    return out


def pids_with(needle: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if needle.encode() in cmd:
            out.append(int(d))
    return out
