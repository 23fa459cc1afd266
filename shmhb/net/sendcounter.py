"""The counter behind ping nonces and push sequence numbers, kept in the board so that
it only grows whatever the wall clock does (a clock stepped back must not make a new
holder reuse values its peers already refused as replays).

Peers refuse a nonce or a push seq that is not above the last they accepted from the
same board identity (``exchange.ReplayGuard``).  The identity is the board's and
outlives any one pinger process, so a pinger that restarts, or a standby that takes
over, must go on above every value any earlier holder of this board used.  Counters
seeded from CLOCK_REALTIME fail that after the clock steps back (NTP, an operator, a VM
restore): with a secret the host's pings were dropped as replays and it read DEAD
everywhere; its pushes were dropped too.  CLOCK_MONOTONIC is no better: a standby in
another time namespace reads another one.

So the holder keeps a **reservation** in the board header (``net_counter``, written by
the agent role holder alone: the role lock excludes any other writer):

* it hands out ``next()`` values one by one from its start;
* before it hands out a value above the reservation it stores a new reservation,
  ``value + RESERVE``, and only then returns the value (the store is to shared memory:
  it survives the process, and the next holder takes the role after this one lost it,
  through a lock, which orders the store before the next holder's read);
* a new holder starts at ``max(reservation + 1, wall clock)``.

Every value used is at most the reservation stored before it was used, so every value a
later holder uses is above it: per board identity the counter only grows.  The wall
clock enters only as a floor at the start, so counters stay above those of a holder
that predates the reservation (it counted from the wall clock), and a board whose word
is still 0 starts where it always did.  One board write per ``RESERVE`` values: none on
the path of a ping but once in 2**24 of them.
"""

from __future__ import annotations

import time
from typing import Final

from ..board.layout import WORD_MAX, header_index

#: Values reserved per store of the reservation word.
RESERVE: Final = 1 << 24
_TOP: Final = WORD_MAX - RESERVE
#: The reservation word's index among the header's u64 words (``Board.words``).
COUNTER_WORD: Final = header_index("net_counter")


class SendCounter:
    """Strictly increasing u64 values for one board identity (see the module text).
    ``words``: the board header as u64 words; ``index``: the reservation word's."""

    __slots__ = ("_words", "_i", "_next", "_limit", "_stored")

    def __init__(self, words: memoryview, index: int, wall_ns: int | None = None) -> None:
        self._words = words
        self._i = index
        floor = int(words[index])
        wall = time.time_ns() if wall_ns is None else wall_ns
        self._next = min(max(floor + 1, wall), _TOP)
        self._limit = self._next - 1  # nothing reserved by this holder yet
        self._stored = 0

    def next(self) -> int:
        v = self._next
        if v > self._limit:
            self._limit = min(v + RESERVE, _TOP + RESERVE)
            self._words[self._i] = self._stored = self._limit  # stored before v leaves us
        self._next = v + 1
        return v

    @property
    def reserved(self) -> int:
        """The highest reservation this counter stored (0: none yet)."""
        return self._stored

    def peek(self) -> int:
        """The value ``next()`` returns next (not reserved by this)."""
        return self._next


__all__ = ["COUNTER_WORD", "RESERVE", "SendCounter"]
