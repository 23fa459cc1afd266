"""The ping budget: which followed host to ping next, and when.  Pure logic, no I/O,
no clock of its own (callers pass ``now_ns``); tested with a fake clock.

The cost of the pinger is in the number of messages (pyzmq spends about as much per
frame as the whole pinger does), so the total rate of pings is what is bounded:

* **Per-host interval.**  Every followed host is pinged once per
  ``host_interval_ns(hosts, budget, min_interval, dead_after)``: the configured
  interval (``--interval-s``, the shortest) while the budget affords it, longer as the
  cluster grows so that ``hosts / interval`` stays within the budget (pings/s, all hosts
  together) -- but never longer than ``dead_after / MIN_PINGS_PER_WINDOW``: each host
  still gets at least that many pings per dead-after window, so the silence that
  convicts it is seen in missed pings, not guessed from one or two.  Where the budget
  cannot afford that floor, the floor wins (a verdict bound is worth more than a
  budget); ``over_budget`` says so.
* **Phases.**  The hosts take turns, one every ``interval / hosts``: round robin over
  a fixed order, released in batches (every ``BATCH_NS``, 250 ms, or every interval if
  shorter), so the load is even -- a quarter of a second's turns at a time, not the
  whole round at once -- and every host's pings keep one interval apart.  A host that
  joins is pinged first (at the next tick); a host that leaves frees its turn.
* **Mutual pairs.**  A host whose own pings to us count as evidence (authenticated, or
  echoing a challenge of ours: see docs/PROTOCOL.md, "Inbound pings as evidence") need
  not be pinged by us as well.  In a pair that follows each other, one side is the
  passive one (the caller decides which: ``shmhb.net.evidence.passive``, by board
  identity, which both sides see alike whatever addresses they know each other by): it
  skips its turn for a host whose evidence is fresher than ``SKIP_FRESH`` intervals,
  but still pings it at least every ``refresh_ns`` (to stay one of its watchers, so its
  pushes reach us) every ``LONG_REFRESH`` times that: its pings carry its digest
  generation, so they already say when our copy is behind, and the refresh only keeps
  the watch.  The active side
  never skips, so the pair never waits on each other; if the evidence stops (that host
  died, or stopped following us) the passive side pings it at once, at the first batch
  after the evidence went stale, and then every turn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..board.config import DEFAULT_BUDGET_PPS, MAX_BUDGET_PPS  # noqa: F401 (re-exported)

# DEFAULT_BUDGET_PPS, MAX_BUDGET_PPS (the total ping rate): settings values, defined
# with the settings in config.py, the lower layer that validates PingerConfig by them
#: Each host gets at least this many pings per ``peer_dead_after`` window.  Three is the
#: fewest that keeps a verdict on time: a host is convicted only after
#: ``suspicion.MISSED_IN_A_ROW`` (2) missed pings as well as ``peer_dead_after`` of
#: silence, and three turns in the window make the first two missed by its end, so DEAD
#: still comes ``peer_dead_after`` after the last evidence (plus at most one batch).  A
#: fourth costs a third more messages, which are the pinger's cost, and bought only a
#: SUSPECT 0.6 s earlier at 250 hosts (3.75 s after the last ack instead of 4.3 s: a ping
#: also counts as missed once it has waited ``peer_suspect_after``); over TCP a ping is
#: lost only with its connection, and a live host that loses every third one never
#: reads SUSPECT (tests/net/test_pingplan.py).
MIN_PINGS_PER_WINDOW = 3
#: Turns are released in batches at most this often (and at most once per interval):
#: the acks of one batch come back together and one wake-up of the loop drains several
#: (the loop's cost is per wake-up more than per frame: measured, a ping a tick cost
#: about twice what a batch does, and at 64 followed hosts 250 ms batches cost a sixth
#: less CPU than 100 ms ones).  A ping leaves at most this much after its phase; every
#: host's pings stay one interval apart on average, and its turns stay in order.
BATCH_NS = 250_000_000
#: A passive side skips its turn while a host's evidence is fresher than this many
#: intervals (more than one, so that a ping arriving a little late still counts).
SKIP_FRESH = 1.5
#: A passive side's refresh period, in ``refresh_ns``, for a host whose pings count as
#: evidence (they tell its digest generation).  A responder forgets a watcher after three peer-dead windows
#: of silence (``NetworkHalf``): two keeps a whole window of margin.
LONG_REFRESH = 2


def host_interval_ns(hosts: int, budget_pps: float, min_interval_ns: int, dead_after_ns: int) -> int:
    """How often each of ``hosts`` followed hosts is pinged (ns).  See the module text."""
    if hosts <= 0:
        return min_interval_ns
    spread = math.ceil(hosts * 1e9 / budget_pps)
    floor = dead_after_ns // MIN_PINGS_PER_WINDOW
    return max(min_interval_ns, min(spread, floor))


class PingPlan:
    """Round-robin turns of the followed hosts under a budget.

    ``set_hosts`` when the followed set changes; ``due(now_ns)`` every tick: the hosts
    whose turn came since the last call, in order; ``evidence`` when a host's own ping
    counted as evidence of its pinger running (mutual pairs)."""

    def __init__(self, budget_pps: float, min_interval_ns: int, dead_after_ns: int, *,
                 refresh_ns: int | None = None, batch_ns: int = BATCH_NS) -> None:
        if not (math.isfinite(budget_pps) and 0 < budget_pps <= MAX_BUDGET_PPS):
            raise ValueError(f"budget must be in (0, {MAX_BUDGET_PPS:g}] pings/s, got {budget_pps!r}")
        if min_interval_ns <= 0 or dead_after_ns <= 0:
            raise ValueError("intervals must be positive")
        self.budget_pps = budget_pps
        self.min_interval_ns = min_interval_ns
        self.dead_after_ns = dead_after_ns
        self.refresh_ns = dead_after_ns if refresh_ns is None else refresh_ns
        self.batch_ns = batch_ns
        self._release_ns: int | None = None
        self._order: list[str] = []
        self._cursor = 0
        self._next_ns: int | None = None
        self.interval_ns = min_interval_ns
        self._gap_ns = min_interval_ns
        self._evidence_ns: dict[str, int] = {}  # host -> last evidence (passive side only)
        self._pinged_ns: dict[str, int] = {}  # host -> our last ping (passive side only)

    # -- the followed set ---------------------------------------------------------------

    def set_hosts(self, hosts: Iterable[str], now_ns: int) -> None:
        """The followed hosts changed.  New ones go first (pinged at the next ``due``);
        the others keep their order from the current turn on."""
        want = set(hosts)
        n = len(self._order)
        kept = [self._order[(self._cursor + k) % n] for k in range(n)] if n else []
        kept = [h for h in kept if h in want]
        have = set(kept)
        self._order = sorted(want - have) + kept
        self._cursor = 0
        for d in (self._evidence_ns, self._pinged_ns):
            for h in [h for h in d if h not in want]:
                del d[h]
        self.interval_ns = host_interval_ns(len(self._order), self.budget_pps,
                                            self.min_interval_ns, self.dead_after_ns)
        self._gap_ns = max(1, self.interval_ns // max(1, len(self._order)))
        if not self._order:
            self._next_ns = None
        elif self._next_ns is None or len(want - have):
            self._next_ns = now_ns  # a newcomer is pinged at once
            self._release_ns = None

    @property
    def hosts(self) -> int:
        return len(self._order)

    @property
    def rate_pps(self) -> float:
        """Pings per second the plan sends (before mutual-pair skips)."""
        return len(self._order) * 1e9 / self.interval_ns if self._order else 0.0

    @property
    def over_budget(self) -> bool:
        """The per-host floor (MIN_PINGS_PER_WINDOW) costs more than the budget."""
        return self.rate_pps > self.budget_pps * 1.001

    def next_ns(self) -> int | None:
        """When the next turn comes (None: no host followed)."""
        return self._next_ns

    # -- turns ----------------------------------------------------------------------------

    def evidence(self, host: str, now_ns: int, *, passive: bool) -> None:
        """``host``'s own ping counted as evidence that its pinger runs.  ``passive``:
        we are the side of the pair that may rely on its pings (the active side's turns
        ignore evidence)."""
        if passive:
            self._evidence_ns[host] = now_ns

    def nudge(self, host: str) -> None:
        """We need ``host``'s digest: its next turn pings it, even where its evidence
        would let a passive side skip (a push told of a change only an ack carries)."""
        self._pinged_ns.pop(host, None)

    def due(self, now_ns: int) -> list[str]:
        """The hosts to ping now: those whose turn came since the last call, less the
        ones a mutual pair covers.  After a stall of more than one interval (our loop
        was stopped) the round starts again from now: one ping each, not a backlog."""
        nxt = self._next_ns
        if nxt is None or now_ns < nxt:
            return []
        if self._release_ns is not None and now_ns < self._release_ns:
            return []  # not yet: the next batch takes these turns along
        batch = min(self.batch_ns, self.interval_ns)
        self._release_ns = now_ns + batch * 3 // 4  # a tick early is the same tick
        if now_ns - nxt > self.interval_ns:
            nxt = now_ns
        out: list[str] = []
        order, n, gap = self._order, len(self._order), self._gap_ns
        for _ in range(n):  # at most one round per call
            if nxt > now_ns:
                break
            h = order[self._cursor]
            self._cursor = (self._cursor + 1) % n
            nxt += gap
            if self._skip(h, now_ns):
                continue
            if h in self._evidence_ns:
                self._pinged_ns[h] = now_ns
            out.append(h)
        self._next_ns = nxt
        # A passive side whose evidence just went stale pings at once, not at its next
        # turn: with 3 turns per window, waiting for the turn after the evidence stopped
        # (up to SKIP_FRESH + 1 intervals) and then for the two missed pings a verdict
        # needs would put DEAD up to 1.8 s past peer_dead_after.  From here on it pings
        # every turn, until that host's pings count again.
        limit = SKIP_FRESH * self.interval_ns
        stale = [h for h, ev in self._evidence_ns.items() if now_ns - ev >= limit]
        for h in stale:
            del self._evidence_ns[h]
            self._pinged_ns.pop(h, None)
            if h not in out:
                out.append(h)
        return out

    def _skip(self, host: str, now_ns: int) -> bool:
        ev = self._evidence_ns.get(host)
        if ev is None:
            return False
        if now_ns - ev >= SKIP_FRESH * self.interval_ns:
            return False  # the other side stopped pinging us: our turn again
        last = self._pinged_ns.get(host)
        # the refresh ping: stay its watcher, and hear its digest now and then
        return not (last is None or now_ns - last >= self.refresh_ns * LONG_REFRESH)
