"""The answering side of the pinger: acks to the pings of hosts that watch us, and
pushes of local deaths, leaves and restarts to them.

It owns the listening ROUTER's traffic: each ping is decoded, (with a secret) checked
for replay, and answered on the connection it came in on with the local digest, whole
or "unchanged" (``exchange.wants_full_digest``).  Watchers are remembered by routing id
for pushes, dropped after three peer-dead periods of silence.  Two bounds of
``4 * npeers`` each: one for watchers whose ping the pinger verified as a followed
host's own (``on_ping`` says so: authenticated, or echoing our challenge), one for
strangers.  Strangers never displace a followed host: 1,024 connections that fill the
strangers' share leave every followed host's watch, and its pushes, as they were
(a flood of strangers cannot stop pings that prove a host alive).  The work per wake-up is bounded by time (``DRAIN_BUDGET_NS``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from ..board.handle import Board
from ..board.core import board_words
from ..clock import Clock
from .digest import LocalDigest
from .exchange import GOODBYE_GEN, ReplayGuard, claimed_ping_address, wants_full_digest
from .exchange import COUNTER_WORD, SendCounter
from .protocol import (
    MAX_PUSH_ENTRIES, DigestEntry, FrameRejected, Identity, Keys, Ping, Push, decode,
    encode_ack_raw, encode_push, encode_refusal,
)
from .suspicion import Suspicion
from .transport import MORE, NOBLOCK, POLLIN, recv_routed

log = logging.getLogger(__name__)

RECV_BATCH = 256  # frames handled per readiness event at most
#: Time one wake-up may spend on the frames of one socket: a flood cannot hold the loop
#: (and so the next pidfd notice) for longer than about this.
DRAIN_BUDGET_NS = 5_000_000
# At most one push per this gap.  The first change after a quiet spell goes out at once;
# changes within the gap are held and sent together by the first flush after it (every
# tick runs one).  Workers killed together die one by one over milliseconds to tens of
# milliseconds (the kernel tears their memory down in turn), and without a gap each
# agent wake-up in between sent its own push: 5 to 11 messages for 32 deaths were seen
# on a 2-core machine.  The price: a change that follows another within the gap waits
# for it (plus up to one tick).
PUSH_GAP_NS = 50_000_000


_REFUSAL = encode_refusal()  # the same 24 bytes for every refused ping


class Responder:
    def __init__(self, board: Board, router: zmq.Socket[bytes], identity: Identity,
                 address: str, secret: Keys, suspicion: Suspicion, clock: Clock,
                 count: Callable[..., None], bad: Callable[[str, str], None],
                 rate_log: Callable[..., None],
                 on_ping: Callable[[Ping, int, str | None], bool] | None = None,
                 on_bad_auth: Callable[[str | None, str | None], None] | None = None, *,
                 counter: SendCounter | None = None) -> None:
        self.b = board
        self.router = router
        self.identity = identity
        self.address = address
        self.secret = secret
        self.suspicion = suspicion
        self.clock = clock
        self._count, self._bad, self._rate_log = count, bad, rate_log
        # a ping that passed, and the address its connection comes from: the pinger
        # weighs it as evidence, and says whether it is a followed host's own
        self._on_ping = on_ping
        # a ping that failed authentication: (its connection's address, the address it
        # claims); the pinger counts it and names the host it comes from
        self._on_bad_auth = on_bad_auth
        # Replay protection for pings only with a secret: without one a ping's identity
        # is anyone's to claim, and a guard keyed by it lets a forger lock a host's real
        # pings out (one ping as A with nonce 2**64-1 and B refused A for good).
        # Unauthenticated replayed pings are harmless: acks are matched to nonces.
        self.ping_guard: ReplayGuard | None = ReplayGuard() if secret else None
        self.watchers: dict[bytes, int] = {}  # ROUTER routing id -> last ping ns
        self._followed: set[bytes] = set()  # those verified as a followed host's own
        self._max_watchers = 4 * board.sizes.npeers  # of each kind
        self.digest = LocalDigest(board, count)
        # push seqs: only grow per board identity, whatever the wall clock does
        self.counter = counter if counter is not None else SendCounter(board_words(board).words, COUNTER_WORD)
        self._unpushed: dict[str, DigestEntry] = {}  # changes held back by PUSH_GAP_NS
        self._last_push_ns: int | None = None

    def drain(self, now_ns: int) -> None:
        r = self.router
        deadline = self.clock.monotonic_ns() + DRAIN_BUDGET_NS
        for n in range(RECV_BATCH):
            if not int(r.getsockopt(zmq.EVENTS)) & POLLIN:
                return  # drained (cheaper than letting recv raise Again)
            if n & 7 == 7 and self.clock.monotonic_ns() >= deadline:
                self._count("drain_budget_spent")
                return  # the rest waits for the next wake-up, after the local watch
            rid, frame, source = recv_routed(r)
            if frame is None:
                self._bad("malformed", "router")
                continue
            try:
                msg = decode(frame, self.secret)
            except FrameRejected as e:
                if e.reason == "auth" and self._on_bad_auth is not None:
                    # which followed host's pings fail it: see NetworkHalf._bad_auth_ping
                    self._on_bad_auth(source, claimed_ping_address(frame))
                    self._refuse(rid)
                else:
                    self._bad(e.reason, "router")
                continue
            if not isinstance(msg, Ping):
                self._bad("type", "router")
                continue
            if self.ping_guard is not None and not self.ping_guard.accept(msg.identity, msg.nonce):
                self._bad("replay", "router")
                continue
            self.suspicion.inbound(now_ns)
            ours = self._on_ping is not None and self._on_ping(msg, now_ns, source)
            self._watch(rid, ours, now_ns)
            d = self.digest
            full = wants_full_digest(msg, self.identity, d.gen)
            ack = encode_ack_raw(msg.nonce, self.identity, self.address, d.gen,
                                 d.body if full else None, self.secret, cut=d.cut > 0,
                                 body_age_ms=d.body_age_ms() if full else 0)
            try:
                r.send(rid, MORE)
                r.send(ack, NOBLOCK)
                self._count("pings_answered")
            except zmq.ZMQError as e:  # EHOSTUNREACH (gone), EAGAIN (slow reader)
                self._rate_log("ack", "pinger: ack to a watcher not sent: %s", e)

    def _refuse(self, rid: bytes) -> None:
        """Answer a ping that failed authentication with a refusal (``encode_refusal``,
        24 bytes: less than any ping, so nothing is amplified): its sender learns that
        our secrets differ, not that we are dead (docs/PROTOCOL.md, "REFUSAL")."""
        try:
            self.router.send(rid, MORE)
            self.router.send(_REFUSAL, NOBLOCK)
            self._count("pings_refused")
        except zmq.ZMQError as e:
            self._rate_log("ack", "pinger: refusal to a watcher not sent: %s", e)

    def _watch(self, rid: bytes, ours: bool, now_ns: int) -> None:
        """Remember the watcher ``rid`` (``ours``: its ping was a followed host's own).
        Each kind has its own bound, so strangers cannot fill a followed host's place."""
        if ours and rid not in self._followed:
            if len(self._followed) >= self._max_watchers:
                return
            self._followed.add(rid)
        elif rid not in self.watchers and (
                len(self.watchers) - len(self._followed) >= self._max_watchers):
            return  # a stranger past its bound: no pushes for it (acks as ever)
        self.watchers[rid] = now_ns

    def _forget(self, rid: bytes) -> None:
        self.watchers.pop(rid, None)
        self._followed.discard(rid)

    def expire(self, cutoff_ns: int) -> None:
        for rid, seen in list(self.watchers.items()):
            if seen < cutoff_ns:
                self._forget(rid)

    def flush(self, now_ns: int) -> None:
        """Rebuild the digest of local slots if anything changed, and push deaths, leaves
        and restarts to the hosts that pinged us recently (batched: see PUSH_GAP_NS)."""
        for e in self.digest.rebuild(now_ns):
            self._unpushed[e.key] = e  # the latest change of a slot wins
        if not self._unpushed:
            return
        if not self.watchers:
            self._unpushed.clear()  # nobody to tell: a watcher's next ack tells it all
            return
        if self._last_push_ns is not None and now_ns - self._last_push_ns < PUSH_GAP_NS:
            return  # held back: a later flush sends everything held so far in one push
        self._last_push_ns = now_ns
        entries, self._unpushed = list(self._unpushed.values()), {}
        self._push(entries)

    def goodbye(self, now_ns: int) -> int:
        """Tell every host that pinged us recently that this pinger stops: the changes
        still held back by the push gap first, then a goodbye (``exchange.GOODBYE_GEN``).
        Returns how many watchers it was sent to."""
        for e in self.digest.rebuild(now_ns):
            self._unpushed[e.key] = e
        if not self.watchers:
            return 0
        if self._unpushed:
            entries, self._unpushed = list(self._unpushed.values()), {}
            self._push(entries)
        frame = encode_push(Push(self.identity, self.address, self.counter.next(), GOODBYE_GEN, ()),
                            self.secret)
        told = 0
        for rid in list(self.watchers):
            try:
                self.router.send(rid, MORE)
                self.router.send(frame, NOBLOCK)
                told += 1
            except zmq.ZMQError:
                pass  # that connection is gone: its host finds out by silence
        return told

    def _push(self, entries: list[DigestEntry]) -> None:
        r = self.router
        for k in range(0, len(entries), MAX_PUSH_ENTRIES):
            frame = encode_push(Push(self.identity, self.address, self.counter.next(),
                                     self.digest.gen,
                                     tuple(entries[k:k + MAX_PUSH_ENTRIES])),
                                self.secret)
            for rid in list(self.watchers):
                try:
                    r.send(rid, MORE)
                    r.send(frame, NOBLOCK)
                    self._count("pushes_sent")
                except zmq.ZMQError:
                    self._forget(rid)  # that connection is gone; its host re-pings us
