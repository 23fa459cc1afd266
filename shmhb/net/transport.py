"""The network half's sockets: one ZMQ context, a listening ROUTER, a connecting ROUTER.

Every socket is made here with the same hygiene: LINGER 0 (closing never waits), small
high-water marks, MAXMSGSIZE (libzmq drops a connection that announces a bigger frame
before we see a byte), ROUTER_MANDATORY (a send to a connection that is down fails at
once instead of queueing).  The listening socket also times out half-open ZMTP
handshakes (HANDSHAKE_IVL) and drops idle connections through ZMTP heartbeats
(HEARTBEAT_IVL/TIMEOUT): that is connection hygiene against floods only, never
evidence of liveness -- libzmq's I/O thread answers heartbeats even while the
application is stuck.  Liveness is the application's ping and ack.  The connecting
socket uses heartbeats too, shorter, for one thing only: to leave a connection whose
far end is stopped as a whole, so that a reconnect reaches the holder that replaced it.
The listening socket is made with ``SO_REUSEPORT`` so that such a replacement can
listen beside the stopped one (``shmhb.net.listener`` argues the design).

Failures are raised as :class:`NetDown` (the whole half cannot run: the agent records it
and retries) or :class:`HostSkipped` (one followed host cannot be pinged: no key, an
address libzmq refuses).  :meth:`Transport.close` never blocks and is safe to call
after any failure, however far the setup got.

The network half takes a ``TransportFactory`` (this class by default), so tests can
run it on ``shmhb.testing.network`` instead: the same sockets and options, in-process.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from ..board.config import format_hostport
from ..errors import FD_ERRNOS, InvalidConfig
from .listener import numeric_ip, open_listener
from .settings import curve_keypair, curve_public_key
from .state import NetDown, NetReason
from .protocol import MAX_FRAME_BYTES

HANDSHAKE_IVL_MS = 2000
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
#: Our connections to followed hosts: one whose far end stopped as a whole (SIGSTOP, a
#: frozen container: the kernel keeps the TCP connection up, nothing reads it) is
#: dropped once a ZMTP heartbeat goes unanswered this long, and one that landed in a
#: stopped listener's accept queue once its handshake has not completed in
#: CLIENT_HANDSHAKE_IVL_MS; each reconnect then reaches whoever listens now (the holder
#: that replaced the stopped one listens beside it: ``shmhb.net.listener``).  The
#: handshake's bound sets how long after that takeover the followers hear the host: it
#: must leave the takeover (the stall bound and the embedded standbys' grace, 4 s) plus
#: one bound plus a reconnect (0.1 s) under the peer dead-after (5 s), or the followers
#: read every live worker of the host DEAD meanwhile (at 1 s they did, for 0.15-0.25 s:
#: ``python -m bench.stopped_holder``).  ZMTP's handshake takes two or three round
#: trips, done by libzmq's I/O thread whatever the application does: 0.3 s leaves room
#: for round trips up to about 0.1 s.
CLIENT_HEARTBEAT_IVL_MS = 500
CLIENT_HEARTBEAT_TIMEOUT_MS = 1500
CLIENT_HANDSHAKE_IVL_MS = 300


class HostSkipped(Exception):
    """A followed host that cannot be pinged as configured (``reason``: HOST_KEY or
    ADDRESS).  Never leaves the network half: the host is skipped and retried later."""

    def __init__(self, reason: NetReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _down(what: str, e: zmq.ZMQError) -> NetDown:
    reason = NetReason.FDS if e.errno in FD_ERRNOS else NetReason.BIND
    return NetDown(reason, f"{what}: {e.strerror}", e.errno or 0)


class Transport:
    """Sockets of one run of the network half (a new Transport after every restart).

    ``ctx``: a context to make the sockets in, which ``close`` leaves open (the fake
    transport shares one between hosts); by default each Transport has its own."""

    def __init__(self, curve_keys: str | None, *,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.curve_keys = curve_keys
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
        if ctx is None:
            self.ctx.setsockopt(zmq.LINGER, 0)
        self.router: zmq.Socket[bytes] | None = None
        self.client: zmq.Socket[bytes] | None = None
        self._auth: object | None = None
        self._closed = False
        self._beside: str | None = None  # see listen_beside

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        try:
            s = self.ctx.socket(kind)
        except zmq.ZMQError as e:
            raise _down("cannot create a socket", e) from None
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        s.setsockopt(zmq.SNDHWM, 64)
        s.setsockopt(zmq.RCVHWM, 1024)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        return s

    def listen(self, host: str, port: int) -> zmq.Socket[bytes]:
        """Bind the answering ROUTER (CURVE server if keys are configured)."""
        r = self._socket(zmq.ROUTER)
        self.router = r  # closed by close() whatever happens next
        r.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        r.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if self.curve_keys:
            try:
                pub, sec = curve_keypair(self.curve_keys, host)
            except InvalidConfig as e:
                raise NetDown(NetReason.CURVE, str(e)) from None
            r.curve_secretkey, r.curve_publickey, r.curve_server = sec, pub, True
            from zmq.auth.thread import ThreadAuthenticator
            auth = ThreadAuthenticator(self.ctx)
            self._auth = auth
            auth.start()
            auth.configure_curve(domain="*", location=self.curve_keys)
        addr = format_hostport(host, port)
        try:
            self._bind(r, host, port)
        except zmq.ZMQError as e:
            raise _down(f"cannot listen on {addr}", e) from None
        except OSError as e:
            reason = NetReason.FDS if e.errno in FD_ERRNOS else NetReason.BIND
            raise NetDown(reason, f"cannot listen on {addr}: {e.strerror}", e.errno or 0) from None
        return r

    def listen_beside(self, address: str) -> None:
        """The listener on ``address`` (host:port) is a stalled holder of this board that
        the caller replaces: :meth:`listen` there joins it and takes every new connection
        (``shmhb.net.listener``)."""
        self._beside = address

    def _bind(self, r: zmq.Socket[bytes], host: str, port: int) -> None:
        """Bind the answering ROUTER: on a numeric IP through a shareable listener of our
        own (``shmhb.net.listener``), elsewhere (an interface name) by libzmq itself."""
        ip = numeric_ip(host)
        if ip is None:
            r.bind(self._bind_endpoint(host, port))
            return
        s = open_listener(ip, port, beside=self._beside == format_hostport(host, port))
        try:
            r.setsockopt(zmq.USE_FD, s.fileno())
            r.bind(self._bind_endpoint(host, port))  # the address is libzmq's label only
        except BaseException:
            s.close()
            raise
        s.detach()  # libzmq owns the descriptor now, and closes it with the socket

    def _bind_endpoint(self, host: str, port: int) -> str:
        return f"tcp://{format_hostport(host, port)}"

    def _connect_endpoint(self, me: str | None, host: str, port: int) -> str:
        return connect_endpoint(me, host, port)

    def connector(self, me: str | None) -> zmq.Socket[bytes]:
        """The socket our pings leave from (made on first use); ``me``: our listen host,
        whose CURVE key pair it presents."""
        if self.client is None:
            c = self._socket(zmq.ROUTER)
            self.client = c
            c.setsockopt(zmq.RECONNECT_IVL, 100)
            c.setsockopt(zmq.RECONNECT_IVL_MAX, 0)  # no backoff: a restarted pinger is seen soon
            c.setsockopt(zmq.HEARTBEAT_IVL, CLIENT_HEARTBEAT_IVL_MS)
            c.setsockopt(zmq.HEARTBEAT_TIMEOUT, CLIENT_HEARTBEAT_TIMEOUT_MS)
            c.setsockopt(zmq.HANDSHAKE_IVL, CLIENT_HANDSHAKE_IVL_MS)
            if self.curve_keys:
                try:
                    pub, sec = curve_keypair(self.curve_keys, me or "client")
                except InvalidConfig as e:
                    raise NetDown(NetReason.CURVE, str(e)) from None
                c.curve_secretkey, c.curve_publickey = sec, pub
        return self.client

    def connect(self, me: str | None, host: str, port: int, rid: bytes) -> str:
        """Connect to a followed host's pinger under routing id ``rid``; returns the
        endpoint (for :meth:`disconnect`).  ``HostSkipped`` if it cannot be."""
        c = self.connector(me)
        if self.curve_keys:
            try:
                c.curve_serverkey = curve_public_key(self.curve_keys, host)
            except InvalidConfig as e:
                raise HostSkipped(NetReason.HOST_KEY, str(e)) from None
        endpoint = self._connect_endpoint(me, host, port)
        try:
            c.setsockopt(zmq.CONNECT_ROUTING_ID, rid)
            c.connect(endpoint)
        except zmq.ZMQError as e:
            if e.errno in FD_ERRNOS:
                raise _down(f"cannot connect to {endpoint}", e) from None
            raise HostSkipped(NetReason.ADDRESS,
                              f"cannot connect to {endpoint}: {e.strerror}") from None
        return endpoint

    def disconnect(self, endpoint: str) -> None:
        if self.client is not None:
            try:
                self.client.disconnect(endpoint)
            except zmq.ZMQError:
                pass  # never connected (ENOENT): nothing to undo

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket and the context; never blocks (LINGER 0 everywhere, the
        authenticator's thread stopped first) -- except that ``linger_ms`` lets what the
        listening socket has queued (a goodbye) go out for at most that long."""
        if self._closed:
            return
        self._closed = True
        for s, linger in ((self.client, 0), (self.router, linger_ms)):
            if s is not None:
                s.close(linger)
        self.client = self.router = None
        auth = self._auth
        if auth is not None:
            auth.stop()  # type: ignore[attr-defined]
        if self._own_ctx:
            self.ctx.destroy(linger=0)


def connect_endpoint(me: str | None, host: str, port: int) -> str:
    """Where a pinger listening on host ``me`` connects to reach ``host:port``: the
    kernel picks the source address, which between hosts is the address of the
    interface that routes to the peer (what ``recv_routed`` reports on the other side,
    and what docs/PROTOCOL.md, "Inbound pings as evidence", relies on).

    Never libzmq's ``source;destination`` form: libzmq resolves a source address
    through getifaddrs() on every (re)connect and aborts the whole process when that
    fails, and under a connection flood it fails with EMFILE (a 30-minute chaos soak
    saw the pinger die of SIGABRT).  So pingers on loopback addresses of one machine
    all leave from 127.0.0.1: only one listening on 127.0.0.1 has its pings count as
    evidence there (the tests and benchmarks that need a mutual pair use it)."""
    return f"tcp://{format_hostport(host, port)}"


#: zmq's send/recv/poll flags as plain ints: pyzmq's enum flags cost an enum operation
#: per send, on the paths of every ping and ack
NOBLOCK = int(zmq.NOBLOCK)
MORE = int(zmq.NOBLOCK | zmq.SNDMORE)  # a routing id: its frame follows
POLLIN = int(zmq.POLLIN)


def recv_routed(sock: zmq.Socket[bytes]) -> tuple[bytes, bytes | None, str | None]:
    """One message off a ROUTER, without blocking (``zmq.Again`` if there is none):
    (routing id, frame, the IP address its connection comes from).  The frame is None
    if the message was not exactly one part after the routing id (the rest is read
    and dropped).  The source is what the kernel says the TCP connection's remote
    address is (libzmq's ``Peer-Address``), None where the transport has none (inproc).

    Cheaper than ``recv_multipart``: two calls, no list, no RCVMORE query."""
    rid = sock.recv(NOBLOCK)
    part = sock.recv(NOBLOCK, copy=False)  # a message's parts arrive together
    if part.more:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(NOBLOCK)
        return rid, None, None
    try:
        got = part.get("Peer-Address")
    except zmq.ZMQError:
        got = None
    return rid, part.bytes, got if isinstance(got, str) else None


#: What the network half builds its sockets with: ``Transport`` itself, or a test's
#: in-process stand-in (``shmhb.testing.network.FakeNetwork.transport``).
TransportFactory = Callable[[str | None], Transport]
