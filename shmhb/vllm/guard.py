"""The worker half of ``ShmhbConnector``: the rank's registration, the links it tracks,
the loads it fails fast and the writes it allows.

Threads: the worker thread (register, poll, shutdown: the LinkReaper's ``on_drop`` runs
there), the inner connector's receiver loop (``load_started``/``load_ended``), its sender
loop (``consumer_seen``/``ask_now``/``allowed``), and the fence server's thread
(grants, in C without the GIL, or a Python thread).  Shared state is the ``LoadTable``
(its own lock, and the states table the fence server grants in) and two dicts written
under ``_lock``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from ..agent.embedded import Board  # its register joins the host's embedded agent
from ..board.reaper import DropReason, Link, LinkReaper
from ..status import Status
from ..errors import ShmhbError
from ..ratelog import RateLimitedLog
from ..kv import grants
from .inner import InnerAdapter
from ..kv.fence import Allowed, Ask, Extra, FenceServer, GrantAsker, parse_extra
from .instance import register_engine_instance, role_of
from ..kv.loads import Load, LoadState, LoadTable
from .settings import ConnectorSettings, rank_key
from .verdict import producer_verdict
from .stats import Counts

log = logging.getLogger(__name__)

#: how long a poll waits for a fence to hold before it reports (the fence is a task
#: cancellation on the inner's loop: milliseconds)
FENCE_WAIT_S = 1.0
_GONE = (Status.DEAD, Status.LEFT)


class WorkerGuard:
    def __init__(self, settings: ConnectorSettings, adapter: InnerAdapter, engine_id: str,
                 counts: Counts) -> None:
        self.settings = settings
        self.adapter = adapter
        self.engine_id = engine_id
        self.counts = counts
        self.loads = LoadTable(grants.new_states(lease_ms=round(settings.grant_lease_s * 1000)))
        self._lock = threading.Lock()
        self._gone_consumers: dict[str, int] = {}  # endpoint -> incarnation dropped (0: any)
        self._tracked: set[str] = set()
        self.board: Board | None = None
        self.hb: Any = None
        self.fence_server: FenceServer | None = None
        self.reaper: LinkReaper | None = None
        self._asker = GrantAsker()
        self._log = RateLimitedLog(log)
        self.key = ""

    # -- lifetime ---------------------------------------------------------------------------

    def register(self) -> None:
        """After the inner connector registered its KV caches: the rank joins its board."""
        if self.hb is not None:
            return  # re-initialisation: one registration per rank
        a = self.adapter
        self.board = Board.attach(self.settings.board)
        eps = a.endpoints()
        rank = a.rank()
        self.key = rank_key(self.engine_id, rank.dp, rank.tp, rank.pp)
        if a.consumes() and a.asks_go_ahead:
            # Serves grants only for the incarnation set below: none before that.
            host = eps["engine"].rsplit(":", 1)[0].strip("[]")
            self.fence_server = FenceServer(host, 0, self.loads.states, self.loads.tokens)
            eps["fence"] = self.fence_server.endpoint
        hb = self.board.register(self.key, endpoints=tuple(eps.values()))
        if self.fence_server is not None:
            self.fence_server.set_incarnation(hb.incarnation)
        self.hb = hb.start(self.settings.beat_interval_s)
        register_engine_instance(self.board, hb, eps, rank,
                                 role_of(a.produces(), a.consumes()), self.engine_id,
                                 self.settings)  # for routers (shmhb.board.instances)
        self.reaper = LinkReaper(self.board, self._on_drop, drop_suspect=self.settings.act_on_suspect)
        self.adapter.install(self)
        log.info("shmhb: %s registered on board %s (incarnation %d, endpoints %s)",
                 self.key, self.board.name, self.hb.incarnation, self.hb.endpoints)

    def shutdown(self) -> None:
        if self.reaper is not None:
            for link in self.reaper.links():
                self.reaper.untrack(link.endpoint)
        if self.hb is not None:
            self.hb.close()  # peers read LEFT at once
        if self.fence_server is not None:
            self.fence_server.close()
        self._asker.close()  # a go-ahead still asked for is given up

    # -- the step -----------------------------------------------------------------------------

    def poll(self) -> None:
        """Once per step, before the inner connector reports what finished: drops (and
        the fences they need) happen here, so their failures are in this step's report."""
        if self.reaper is not None:
            self.reaper.poll()
        if self.fence_server is not None:
            granted = self.fence_server.report()  # a few C counters' loads
            if granted:
                self.counts.add("granted_loads", granted)

    def _on_drop(self, link: Link, reason: DropReason) -> None:
        kind, what = link.payload
        self.counts.add(f"drops.{reason.value}")
        if kind == "producer":
            given_up = self.loads.abandon(endpoint=link.endpoint)
            self._fence(given_up)
            self.adapter.evict_engine(what)
            log.info("shmhb: producer %s of engine %s dropped (%s): %d load(s) failed, "
                     "engine evicted", link.endpoint, what, reason, len(given_up))
        else:
            with self._lock:
                self._gone_consumers[link.endpoint] = link.incarnation
                self._tracked.discard(link.endpoint)
            self.adapter.evict_consumer(link.endpoint)
            log.info("shmhb: consumer %s dropped (%s): its sends are freed", link.endpoint, reason)
        with self._lock:
            self._tracked.discard(link.endpoint)

    def _fence(self, given_up: list[Load]) -> None:
        if not given_up:
            return
        self.counts.add("failed_loads", len(given_up))
        tokens = []
        for tok in {id(ld.token): ld.token for ld in given_up}.values():
            # a request that carries a load still granted stays: its write may be under way
            if all(ld.state is LoadState.ABANDONED for ld in self.loads.by_token(tok)):
                tokens.append(tok)
        self.counts.add("fenced_requests", len(tokens))
        fut = self.adapter.fence(tokens)
        try:
            fut.result(FENCE_WAIT_S)
        except TimeoutError:  # concurrent.futures' is the builtin (Python 3.11 on)
            log.warning("shmhb: fencing %d request(s) took over %.1f s; their failures are "
                        "reported when it holds", len(tokens), FENCE_WAIT_S)

    # -- hooks: consumer ------------------------------------------------------------------------

    def load_started(self, endpoint: str, engine_id: str, reqs: dict[str, frozenset[int]],
                     token: object) -> bool:
        b = self.board
        # An empty pull loads nothing: it only tells a producer that may be alive to free
        # its blocks, so it is never vetoed (it is tracked and fenced like any load).
        if b is not None and any(reqs.values()):
            gone = producer_verdict(b.remote(endpoint), engine_id, self.settings.act_on_suspect)
            if gone is not None:
                self.counts.add(f"vetoes.{gone}")
                self.counts.add("failed_loads", len(reqs))
                self.adapter.evict_engine(engine_id)
                return False
        now = time.monotonic_ns()
        self.loads.start(Load(r, endpoint, engine_id, b, token, started_ns=now)
                         for r, b in reqs.items())
        self._track(endpoint, ("producer", engine_id), None)
        return True

    def go_ahead(self, endpoint: str, req_ids: list[str]) -> list[str]:
        """A consumer that moves the bytes itself (a pull) is about to start these
        loads from ``endpoint``: the ones still wanted, now GRANTED (never failed
        early: the transfer cannot be called back once started; counted, so the count
        explains a load that waits)."""
        ok = self.loads.grant(endpoint, req_ids)
        if ok:
            self.counts.add("granted_loads", len(ok))
        return ok

    def load_ended(self, endpoint: str, req_ids: list[str]) -> dict[str, int]:
        """The inner connector is done with these loads.  Returns those whose blocks it
        must not hand back yet if it failed them: granted to a producer whose lease still
        runs, each with when it ends (``time.monotonic_ns``): that producer may still
        start its write until then (``grants``, "The lease")."""
        now = time.monotonic_ns()
        return {ld.req_id: ld.lease_until_ns for ld in self.loads.end(req_ids, endpoint)
                if ld.state is LoadState.GRANTED and ld.lease_until_ns > now}

    def failure_held(self, n: int) -> None:
        """``n`` failed loads are reported only once their grants' leases ran out."""
        self.counts.add("held_failures", n)

    def give_up(self, req_ids: list[str]) -> list[object]:
        """On the inner's receiver loop: these requests failed at one producer worker
        (fenced, or vetoed at the start), so their loads from the others cannot
        complete them (one decode rank pulls a request from every producer rank it maps
        to).  Give up those still WAITING, under the same rule as a drop (no grant after
        this; GRANTED ones finish), and return the requests (tokens) that now carry only
        given-up loads: the adapter cuts them on the loop it runs on."""
        given_up = self.loads.abandon(req_ids=set(req_ids))
        if not given_up:
            return []
        self.counts.add("failed_loads", len(given_up))
        tokens = [tok for tok in {id(ld.token): ld.token for ld in given_up}.values()
                  if all(ld.state is LoadState.ABANDONED for ld in self.loads.by_token(tok))]
        self.counts.add("fenced_requests", len(tokens))
        return tokens

    def request_extra(self, producer: str | None) -> dict[str, Any] | None:
        """What a transfer request to ``producer`` carries: this consumer's incarnation,
        its go-ahead endpoint, and the token that lets that producer (only) ask."""
        if self.hb is None or self.fence_server is None:
            return None
        out: dict[str, Any] = {"inc": self.hb.incarnation, "fence": self.fence_server.endpoint}
        if producer is not None:
            out["tok"] = self.fence_server.token_for(producer)
        return out

    # -- hooks: producer --------------------------------------------------------------------------

    def consumer_seen(self, endpoint: str, extra: Any) -> Extra | None:
        """A request from the consumer at ``endpoint`` was read: it is tracked, and what
        its shmhb field says is returned, checked (for ``ask_now`` and ``allowed``)."""
        x = parse_extra(extra)
        self._track(endpoint, ("consumer", endpoint), x[0] if x else None)
        return x

    def _consumer_dropped(self, consumer: str, x: Extra | None) -> bool:
        with self._lock:
            gone_inc = self._gone_consumers.get(consumer)
        return gone_inc is not None and (x is None or gone_inc in (0, x[0]))

    def _consumer_gone(self, consumer: str, x: Extra | None) -> bool:
        if self._consumer_dropped(consumer, x):
            return True  # that consumer incarnation was dropped
        b = self.board
        s = b.remote(consumer) if b is not None else None
        if s is not None and s.status is not Status.UNKNOWN:
            if s.status in _GONE or (x is not None and s.incarnation > x[0]):
                return True  # dead, left, or restarted since it asked
        return False

    def ask_now(self, consumer: str, x: Extra | None, req_ids: list[str]) -> Ask | None:
        """On the sender loop, as a request is read whose blocks are computed: the
        go-ahead asked now, its answer read by ``allowed`` (None: asked then).  The
        board is not read here (tens of microseconds on the path to the write): an ask
        to a consumer that is gone is never answered, and ``allowed`` looks then."""
        if x is None or self._consumer_dropped(consumer, x):
            return None
        return self._asker.ask_now(x[1], x[0], x[2], req_ids)

    def forget(self, ask: Ask) -> None:
        self._asker.forget(ask)

    def ask_counts(self) -> dict[str, int]:
        """How this producer's go-ahead answers were read (``GrantAsker.counts``)."""
        return dict(self._asker.counts)

    async def allowed(self, consumer: str, x: Extra | None, req_ids: list[str],
                      asked: Ask | None = None) -> Allowed:
        """Of ``req_ids``, those the producer may write, and until when: those the
        consumer granted (in ``asked``: a grant is its promise to hold the blocks for
        its lease, so nothing else is looked at), and of the rest, those it grants now
        if the board says it is there.  The write must start before ``until_ns``."""
        timeout_s = self.settings.grant_timeout_s
        ok: list[str] = []
        until: int | None = None
        rest = req_ids
        if asked is not None:
            if not self._asker.settled(asked) and self._consumer_gone(consumer, x):
                self._asker.forget(asked)  # no answer yet, and none is coming
                return Allowed([], None)
            ok = await self._asker.result(asked, req_ids, timeout_s)
            until = asked.until_ns if ok else None
            if asked.req_ids != req_ids:
                in_ask = set(asked.req_ids)
                rest = [r for r in req_ids if r not in in_ask]
            else:
                rest = []
        if not rest or self._consumer_gone(consumer, x):
            return Allowed(ok, until)
        if x is None:  # a consumer without shmhb: the board is all we can ask
            return Allowed(req_ids, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        a = await self._asker.post(x[1], x[0], x[2], rest, timeout_s)
        more = [] if a is None else await self._asker.result(
            a, rest, max(0.0, deadline - loop.time()))
        if a is not None and more:
            until = a.until_ns if until is None else min(until, a.until_ns)
        return Allowed(ok + more, until)

    def lease_ran_out(self, consumer: str) -> None:
        """A granted write to ``consumer`` (its transfer engine) was not made: the lease
        ran out before the write could start (from the thread that writes)."""
        self.counts.add("expired_grants")
        self._log.warn("lease", "shmhb: the go-ahead of consumer %s ran out before the "
                       "write could start: not written", consumer)

    def write_denied(self, consumer: str, n: int) -> None:
        self.counts.add("denied_writes", n)
        self.counts.add("freed_sends", n)

    # -- links ------------------------------------------------------------------------------------

    def _track(self, endpoint: str, payload: tuple[str, str], incarnation: int | None) -> None:
        with self._lock:
            if endpoint in self._tracked or self.reaper is None:
                return
            self._tracked.add(endpoint)
        try:
            self.reaper.track(endpoint, payload=payload, incarnation=incarnation)
        except ShmhbError as e:  # e.g. the registry lock held by a stopped process
            with self._lock:
                self._tracked.discard(endpoint)
            log.warning("shmhb: could not track %s (%s); retried at its next request", endpoint, e)
