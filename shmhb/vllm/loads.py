"""The consumer's loads in flight and the one rule that makes failing them fast safe.

A load is one request's KV asked of one producer worker (its side-channel endpoint).
Its state moves only forward, under one lock:

    WAITING --grant--> GRANTED --end--> (gone)
       |
       +--abandon--> ABANDONED --end--> (gone)

* ``grant`` is the producer asking, just before it writes, whether the consumer still
  wants the blocks.  Only a WAITING load is granted, and only to the producer it was
  asked of, for the consumer incarnation that asked.
* ``abandon`` is the consumer giving the load up (its producer was dropped).  Only a
  WAITING load can be abandoned: a GRANTED one may have a write under way, so its
  blocks stay out of vLLM's hands until the inner connector finishes it (or times out).

Both take the same lock, so of a grant and an abandon for one load exactly one wins:
after ``abandon`` returned a load, no grant for it is ever given, and a producer that
honours grants writes nothing into its blocks.  That is the fence (issue: a resumed
producer must never write into blocks reported failed).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field


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


class LoadTable:
    """Thread-safe: the receiver loop starts and ends loads, the fence server grants,
    the worker thread abandons."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: dict[tuple[str, str], Load] = {}

    def start(self, loads: Iterable[Load]) -> None:
        with self._lock:
            for ld in loads:
                self._loads[(ld.req_id, ld.endpoint)] = ld

    def end(self, req_ids: Iterable[str], endpoint: str) -> list[Load]:
        """The inner connector is done with these (finished, failed, or fenced)."""
        with self._lock:
            return [ld for r in req_ids if (ld := self._loads.pop((r, endpoint), None)) is not None]

    def grant(self, endpoint: str, req_ids: Iterable[str]) -> list[str]:
        """The producer at ``endpoint`` is about to write these: the ones still wanted."""
        out = []
        with self._lock:
            for r in req_ids:
                ld = self._loads.get((r, endpoint))
                if ld is not None and ld.state is LoadState.WAITING:
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
                if ld.state is not LoadState.WAITING:
                    continue
                if (endpoint is not None and ld.endpoint == endpoint) or (
                        engine_id is not None and ld.engine_id == engine_id) or (
                        req_ids is not None and ld.req_id in req_ids):
                    ld.state = LoadState.ABANDONED
                    out.append(ld)
        return out

    def by_token(self, token: object) -> list[Load]:
        with self._lock:
            return [ld for ld in self._loads.values() if ld.token is token]

    def endpoints(self) -> set[str]:
        with self._lock:
            return {ld.endpoint for ld in self._loads.values()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._loads)
