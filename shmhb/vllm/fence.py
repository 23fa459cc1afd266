"""The go-ahead a producer asks of its consumer before it writes into the consumer's
blocks, over a small TCP side channel of the consumer worker (length-prefixed frames:
``shmhb.vllm.fencewire``).

Wire (JSON, one frame each way, at most ``MAX_FRAME`` bytes):
  ask:   {"v": 3, "n": nonce, "inc": consumer incarnation, "from": "host:port",
          "tok": capability, "reqs": [id]}
  reply: {"v": 3, "n": nonce, "ok": [id]}
``from`` is the producer's side channel (the endpoint the consumer sent its request to);
``inc`` is the incarnation the consumer put into that request: a consumer that restarted
since (a new incarnation at the same address) grants nothing.

Version 3 is version 2's JSON over plain TCP, each frame a 4-byte big-endian length and
its bytes (version 2 went over ZMQ, whose own I/O threads cost four thread wake-ups per
round trip).  The versions do not talk: a version 2 producer's ZMTP greeting starts with
0xFF, which reads as a length over ``MAX_FRAME``, so its connection is closed as a bad
frame and its write is not granted (the request is recomputed); a version 3 frame's first
byte, 0, is a frame ZMTP refuses, so a version 2 consumer closes the connection and
grants nothing either.  Upgrade both sides together.

**Who may take a grant.**  ``from`` is only a claim.  What binds a grant to the
producer the consumer sent the request to is ``tok``: a keyed digest of that producer's
endpoint under a random key the consumer process draws at start and never sends
(:meth:`FenceServer.token_for`).  The consumer puts the token into the requests it sends
to that producer only, so only a process that received one of them can ask for that
producer's loads; a third party that knows a request id (or claims another producer's
``from``) is refused and changes nothing: the load stays WAITING, so the consumer can
still give it up at once.  The token is per consumer incarnation and per producer, and
is compared in constant time.  (Where one wants more: the request travels in the clear,
so anyone who can read that traffic can read the token; that party can also read and
write the KV itself.)  An ask without a token (a producer of the first fence version) is
refused: such a producer's write is not granted and the request is recomputed.

Nothing received is trusted: sizes, types, lengths and text are checked (a lone surrogate
or a nesting too deep for the parser is a bad frame like any other), a bad frame is
dropped and counted, and nothing a peer sends or does can end the server's thread: a
bad length, a reset or a connection held open with half a frame costs that peer its
connection, and at most ``MAX_CONNECTIONS`` are kept (the least recently active goes).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..board import address
from ..errors import InvalidConfig
from ..ratelog import RateLimitedLog
from . import fencewire
from .fencewire import MAX_FRAME

log = logging.getLogger(__name__)

VERSION = 3
MAX_REQS = 1024
MAX_ID_BYTES = 256
TOKEN_HEX = 32  # a 128-bit token, as hex
#: connections a fence server keeps open at once (past it, the least recently active goes)
MAX_CONNECTIONS = 1024
#: consumers a producer keeps a go-ahead connection to (the least recently asked goes)
MAX_CHANNELS = 256
#: past an ask's deadline, how long one last look waits for a reply already on its way
#: (see ``GrantAsker.ask``)
LAST_LOOK_S = 0.25
_LOG_EVERY_S = 10.0
_HEX = frozenset("0123456789abcdef")


def check_endpoint(ep: object) -> str:
    """A "host:port" from outside, checked at the project's one address door."""
    return address.check_endpoint(ep)


def _load(frame: bytes) -> object:
    """JSON from outside, or None: a parser error, a nesting too deep for it, or text
    that is not UTF-8 are all just a bad frame."""
    if len(frame) > MAX_FRAME:
        return None
    try:
        return json.loads(frame)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def _text_ok(v: object, max_bytes: int) -> bool:
    if not isinstance(v, str):
        return False
    try:
        n = len(v.encode())
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON)
        return False
    return 0 < n <= max_bytes


def _ids(v: object) -> list[str] | None:
    if not isinstance(v, list) or len(v) > MAX_REQS:
        return None
    if not all(_text_ok(r, MAX_ID_BYTES) for r in v):
        return None
    return v


def _token(v: object) -> str | None:
    if isinstance(v, str) and len(v) == TOKEN_HEX and _HEX.issuperset(v):
        return v
    return None


def decode_ask(frame: bytes) -> tuple[int, int, str, str, list[str]] | None:
    """``(nonce, incarnation, from, token, request ids)`` of a well-formed ask, else None."""
    m = _load(frame)
    if not isinstance(m, dict) or m.get("v") != VERSION:
        return None
    n, inc, frm, reqs = m.get("n"), m.get("inc"), m.get("from"), _ids(m.get("reqs"))
    tok = _token(m.get("tok"))
    if not isinstance(n, int) or not isinstance(inc, int) or reqs is None or tok is None:
        return None
    try:
        frm = check_endpoint(frm)
    except InvalidConfig:
        return None
    return n, inc, frm, tok, reqs


def decode_reply(frame: bytes, nonce: int) -> list[str] | None:
    m = _load(frame)
    if not isinstance(m, dict) or m.get("v") != VERSION or m.get("n") != nonce:
        return None
    return _ids(m.get("ok"))


class FenceServer:
    """The consumer worker's side: answers asks with ``grant(from, reqs)`` when ``inc``
    is ours and ``tok`` is the one this process gave ``from``.  One thread, one selector
    over a listening TCP socket and its connections; nothing a peer does ends the
    thread."""

    def __init__(self, host: str, incarnation: int,
                 grant: Callable[[str, list[str]], list[str]]) -> None:
        self.incarnation = incarnation
        self._grant = grant
        self._key = os.urandom(32)  # never leaves this process
        self.bad_frames = 0
        self.refused_tokens = 0
        self.asks = 0
        self._log = RateLimitedLog(log, _LOG_EVERY_S)
        self._wire = fencewire.FrameServer(host, self._answer_safely, self._bad,
                                           MAX_CONNECTIONS)
        self.endpoint = self._wire.endpoint  # "host:port" or "[v6]:port", as bound
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._wire.serve, args=(self._stop,),
                                        name="shmhb-fence", daemon=True)
        self._thread.start()

    def token_for(self, producer: str) -> str:
        """The capability this consumer gives the producer at ``producer`` (its side
        channel, as the producer names itself in ``from``) with each request."""
        return hmac.new(self._key, producer.encode(), hashlib.blake2b).hexdigest()[:TOKEN_HEX]

    def answer(self, frame: bytes) -> bytes | None:
        """The reply to one ask, or None for a bad frame (counted)."""
        ask = decode_ask(frame)
        if ask is None:
            self._bad("malformed ask")
            return None
        n, inc, frm, tok, reqs = ask
        self.asks += 1
        ok: list[str] = []
        if inc == self.incarnation:
            if hmac.compare_digest(tok, self.token_for(frm)):
                ok = self._grant(frm, reqs)
            else:
                self.refused_tokens += 1
                self._log.warn("token", "fence server %s: refused an ask claiming to be "
                                  "%s with a token this consumer never gave it (%d so far)",
                                  self.endpoint, frm, self.refused_tokens)
        return json.dumps({"v": VERSION, "n": n, "ok": ok}).encode()

    def _answer_safely(self, frame: bytes) -> bytes | None:
        try:
            return self.answer(frame)
        except Exception as e:  # noqa: BLE001 - no frame may end the go-ahead's thread
            self.bad_frames += 1
            self._log.warn("crash", "fence server %s: an ask raised %r; dropped "
                           "(%d bad so far)", self.endpoint, e, self.bad_frames)
            return None

    def _bad(self, why: str) -> None:
        self.bad_frames += 1
        self._log.warn("bad", "fence server %s: dropped a bad frame (%s; %d so far)",
                          self.endpoint, why, self.bad_frames)

    def close(self) -> None:
        """The thread stops within one select (0.1 s) and closes every socket on its way
        out (a grant still running when the wait ends: once it returns)."""
        self._stop.set()
        self._thread.join(2.0)


class _Channel:
    """One connection to one consumer's fence server, used by one ask at a time."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None  # connected by the first ask
        self.buf = bytearray()  # what has been read of the next reply
        self.lock = asyncio.Lock()
        self.waiting = 0  # asks waiting for the lock
        self.evicted = False  # dropped from the table while an ask held it: that ask closes it

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


class GrantAsker:
    """The producer's side: which requests a consumer still wants, asked just before
    writing.  One connection per consumer is kept (a new TCP connection per ask costs
    a handshake), on the event loop that asks; asks to one consumer take turns.  A
    channel whose ask timed out, failed or was cancelled is closed and made anew by the
    next ask, so no late reply is ever read as the next ask's (the nonce check stands
    behind that too)."""

    def __init__(self) -> None:
        self._channels: OrderedDict[tuple[int, str], _Channel] = OrderedDict()
        self._log = RateLimitedLog(log, _LOG_EVERY_S)

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    def _channel(self, endpoint: str) -> _Channel:
        key = (id(asyncio.get_running_loop()), endpoint)  # a socket serves one loop
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = _Channel()
            while len(self._channels) > MAX_CHANNELS:
                _, old = self._channels.popitem(last=False)
                old.evicted = True
                if not old.lock.locked():
                    old.close()  # else the ask holding it closes it on the way out
        self._channels.move_to_end(key)
        return ch

    def _drop(self, endpoint: str, ch: _Channel) -> None:
        key = (id(asyncio.get_running_loop()), endpoint)
        if self._channels.get(key) is ch:
            del self._channels[key]
        ch.evicted = True  # closed once its lock is released (waiters see it closed)

    async def _take(self, endpoint: str, deadline: float) -> _Channel | None:
        """The channel to ``endpoint``, its lock held; None if the deadline passed first."""
        loop = asyncio.get_running_loop()
        while True:
            ch = self._channel(endpoint)
            if ch.waiting or ch.lock.locked():
                ch.waiting += 1
                try:
                    await asyncio.wait_for(ch.lock.acquire(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    return None
                finally:
                    ch.waiting -= 1
            else:  # no ask holds it or waits for it: taken at once, without the turn of
                await ch.lock.acquire()  # the loop that wait_for's task costs
            if not ch.evicted:
                return ch
            ch.lock.release()  # dropped while this ask waited: take the new one

    async def ask(self, endpoint: str, incarnation: int, token: str | None, producer: str,
                  req_ids: list[str], timeout_s: float) -> list[str]:
        """The subset of ``req_ids`` the consumer at ``endpoint`` grants.  Any failure
        (unreachable, timeout, bad reply, no token) is "none": a write the consumer did
        not confirm is a write into blocks it may have given up."""
        if token is None:
            return []  # the consumer gave no capability: it cannot grant
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        ch = await self._take(endpoint, deadline)
        if ch is None:
            return self._gave_up(endpoint, timeout_s, req_ids)
        nonce = int.from_bytes(os.urandom(6), "little")
        body = json.dumps({"v": VERSION, "n": nonce, "inc": incarnation, "from": producer,
                           "tok": token, "reqs": req_ids}).encode()
        ok: list[str] | None = None
        try:
            ok = await self._exchange(ch, endpoint, body, nonce, deadline)
        except asyncio.TimeoutError:
            pass  # connecting or sending took the whole wait
        except (OSError, ValueError) as e:  # ValueError: a bad frame length, a bad endpoint
            self._log.warn("wire", "asking consumer %s for a go-ahead failed: %r", endpoint, e)
            return []
        finally:
            if ok is None:  # timed out, failed or cancelled: no later ask reads this one's reply
                self._drop(endpoint, ch)
            ch.lock.release()
            if ch.evicted:
                ch.close()
        if ok is None:
            return self._gave_up(endpoint, timeout_s, req_ids)
        asked = set(req_ids)
        return [r for r in ok if r in asked]

    async def _exchange(self, ch: _Channel, endpoint: str, body: bytes, nonce: int,
                        deadline: float) -> list[str] | None:
        """The ask sent on ``ch`` (connected first if it is new) and its grant read; None
        if none came by the deadline and the one last look."""
        loop = asyncio.get_running_loop()
        if ch.sock is not None and not fencewire.still_open(ch.sock, ch.buf):
            ch.close()  # the consumer closed it while it sat idle: nothing was asked on it
            ch.sock, ch.buf = None, bytearray()
        if ch.sock is None:
            ch.sock = await asyncio.wait_for(fencewire.connect(endpoint),
                                             max(0.0, deadline - loop.time()))
        await fencewire.send_frame(ch.sock, body, deadline - loop.time())
        looked = False
        while True:
            frame = fencewire.next_frame(ch.buf)
            if frame is not None:
                ok = decode_reply(frame, nonce)
                if ok is not None:
                    return ok
                continue  # another ask's reply (or a bad one): skipped
            # A grant is the consumer's promise to hold the load (it never gives up a
            # GRANTED one), so a reply is honoured however late this process reads it:
            # the deadline only bounds the wait for a consumer that does not answer.  A
            # producer stopped (SIGSTOP, a long GC) between its ask and the read finds
            # its deadline passed on resume, with the reply in the kernel's buffer and
            # not yet read: without one last look it would fail a load its consumer
            # granted and is waiting for.
            if loop.time() >= deadline:
                if looked:
                    return None
                looked, deadline = True, loop.time() + LAST_LOOK_S
            await fencewire.recv_into(ch.sock, ch.buf, deadline - loop.time())

    def _gave_up(self, endpoint: str, timeout_s: float, req_ids: list[str]) -> list[str]:
        self._log.warn("timeout", "no go-ahead from consumer %s within %.1f s: not "
                          "writing %d request(s)", endpoint, timeout_s, len(req_ids))
        return []

    def close(self) -> None:
        """From any thread, once no ask runs: every channel goes."""
        channels = list(self._channels.values())
        self._channels.clear()
        for ch in channels:
            ch.close()


def parse_extra(v: Any) -> tuple[int, str, str | None] | None:
    """The consumer's incarnation, fence endpoint and the token it gave this producer,
    as its request carried them (no token: a consumer of the first fence version)."""
    if not isinstance(v, dict):
        return None
    inc, fence = v.get("inc"), v.get("fence")
    if not isinstance(inc, int) or inc <= 0:
        return None
    try:
        return inc, check_endpoint(fence), _token(v.get("tok"))
    except InvalidConfig:
        return None
