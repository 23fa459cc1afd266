"""The LinkReaper: drop cached links to dead or restarted peers, exactly once.

A KV connector caches, per remote engine and port, what its handshake learned (side
channel address, KV base addresses, transfer-engine session).  It ``track``s each link
at handshake time; the reaper remembers the peer's incarnation and calls ``on_drop``
once when the peer dies, leaves, restarts (new incarnation) or stops advertising the
endpoint.  A flap (SUSPECT and back) drops nothing unless ``drop_suspect``; UNKNOWN
(this host's agent is not observing) never drops anything: we do not know.

Cost: ``poll()`` with nothing changed is one read of the board's change counter plus a
vectorised staleness check of the local slots it tracks -- a few microseconds whatever
the number of links.  Only when something changed does it judge links one by one.

Watches: a remote link keeps its peer's host followed (``Board.watch``) while tracked.
Giving a watch back takes the board's registry lock, which a process stopped (or hung)
while holding it keeps for as long as it is stopped; so a drop never waits for it: the
watch is given back after the callbacks, with a short wait, and if the lock is still
held, at a later poll.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .handle import Board
from .core import board_words
from .config import check_endpoint, parse_hostport, positive_seconds
from ..errors import InvalidAddress, LockTimeout
from ..periodic import Periodic
from ..status import PeerStatus, SlotStatus, Status

log = logging.getLogger(__name__)

#: how long giving a watch back may wait for the registry lock (held for microseconds,
#: unless its holder is stopped or hung: then it is retried at the next poll)
_UNWATCH_WAIT_S = 0.02


class DropReason(str, enum.Enum):
    """Why a link was dropped."""

    DEAD = "dead"  # the peer process is dead (killed, hung past dead-after, host dead)
    LEFT = "left"  # it closed its registration gracefully
    RESTARTED = "restarted"  # a new incarnation holds the key: the link is to the old one
    GONE = "gone"  # no live slot advertises the endpoint any more
    SUSPECT = "suspect"  # only with drop_suspect=True: silent past suspect-after

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Link:
    """A tracked link: the endpoint, the peer incarnation it was made with (0 while not
    yet known: adopted from the first report), and the connector's payload."""

    endpoint: str
    key: str | None
    incarnation: int
    local: bool
    payload: Any = field(default=None, compare=False)
    #: when it was tracked (the board's clock); a remote endpoint that its ALIVE host's
    #: reports never name for a peer dead-after window from then is GONE
    tracked_ns: int = field(default=0, compare=False)


OnDrop = Callable[[Link, DropReason], None]


class LinkReaper:
    """Tracks links and drops each exactly once.  Thread-safe."""

    def __init__(self, board: Board, on_drop: OnDrop | None = None, *,
                 drop_suspect: bool = False) -> None:
        self.board = board
        self.bw = board_words(board)
        self.on_drop = on_drop
        self.drop_suspect = drop_suspect
        self._lock = threading.RLock()
        self._links: dict[str, Link] = {}
        # Some link could not be judged yet (its host never reported, or nobody observes
        # here): re-judge it when the board changes, or when this host's agent becomes
        # fresh again -- never on every poll (that is a full judge, ~0.5 ms per poll).
        self._pending = False
        self._dirty = False  # judge every link at the next poll (a link was tracked)
        self._wait_agent = False  # some link read UNKNOWN: re-judge once the agent is fresh
        #: how many polls judged every link (the slow path); the rest read one counter
        self.judges = 0
        self._seen_changes = -1
        self._local_words = np.empty(0, np.intp)  # slot indices of tracked local links
        self._remote_links = 0  # how many tracked links are remote
        self._stale_units = board.thresholds.suspect if drop_suspect else board.thresholds.dead
        self._ticker = Periodic("shmhb-reaper")
        self._unwatch_due: list[str] = []  # watches of links that went, not given back yet
        # a link no report named yet is GONE once its ALIVE host reported for this long
        # after the handshake without naming it; the earliest such deadline, re-judged
        # then even if nothing changed (0: none)
        self._gone_after_ns = int(board.policy.peer_dead_after_s * 1e9)
        self._gone_due_ns = 0
        self._unwatch_logged = False

    # -- tracking -------------------------------------------------------------------------

    def track(self, endpoint: str, payload: Any = None, *, incarnation: int | None = None) -> Link:
        """Start tracking the link to ``endpoint`` made just now.  Remembers the current
        incarnation of the peer that serves it (or ``incarnation`` if the handshake told
        it), and asks this host's pinger to follow the peer's host if it is remote.

        For a remote peer, pass the incarnation the handshake returned: this host's view
        of a remote host lags by a round trip, so right after a peer restarts the board
        may still show the old incarnation, or no row at all for a new key.

        ``endpoint`` passes the door every address passes (``shmhb.board.address``): it is
        canonicalised (``[FD00:0::1]:30001`` is tracked as ``[fd00::1]:30001``,
        ``Node-A:30002`` as ``node-a:30002``; the returned link holds that text) or
        refused with ``InvalidAddress``.  Uncanonical text matched no report: the link
        was never judged against the worker it names, and never dropped when it died."""
        endpoint = check_endpoint(endpoint)
        # Under the lock: track() and poll() never use the board's per-key read memo
        # (Board.slot) from two threads at once.
        with self._lock:
            s = self._local(endpoint)
            if s is not None:
                link = Link(endpoint, s.key, incarnation or s.incarnation, True, payload)
            else:
                r = self.board.remote(endpoint)
                # Only a live report names the peer this handshake met: a dead or left row
                # is an earlier holder of the endpoint (adopting it would drop this fresh
                # link at the next poll, and its successor at every re-track).
                known = r is not None and r.status in (Status.ALIVE, Status.SUSPECT)
                inc = incarnation or (r.incarnation if known and r is not None else 0)
                # the key comes from a report about this very incarnation, or later from
                # the first report that names it (see _judge_remote)
                key = r.key if r is not None and r.incarnation == inc else None
                link = Link(endpoint, key, inc, False, payload, self.bw.now_ns())
        # Follow the peer's host before the link counts, and not under our lock: watch()
        # waits for the registry lock, which a stopped process may hold for seconds (it
        # then raises LockTimeout and nothing is tracked), and polls on other threads
        # must not wait with it.
        if not link.local:
            self.board.watch(endpoint)
        with self._lock:
            old = self._links.get(endpoint)
            if old is not None:
                self._forget(old)
            self._links[endpoint] = link
            self._dirty = True
            self._reindex()
        self._give_back_watches()
        return link

    def untrack(self, endpoint: str) -> Link | None:
        """Stop tracking ``endpoint`` without calling ``on_drop``; returns the link, or
        None if it was not tracked or a poll has already dropped it (whose ``on_drop``
        may still be running on another thread).  ``endpoint`` is canonicalised as by
        :meth:`track`; text the door refuses was never tracked."""
        try:
            endpoint = check_endpoint(endpoint)
        except InvalidAddress:
            return None
        with self._lock:
            link = self._links.pop(endpoint, None)
            if link is not None:
                self._forget(link)
                self._reindex()
        self._give_back_watches()
        return link

    @property
    def pending(self) -> bool:
        """Whether some tracked link waits for a report (judged again when one comes)."""
        return self._pending

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def _forget(self, link: Link) -> None:
        """The link went: its watch is owed back (caller holds the lock)."""
        if not link.local:
            self._unwatch_due.append(link.endpoint)

    def _give_back_watches(self) -> None:
        """Give back the watches of links that went.  Never waits long for the registry
        lock: a drop must not be delayed, lost or turned into an exception because some
        process is stopped while holding it.  What is left is retried at the next poll."""
        with self._lock:
            due, self._unwatch_due = self._unwatch_due, []
        for k, endpoint in enumerate(due):
            try:
                self.board.unwatch(endpoint, timeout_s=_UNWATCH_WAIT_S)
            except LockTimeout:
                with self._lock:
                    self._unwatch_due[:0] = due[k:]
                if not self._unwatch_logged:
                    self._unwatch_logged = True
                    log.warning("board %s: registry lock busy; %d watch(es) of dropped links "
                                "will be given back later", self.board.name, len(due) - k)
                return
        self._unwatch_logged = False

    def _reindex(self) -> None:
        """Recompute what the fast path needs after the set of links changed."""
        idx = set()
        self._remote_links = sum(1 for lk in self._links.values() if not lk.local)
        for link in self._links.values():
            if link.local and link.key is not None:
                i = self.bw.cached_index(link.key)
                if i is not None:
                    idx.add(i)
        self._local_words = np.array(sorted(idx), np.intp)

    def _local(self, endpoint: str) -> SlotStatus | None:
        """The local slot that advertises ``endpoint``: a live one if any, else the
        newest dead or left one (a link made to a peer that has died since is local
        all the same, and the next poll drops it)."""
        best = None
        for s in self.board.slots():
            if endpoint not in s.endpoints:
                continue
            if s.status not in (Status.LEFT, Status.DEAD):
                best = s
                break
            if best is None or s.incarnation > best.incarnation:
                best = s
        if best is not None:
            self.board.slot(best.key)  # prime the hot-path cache for this key
        return best

    # -- polling --------------------------------------------------------------------------

    def poll(self) -> list[tuple[Link, DropReason]]:
        """Drop links whose peer died, left, restarted or vanished; call ``on_drop`` for
        each (outside the lock) and return them.  Cheap when nothing changed."""
        b = self.board
        if self._unwatch_due:
            self._give_back_watches()
        with self._lock:
            changes = b.changes()
            if (changes == self._seen_changes and not self._dirty and not self._maybe_stale()
                    and not (self._wait_agent and b.agent_fresh())
                    and not (self._gone_due_ns and self.bw.now_ns() >= self._gone_due_ns)):
                return []
            self._gone_due_ns = 0  # recomputed by this judge
            # Pending links wait for a change: a remote verdict is a pure function of
            # words the agent writes (each write moves changes()) and of whether the
            # agent is fresh; the one time-driven input, local staleness, is checked
            # above by _maybe_stale.  So a poll with neither is answered by the counter.
            self._seen_changes = changes
            self._dirty = False
            self.judges += 1
            wait_agent = False
            dropped: list[tuple[Link, DropReason]] = []
            pending = False
            view = _RemoteView(b) if self._remote_links else None
            for ep, link in list(self._links.items()):
                if link.local:
                    verdict = self._judge_local(link)
                else:
                    assert view is not None
                    link, verdict = self._judge_remote(link, view)
                    self._links[ep] = link  # the same, or completed by a first report
                if verdict is None:
                    continue
                if verdict is _PENDING or verdict is _UNKNOWN:
                    pending = True
                    wait_agent = wait_agent or verdict is _UNKNOWN
                    continue
                del self._links[ep]
                dropped.append((link, verdict))  # type: ignore[arg-type]
            self._pending = pending
            self._wait_agent = wait_agent
            for link, _ in dropped:
                self._forget(link)  # given back after the callbacks: they never wait for it
            if dropped:
                self._reindex()
        for link, reason in dropped:
            log.info("link to %s (incarnation %d) dropped: %s", link.endpoint, link.incarnation, reason)
            if self.on_drop is not None:
                try:
                    self.on_drop(link, reason)
                except Exception:  # a connector's bug must not stop the reaper or lose drops
                    log.exception("on_drop callback failed for %s (%s)", link.endpoint, reason)
        if dropped:
            self._give_back_watches()
        return dropped

    def _maybe_stale(self) -> bool:
        """Could a tracked local slot have crossed the staleness threshold?  One numpy
        pass over their heartbeat words; no Python loop over links."""
        idx = self._local_words
        if not len(idx):
            return False
        age = self.bw.oldest_beat_age(idx)  # the board's clock, as slot() judges
        return age is not None and age >= self._stale_units

    def _judge_local(self, link: Link) -> DropReason | object | None:
        s = self.board.slot(link.key) if link.key is not None else None
        if s is None:
            return DropReason.GONE  # no slot holds the key any more: reused by another key
        return self._verdict(link, s)

    def _judge_remote(self, link: Link, view: _RemoteView) -> tuple[Link, DropReason | object | None]:
        """A remote link against this host's latest reports.  Those lag the peer by a
        round trip, so a report older than the handshake (a lower incarnation, or no row
        yet for a key the handshake just met) is waited for, never taken as a verdict."""
        host = view.hosts.get(_host_of(link.endpoint))
        if host is None:
            return link, _PENDING  # that host never reported yet
        if host.status is Status.UNKNOWN:
            return link, _UNKNOWN  # nobody observes here: wait for the agent
        host_dead = DropReason.DEAD if host.status is Status.DEAD else _PENDING
        if link.incarnation == 0:  # the handshake did not say: adopt the first live report
            s = view.by_endpoint.get(link.endpoint)
            if s is None or s.status not in (Status.ALIVE, Status.SUSPECT):
                # no live report names the peer yet; if its host is dead, so is it
                return link, host_dead if host_dead is not _PENDING else self._unnamed(link, host)
            link = Link(link.endpoint, s.key, s.incarnation, False, link.payload)
        elif link.key is None:  # incarnation known, but no report named the peer yet
            s = view.by_endpoint.get(link.endpoint)
            if s is None and host_dead is _PENDING:
                return link, self._unnamed(link, host)
            if s is None or s.incarnation < link.incarnation:
                return link, host_dead
            if s.incarnation > link.incarnation:
                return link, DropReason.RESTARTED
            link = Link(link.endpoint, s.key, link.incarnation, False, link.payload)
        s = view.by_key.get((host.address, link.key))  # type: ignore[arg-type]
        if s is None and host.rows_capped and host.status is not Status.DEAD:
            return link, _PENDING  # not stored here (its host's share was spent): unknown
        if s is None:
            # a report of a live host lacks the key: its slot went to another key (or
            # the host's board was recreated)
            return link, DropReason.DEAD if host.status is Status.DEAD else DropReason.GONE
        if s.incarnation < link.incarnation:
            return link, host_dead  # the report predates our handshake: wait for a newer one
        return link, self._verdict(link, s)

    def _unnamed(self, link: Link, host: PeerStatus) -> DropReason | object:
        """A link whose endpoint no report of its host named yet: GONE once the host,
        ALIVE, has reported for a peer dead-after window after the handshake without
        naming it (no live slot serves it); pending before, re-judged at that time."""
        if host.status is not Status.ALIVE or host.age_s is None or host.rows_capped:
            return _PENDING  # (capped: its report may name it and not be stored here)
        now = self.bw.now_ns()
        due = link.tracked_ns + self._gone_after_ns
        if now - int(host.age_s * 1e9) >= due:
            return DropReason.GONE
        self._gone_due_ns = due if not self._gone_due_ns else min(due, self._gone_due_ns)
        return _PENDING

    def _verdict(self, link: Link, s: SlotStatus) -> DropReason | object | None:
        """The link against the current holder of its key, local or remote alike."""
        if s.status is Status.UNKNOWN:
            return _UNKNOWN
        if s.incarnation != link.incarnation:
            # A new incarnation holds the key: the link is to the old one.  If the new
            # one no longer serves the endpoint, a re-handshake there would find nobody.
            return DropReason.RESTARTED if link.endpoint in s.endpoints else DropReason.GONE
        if s.status is Status.DEAD:
            return DropReason.DEAD
        if s.status is Status.LEFT:
            return DropReason.LEFT
        if link.endpoint not in s.endpoints:
            return DropReason.GONE
        if s.status is Status.SUSPECT and self.drop_suspect:
            return DropReason.SUSPECT
        return None

    # -- background thread ------------------------------------------------------------------

    def start(self, interval_s: float = 0.05) -> LinkReaper:
        """Poll from a daemon thread every ``interval_s`` until ``stop()``."""
        self._ticker.start(self.poll, positive_seconds("interval_s", interval_s))
        return self

    @property
    def running(self) -> bool:
        """Whether the background thread runs."""
        return self._ticker.running

    def stop(self) -> None:
        self._ticker.stop()

    def __enter__(self) -> LinkReaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_PENDING = object()  # not judged yet: wait for the board to change
_UNKNOWN = object()  # nobody observes here: wait for the agent to be fresh again


@functools.lru_cache(maxsize=1 << 16)
def _host_of(endpoint: str) -> str:
    """The host part of "host:port" (memoised: a full judge asks it once per link)."""
    return parse_hostport(endpoint)[0]


class _RemoteView:
    """Remote hosts and workers as of one poll: one pass over the board's remote tables
    instead of one per link."""

    def __init__(self, board: Board) -> None:
        self.hosts: dict[str, PeerStatus] = {}  # host (no port) -> its pinger's report
        self.by_endpoint: dict[str, SlotStatus] = {}  # the newest worker advertising it
        self.by_key: dict[tuple[str, str], SlotStatus] = {}  # (pinger address, key)
        for p in board.peers():
            self.hosts[_host_of(p.address)] = p
            for s in p.slots:
                self.by_key[(p.address, s.key)] = s
                for ep in s.endpoints:
                    old = self.by_endpoint.get(ep)
                    if old is None or s.incarnation > old.incarnation:
                        self.by_endpoint[ep] = s
