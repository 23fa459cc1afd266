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
  whose request was read are never closed that way;
- a request that waits on purpose (a long poll, ``/instances/changes?wait_s=``) parks
  itself (``environ[PARK]``, a context manager giving an event): at the bound with
  nothing left to close, the server sets the event of the request parked the longest,
  which then answers at once (as it would at its deadline: the client asks again) and
  frees its slot; the new connection waits moments for it.  Only with every slot
  answering a request that is not parked is the new connection closed.

So a scrape or a probe gets through whatever any number of slow clients and long polls
do, as long as it sends its request within the time ``max_connections`` later
connections take to arrive.  Closing means ``shutdown(2)``: the thread blocked reading
that socket wakes at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
HEADER_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 10.0
#: the WSGI environ key of a request's ``park()`` (see the module docstring)
PARK = "shmhb.park"


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
        #: serving requests that wait on purpose, the longest parked first, each with the
        #: event that asks it to answer now
        self._parked: dict[socket.socket, threading.Event] = {}
        self.evicted = 0  # connections closed for the bounds (for tests and logs)
        self.unparked = 0  # waiting requests asked to answer early (for tests and logs)

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self._guard:
            self._expire(now)
            if self._full():
                if self._reading:
                    self._drop(min(self._reading, key=self._reading.__getitem__))
                else:  # a request just read may be about to park: a moment for it
                    self._guard.wait_for(lambda: self._parked or not self._full(), timeout=0.5)
                if self._full() and self._parked:  # the longest waiting answers now
                    self._parked.pop(next(iter(self._parked))).set()
                    self.unparked += 1
                elif self._full():
                    self._drop(request)  # every slot is answering a request: not this one
                    self.shutdown_request(request)
                    return
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

    def _full(self) -> bool:
        return len(self._reading) + len(self._serving) >= self.max_connections

    @contextlib.contextmanager
    def park(self, request: socket.socket) -> Iterator[threading.Event]:
        """While inside, ``request`` waits on purpose; the event is set when the server
        needs its slot (then answer at once)."""
        ev = threading.Event()
        with self._guard:
            if request in self._serving:
                self._parked[request] = ev
                self._guard.notify_all()
        try:
            yield ev
        finally:
            with self._guard:
                self._parked.pop(request, None)

    def close_request(self, request: Any) -> None:
        super().close_request(request)
        with self._guard:
            self._reading.pop(request, None)
            self._serving.discard(request)
            self._closing.discard(request)
            self._parked.pop(request, None)
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
    """Tells the server when the request was read, and gives the app its ``park``;
    a per-operation socket timeout."""

    timeout = IO_TIMEOUT_S

    def parse_request(self) -> bool:
        ok = super().parse_request()
        server = self.server
        if isinstance(server, BoundedServer):
            server.request_read(self.request)
        return ok

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        server = self.server
        if isinstance(server, BoundedServer):
            env[PARK] = functools.partial(server.park, self.request)
        return env


__all__ = ["BoundedHandler", "BoundedServer", "BoundedServer6", "HEADER_TIMEOUT_S",
           "IO_TIMEOUT_S", "MAX_CONNECTIONS", "PARK"]
