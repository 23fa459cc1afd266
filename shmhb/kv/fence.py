"""The go-ahead a producer asks of its consumer before it writes into the consumer's
blocks, over a small TCP side channel of the consumer worker: the consumer's server
(:class:`FenceServer`) and the producer's asks (:class:`GrantAsker`).

The wire is version 1, binary (``shmhb.kv.grants``): an ask names the consumer
incarnation the request carried, the token it carried, and request ids; the reply says
which are granted.  A consumer that restarted since (a new incarnation at the same
address) grants nothing.  The consumer answers in a C thread that never waits for its
engine's GIL (``shmhb._fence``; a Python thread where that is not built).

A frame of another version reads as a malformed ask and its connection is closed, so its
write is not granted and the request is recomputed: upgrade both sides together when the
wire changes.

**Who may take a grant.**  What binds a grant to the producer the consumer sent the
request to is the token: a keyed digest of that producer's endpoint under a random key
the consumer process draws at start and never sends (``grants.Tokens``).  The consumer
puts the token into the requests it sends to that producer only, and keys each load by
it, so only a process that received one of those requests can ask for that producer's
loads; a third party that knows a request id (or forges a token) finds no load and
changes nothing: the load stays WAITING, so the consumer can still give it up at once.
(Where one wants more: the request travels in the clear, so anyone who can read that
traffic can read the token; that party can also read and write the KV itself.)

**When the producer asks.**  As soon as it reads a request whose blocks are already
computed (``ask_now``), and reads the answer when it is about to write (``result``):
the round trip then overlaps the producer's own hop from reading the request to
writing.  Otherwise it asks right before writing (``ask``).  Asks to one consumer share
one connection and may be in flight together; replies are matched by nonce.

**For how long.**  Each grant carries a lease (``grants``, "The lease"): the producer
writes only while it runs, counted from when it sent the ask (``Ask.until_ns``, checked
by the adapter right before the write), and the consumer holds a granted load's blocks
at least that long.

Nothing received is trusted: sizes, kinds and lengths are checked, a bad frame closes
its connection and is counted, and nothing a peer sends or does can end the server's
thread.  At most ``MAX_CONNECTIONS`` connections are kept (the least recently active
goes).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ..board import address
from ..errors import InvalidConfig
from ..ratelog import RateLimitedLog
from . import fencewire, grants
from .grants import States, Tokens

log = logging.getLogger(__name__)

VERSION = grants.VERSION
TOKEN_HEX = 2 * grants.TOKEN_BYTES  # the token, as hex in a request's params
#: connections a fence server keeps open at once (past it, the least recently active goes)
MAX_CONNECTIONS = 1024
#: consumers a producer keeps a go-ahead connection to (the least recently asked goes)
MAX_CHANNELS = 256
#: past an ask's deadline, how long one last look waits for a reply already on its way
#: (see ``GrantAsker.result``)
LAST_LOOK_S = 0.25
#: how long a producer waits for a reply without dropping the GIL (in C) before it
#: awaits it on its loop: a consumer answering in C replies within a round trip (about
#: 0.1 ms on loopback), while a wait that drops the GIL costs up to a switch interval
#: (5 ms) to get it back on a busy engine.  The engine's other threads wait as long.
HOLD_MS = 1
_LOG_EVERY_S = 10.0
_HEX = frozenset("0123456789abcdef")
_MAX_ENDPOINT = 300


def check_endpoint(ep: object) -> str:
    """A "host:port" from outside, checked at the project's one address door (a string
    that passed is remembered: the same few consumers name themselves in every request,
    and the full check costs tens of microseconds on the producer's sender loop)."""
    if isinstance(ep, str) and len(ep) <= _MAX_ENDPOINT:
        return _checked(ep)
    return address.check_endpoint(ep)


@functools.lru_cache(maxsize=1024)
def _checked(ep: str) -> str:
    return address.check_endpoint(ep)  # a refusal raises, and is not remembered


def _token(v: object) -> str | None:
    if isinstance(v, str) and len(v) == TOKEN_HEX and _HEX.issuperset(v):
        return v
    return None


class FenceServer:
    """The consumer worker's side: answers asks for the loads in ``states`` (keyed by
    ``tokens``) when they name ``incarnation``.  ``counters()``: asks, bad frames,
    stale asks (another incarnation), loads granted, connections dropped; ``report()``
    logs what went wrong since it last looked (the server's thread cannot log: it never
    takes the GIL)."""

    def __init__(self, host: str, incarnation: int, states: States, tokens: Tokens) -> None:
        self._tokens = tokens
        sock, self.endpoint = fencewire.listen(host)  # "host:port" or "[v6]:port", as bound
        self._srv = grants.serve(states, sock, incarnation, MAX_CONNECTIONS)
        self._log = RateLimitedLog(log, _LOG_EVERY_S)
        self._seen = self._srv.counters()

    def set_incarnation(self, incarnation: int) -> None:
        self._srv.set_incarnation(incarnation)

    def token_for(self, producer: str) -> str:
        """The capability this consumer gives the producer at ``producer`` (its side
        channel), as hex, with each request."""
        return self._tokens.of(producer).hex()

    def counters(self) -> dict[str, int]:
        return self._srv.counters()

    def report(self) -> int:
        """Loads granted since the last call; bad frames and stale asks since then are
        logged (rate-limited)."""
        now, seen = self._srv.counters(), self._seen
        if now == seen:
            return 0
        self._seen = now
        bad = now["bad_frames"] - seen["bad_frames"]
        if bad:
            self._log.warn("bad", "fence server %s: dropped %d bad frame(s) (%d so far)",
                           self.endpoint, bad, now["bad_frames"])
        room = now["dropped"] - seen["dropped"]
        if room:
            self._log.warn("room", "fence server %s: closed %d connection(s) to make room "
                           "(over %d open, or no descriptor left; %d so far)",
                           self.endpoint, room, MAX_CONNECTIONS, now["dropped"])
        return now["granted"] - seen["granted"]

    def close(self) -> None:
        """Stops the server's thread and closes every socket."""
        self._srv.close()


class Ask:
    """One ask sent and not yet settled: ``granted`` is None until its reply is read
    (or it failed: all False).  ``sent_ns``: when it was sent (``time.monotonic_ns``,
    taken before the send); ``until_ns``: when the lease of what it was granted ends on
    this clock (0: nothing granted)."""

    __slots__ = ("endpoint", "nonce", "req_ids", "granted", "channel", "sent_ns", "until_ns")

    def __init__(self, endpoint: str, nonce: int, req_ids: list[str], ch: _Channel,
                 sent_ns: int) -> None:
        self.endpoint, self.nonce, self.req_ids, self.channel = endpoint, nonce, req_ids, ch
        self.granted: list[bool] | None = None
        self.sent_ns, self.until_ns = sent_ns, 0


@dataclass(frozen=True)
class Allowed:
    """What a producer may write: ``req_ids``, each only before ``until_ns`` on this
    process's monotonic clock (the earliest lease among the asks that granted them;
    None: no lease binds them, for a consumer without shmhb, which only the board
    vouches for)."""

    req_ids: list[str]
    until_ns: int | None


class _Channel:
    """One connection to one consumer's fence server, on one event loop."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.buf = bytearray()  # what has been read of the next reply
        self.pending: dict[int, Ask] = {}  # nonce -> the ask waiting for its reply
        #: asks given up whose replies may still come (each may skip one reply)
        self.forgotten = 0
        self.connecting: asyncio.Task[None] | None = None
        self.readable: asyncio.Future[None] | None = None
        self.closed = False


class GrantAsker:
    """The producer's side: which requests a consumer still wants, asked before writing.
    One connection per consumer is kept, on the event loop that asks, and asks share
    it.  Any failure (unreachable, timeout, bad reply, no token) is "none granted": a
    write the consumer did not confirm is a write into blocks it may have given up."""

    def __init__(self, use_native: bool | None = None) -> None:
        self._channels: OrderedDict[tuple[int, str], _Channel] = OrderedDict()
        self._io = grants.sender(use_native)
        self._log = RateLimitedLog(log, _LOG_EVERY_S)
        #: asks sent as the request was read ("early"), how each answer was read: in at
        #: once ("in_time"), within the hold ("held"), or awaited ("awaited"), and
        #: grants whose lease had run out when read ("expired")
        self.counts: Counter[str] = Counter()
        # Nonces match replies to asks on a connection, so they only need to differ:
        # a count from a random start.  (os.urandom per ask would drop the GIL around
        # getrandom(), which costs a switch interval on a busy engine.)
        self._nonces = itertools.count(int.from_bytes(os.urandom(7), "little"))

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    def _channel(self, endpoint: str) -> _Channel:
        key = (id(asyncio.get_running_loop()), endpoint)  # a socket serves one loop
        ch = self._channels.get(key)
        if ch is None or ch.closed:
            ch = self._channels[key] = _Channel()
            idle = [k for k, c in self._channels.items()
                    if not c.pending and c.connecting is None and c is not ch]
            for k in idle[:max(0, len(self._channels) - MAX_CHANNELS)]:
                self._close(self._channels.pop(k))
        self._channels.move_to_end(key)
        return ch

    def ask_now(self, endpoint: str, incarnation: int, token: str | None,
                req_ids: list[str]) -> Ask | None:
        """Sends an ask on an open connection without waiting (nor dropping the GIL);
        None where there is none (the ask is then made when the answer is needed)."""
        if token is None or not req_ids:
            return None
        ch = self._channel(endpoint)
        if ch.sock is None:
            return None
        self._pump(ch)  # a connection the consumer closed while idle is found here
        a = self._post(endpoint, ch, incarnation, token, req_ids)
        if a is not None:
            self.counts["early"] += 1
        return a

    async def ask(self, endpoint: str, incarnation: int, token: str | None,
                  req_ids: list[str], timeout_s: float) -> list[str]:
        """The subset of ``req_ids`` the consumer at ``endpoint`` grants (``post``, then
        ``result`` within what is left of ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        a = await self.post(endpoint, incarnation, token, req_ids, timeout_s)
        if a is None:
            return []
        return await self.result(a, req_ids, max(0.0, deadline - loop.time()))

    async def post(self, endpoint: str, incarnation: int, token: str | None,
                   req_ids: list[str], timeout_s: float) -> Ask | None:
        """Sends an ask, connecting first if need be (within ``timeout_s``); None where
        it could not be sent (no token, unreachable, over the wire's limits)."""
        if token is None or not req_ids:
            return None  # the consumer gave no capability: it cannot grant
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        ch = self._channel(endpoint)
        if ch.sock is not None:
            self._pump(ch)
            if ch.closed:
                ch = self._channel(endpoint)
        if ch.sock is None and not await self._connect(ch, endpoint, deadline):
            self._gave_up(endpoint, timeout_s, req_ids)
            return None
        return self._post(endpoint, ch, incarnation, token, req_ids)

    async def result(self, a: Ask, req_ids: list[str], timeout_s: float) -> list[str]:
        """Of ``req_ids``, those ``a`` was granted, waiting up to ``timeout_s`` for its
        reply (read at once when it is already in: no turn of the loop)."""
        ch = a.channel
        if self.settled(a):  # the usual case: the answer is in, and read here
            self.counts["in_time"] += 1
            return self._granted(a, req_ids)
        if ch.sock is not None and not ch.closed and self._io.hold(ch.sock, HOLD_MS) \
                and self.settled(a):
            self.counts["held"] += 1
            return self._granted(a, req_ids)
        loop = asyncio.get_running_loop()
        deadline, looked = loop.time() + timeout_s, False
        while not self.settled(a):
            # A grant is the consumer's promise to hold the load for its lease (it never
            # gives up a GRANTED one before the lease ran out), so a reply is honoured
            # however late this process reads it while the lease runs: the deadline
            # only bounds the wait for a consumer that does not answer.  A producer
            # stopped (SIGSTOP, a long GC) after its ask finds its deadline passed on
            # resume with the reply in the kernel's buffer: ``settled`` reads it before
            # the deadline is looked at, and one last look waits a little for one on its
            # way.  A lease that ran out meanwhile grants nothing (``_granted``).
            if loop.time() >= deadline:
                if looked:
                    self.forget(a)
                    return self._gave_up(a.endpoint, timeout_s, req_ids)
                looked, deadline = True, loop.time() + LAST_LOOK_S
            await self._readable(ch, deadline - loop.time())
        self.counts["awaited"] += 1
        return self._granted(a, req_ids)

    def _granted(self, a: Ask, req_ids: list[str]) -> list[str]:
        assert a.granted is not None
        if any(a.granted) and time.monotonic_ns() >= a.until_ns:
            self.counts["expired"] += 1
            self._log.warn("lease", "the go-ahead of consumer %s came back after its lease "
                           "ran out (%.1f s since the ask): not writing", a.endpoint,
                           (time.monotonic_ns() - a.sent_ns) / 1e9)
            return []
        if a.req_ids == req_ids:
            return [r for r, g in zip(req_ids, a.granted) if g]
        wanted = set(req_ids)
        return [r for r, g in zip(a.req_ids, a.granted) if g and r in wanted]

    def settled(self, a: Ask) -> bool:
        """Whether ``a``'s answer is in (read now if it has come), without waiting."""
        if a.granted is None:
            self._pump(a.channel)
        return a.granted is not None

    def forget(self, a: Ask) -> None:
        """An ask whose answer is no longer wanted: a reply to it is skipped."""
        if a.granted is None:
            if a.channel.pending.pop(a.nonce, None) is not None:
                a.channel.forgotten += 1
            a.granted = [False] * len(a.req_ids)

    # -- the connection -------------------------------------------------------------------

    async def _connect(self, ch: _Channel, endpoint: str, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        if ch.connecting is None:
            ch.connecting = loop.create_task(self._open(ch, endpoint))
            ch.connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            await asyncio.wait_for(asyncio.shield(ch.connecting), max(0.0, deadline - loop.time()))
        except TimeoutError:  # asyncio's is the builtin (Python 3.11 on)
            return False
        except (OSError, ValueError) as e:  # ValueError: a bad endpoint
            self._log.warn("wire", "connecting to consumer %s for a go-ahead failed: %r",
                           endpoint, e)
            return False
        return ch.sock is not None and not ch.closed

    async def _open(self, ch: _Channel, endpoint: str) -> None:
        try:
            sock = await fencewire.connect(endpoint)
        except BaseException:
            self._fail(ch)
            raise
        if ch.closed:
            sock.close()
        else:
            ch.sock = sock

    def _post(self, endpoint: str, ch: _Channel, incarnation: int, token: str,
              req_ids: list[str]) -> Ask | None:
        nonce = next(self._nonces)  # below 2**56 + the asks made: a u64 for ever
        try:
            data = fencewire.pack(grants.encode_ask(
                nonce, incarnation, bytes.fromhex(token), [grants.wire_id(r) for r in req_ids]))
        except ValueError as e:  # over the wire's limits: not asked, not granted
            self._log.warn("size", "not asking consumer %s for %d request(s): %s",
                           endpoint, len(req_ids), e)
            return None
        assert ch.sock is not None
        sent_ns = time.monotonic_ns()  # before the send: the lease counts from here
        try:
            sent = self._io.send(ch.sock, data)
        except OSError:
            sent = -1
        if sent != len(data):  # a consumer that does not read: its connection goes
            self._fail(ch)
            return None
        a = ch.pending[nonce] = Ask(endpoint, nonce, req_ids, ch, sent_ns)
        return a

    def _pump(self, ch: _Channel) -> None:
        """Reads what has come on ``ch`` and settles the asks it answers.  A consumer
        answers each ask once, so every frame either settles a pending ask or skips the
        late reply of one given up; any other frame (a reply to nothing asked, garbage)
        is a broken or hostile peer, whose connection goes at once: the work of one call
        is bounded by the asks made, whatever the peer streams."""
        while ch.sock is not None and not ch.closed:
            try:
                data = self._io.recv(ch.sock, fencewire.room(ch.buf))
            except OSError:
                data = b""
            if data is None:
                return
            if not data:  # the consumer closed it (or reset it)
                self._fail(ch)
                return
            ch.buf += data
            try:
                while (frame := fencewire.next_frame(ch.buf)) is not None:
                    self._settle(ch, frame)
            except fencewire.BadFrame as e:
                self._log.warn("wire", "consumer %s: %s; its connection is closed",
                               self._endpoint_of(ch), e)
                self._fail(ch)
                return

    @staticmethod
    def _settle(ch: _Channel, frame: bytes) -> None:
        nonce = grants.reply_nonce(frame)
        a = None if nonce is None else ch.pending.get(nonce)
        ok = None if a is None else grants.decode_reply(frame, a.nonce, len(a.req_ids))
        if a is not None and ok is not None:
            del ch.pending[a.nonce]
            a.granted, a.until_ns = ok.granted, ok.until_ns(a.sent_ns)
        elif a is None and nonce is not None and ch.forgotten > 0:
            ch.forgotten -= 1  # the late reply of an ask given up
        else:
            raise fencewire.BadFrame("a frame that answers no ask")

    def _endpoint_of(self, ch: _Channel) -> str:
        return next((k[1] for k, c in self._channels.items() if c is ch), "?")

    async def _readable(self, ch: _Channel, timeout_s: float) -> None:
        if ch.sock is None or ch.closed:
            return
        loop = asyncio.get_running_loop()
        if ch.readable is None:
            fut = ch.readable = loop.create_future()
            fd = ch.sock.fileno()

            def wake() -> None:
                loop.remove_reader(fd)
                ch.readable = None
                if not fut.done():
                    fut.set_result(None)
            loop.add_reader(fd, wake)
        await asyncio.wait((ch.readable,), timeout=max(0.0, timeout_s))

    def _fail(self, ch: _Channel) -> None:
        """The connection goes (the next ask makes a new one); every ask waiting on it
        is granted nothing."""
        for a in ch.pending.values():
            a.granted = [False] * len(a.req_ids)
        ch.pending.clear()
        self._close(ch)
        for k in [k for k, c in self._channels.items() if c is ch]:
            del self._channels[k]

    def _close(self, ch: _Channel) -> None:
        """On the channel's loop (``close()`` is the one from any thread)."""
        ch.closed = True
        if ch.sock is not None:
            if ch.readable is not None:
                fut, ch.readable = ch.readable, None
                asyncio.get_running_loop().remove_reader(ch.sock.fileno())
                if not fut.done():
                    fut.set_result(None)
            ch.sock.close()

    def _gave_up(self, endpoint: str, timeout_s: float, req_ids: list[str]) -> list[str]:
        self._log.warn("timeout", "no go-ahead from consumer %s within %.1f s: not "
                          "writing %d request(s)", endpoint, timeout_s, len(req_ids))
        return []

    def close(self) -> None:
        """From any thread, once no ask runs: every channel goes."""
        channels = list(self._channels.values())
        self._channels.clear()
        for ch in channels:
            ch.closed = True
            if ch.sock is not None:
                ch.sock.close()


#: what a request's shmhb field says: the consumer's incarnation, its fence endpoint,
#: and the token it gave this producer (None: it gave none)
Extra = tuple[int, str, str | None]


def parse_extra(v: Any) -> Extra | None:
    """The consumer's incarnation, fence endpoint and the token it gave this producer,
    as its request carried them (no token: a consumer that cannot grant)."""
    if not isinstance(v, dict):
        return None
    inc, fence = v.get("inc"), v.get("fence")
    if isinstance(inc, bool) or not isinstance(inc, int) or not 0 < inc < 1 << 64:
        return None
    try:
        return inc, check_endpoint(fence), _token(v.get("tok"))
    except InvalidConfig:
        return None
