"""An in-process network for the network half, for tests: real ZMQ sockets and frames,
real polls, no TCP and no ports.

``FakeNetwork.transport`` is a ``transport.TransportFactory``: give it to ``Agent``
(``transport=``) and the agent's pinger builds its sockets through ``FakeTransport``, the
real ``Transport`` with its socket options (LINGER 0, high-water marks,
ROUTER_MANDATORY), bound and connected over ``inproc://`` on the network's one shared
context instead of TCP.  A pinger address such as ``127.0.0.2:5000`` is only a name
here: nothing is bound on it.

Every connection runs through a link the network owns (two DEALERs: one bound for the
connecting pinger, one connected to the listening one), and frames move over a link only
in ``deliver()``.  So a test decides when the network carries what was sent, as it
decides with a ``FakeClock`` when time passes; it sees every frame (``frames``), and
``cut(host)`` drops every frame to and from that host -- silently, as a partition does
to TCP, which keeps its connections while packets vanish: the pinger sees unanswered
pings, not refused connections -- until ``heal(host)``.  A host whose agent the test
does not step is a stopped pinger: its frames wait in its queues.

A pure-Python fake with pollable fds (eventfds) would need its own frame queues and a
poller of its own; this one keeps the sockets, the poll and the frames that run in
production, and adds only the relay.  Not modelled: CURVE (inproc has no ZMTP handshake:
``FakeTransport`` refuses CURVE keys rather than run without the security configured;
use a secret file), MAXMSGSIZE (inproc does not enforce it; the decoder refuses
oversized frames anyway), ZMTP heartbeats, and connections refused or reset.
"""

from __future__ import annotations

import errno
import itertools
import uuid
from typing import NamedTuple

import zmq

from ..board.config import format_hostport
from ..net.state import NetDown, NetReason
from ..net.transport import NOBLOCK, POLLIN, Transport

__all__ = ["FakeNetwork", "FakeTransport", "Frame"]



class Frame(NamedTuple):
    """One message the network carried (or dropped) between two pinger hosts."""

    src: str
    dst: str
    parts: tuple[bytes, ...]
    dropped: bool


class _Link:
    """One connection: ``inner`` faces the connecting pinger (``src``), ``outer`` the
    listening one (``dst``, listening on ``target``, "host:port")."""

    def __init__(self, src: str, dst: str, target: str, inner: zmq.Socket[bytes],
                 owner: FakeTransport) -> None:
        self.src, self.dst, self.target = src, dst, target
        self.inner = inner
        self.outer: zmq.Socket[bytes] | None = None
        self.outer_gen = -1  # the bind of ``target`` that ``outer`` is connected to
        self.owner = owner


class FakeNetwork:
    """The hosts' shared in-process network (see the module text).  ``close()`` it at
    the end of the test, after the agents on it."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self._prefix = f"inproc://shmhb-fake-{uuid.uuid4().hex[:12]}"
        self._seq = itertools.count()
        self._links: dict[str, _Link] = {}  # inner endpoint -> link
        self._listeners: dict[str, tuple[str, int]] = {}  # "host:port" -> (endpoint, bind gen)
        self._gens = itertools.count(1)
        self._cut: set[str] = set()
        self.frames: list[Frame] = []

    # -- what a test uses ---------------------------------------------------------------

    def transport(self, curve_keys: str | None) -> FakeTransport:
        """A ``TransportFactory``: one run of a network half's sockets on this network."""
        return FakeTransport(self, curve_keys)

    def cut(self, host: str) -> None:
        """Drop every frame to or from ``host`` (its pinger's listen host) from now on."""
        self._cut.add(host.lower())

    def heal(self, host: str) -> None:
        self._cut.discard(host.lower())

    def deliver(self) -> int:
        """Carry every frame waiting on every link, both ways (dropping those of a cut
        host); returns how many were carried or dropped.  What the receivers send in
        answer waits for the next call."""
        moved = 0
        for link in list(self._links.values()):
            outer = self._outer(link)
            if outer is None:
                continue
            moved += self._move(link.inner, outer, link.src, link.dst)
            moved += self._move(outer, link.inner, link.dst, link.src)
        return moved

    def sent(self, src: str | None = None, dst: str | None = None) -> list[Frame]:
        """Frames carried or dropped so far, from ``src`` and to ``dst`` if given."""
        return [f for f in self.frames
                if (src is None or f.src == src) and (dst is None or f.dst == dst)]

    def close(self) -> None:
        for link in list(self._links.values()):
            self._close_link(link)
        self._links.clear()
        self.ctx.destroy(linger=0)

    # -- what FakeTransport uses ----------------------------------------------------------

    def claim(self, host: str, port: int) -> str:
        """The inproc endpoint to bind for listening on ``host:port``; EADDRINUSE while
        another transport listens there.  Each bind gets a name of its own: a closed
        socket releases its inproc name only once libzmq's reaper has run, and a
        restarted network half must not depend on when that is."""
        addr = format_hostport(host, port)
        if addr in self._listeners:
            raise zmq.ZMQError(errno.EADDRINUSE)
        gen = next(self._gens)
        ep = f"{self._prefix}/{addr}/{gen}"
        self._listeners[addr] = (ep, gen)
        return ep

    def release(self, endpoint: str) -> None:
        for addr, (ep, _gen) in list(self._listeners.items()):
            if ep == endpoint:
                del self._listeners[addr]

    def link(self, owner: FakeTransport, src: str, host: str, port: int) -> str:
        """A new link from ``src`` to the pinger at ``host:port``; returns the endpoint
        the connecting socket connects to."""
        inner_ep = f"{self._prefix}/link-{next(self._seq)}"
        inner = _socket(self.ctx, zmq.DEALER)
        try:
            inner.bind(inner_ep)
        except BaseException:
            inner.close(0)
            raise
        self._links[inner_ep] = _Link(src.lower(), host.lower(), format_hostport(host, port),
                                      inner, owner)
        return inner_ep

    def unlink(self, endpoint: str) -> None:
        link = self._links.pop(endpoint, None)
        if link is not None:
            self._close_link(link)

    def unlink_all(self, owner: FakeTransport) -> None:
        for ep, link in list(self._links.items()):
            if link.owner is owner:
                self.unlink(ep)

    # -- internals ------------------------------------------------------------------------

    def _outer(self, link: _Link) -> zmq.Socket[bytes] | None:
        """The link's socket toward its listener, (re)connected to the listener's latest
        bind: a restarted network half binds anew, and inproc does not reconnect."""
        listener = self._listeners.get(link.target)
        if listener is None:
            return link.outer  # nobody listens there now: frames wait (or are dropped)
        ep, gen = listener
        if link.outer is None or link.outer_gen != gen:
            if link.outer is not None:
                link.outer.close(0)
            link.outer = _socket(self.ctx, zmq.DEALER)
            link.outer.connect(ep)
            link.outer_gen = gen
        return link.outer

    def _move(self, a: zmq.Socket[bytes], b: zmq.Socket[bytes], src: str, dst: str) -> int:
        n = 0
        while int(a.getsockopt(zmq.EVENTS)) & POLLIN:
            parts = tuple(a.recv_multipart(NOBLOCK))
            dropped = src in self._cut or dst in self._cut
            if not dropped:
                try:
                    b.send_multipart(parts, NOBLOCK)
                except zmq.Again:
                    dropped = True  # the receiver's queue is full, as TCP's would be
            self.frames.append(Frame(src, dst, parts, dropped))
            n += 1
        return n

    @staticmethod
    def _close_link(link: _Link) -> None:
        link.inner.close(0)
        if link.outer is not None:
            link.outer.close(0)
            link.outer = None


def _socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 1024)
    s.setsockopt(zmq.RCVHWM, 1024)
    return s


class FakeTransport(Transport):
    """``Transport`` over a ``FakeNetwork``: the same sockets and options, inproc."""

    def __init__(self, network: FakeNetwork, curve_keys: str | None) -> None:
        if curve_keys:
            raise NetDown(NetReason.CURVE, "the in-process transport has no CURVE (inproc "
                          "has no ZMTP handshake); test authentication with a secret file")
        super().__init__(curve_keys, ctx=network.ctx)
        self.network = network
        self._listening: str | None = None

    def _bind(self, r: zmq.Socket[bytes], host: str, port: int) -> None:
        r.bind(self._bind_endpoint(host, port))  # inproc: no TCP listener to share

    def _bind_endpoint(self, host: str, port: int) -> str:
        self._listening = self.network.claim(host, port)
        return self._listening

    def _connect_endpoint(self, me: str | None, host: str, port: int) -> str:
        return self.network.link(self, me or "", host, port)

    def disconnect(self, endpoint: str) -> None:
        super().disconnect(endpoint)
        self.network.unlink(endpoint)

    def close(self, linger_ms: int = 0) -> None:
        super().close(linger_ms)
        self.network.unlink_all(self)
        if self._listening is not None:
            self.network.release(self._listening)
            self._listening = None
