"""``shmhb feed``: keep a router's worker list equal to the live instances on the board.

Two threads.  The *follower* reads the boards (``shmhb.board.instances``) whenever their change
counter moves, and at least every ``reread_s`` (silence turns a slot SUSPECT or DEAD
without a write), and hands the instances it read to the *applier*.  The applier plans
(``plan``, pure) against the router's worker list as it last knew it and calls the
router: it removes a worker whose instances all read DEAD or LEFT, adds back one whose
instance is ALIVE again where the router's API allows it, and replaces one whose
instance restarted (a new incarnation) while listed, or that the router lists unhealthy
while its instance reads ALIVE.  An add counts only once the
router lists the worker healthy: until then the applier lists the router's workers
every ``confirm_s`` and adds it again after ``retry_s`` (doubling to ``max_retry_s``), so
a router that accepted the add and then failed its own registration (the engine's HTTP
server not up yet) or removed the worker afterwards (a drain that ended) serves it in
the end.  A router that is unreachable,
slow or answers errors is retried with backoff (``backoff_s`` doubling to
``max_backoff_s``); the follower never waits for it, so the next plan uses the newest
board.  A draining instance is removed at once and not added back while it drains.
UNKNOWN (the host's agent absent or stalled) never removes anything.  SUSPECT
removes with ``act_on_suspect``; by default (None) that is on for a router that takes a
worker back over HTTP (the instance returns as soon as it reads ALIVE again: a stall
costs it its traffic for the stall, never its links or a verdict) and off for one that
cannot (vllm-router's PD mode: a stall would cost the instance its place until the
router restarts).

How an instance finds its worker in the router: by its serving address when it has one
(``http://host:port``), else by the host of its bootstrap address and the bootstrap port
the router lists for the worker.  Every worker the router ever listed is remembered, so
a removed one can be added back with its role and bootstrap port.  Workers that no
instance matches are left alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..board.address import parse_address
from ..clock import MONOTONIC, Clock
from ..errors import InvalidConfig, ShmhbError
from ..board.instances import Instance
from ..ratelog import RateLimitedLog
from .routerapi import RouterClient, RouterError, RouterWorker, worker_endpoint
from ..status import Status

__all__ = ["Action", "Feeder", "FeederConfig", "Memory", "Pending", "plan"]

log = logging.getLogger(__name__)
_rl = RateLimitedLog(log)
_ROLE = {"prefill": "prefill", "decode": "decode", "both": "regular"}


class Pending(NamedTuple):
    """An add the router has not yet confirmed (listed healthy)."""

    worker: RouterWorker
    retry_at_ns: int      # when to add it again if still not served
    tries: int


class Action(NamedTuple):
    op: str                 # "remove", "add", or "cannot_add" (said once, nothing called)
    url: str
    role: str               # the router's worker_type
    bootstrap_port: int | None
    worker: RouterWorker | None  # for a remove: the router's entry
    why: str


@dataclass
class Memory:
    """What the applier keeps between plans: every worker the router listed (url ->
    entry), the incarnation of the instance each listed url was confirmed for, and the
    adds not confirmed yet."""

    seen: dict[str, RouterWorker] = field(default_factory=dict)
    served_inc: dict[str, int] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)  # added, not served yet
    told: set[tuple[str, int]] = field(default_factory=set)  # (url, incarnation) said cannot_add


def _url_of(inst: Instance, known: Iterable[RouterWorker]) -> str | None:
    if inst.serving is not None:
        return f"http://{inst.serving}"
    if inst.bootstrap is None:
        return None
    b = parse_address(inst.bootstrap, need_port=True)
    for w in known:
        if w.bootstrap_port == b.port and parse_address(worker_endpoint(w.url)).host == b.host:
            return w.url
    return None


def plan(instances: Iterable[Instance], listed: list[RouterWorker], mem: Memory,
         can_add: Callable[[str], bool], act_on_suspect: bool = False) -> list[Action]:
    """The calls that make the router's list (``listed``) follow ``instances``.  Updates
    ``mem`` with what it learnt from ``listed``; pure otherwise."""
    for w in listed:
        mem.seen[w.url] = w
    by_url: dict[str, list[Instance]] = {}
    for inst in instances:
        url = _url_of(inst, mem.seen.values())
        if url is not None:
            by_url.setdefault(url, []).append(inst)
    present = {w.url: w for w in listed}
    gone = {Status.DEAD, Status.LEFT} | ({Status.SUSPECT} if act_on_suspect else set())
    out = []
    for url, insts in sorted(by_url.items()):
        live = [i for i in insts if i.status not in gone and i.status is not Status.UNKNOWN
                and not i.draining]
        unknown = any(i.status is Status.UNKNOWN for i in insts)
        cur = present.get(url)
        if live:
            newest = max(live, key=lambda i: i.incarnation)
            if newest.status is not Status.ALIVE:
                continue  # SUSPECT (not acted on): leave it as it is
            role = _ROLE[newest.role]
            prior = mem.seen.get(url)
            bport = prior.bootstrap_port if prior is not None else (
                parse_address(newest.bootstrap, need_port=True).port if newest.bootstrap else None)
            if cur is not None:
                was = mem.served_inc.setdefault(url, newest.incarnation)
                if was != newest.incarnation:  # restarted while listed: its entry is stale
                    out.append(Action("remove", url, cur.role, cur.bootstrap_port, cur,
                                      f"{newest.key} restarted (incarnation {newest.incarnation})"))
                    if can_add(cur.role):
                        out.append(Action("add", url, cur.role, cur.bootstrap_port, None,
                                          f"{newest.key} serves again"))
                elif not cur.healthy and url not in mem.pending and can_add(cur.role):
                    # listed unhealthy by the router's own check (it missed a restart, or
                    # convicted a busy instance), alive on the board: the router would
                    # wait for its health check to pass several times (smg: 2 at 60 s
                    # apart by default); an add not yet confirmed is left to its retries
                    out.append(Action("remove", url, cur.role, cur.bootstrap_port, cur,
                                      f"{newest.key} is alive; the router lists it unhealthy"))
                    out.append(Action("add", url, cur.role, cur.bootstrap_port, None,
                                      f"{newest.key} serves again"))
            elif can_add(role):
                out.append(Action("add", url, role, bport, None, f"{newest.key} is alive"))
            elif (url, newest.incarnation) not in mem.told:
                if len(mem.told) > 4096:
                    mem.told.clear()  # bounded: at worst said once more
                mem.told.add((url, newest.incarnation))
                out.append(Action("cannot_add", url, role, bport, None,
                                  f"{newest.key} is alive but this router takes no {role} "
                                  "worker over HTTP: restart the router to serve it again"))
        elif cur is not None and not unknown:
            worst = ("draining" if insts[0].draining else insts[0].status.value) \
                if len(insts) == 1 else "gone"
            out.append(Action("remove", url, cur.role, cur.bootstrap_port, cur,
                              f"{', '.join(i.key for i in insts)} {worst}"))
    return out


@dataclass(frozen=True)
class FeederConfig:
    poll_s: float = 0.002         # how often the follower looks at the change counters
    reread_s: float = 0.1         # and reads the boards even when none moved
    resync_s: float = 2.0         # how often the applier lists the router's workers anew
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    confirm_s: float = 0.05       # how often to list the workers while an add is unconfirmed
    retry_s: float = 0.2          # an add not served after this is made again (doubling)
    max_retry_s: float = 1.0
    act_on_suspect: bool | None = None  # None: where the router can add the worker back

    def __post_init__(self) -> None:
        if self.act_on_suspect not in (None, True, False):
            raise InvalidConfig(f"act_on_suspect is True, False or None, got {self.act_on_suspect!r}")
        for name in ("poll_s", "reread_s", "resync_s", "backoff_s", "max_backoff_s",
                     "confirm_s", "retry_s", "max_retry_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise InvalidConfig(f"{name} must be a number of seconds in (0, 3600], got {v!r}")


class Feeder:
    """Follow ``read()`` (the instances now) and ``changes()`` (a counter that moves when
    the boards change) and keep ``client``'s router in step.  ``on_action(action, t_ns)``
    is called after each call the router accepted (for tests and the bench)."""

    def __init__(self, read: Callable[[], list[Instance]], changes: Callable[[], int],
                 client: RouterClient, config: FeederConfig = FeederConfig(),
                 clock: Clock = MONOTONIC,
                 on_action: Callable[[Action, int], None] | None = None) -> None:
        self.read, self.changes, self.client, self.cfg = read, changes, client, config
        self.clock, self.on_action = clock, on_action
        self.mem = Memory()
        self._cv = threading.Condition()
        self._latest: list[Instance] | None = None
        self._gen = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failures = 0

    def latest(self) -> list[Instance] | None:
        """The instances the follower last read (None before its first read)."""
        with self._cv:
            return self._latest

    # -- the follower ---------------------------------------------------------------------

    def follow_once(self, last: tuple[int, int, list[Instance] | None]
                    ) -> tuple[int, int, list[Instance] | None]:
        """One look at the boards; publishes the instances when they changed."""
        seen, at_ns, prev = last
        now = self.clock.monotonic_ns()
        c = self.changes()
        if c == seen and prev is not None and now - at_ns < self.cfg.reread_s * 1e9:
            return last
        insts = self.read()
        if insts != prev:
            with self._cv:
                self._latest, self._gen = insts, self._gen + 1
                self._cv.notify_all()
        return c, now, insts

    def _follow(self) -> None:
        last: tuple[int, int, list[Instance] | None] = (-1, 0, None)
        while not self._stop.is_set():
            try:
                last = self.follow_once(last)
            except (ShmhbError, OSError, ValueError) as e:  # a board gone, a bad row
                _rl.warn("read", "shmhb feed: reading the board failed (%s); retrying", e)
            self._stop.wait(self.cfg.poll_s)

    # -- the applier ------------------------------------------------------------------------

    def apply_once(self, insts: list[Instance], listed: list[RouterWorker]) -> list[RouterWorker]:
        """Plan and call the router; returns the list as it now stands.  ``RouterError``
        from the first call that failed (the rest are planned anew next time)."""
        now = self.clock.monotonic_ns()
        cur = list(listed)
        have = {w.url: w for w in cur}
        retry: dict[str, int] = {}
        for url, p in list(self.mem.pending.items()):
            w = have.get(url)
            if w is not None and w.healthy:
                del self.mem.pending[url]  # served: confirmed
            elif now < p.retry_at_ns:
                if w is None:
                    cur.append(p.worker)  # added, not listed yet: the router is checking it
            else:
                del self.mem.pending[url]  # not served in time: planned anew
                retry[url] = p.tries + 1
                if w is not None and self.client.replaces:
                    cur.remove(w)  # listed unhealthy: the add replaces it
        for a in plan(insts, cur, self.mem, self.client.can_add, self.acts_on_suspect()):
            if a.op == "remove" and a.worker is not None:
                self.client.remove(a.worker)
                cur = [w for w in cur if w.url != a.url]
                self.mem.served_inc.pop(a.url, None)
                self.mem.pending.pop(a.url, None)
            elif a.op == "cannot_add":
                log.warning("shmhb feed: %s: %s", self.client.base, a.why)
            else:
                ident = self.client.add(a.url, a.role, a.bootstrap_port) or a.url
                w = RouterWorker(a.url, a.role, a.bootstrap_port, ident, healthy=False)
                cur.append(w)
                tries = retry.get(a.url, 0)
                wait_s = min(self.cfg.retry_s * 2 ** min(tries, 16), self.cfg.max_retry_s)
                self.mem.pending[a.url] = Pending(w, self.clock.monotonic_ns() + int(wait_s * 1e9),
                                                  tries)
                if tries:
                    a = a._replace(why=f"{a.why}; not served yet, added again (try {tries + 1})")
            if a.op != "cannot_add":
                log.info("shmhb feed: %s %s %s (%s)", self.client.base, a.op, a.url, a.why)
            if self.on_action is not None:
                self.on_action(a, self.clock.monotonic_ns())
        return cur

    def acts_on_suspect(self) -> bool:
        """Whether a SUSPECT instance is taken out (see the module's docstring)."""
        if self.cfg.act_on_suspect is not None:
            return self.cfg.act_on_suspect
        return self.client.can_add("prefill") and self.client.can_add("decode")

    def _apply(self) -> None:
        listed: list[RouterWorker] | None = None
        listed_at = 0
        gen = -1
        delay = self.cfg.backoff_s
        while not self._stop.is_set():
            every = self.cfg.confirm_s if self.mem.pending else self.cfg.resync_s
            with self._cv:
                if self._gen == gen and listed is not None:
                    left = every - (self.clock.monotonic_ns() - listed_at) / 1e9
                    if left > 0:
                        self._cv.wait(left)
                insts, g = self._latest, self._gen
            if insts is None or self._stop.is_set():
                self._stop.wait(self.cfg.poll_s)
                continue
            try:
                if listed is None or self.clock.monotonic_ns() - listed_at >= every * 1e9:
                    listed, listed_at = self.client.workers(), self.clock.monotonic_ns()
                listed = self.apply_once(insts, listed)
                gen, delay = g, self.cfg.backoff_s
            except RouterError as e:
                self.failures += 1
                listed = None
                _rl.warn("router", "shmhb feed: router %s: %s; retrying in %.2f s (the board "
                         "is still followed)", self.client.base, e, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, self.cfg.max_backoff_s)

    # -- lifetime --------------------------------------------------------------------------

    def start(self) -> Feeder:
        for fn, name in ((self._follow, "shmhb-feed-follow"), (self._apply, "shmhb-feed-apply")):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            t.join(5)
