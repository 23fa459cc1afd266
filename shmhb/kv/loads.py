"""The consumer's loads in flight and the one rule that makes failing them fast safe.

A load is one request's KV asked of one producer worker (its side-channel endpoint).
Its state moves only forward:

    WAITING --grant--> GRANTED --end--> (gone)
       |
       +--abandon--> ABANDONED --end--> (gone)

* ``grant`` is the producer asking, before it writes, whether the consumer still
  wants the blocks.  Only a WAITING load is granted, and only to the producer it was
  asked of, for the consumer incarnation that asked.
* ``abandon`` is the consumer giving the load up (its producer was dropped).  Only a
  WAITING load can be abandoned: a GRANTED one may have a write under way, so its
  blocks stay out of vLLM's hands until the inner connector finishes it (or times out),
  and, where the inner gives it up on its own, until the grant's lease has run out
  (``Load.lease_until_ns``; ``grants``, "The lease").

Both are one move out of WAITING in the states table (``grants.States``: the C table
under its mutex, or a dict under a lock), so of a grant and an abandon for one load
exactly one wins: after ``abandon`` returned a load, no grant for it is ever given, and
a producer that honours grants writes nothing into its blocks.  That is the fence
(issue: a resumed producer must never write into blocks reported failed).  The states
table is keyed by the token of the producer the load was asked of and the request id
(``grants.Tokens``, ``grants.wire_id``): the grant server looks loads up by what an ask
carries, without the GIL.  This table keeps, under its own lock, what only Python
needs (the endpoint, engine, blocks and the request's handle); ``Load.state`` is the
state as of the call that returned it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from . import grants
from .grants import States, Tokens


class LoadState(str, enum.Enum):
    WAITING = "waiting"
    GRANTED = "granted"
    ABANDONED = "abandoned"


@dataclass
class Load:
    req_id: str
    endpoint: str  # the producer worker's side channel, "host:port"
    engine_id: str
    block_ids: frozenset[int]
    token: object  # the inner connector's handle on the request (to fence it)
    state: LoadState = LoadState.WAITING
    started_ns: int = field(default=0, compare=False)
    key: bytes = field(default=b"", compare=False, repr=False)  # in the states table
    #: granted over the wire: when its lease ends (``time.monotonic_ns``; 0: no lease),
    #: as of the ``end`` that returned it
    lease_until_ns: int = field(default=0, compare=False)


_STATE = {grants.WAITING: LoadState.WAITING, grants.GRANTED: LoadState.GRANTED,
          grants.ABANDONED: LoadState.ABANDONED}


class LoadTable:
    """Thread-safe: the receiver loop starts and ends loads, the fence server grants
    (its own thread, through ``states``), the worker thread abandons."""

    def __init__(self, states: States | None = None, tokens: Tokens | None = None) -> None:
        self.states = states if states is not None else grants.new_states()
        self.tokens = tokens if tokens is not None else Tokens()
        self._lock = threading.Lock()
        self._loads: dict[tuple[str, str], Load] = {}

    def _key(self, req_id: str, endpoint: str) -> bytes:
        return self.tokens.of(endpoint) + grants.wire_id(req_id)

    def _sync(self, ld: Load, code: int) -> Load:
        if code in _STATE:
            ld.state = _STATE[code]
        return ld

    def start(self, loads: Iterable[Load]) -> None:
        with self._lock:
            for ld in loads:
                ld.key = self._key(ld.req_id, ld.endpoint)
                ld.state = LoadState.WAITING
                self._loads[(ld.req_id, ld.endpoint)] = ld
                self.states.start(ld.key)

    def end(self, req_ids: Iterable[str], endpoint: str) -> list[Load]:
        """The inner connector is done with these (finished, failed, or fenced): their
        last state, and when the lease of a grant over the wire ends."""
        out = []
        with self._lock:
            for r in req_ids:
                ld = self._loads.pop((r, endpoint), None)
                if ld is not None:
                    code, ld.lease_until_ns = self.states.end(ld.key)
                    out.append(self._sync(ld, code))
        return out

    def grant(self, endpoint: str, req_ids: Iterable[str]) -> list[str]:
        """The producer at ``endpoint`` is about to write these (or a pull is about to
        read them): the ones still wanted, now GRANTED."""
        out = []
        with self._lock:
            for r in req_ids:
                ld = self._loads.get((r, endpoint))
                if ld is not None and self.states.grant(ld.key):
                    ld.state = LoadState.GRANTED
                    out.append(r)
        return out

    def abandon(self, *, endpoint: str | None = None, engine_id: str | None = None,
                req_ids: Collection[str] | None = None) -> list[Load]:
        """Give up the WAITING loads from ``endpoint`` (or from any worker of
        ``engine_id``, or of the requests ``req_ids`` from any worker); returns them.
        GRANTED loads are left to finish."""
        out = []
        with self._lock:
            for ld in self._loads.values():
                if not ((endpoint is not None and ld.endpoint == endpoint) or (
                        engine_id is not None and ld.engine_id == engine_id) or (
                        req_ids is not None and ld.req_id in req_ids)):
                    continue
                if self.states.abandon(ld.key):
                    ld.state = LoadState.ABANDONED
                    out.append(ld)
        return out

    def by_token(self, token: object) -> list[Load]:
        with self._lock:
            return [self._sync(ld, self.states.state(ld.key))
                    for ld in self._loads.values() if ld.token is token]

    def endpoints(self) -> set[str]:
        with self._lock:
            return {ld.endpoint for ld in self._loads.values()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._loads)
