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
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .board import Board
from .layout import TS39_MASK, TS_SHIFT
from .config import parse_hostport
from .status import PeerStatus, SlotStatus, Status

log = logging.getLogger(__name__)


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


OnDrop = Callable[[Link, DropReason], None]


class LinkReaper:
    """Tracks links and drops each exactly once.  Thread-safe."""

    def __init__(self, board: Board, on_drop: OnDrop | None = None, *,
                 drop_suspect: bool = False) -> None:
        self.board = board
        self.on_drop = on_drop
        self.drop_suspect = drop_suspect
        self._lock = threading.RLock()
        self._links: dict[str, Link] = {}
        self._pending = False  # some link could not be judged: re-judge on every poll
        self._seen_changes = -1
        self._local_words = np.empty(0, np.intp)  # slot indices of tracked local links
        self._stale_units = board.thresholds.suspect if drop_suspect else board.thresholds.dead
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- tracking -------------------------------------------------------------------------

    def track(self, endpoint: str, payload: Any = None, *, incarnation: int | None = None) -> Link:
        """Start tracking the link to ``endpoint`` made just now.  Remembers the current
        incarnation of the peer that serves it (or ``incarnation`` if the handshake told
        it), and asks this host's pinger to follow the peer's host if it is remote."""
        s = self._local(endpoint)
        if s is not None:
            link = Link(endpoint, s.key, incarnation or s.incarnation, True, payload)
        else:
            r = self.board.remote(endpoint)
            known = r is not None and r.status is not Status.UNKNOWN
            inc = incarnation or (r.incarnation if known and r is not None else 0)
            link = Link(endpoint, r.key if r is not None else None, inc, False, payload)
        with self._lock:
            old = self._links.get(endpoint)
            if old is not None and not old.local:
                self.board.unwatch(endpoint)
            if not link.local:
                self.board.watch(endpoint)
            self._links[endpoint] = link
            self._pending = True
            self._reindex()
        return link

    def untrack(self, endpoint: str) -> Link | None:
        """Stop tracking ``endpoint`` without calling ``on_drop``; returns the link."""
        with self._lock:
            link = self._links.pop(endpoint, None)
            if link is not None:
                self._forget(link)
        return link

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def _forget(self, link: Link) -> None:
        if not link.local:
            self.board.unwatch(link.endpoint)
        self._reindex()

    def _reindex(self) -> None:
        idx = set()
        for link in self._links.values():
            if link.local and link.key is not None:
                c = self.board._by_key.get(link.key)
                if c is not None:
                    idx.add((c[0] - self.board._hb0) // 8)
        self._local_words = np.array(sorted(idx), np.intp)

    def _local(self, endpoint: str) -> SlotStatus | None:
        """The live local slot that advertises ``endpoint``, if any."""
        for s in self.board.slots():
            if endpoint in s.endpoints and s.status not in (Status.LEFT, Status.DEAD):
                self.board.slot(s.key)  # prime the hot-path cache for this key
                return s
        return None

    # -- polling --------------------------------------------------------------------------

    def poll(self) -> list[tuple[Link, DropReason]]:
        """Drop links whose peer died, left, restarted or vanished; call ``on_drop`` for
        each (outside the lock) and return them.  Cheap when nothing changed."""
        b = self.board
        with self._lock:
            changes = b.changes()
            if changes == self._seen_changes and not self._pending and not self._maybe_stale():
                return []
            self._seen_changes = changes
            dropped: list[tuple[Link, DropReason]] = []
            pending = False
            view = _RemoteView(b) if any(not lk.local for lk in self._links.values()) else None
            for ep, link in list(self._links.items()):
                verdict = self._judge(link, view)
                if verdict is None:
                    continue
                if isinstance(verdict, Link):  # first report of a remote peer: adopt it
                    self._links[ep] = verdict
                    continue
                if verdict is _PENDING:
                    pending = True
                    continue
                del self._links[ep]
                dropped.append((link, verdict))  # type: ignore[arg-type]
            self._pending = pending
            for link, _ in dropped:
                self._forget(link)
        for link, reason in dropped:
            log.info("link to %s (incarnation %d) dropped: %s", link.endpoint, link.incarnation, reason)
            if self.on_drop is not None:
                try:
                    self.on_drop(link, reason)
                except Exception:  # a connector's bug must not stop the reaper or lose drops
                    log.exception("on_drop callback failed for %s (%s)", link.endpoint, reason)
        return dropped

    def _maybe_stale(self) -> bool:
        """Could a tracked local slot have crossed the staleness threshold?  One numpy
        pass over their heartbeat words; no Python loop over links."""
        idx = self._local_words
        if not len(idx):
            return False
        ts = self.board._hb[idx] & np.uint64(TS39_MASK)
        now = time.monotonic_ns() >> TS_SHIFT
        return bool(now - int(ts.min()) >= self._stale_units)

    def _judge(self, link: Link, view: _RemoteView | None) -> DropReason | Link | object | None:
        if link.local:
            s = self.board.slot(link.key) if link.key is not None else None
            if s is None:
                return DropReason.GONE
        else:
            assert view is not None
            s = view.by_endpoint.get(link.endpoint)
            if s is None:
                host = view.hosts.get(parse_hostport(link.endpoint)[0])
                if link.incarnation and host is not None and host.status is Status.ALIVE:
                    return DropReason.GONE  # a fresh digest of a live host lacks it
                if host is not None and host.status is Status.DEAD and link.incarnation:
                    return DropReason.DEAD
                return _PENDING
            if s.status is Status.UNKNOWN:
                return _PENDING
            if link.incarnation == 0:
                if s.status in (Status.ALIVE, Status.SUSPECT):
                    return Link(link.endpoint, s.key, s.incarnation, False, link.payload)
                return _PENDING
        if s.incarnation != link.incarnation:
            return DropReason.RESTARTED
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
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        with self._lock:
            if self._thread is not None:
                return self
            self._stop.clear()
            t = threading.Thread(target=self._run, args=(interval_s,), name="shmhb-reaper",
                                 daemon=True)
            self._thread = t
        t.start()
        return self

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.poll()

    def stop(self) -> None:
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._stop.set()
            if t is not threading.current_thread():
                t.join()

    def __enter__(self) -> LinkReaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_PENDING = object()


class _RemoteView:
    """Remote hosts and workers as of one poll: one pass over the board's remote tables
    instead of one per link."""

    def __init__(self, board: Board) -> None:
        self.hosts: dict[str, PeerStatus] = {}
        self.by_endpoint: dict[str, SlotStatus] = {}
        for p in board.peers():
            self.hosts[parse_hostport(p.address)[0]] = p
            for s in p.slots:
                for ep in s.endpoints:
                    old = self.by_endpoint.get(ep)
                    if old is None or s.incarnation > old.incarnation:
                        self.by_endpoint[ep] = s
