"""A threaded WSGI server that a slow or hostile client cannot starve (the exporter's).

``wsgiref`` with ``ThreadingMixIn`` gives every connection a thread for as long as the
client takes to send its request: 125 half-sent requests ("slowloris") at a 128-fd
limit held 123 threads and every fd, and normal scrapes timed out.  Here:

- at most ``max_connections`` connections are open at once (threads and fds bounded);
- a connection still sending its request line and headers is given at most
  ``header_timeout_s`` in all (not per byte: a byte every few seconds does not keep it),
  then closed; one that has sent them has ``io_timeout_s`` per read or write;
- when a new connection arrives at the bound, the connection that has been sending its
  request the longest is closed to make room (a scraper sends its whole request at
  once, so the new one is served while older half-sent ones go first).  Connections
  whose request was read are never closed that way: at the bound with all of them
  being served, the new connection is closed instead.

So a scrape gets through whatever any number of slow clients do, as long as it sends
its request within the time ``max_connections`` later connections take to arrive.
Closing means ``shutdown(2)``: the thread blocked reading that socket wakes at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
HEADER_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 10.0


class BoundedServer(ThreadingMixIn, WSGIServer):
    """``WSGIServer`` with the bounds above (set the class attributes to change them)."""

    daemon_threads = True
    block_on_close = False  # no list of finished threads kept (it grew with each request)
    #: the kernel's queue of connections not yet accepted (socketserver's default is 5:
    #: a burst of connections beyond it waited for SYN retries, a scrape among them too)
    request_queue_size = 128
    max_connections = MAX_CONNECTIONS
    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._guard = threading.Condition()
        self._reading: dict[socket.socket, float] = {}  # sending its request: since when
        self._serving: set[socket.socket] = set()  # request read: being answered
        self._closing: set[socket.socket] = set()  # closed for the bounds, thread ending
        self.evicted = 0  # connections closed for the bounds (for tests and logs)

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self._guard:
            self._expire(now)
            if len(self._reading) + len(self._serving) >= self.max_connections:
                if not self._reading:
                    self._drop(request)  # every slot is answering a request: not this one
                    self.shutdown_request(request)
                    return
                self._drop(min(self._reading, key=self._reading.__getitem__))
            # The threads of connections just closed end within moments: wait for them
            # (briefly: a thread stuck elsewhere must not stop the server), so threads
            # stay within the bound however fast clients come and go.
            self._guard.wait_for(lambda: len(self._reading) + len(self._serving)
                                 + len(self._closing) < self.max_connections, timeout=0.5)
            self._reading[request] = now
        super().process_request(request, client_address)

    def request_read(self, request: socket.socket) -> None:
        """The handler read the request line and headers of ``request``."""
        with self._guard:
            if self._reading.pop(request, None) is not None:
                self._serving.add(request)

    def close_request(self, request: Any) -> None:
        super().close_request(request)
        with self._guard:
            self._reading.pop(request, None)
            self._serving.discard(request)
            self._closing.discard(request)
            self._guard.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away mid-request: a debug line, not the
        traceback ``socketserver`` prints to stderr (any client could fill a log)."""
        log.debug("http: request from %s failed", client_address, exc_info=True)

    def service_actions(self) -> None:
        """Run by ``serve_forever`` every poll interval: the header deadline holds even
        while no new connection comes."""
        with self._guard:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        for s, since in list(self._reading.items()):
            if now - since >= self.header_timeout_s:
                self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        """Close ``s`` for the bounds (caller holds the guard).  Its handler thread, if
        any, wakes from its read and ends; ``close_request`` then forgets it."""
        if self._reading.pop(s, None) is not None:
            self._closing.add(s)  # its handler thread runs until close_request
        self.evicted += 1
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone
        if self.evicted & (self.evicted - 1) == 0:  # 1, 2, 4, 8, ...: rate-limited
            log.warning("http: %d connection(s) closed so far for sending no request in "
                        "%.0f s or holding a slot past %d open connections", self.evicted,
                        self.header_timeout_s, self.max_connections)


class BoundedServer6(BoundedServer):
    address_family = socket.AF_INET6


class BoundedHandler(WSGIRequestHandler):
    """Tells the server when the request was read; a per-operation socket timeout."""

    timeout = IO_TIMEOUT_S

    def parse_request(self) -> bool:
        ok = super().parse_request()
        server = self.server
        if isinstance(server, BoundedServer):
            server.request_read(self.request)
        return ok


__all__ = ["BoundedHandler", "BoundedServer", "BoundedServer6", "HEADER_TIMEOUT_S",
           "IO_TIMEOUT_S", "MAX_CONNECTIONS"]
