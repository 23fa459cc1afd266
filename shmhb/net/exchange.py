"""What the two ends of a ping exchange remember and decide, above the frame codec.

``shmhb.net.protocol`` turns bytes into frames and back and keeps no state.  This module
holds the rest of the exchange, pure as well: the responder's rule for answering a ping
with a full digest or "unchanged" (:func:`wants_full_digest`), and the little state that
replay protection needs (:class:`ReplayGuard` per sender identity, :class:`OutstandingPings`
for the nonces a pinger awaits acks for).  docs/PROTOCOL.md, "Replay rules", argues why these
suffice.  And the sender's side of the same rule: :class:`SendCounter`, the nonces and push
sequence numbers that only grow for one board identity, whoever holds its agent role.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Final

from shmhb.board.layout import WORD_MAX, header_index
from shmhb.errors import InvalidConfig
from shmhb.net.protocol import FLAG_AUTH, TAG_BYTES, FrameRejected, Identity, Ping, Push, decode

_FLAGS_AT = 6  # the flags byte of a frame's header (shmhb.net.protocol)


def claimed_ping_address(frame: bytes) -> str | None:
    """The listen address a ping that failed authentication *claims* to come from, or
    None if it is no well-formed ping.  Unauthenticated: use it only to explain a
    silence (which host's pings fail authentication), never as evidence of anything."""
    if len(frame) <= _FLAGS_AT:
        return None
    flags = frame[_FLAGS_AT]
    body = frame[:len(frame) - TAG_BYTES] if flags & FLAG_AUTH else frame
    try:
        msg = decode(body[:_FLAGS_AT] + bytes([flags & ~FLAG_AUTH]) + body[_FLAGS_AT + 1:])
    except FrameRejected:
        return None
    return msg.address if isinstance(msg, Ping) else None


#: The generation a goodbye names: a PUSH of generation 0 with no entries says that the
#: sender's pinger stops and no worker of its host lives (docs/PROTOCOL.md, "Goodbye").
#: A digest's generation is never 0 (``shmhb.net.digest``), so no other push looks like it.
GOODBYE_GEN = 0


def is_goodbye(push: Push) -> bool:
    return push.gen == GOODBYE_GEN and not push.entries


def wants_full_digest(ping: Ping, identity: Identity, gen: int) -> bool:
    """The responder's rule: send the full digest unless the pinger already holds
    generation ``gen`` of this very board ``identity`` (gen 0 never counts as held)."""
    return not (ping.known_gen != 0 and ping.known_gen == gen
                and ping.known_identity == identity)


class ReplayGuard:
    """Highest counter (ping nonce or push seq) accepted per sender identity.

    Only strictly increasing counters pass.  Memory is bounded: the least recently
    accepted identities beyond ``max_identities`` are forgotten, which reopens replay
    for them; size the bound above the number of hosts.  Use one guard per frame type,
    and feed it only frames that decode (and so authentication) accepted."""

    def __init__(self, max_identities: int = 4096) -> None:
        if max_identities < 1:
            raise InvalidConfig("max_identities must be >= 1")
        self._max = max_identities
        self._last: OrderedDict[Identity, int] = OrderedDict()

    def accept(self, identity: Identity, counter: int) -> bool:
        last = self._last.get(identity)
        if last is not None and counter <= last:
            return False
        self._last[identity] = counter
        self._last.move_to_end(identity)
        if len(self._last) > self._max:
            self._last.popitem(last=False)
        return True

    def require(self, identity: Identity, counter: int) -> None:
        """:meth:`accept`, raising ``FrameRejected("replay")`` on refusal."""
        if not self.accept(identity, counter):
            raise FrameRejected("replay", f"counter {counter} not above {self._last[identity]}")

    def last(self, identity: Identity) -> int | None:
        return self._last.get(identity)

    def __len__(self) -> int:
        return len(self._last)


class OutstandingPings:
    """The pinger's pings awaiting an ack: ``(peer_key, nonce) -> sent_ns``.

    :meth:`take` succeeds once per ping, so a replayed or duplicated ack finds nothing.
    Only the last ``per_peer`` nonces of a peer are kept (an ack older than that is
    treated as lost) and at most ``max_peers`` peers (least recently pinged dropped)."""

    def __init__(self, per_peer: int = 8, max_peers: int = 4096) -> None:
        if per_peer < 1 or max_peers < 1:
            raise InvalidConfig("per_peer and max_peers must be >= 1")
        self._per_peer, self._max_peers = per_peer, max_peers
        self._peers: OrderedDict[Hashable, OrderedDict[int, int]] = OrderedDict()
        self._count = 0

    def add(self, peer_key: Hashable, nonce: int, sent_ns: int) -> None:
        pending = self._peers.get(peer_key)
        if pending is None:
            pending = self._peers[peer_key] = OrderedDict()
            if len(self._peers) > self._max_peers:
                self._count -= len(self._peers.popitem(last=False)[1])
        else:
            self._peers.move_to_end(peer_key)
        self._count += nonce not in pending
        pending[nonce] = sent_ns
        pending.move_to_end(nonce)
        if len(pending) > self._per_peer:
            pending.popitem(last=False)
            self._count -= 1

    def take(self, peer_key: Hashable, nonce: int) -> int | None:
        """The send time of the ping ``nonce`` to ``peer_key``, forgetting it; None if
        unknown, expired or already taken."""
        pending = self._peers.get(peer_key)
        if pending is None:
            return None
        sent_ns = pending.pop(nonce, None)
        if sent_ns is not None:
            self._count -= 1
            if not pending:
                del self._peers[peer_key]
        return sent_ns

    def drop_peer(self, peer_key: Hashable) -> None:
        self._count -= len(self._peers.pop(peer_key, ()))

    def peers(self) -> int:
        return len(self._peers)

    def __len__(self) -> int:
        return self._count




# --- the sender's nonces and push seqs: a counter kept in the board ------------------------
#
# The counter behind ping nonces and push sequence numbers, kept in the board so that
# it only grows whatever the wall clock does (a clock stepped back must not make a new
# holder reuse values its peers already refused as replays).
#
# Peers refuse a nonce or a push seq that is not above the last they accepted from the
# same board identity (``exchange.ReplayGuard``).  The identity is the board's and
# outlives any one pinger process, so a pinger that restarts, or a standby that takes
# over, must go on above every value any earlier holder of this board used.  Counters
# seeded from CLOCK_REALTIME fail that after the clock steps back (NTP, an operator, a VM
# restore): with a secret the host's pings were dropped as replays and it read DEAD
# everywhere; its pushes were dropped too.  CLOCK_MONOTONIC is no better: a standby in
# another time namespace reads another one.
#
# So the holder keeps a **reservation** in the board header (``net_counter``, written by
# the agent role holder alone: the role lock excludes any other writer):
#
# * it hands out ``next()`` values one by one from its start;
# * before it hands out a value above the reservation it stores a new reservation,
#   ``value + RESERVE``, and only then returns the value (the store is to shared memory:
#   it survives the process, and the next holder takes the role after this one lost it,
#   through a lock, which orders the store before the next holder's read);
# * a new holder starts at ``max(reservation + 1, wall clock)``.
#
# Every value used is at most the reservation stored before it was used, so every value a
# later holder uses is above it: per board identity the counter only grows.  The wall
# clock enters only as a floor at the start (a new board's word is 0).  One board write
# per ``RESERVE`` values: none on the path of a ping but once in 2**24 of them.

#: Values reserved per store of the reservation word.
RESERVE: Final = 1 << 24
_TOP: Final = WORD_MAX - RESERVE
#: The reservation word's index among the header's u64 words (``BoardWords.words``).
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


__all__ = ["COUNTER_WORD", "GOODBYE_GEN", "OutstandingPings", "RESERVE", "ReplayGuard",
           "SendCounter", "claimed_ping_address", "is_goodbye", "wants_full_digest"]
