"""The consumer's grants: each load's state, and the server that answers a producer's
ask, in C (``shmhb._fence``) or in Python, on one wire (version 1, below).

Why C.  A grant is a few microseconds of work, but a Python thread that answers it
first waits for its engine's GIL: up to a switch interval (5 ms) each time the engine's
main thread runs Python, which on the CPU bench made the go-ahead cost several times its
round trip (docs/VLLM.md, "Cost").  ``shmhb._fence`` answers in a thread of its own that
never takes the GIL, over a table of the loads' states guarded by one pthread mutex.
The pure-Python driver (no compiler at install, or ``SHMHB_PURE_PYTHON=1``) gives the
same answers on the same wire, from a Python thread (``fencewire.FrameServer``).

**The wire, version 1** (each frame a 4-byte big-endian length, then its body;
``fencewire``):

  ask:   version 1 (1 byte), kind 1 (1), count (2, 1 to ``MAX_REQS``), nonce (8),
         consumer incarnation (8), token (16), then ``count`` request ids, each a
         2-byte length (1 to ``MAX_ID_BYTES``) and its bytes
  reply: version 1, kind 2, count (as asked), nonce (as asked), lease (4, in ms), then
         ``count`` bytes: byte ``i`` is 1 when id ``i`` is granted, else 0

All integers are big-endian and unsigned.  An ask is checked whole (sizes, kinds,
lengths, nothing left over) before any load is looked at; anything else is a bad frame,
and its connection is closed.  An ask that names another incarnation is answered with
nothing granted.  The token is the capability of ``fence.py`` (what binds a grant to
the producer the request was sent to); the table is keyed by it and the request id, so
an ask with a token this consumer never gave finds no load and is granted nothing.

**The lease: a grant is a promise for a bounded time.**  A GRANTED load's write may be
under way, so the consumer never gives one up early (``loads``).  But its inner
connector still gives the load up at its own timeout (Mooncake: the request socket's
receive timeout), and vLLM then reuses the blocks; a producer stopped past that inside
its read-to-write window would resume holding "granted" and write into reused blocks.
So each grant carries a lease ``L`` (the reply's lease field, the consumer's
``grant_lease_s``), and:

* the producer writes a granted load only if, right before the write, less than
  ``L * (1 - 2 * CLOCK_RATE_SLACK)`` has passed on its own monotonic clock since it
  *sent* the ask (``fence.Ask.until_ns``; ``mooncake_adapter`` checks it in the thread
  that writes, at the write);
* the consumer reports a GRANTED load failed (which hands its blocks back to vLLM)
  only once ``L`` has passed on its own monotonic clock since it *read* the ask
  (``States.end`` gives that moment; ``mooncake_pulls.Ledger`` holds the report until
  then), unless the producer itself answered for the load (a producer answers after
  its write call returned: no byte of it lands later).

Why no write lands in reused blocks: the ask is read after it was sent, so the
producer's count starts no later than the consumer's.  No clock is compared across
hosts, only durations, and two monotonic clocks' rates differ by at most
``CLOCK_RATE_SLACK`` (1000 ppm: ten times what crystal oscillators drift, twice the
most an NTP slew applies), so the producer's shortened lease ends, in real time, before
the consumer's.  A write that starts before the producer's lease ends therefore starts
before the consumer may reuse the blocks.  What this does not bound is a write already
started: a producer stopped in the middle of its copy for longer than both the lease
and the inner's own timeout can still land the rest late (the copy takes milliseconds;
docs/VLLM.md, "Known limits").  A late reply, an expired lease, a lost reply: each
reads as "not granted", and the producer tells the consumer so, which recomputes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from ..board.native import PURE_ENV
from ..errors import InvalidConfig
from ..periodic import block_host_signals
from . import fencewire

log = logging.getLogger(__name__)

VERSION = 1
KIND_ASK, KIND_REPLY = 1, 2
MAX_REQS = 1024
MAX_ID_BYTES = 256
TOKEN_BYTES = 16
WAITING, GRANTED, ABANDONED = 0, 1, 2
#: what a grant promises by default: the consumer holds a granted load's blocks this
#: long at least (the lease; connector setting ``grant_lease_s``)
LEASE_MS = 30_000
#: how far two hosts' monotonic clocks may run apart in rate (see the module docstring)
CLOCK_RATE_SLACK = 0.001
_ASK = struct.Struct(">BBHQQ16s")
_REPLY = struct.Struct(">BBHQI")
_LEN = struct.Struct(">H")


def check_lease(lease_s: float, grant_timeout_s: float, names: tuple[str, str]) -> None:
    """``InvalidConfig`` unless a lease of ``lease_s`` leaves time to write after an
    answer read at the end of a producer's wait of ``grant_timeout_s`` (over twice it).
    ``names``: how the caller's settings call the two (lease first)."""
    if lease_s <= 2 * grant_timeout_s:
        raise InvalidConfig(f"{names[0]} ({lease_s}) must be over twice {names[1]} "
                            f"({grant_timeout_s}): an answer read at the end of the wait "
                            "must leave time to write")


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") == "1":
        return None
    try:
        from .. import _fence  # type: ignore[attr-defined]
    except ImportError:  # built without a compiler: the Python driver
        return None
    return _fence  # type: ignore[no-any-return]


_ext = _load()
#: whether grants are answered in C in this process
native: bool = _ext is not None


# -- the wire -----------------------------------------------------------------------------------


def wire_id(req_id: str) -> bytes:
    """A request id as the wire carries it: its UTF-8 (lone surrogates kept), or, where
    that is empty or over ``MAX_ID_BYTES``, ``#`` and a 32-hex digest of it (both sides
    map ids the same way, so such a load can still be granted)."""
    b = req_id.encode("utf-8", "surrogatepass")
    if 0 < len(b) <= MAX_ID_BYTES:
        return b
    return b"#" + hashlib.blake2b(b, digest_size=16).hexdigest().encode()


def encode_ask(nonce: int, incarnation: int, token: bytes, ids: list[bytes]) -> bytes:
    if not 0 < len(ids) <= MAX_REQS or len(token) != TOKEN_BYTES:
        raise ValueError(f"an ask carries 1 to {MAX_REQS} ids and a {TOKEN_BYTES}-byte token")
    parts = [_ASK.pack(VERSION, KIND_ASK, len(ids), nonce, incarnation, token)]
    for i in ids:
        parts += (_LEN.pack(len(i)), i)
    return b"".join(parts)


def decode_ask(body: bytes) -> tuple[int, int, bytes, list[bytes]] | None:
    """``(nonce, incarnation, token, ids)`` of a well-formed ask, else None: the rule
    ``_fence.c``'s ``answer`` applies, byte for byte."""
    if not _ASK.size <= len(body) <= fencewire.MAX_FRAME:
        return None
    version, kind, count, nonce, inc, token = _ASK.unpack_from(body)
    if version != VERSION or kind != KIND_ASK or not 0 < count <= MAX_REQS:
        return None
    ids, p = [], _ASK.size
    for _ in range(count):
        if p + 2 > len(body):
            return None
        (n,) = _LEN.unpack_from(body, p)
        if not 0 < n <= MAX_ID_BYTES or p + 2 + n > len(body):
            return None
        ids.append(body[p + 2:p + 2 + n])
        p += 2 + n
    return (nonce, inc, token, ids) if p == len(body) else None


def encode_reply(nonce: int, granted: list[bool], lease_ms: int) -> bytes:
    return _REPLY.pack(VERSION, KIND_REPLY, len(granted), nonce, lease_ms) + \
        bytes(map(int, granted))


@dataclass(frozen=True)
class Reply:
    """A reply read: which ids were granted, and for how long (ms, counted by the
    producer from when it sent the ask)."""

    granted: list[bool]
    lease_ms: int

    def until_ns(self, sent_ns: int) -> int:
        """When, on the producer's monotonic clock, its lease ends for an ask sent at
        ``sent_ns``: shortened by twice the clock-rate slack (module docstring)."""
        lease_ns = self.lease_ms * 1_000_000
        return sent_ns + lease_ns - int(lease_ns * 2 * CLOCK_RATE_SLACK)


def reply_nonce(body: bytes) -> int | None:
    """The nonce of what looks like a reply (it is checked whole by ``decode_reply``)."""
    if len(body) < _REPLY.size or body[0] != VERSION or body[1] != KIND_REPLY:
        return None
    return int(_REPLY.unpack_from(body)[3])


def decode_reply(body: bytes, nonce: int, count: int) -> Reply | None:
    """Which of the ``count`` ids asked under ``nonce`` were granted, and the lease;
    None if ``body`` is not exactly that reply."""
    if len(body) != _REPLY.size + count:
        return None
    version, kind, n, got, lease_ms = _REPLY.unpack_from(body)
    if version != VERSION or kind != KIND_REPLY or n != count or got != nonce:
        return None
    flags = body[_REPLY.size:]
    if not frozenset(flags) <= {0, 1}:
        return None
    return Reply([f == 1 for f in flags], lease_ms)


# -- the states -------------------------------------------------------------------------------


class States(Protocol):
    """Each load's state, keyed by ``token + wire id``; every move is out of WAITING.
    ``grant`` is the consumer's own go-ahead (a pull: no lease); ``answer`` grants a
    producer's ask, each grant under the lease.  ``end`` removes a load and returns its
    state (-1: absent) and when its lease ends (``time.monotonic_ns``; 0: none): the
    C extension's pair, named by ``loads.LoadTable``."""

    def start(self, key: bytes) -> None: ...
    def grant(self, key: bytes) -> bool: ...
    def abandon(self, key: bytes) -> bool: ...
    def state(self, key: bytes) -> int: ...
    def end(self, key: bytes) -> tuple[int, int]: ...
    def answer(self, incarnation: int, body: bytes) -> bytes | None: ...
    def __len__(self) -> int: ...


class PyStates:
    """The Python driver of ``States``: a dict (key -> state) under one lock, and the
    lease ends of the loads granted over the wire."""

    def __init__(self, lease_ms: int = LEASE_MS) -> None:
        if not 0 < lease_ms < 1 << 32:
            raise ValueError("a lease is 1 to 2**32 - 1 ms")
        self.lease_ms = lease_ms
        self._lock = threading.Lock()
        self._s: dict[bytes, int] = {}
        self._until: dict[bytes, int] = {}

    def start(self, key: bytes) -> None:
        with self._lock:
            self._s[key] = WAITING
            self._until.pop(key, None)

    def _move(self, key: bytes, to: int) -> bool:
        with self._lock:
            if self._s.get(key) != WAITING:
                return False
            self._s[key] = to
            return True

    def grant(self, key: bytes) -> bool:
        return self._move(key, GRANTED)

    def abandon(self, key: bytes) -> bool:
        return self._move(key, ABANDONED)

    def state(self, key: bytes) -> int:
        with self._lock:
            return self._s.get(key, -1)

    def end(self, key: bytes) -> tuple[int, int]:
        with self._lock:
            return self._s.pop(key, -1), self._until.pop(key, 0)

    def answer(self, incarnation: int, body: bytes) -> bytes | None:
        ask = decode_ask(body)
        if ask is None:
            return None
        nonce, inc, token, ids = ask
        if inc != incarnation:
            return encode_reply(nonce, [False] * len(ids), self.lease_ms)
        until = time.monotonic_ns() + self.lease_ms * 1_000_000  # from the ask's read
        with self._lock:
            granted = []
            for i in ids:
                ok = self._s.get(token + i) == WAITING
                if ok:
                    self._s[token + i] = GRANTED
                    self._until[token + i] = until
                granted.append(ok)
        return encode_reply(nonce, granted, self.lease_ms)

    def __len__(self) -> int:
        with self._lock:
            return len(self._s)


def new_states(use_native: bool | None = None, lease_ms: int = LEASE_MS) -> States:
    """The C table where it is built (and ``use_native`` is not False), else Python's;
    grants over the wire are promised for ``lease_ms``."""
    if _ext is not None and use_native is not False:
        return _ext.GrantTable(os.urandom(16), lease_ms)  # type: ignore[no-any-return]
    return PyStates(lease_ms)


# -- the server ---------------------------------------------------------------------------------


class Server(Protocol):
    def set_incarnation(self, incarnation: int) -> None: ...
    def counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class PyServer:
    """The Python driver of the grant server: ``fencewire.FrameServer`` on a thread."""

    def __init__(self, states: States, sock: socket.socket, incarnation: int,
                 max_connections: int) -> None:
        self._states, self._inc = states, incarnation
        self._c = dict.fromkeys(("asks", "bad_frames", "stale_asks", "granted"), 0)
        self._wire = fencewire.FrameServer(sock, self._answer, self._bad, max_connections)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shmhb-fence", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        block_host_signals()  # as the C server's thread: the host's signals reach its main thread
        self._wire.serve(self._stop)

    def _answer(self, body: bytes) -> bytes | None:
        inc = self._inc
        reply = self._states.answer(inc, body)
        if reply is None:  # counted by _bad; its connection is closed, as in C
            raise fencewire.BadFrame("a malformed ask")
        self._c["asks"] += 1
        if _ASK.unpack_from(body)[4] != inc:  # a reply: the ask was well-formed
            self._c["stale_asks"] += 1
        self._c["granted"] += sum(reply[_REPLY.size:])
        return reply

    def _bad(self, why: str) -> None:
        self._c["bad_frames"] += 1

    def set_incarnation(self, incarnation: int) -> None:
        self._inc = incarnation  # one store: atomic

    def counters(self) -> dict[str, int]:
        return {**self._c, "dropped": self._wire.dropped}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def serve(states: States, sock: socket.socket, incarnation: int, max_connections: int) -> Server:
    """A grant server on the listening ``sock`` (which it owns from now on): in C when
    ``states`` is the C table, else on a Python thread."""
    if _ext is not None and isinstance(states, _ext.GrantTable):
        try:
            srv: Server = _ext.GrantServer(states, sock.fileno(), incarnation, max_connections)
        finally:
            sock.close()  # the server holds a descriptor of its own
        return srv
    return PyServer(states, sock, incarnation, max_connections)


class Io(Protocol):
    """The producer's socket calls (``sender``)."""

    def send(self, sock: socket.socket, data: bytes) -> int: ...
    def recv(self, sock: socket.socket, n: int) -> bytes | None: ...
    def hold(self, sock: socket.socket, ms: int) -> bool: ...


#: the producer's non-blocking send and receive: in C they keep the GIL (a Python
#: socket call drops it, and getting it back can wait a switch interval)
def _py_send(fd_sock: socket.socket, data: bytes) -> int:
    try:
        return fd_sock.send(data, getattr(socket, "MSG_NOSIGNAL", 0))
    except (BlockingIOError, InterruptedError):
        return 0


def _py_recv(fd_sock: socket.socket, n: int) -> bytes | None:
    try:
        return fd_sock.recv(n)
    except (BlockingIOError, InterruptedError):
        return None


class _PyIo:
    send = staticmethod(_py_send)
    recv = staticmethod(_py_recv)

    @staticmethod
    def hold(sock: socket.socket, ms: int) -> bool:
        return False  # a wait in Python drops the GIL: the caller awaits instead


class _CIo:
    def __init__(self, ext: ModuleType) -> None:
        self._s, self._r, self._w = ext.send_nowait, ext.recv_nowait, ext.wait_readable

    def send(self, sock: socket.socket, data: bytes) -> int:
        return int(self._s(sock.fileno(), data))

    def recv(self, sock: socket.socket, n: int) -> bytes | None:
        return self._r(sock.fileno(), n)  # type: ignore[no-any-return]

    def hold(self, sock: socket.socket, ms: int) -> bool:
        return bool(self._w(sock.fileno(), ms))


def sender(use_native: bool | None = None) -> Io:
    """The producer's calls on a non-blocking socket: ``send`` (bytes sent, 0: its
    buffer is full), ``recv`` (bytes read; ``b""``: closed; None: nothing yet), other
    failures raising ``OSError``; and ``hold(sock, ms)``: wait up to ``ms`` for it to be
    readable without dropping the GIL (False at once where that cannot be done)."""
    if _ext is not None and use_native is not False:
        return _CIo(_ext)
    return _PyIo()


class Tokens:
    """The capabilities a consumer gives its producers: a keyed BLAKE2b digest of each
    producer's side-channel endpoint (``TOKEN_BYTES``), under a key this process draws
    at start and never sends.  Loads are keyed by it, so only a process that received
    a request carrying its token can ask for that producer's loads."""

    def __init__(self) -> None:
        self._key = os.urandom(32)

    def of(self, producer: str) -> bytes:
        return hashlib.blake2b(producer.encode("utf-8", "surrogatepass"), key=self._key,
                               digest_size=TOKEN_BYTES).digest()
