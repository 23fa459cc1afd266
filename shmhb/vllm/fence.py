"""The go-ahead a producer asks of its consumer before it writes into the consumer's
blocks, over a small ZMQ side channel of the consumer worker.

Wire (JSON, one frame each way, at most ``MAX_FRAME`` bytes):
  ask:   {"v": 2, "n": nonce, "inc": consumer incarnation, "from": "host:port",
          "tok": capability, "reqs": [id]}
  reply: {"v": 2, "n": nonce, "ok": [id]}
``from`` is the producer's side channel (the endpoint the consumer sent its request to);
``inc`` is the incarnation the consumer put into that request: a consumer that restarted
since (a new incarnation at the same address) grants nothing.

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
dropped and counted, and no frame can end the server's thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ..board import address
from ..errors import InvalidConfig
from ..ratelog import RateLimitedLog

log = logging.getLogger(__name__)

VERSION = 2
MAX_FRAME = 64 * 1024
MAX_REQS = 1024
MAX_ID_BYTES = 256
TOKEN_HEX = 32  # a 128-bit token, as hex
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
    is ours and ``tok`` is the one this process gave ``from``.  One thread, one ROUTER
    socket; no frame ends the thread."""

    def __init__(self, host: str, incarnation: int,
                 grant: Callable[[str, list[str]], list[str]]) -> None:
        self.incarnation = incarnation
        self._grant = grant
        self._key = os.urandom(32)  # never leaves this process
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self.bad_frames = 0
        self.refused_tokens = 0
        self.asks = 0
        self._log = RateLimitedLog(log, _LOG_EVERY_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmhb-fence", daemon=True)
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

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2:
                    self._bad("frame count")
                    continue
                try:
                    reply = self.answer(frames[1])
                except Exception as e:  # noqa: BLE001 - no frame may end the go-ahead's thread
                    self.bad_frames += 1
                    self._log.warn("crash", "fence server %s: an ask raised %r; dropped "
                                   "(%d bad so far)", self.endpoint, e, self.bad_frames)
                    continue
                if reply is not None:
                    self._sock.send_multipart([frames[0], reply])
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(0)

    def _bad(self, why: str) -> None:
        self.bad_frames += 1
        self._log.warn("bad", "fence server %s: dropped a bad frame (%s; %d so far)",
                          self.endpoint, why, self.bad_frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._ctx.term()


class _Channel:
    """One DEALER to one consumer's fence server, used by one ask at a time."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self.sock.connect(f"tcp://{endpoint}")
        self.lock = asyncio.Lock()
        self.evicted = False  # dropped from the table while an ask held it: that ask closes it


class GrantAsker:
    """The producer's side: which requests a consumer still wants, asked just before
    writing.  One connection per consumer is kept (a new TCP connection and ZMTP
    handshake per ask cost most of an ask's time), on the event loop that asks; asks to
    one consumer take turns.  A channel whose ask timed out or failed is closed and
    made anew by the next ask, so no late reply is ever read as the next ask's (the
    nonce check stands behind that too)."""

    def __init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._channels: OrderedDict[tuple[int, str], _Channel] = OrderedDict()
        self._log = RateLimitedLog(log, _LOG_EVERY_S)

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    def _channel(self, endpoint: str) -> _Channel:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        key = (id(asyncio.get_running_loop()), endpoint)  # a socket serves one loop
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = _Channel(self._ctx, endpoint)
            while len(self._channels) > MAX_CHANNELS:
                _, old = self._channels.popitem(last=False)
                old.evicted = True
                if not old.lock.locked():
                    old.sock.close(0)  # else the ask holding it closes it on the way out
        self._channels.move_to_end(key)
        return ch

    def _drop(self, endpoint: str, ch: _Channel) -> None:
        key = (id(asyncio.get_running_loop()), endpoint)
        if self._channels.get(key) is ch:
            del self._channels[key]
        ch.evicted = True  # closed once its lock is released (waiters see it closed)

    async def ask(self, endpoint: str, incarnation: int, token: str | None, producer: str,
                  req_ids: list[str], timeout_s: float) -> list[str]:
        """The subset of ``req_ids`` the consumer at ``endpoint`` grants.  Any failure
        (unreachable, timeout, bad reply, no token) is "none": a write the consumer did
        not confirm is a write into blocks it may have given up."""
        if token is None:
            return []  # the consumer gave no capability: it cannot grant
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            ch = self._channel(endpoint)
            try:
                await asyncio.wait_for(ch.lock.acquire(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return self._gave_up(endpoint, timeout_s, req_ids)
            if not ch.evicted:
                break
            ch.lock.release()  # dropped while this ask waited: take the new one
        try:
            nonce = int.from_bytes(os.urandom(6), "little")
            await ch.sock.send(json.dumps({"v": VERSION, "n": nonce, "inc": incarnation,
                                           "from": producer, "tok": token,
                                           "reqs": req_ids}).encode())
            looked = False
            while True:
                # A grant is the consumer's promise to hold the load (it never gives up a
                # GRANTED one), so a reply is honoured however late this process reads
                # it: the deadline only bounds the wait for a consumer that does not
                # answer.  A producer stopped (SIGSTOP, a long GC) between its ask and
                # the read finds its deadline passed on resume, with the reply in the
                # kernel's buffer and zmq's I/O thread not yet run: without one last look
                # it would fail a load its consumer granted and is waiting for.
                left = deadline - loop.time()
                if left <= 0 and not looked:
                    looked, left = True, LAST_LOOK_S
                if left <= 0 or not await ch.sock.poll(int(left * 1000) + 1):
                    if not looked:
                        continue  # the deadline: the last look
                    self._drop(endpoint, ch)
                    return self._gave_up(endpoint, timeout_s, req_ids)
                ok = decode_reply(await ch.sock.recv(), nonce)
                if ok is not None:
                    asked = set(req_ids)
                    return [r for r in ok if r in asked]
        except zmq.ZMQError as e:
            self._drop(endpoint, ch)
            self._log.warn("zmq", "asking consumer %s for a go-ahead failed: %s", endpoint, e)
            return []
        finally:
            ch.lock.release()
            if ch.evicted and not ch.sock.closed:
                ch.sock.close(0)

    def _gave_up(self, endpoint: str, timeout_s: float, req_ids: list[str]) -> list[str]:
        self._log.warn("timeout", "no go-ahead from consumer %s within %.1f s: not "
                          "writing %d request(s)", endpoint, timeout_s, len(req_ids))
        return []

    def close(self) -> None:
        """From any thread, once no ask runs: every channel goes (linger 0)."""
        self._channels.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)


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
