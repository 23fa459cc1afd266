"""The go-ahead's transport (``shmhb.kv.fence``): length-prefixed frames over plain TCP.

A frame is a 4-byte big-endian unsigned length, then that many bytes (1 to
``MAX_FRAME``).  Any other length is a bad frame, and the connection that sent it is
closed: nothing after it can be told apart from garbage.  What a frame says is the
fence's business; this module knows bytes and sockets only.

The consumer's side (:class:`FrameServer`) is one thread with one selector over a
listening socket and the connections it accepted, all non-blocking.  A peer gets
nothing but its own connection closed for anything it sends or does (a bad length, a
reset, a half-close, a partial frame held open), each connection's buffer is bounded by
one frame, and past ``max_connections`` the least recently active connection goes, so
idle or slow peers cannot crowd a producer out (counted: ``FrameServer.dropped``).  Out
of descriptors, the oldest connection goes too; with none to close, accepting rests
``PAUSE_S`` (the listener stays readable, and accepting at once again would spin).  A
reply that does not go out whole at once closes its connection: replies are small, and
a peer that does not read is not served.

The producer's side is :func:`connect`; it reads and writes its connection without
awaiting (``fence.GrantAsker``), a frame at a time through :func:`pack` and
:func:`next_frame`.
"""

from __future__ import annotations

import asyncio
import errno
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..board import address

MAX_FRAME = 64 * 1024
#: how long the server's thread waits in one select: what bounds ``close()``
SELECT_S = 0.1
#: how long accept() rests when no descriptor is left and no connection can make room
#: (the listener stays readable: accepting again at once would spin)
PAUSE_S = 0.1
_HEADER = struct.Struct(">I")
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
#: accept() failures that a free descriptor cures: the oldest connection makes room
_OUT_OF_ROOM = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class BadFrame(ValueError):
    """A frame length of 0 or over ``MAX_FRAME``, or a frame its reader refused: the
    stream cannot be read further."""


def pack(body: bytes) -> bytes:
    if not 0 < len(body) <= MAX_FRAME:
        raise BadFrame(f"a frame of {len(body)} bytes")
    return _HEADER.pack(len(body)) + body


def next_frame(buf: bytearray) -> bytes | None:
    """Takes the first whole frame off ``buf``; None while it is not all there."""
    if len(buf) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack_from(buf)
    if not 0 < n <= MAX_FRAME:
        raise BadFrame(f"a frame length of {n}")
    end = _HEADER.size + n
    if len(buf) < end:
        return None
    frame = bytes(buf[_HEADER.size:end])
    del buf[:end]
    return frame


def room(buf: bytearray) -> int:
    """What one read may add: a buffer holds at most one frame and its length.  (Never
    0: a buffer with no whole frame left in it is shorter than that.)"""
    return _HEADER.size + MAX_FRAME - len(buf)


def listen(host: str) -> tuple[socket.socket, str]:
    """A non-blocking listening socket on a port of ``host`` the kernel picks, and its
    endpoint as it is bound (an address, "a.b.c.d:port" or "[v6]:port")."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, 0, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        bound = sock.getsockname()
        return sock, address.check_endpoint(address.format_address(bound[0], bound[1]))
    except BaseException:
        sock.close()
        raise


class FrameServer:
    """Frames in, replies out, on the thread that runs :meth:`serve`, over the listening
    socket ``listener`` (from :func:`listen`; closed by ``serve`` on its way out):
    ``handle(frame)`` gives the reply to send back (None: none), or raises ``BadFrame``;
    ``bad(why)`` hears of a bad frame (a bad length, or what ``handle`` refused), whose
    connection is then closed."""

    def __init__(self, listener: socket.socket, handle: Callable[[bytes], bytes | None],
                 bad: Callable[[str], None], max_connections: int) -> None:
        self._listener = listener
        self._handle, self._bad, self._max = handle, bad, max_connections
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        #: open connections and their read buffers, the least recently active first
        self._conns: OrderedDict[socket.socket, bytearray] = OrderedDict()
        self._paused_until: float | None = None  # accept() rests until then
        #: connections closed to make room (past ``max_connections``, or out of
        #: descriptors); written by the serving thread only
        self.dropped = 0

    def serve(self, stop: threading.Event) -> None:
        """Until ``stop`` is set (seen within ``SELECT_S``); then every socket is closed."""
        try:
            while not stop.is_set():
                if self._paused_until is not None and time.monotonic() >= self._paused_until:
                    self._paused_until = None
                    self._sel.register(self._listener, selectors.EVENT_READ, None)
                for key, _ in self._sel.select(SELECT_S):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
        finally:
            for sock in list(self._conns):
                self._drop(sock)
            self._sel.close()
            self._listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # aborted before it was taken, or no descriptor left
            if e.errno in _OUT_OF_ROOM:
                if self._conns:
                    self._drop_oldest()
                else:  # nothing to close: rest, as the C server does
                    self._sel.unregister(self._listener)
                    self._paused_until = time.monotonic() + PAUSE_S
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sel.register(sock, selectors.EVENT_READ, sock)
        except (OSError, ValueError):
            sock.close()
            return
        self._conns[sock] = bytearray()
        while len(self._conns) > self._max:
            self._drop_oldest()  # a peer holding idle connections cannot crowd others out

    def _read(self, sock: socket.socket) -> None:
        buf = self._conns.get(sock)
        if buf is None:
            return  # closed earlier in this round
        try:
            data = sock.recv(room(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # a reset, or whatever else the peer did: its connection goes
            self._drop(sock)
            return
        if not data:  # the peer closed its side: what it sent before was answered
            self._drop(sock)
            return
        self._conns.move_to_end(sock)
        buf += data
        try:
            while (frame := next_frame(buf)) is not None:
                reply = self._handle(frame)
                if reply is not None and not self._send(sock, pack(reply)):
                    return
        except BadFrame as e:
            self._bad(str(e))
            self._drop(sock)

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sent = sock.send(data, _NOSIGNAL)
        except OSError:  # BlockingIOError included: a peer that does not read
            sent = 0
        if sent == len(data):
            return True
        self._drop(sock)
        return False

    def _drop_oldest(self) -> None:
        if self._conns:
            self._drop(next(iter(self._conns)))
            self.dropped += 1

    def _drop(self, sock: socket.socket) -> None:
        if self._conns.pop(sock, None) is None:
            return
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()


# -- the producer's side ------------------------------------------------------------------


async def connect(endpoint: str) -> socket.socket:
    """A connected non-blocking TCP socket to a checked "host:port" / "[v6]:port".  The
    host is resolved numerically only (a name is an ``OSError``): an endpoint a fence
    server gives is an address."""
    a = address.parse_address(endpoint, what="fence endpoint", need_port=True)
    family = socket.AF_INET6 if ":" in a.host else socket.AF_INET
    addr: Any = socket.getaddrinfo(a.host, a.port, family, socket.SOCK_STREAM, 0,
                                   socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.get_running_loop().sock_connect(sock, addr)
    except BaseException:  # a timeout's cancellation included: the socket goes
        sock.close()
        raise
    return sock
