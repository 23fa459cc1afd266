"""Many remote pingers in one light process, for the pinger CPU target of ``bench.cluster``.

``python -m bench.emulator --hosts N --port P --target HOST:PORT --interval-s S``:
emulates ``N`` remote hosts, each with its own identity (boot id and board incarnation)
and a 16-slot digest, each bound on its own loopback address (``address(i)``:
``127.0.1.1`` ... ``127.0.1.250``, then ``127.0.2.1`` ...) at the cluster pinger port.  Pings that reach them get
valid acks built with ``shmhb.net.protocol`` (the full digest only when the pinger does not
hold it yet, exactly as a real pinger answers).  With pinging on, every emulated host
also pings the real pinger at ``TARGET`` every ``S`` seconds (DEALER, nonces strictly
increasing, the digest generation it holds echoed back), so the real pinger answers as
many pings as it sends, as in a cluster where every host follows every other.

Each emulated host pings as a default pinger would in that mutual pair: it connects
from its own address, counts the real pinger's pings to it as evidence by the pinger's
own rule (``shmhb.net.evidence``, no secret: the ping must echo a challenge the emulated
host sent in its own pings; its pings carry one, echo the real pinger's, and tell its
digest generation), and plans its turns with the pinger's own ``PingPlan``: it is the
passive side where its board identity is the larger (``evidence.passive``; about half of
them), and then pings only once per refresh period while the evidence is fresh.
``--no-mutual`` pings every interval regardless, as if no pair covered it.

``--floor dealers|router --listen HOST:PORT``: instead, a bare Python + pyzmq process that
moves the same frames as a pinger on the same tick (its default): a prebuilt PING to each
emulated host every ``S`` seconds (after ``mutual 1`` on its stdin, as the active side
of the mutual pairs with the even-index hosts and the passive side with the others:
see ``ping 4``; ``mutual 0`` undoes it), acks received and dropped unread, and one ROUTER
answering every ping with a prebuilt ACK (no decoding, no state, no board); either one
DEALER per host (the pinger's socket layout) or one ROUTER connected to all hosts (a
poll set of two sockets).  The CPU of the real pinger is compared with both.

Stdin commands: ``ping 1`` / ``ping 0``; ``ping 2``: ping every interval, as
``--no-mutual``; ``ping 3``: as ``ping 1``, but each host's pings name an address the
real pinger does not follow it by (``10.x.y.1``: behind a NAT, or followed by a name),
so only its board identity tells the real pinger who it is; ``ping 4``: for a floor,
the message count of ``ping 1`` without its rules: the hosts of odd index ping every
interval, the others once per refresh (``LONG_REFRESH`` peer dead-after windows), as
the two sides of mutual pairs do (a floor's pings count as nobody's evidence, so
``ping 1`` would make every host ping every turn); ``kill I``: host I (0-based) dies at once (its
sockets close: it answers and sends nothing more); EOF ends it.  It prints ``ready`` once bound,
and ``stats PINGS_ANSWERED PINGS_SENT ACKS_RECEIVED`` after each command (``stats``
asks for just that).  One thread,
one ``zmq.Poller``; ~10 µs of Python per frame, so 64 hosts at 5 pings/s in both
directions cost it a few % of a core.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Callable

import zmq

from shmhb.board.config import AgentConfig
from shmhb.net.evidence import counts_as_evidence, echoed, issue, new_challenge, passive
from shmhb.net.exchange import wants_full_digest
from shmhb.net.plan import DEFAULT_BUDGET_PPS, LONG_REFRESH, PingPlan
from shmhb.net.protocol import (
    Ack,
    DigestEntry,
    FrameRejected,
    Identity,
    Ping,
    decode,
    encode_ack_raw,
    encode_entries,
    encode_ping,
)
from shmhb.net.transport import recv_routed

#: The pinger's default peer dead-after (Policy.peer_dead_after_s): its passive side's
#: refresh period in a mutual pair.
DEAD_AFTER_NS = 5_000_000_000
#: ``ping 4`` and a floor's ``mutual 1``: how often the passive side of a pair pings (s)
REFRESH_S = LONG_REFRESH * DEAD_AFTER_NS / 1e9


def address(i: int) -> str:
    """The loopback address of emulated host ``i`` (0-based)."""
    return f"127.0.{1 + i // 250}.{1 + i % 250}"


class Host:
    def __init__(self, ctx: zmq.Context, addr: str, port: int, slots: int) -> None:
        self.addr = f"{addr}:{port}"
        self.identity = Identity(os.urandom(16), random.getrandbits(62) | 1)
        self.gen = 1
        self.body = encode_entries(
            DigestEntry(f"rank-{j}", j + 1, 1, 10000 + j, 5, (f"{addr}:{30000 + j}",))
            for j in range(slots))
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://{self.addr}")
        self.dealer: zmq.Socket | None = None
        self.nonce = time.time_ns()
        self.known: tuple[int, Identity | None] = (0, None)
        self.next_ping = 0.0
        self.dead = False
        self.plan: PingPlan | None = None
        self.evidence_nonce = 0
        self.issued: tuple[int, ...] = ()  # challenges sent to the real pinger
        self.theirs = 0  # the real pinger's last challenge to us
        self.named = self.addr  # the address its pings name (``ping 3``: another)
        self.every = 0.0  # without a plan: its ping period (``ping 2``, ``ping 4``)


class Emulator:
    """The emulated hosts, their sockets, and what they counted."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ctx = zmq.Context()
        self.hosts = [Host(self.ctx, address(i), a.port, a.slots) for i in range(a.hosts)]
        self.by_sock: dict[zmq.Socket, tuple[Host, bool]] = {}
        self.poller = zmq.Poller()
        for h in self.hosts:
            d = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.IMMEDIATE, 1)
            d.connect(f"tcp://{h.addr.rsplit(':', 1)[0]}:0;{a.target}")  # from its own address
            h.dealer = d
            self.by_sock[h.router] = (h, True)
            self.by_sock[d] = (h, False)
            self.poller.register(h.router, zmq.POLLIN)
            self.poller.register(d, zmq.POLLIN)
        self.stdin = sys.stdin.fileno()
        self.poller.register(self.stdin, zmq.POLLIN)
        self.pinging = False
        self.answered = self.sent = self.acks = 0

    def run(self) -> int:
        print("ready", flush=True)
        while True:
            timeout = None
            if self.pinging:
                now = time.monotonic()
                self.send_due(now)
                wake = min((h.next_ping for h in self.hosts if not h.dead), default=now + 1)
                timeout = max(0, math.ceil((wake - time.monotonic()) * 1000))  # int ms: never spin
            for sock, _ in self.poller.poll(timeout):
                if sock == self.stdin:
                    line = os.read(self.stdin, 256).decode()
                    if not line:
                        return 0
                    for cmd in line.split("\n"):
                        self.command(cmd)
                elif sock in self.by_sock:
                    self.receive(sock)

    def send_due(self, now: float) -> None:
        """Ping the real pinger from every host whose turn it is."""
        now_ns = int(now * 1e9)
        for h in self.hosts:
            if now < h.next_ping or h.dead:
                continue
            if h.plan is not None:
                due = bool(h.plan.due(now_ns))
                nxt = h.plan.next_ns()
                h.next_ping = now + 1 if nxt is None else max(nxt / 1e9, now + 0.001)
                if not due:
                    continue
            else:
                h.next_ping = max(h.next_ping + h.every, now)
            h.nonce += 1
            ch = new_challenge()
            h.issued = issue(h.issued, ch)
            frame = encode_ping(Ping(h.identity, h.named, h.nonce, h.known[0], h.known[1],
                                     ch, h.theirs, h.gen))
            try:
                h.dealer.send(frame, zmq.NOBLOCK)  # type: ignore[union-attr]
                self.sent += 1
            except zmq.Again:
                pass

    def stats(self) -> None:
        print(f"stats {self.answered} {self.sent} {self.acks}", flush=True)

    def command(self, cmd: str) -> None:
        """One stdin command (see the module docstring)."""
        if cmd.startswith("kill "):
            h = self.hosts[int(cmd.split()[1])]
            for sock in (h.router, h.dealer):
                if sock is not None and not sock.closed:
                    self.poller.unregister(sock)
                    self.by_sock.pop(sock, None)
                    sock.close(0)
            h.dead = True
            self.stats()
        if cmd == "stats":
            self.stats()
        if cmd.startswith("ping "):
            self.ping_mode(cmd.split()[1])
            self.stats()

    def ping_mode(self, mode: str) -> None:
        a = self.a
        self.pinging = mode in ("1", "2", "3", "4")
        if not self.pinging:
            return
        t = time.monotonic()
        for k, h in enumerate(self.hosts):  # spread the pings over one interval
            h.next_ping = t + random.uniform(0, a.interval_s)
            h.plan = None
            h.every = REFRESH_S if mode == "4" and k % 2 == 0 else a.interval_s
            # a new mode starts from no challenge: the pinger may still hold one from
            # the last mode
            h.issued = ()
            h.named = f"10.{k // 250}.{k % 250}.1:{a.port}" if mode == "3" else h.addr
            if not a.no_mutual and mode in ("1", "3"):
                h.plan = PingPlan(DEFAULT_BUDGET_PPS, int(a.interval_s * 1e9), DEAD_AFTER_NS)
                h.plan.set_hosts([a.target], int(h.next_ping * 1e9))

    def receive(self, sock: zmq.Socket) -> None:
        """What waits on one host's socket: pings to answer, acks to count."""
        h, is_router = self.by_sock[sock]
        for _ in range(256):
            try:
                if is_router:
                    rid, frame, _ = recv_routed(sock)
                    parts = [rid, frame] if frame is not None else []
                else:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not parts:
                continue
            try:
                msg = decode(parts[-1])
            except FrameRejected:
                continue
            if is_router and isinstance(msg, Ping) and len(parts) == 2:
                self.answer(h, sock, parts[0], msg)
            elif not is_router and isinstance(msg, Ack):
                self.acks += 1
                if msg.full:
                    h.known = (msg.gen, msg.identity)

    def answer(self, h: Host, sock: zmq.Socket, rid: bytes, msg: Ping) -> None:
        """Ack a ping of the real pinger, first counting it as evidence where the
        pinger's own rule would."""
        target = self.a.target
        if msg.address == target and msg.challenge:
            h.theirs = msg.challenge
        if (h.plan is not None and msg.address == target
                and counts_as_evidence(msg, authenticated=False, known=h.known[1],
                                       last_nonce=h.evidence_nonce, me=h.identity,
                                       my_gen=h.gen,
                                       echoed=echoed(h.issued, msg.echo))):
            h.evidence_nonce = msg.nonce
            assert h.known[1] is not None  # counts_as_evidence checked it
            h.plan.evidence(target, int(time.monotonic() * 1e9),
                            passive=passive(h.identity, h.known[1]))
        full = wants_full_digest(msg, h.identity, h.gen)
        ack = encode_ack_raw(msg.nonce, h.identity, h.addr, h.gen,
                             h.body if full else None)
        try:
            sock.send_multipart([rid, ack], zmq.NOBLOCK)
            self.answered += 1
        except zmq.ZMQError:
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.emulator")
    p.add_argument("--hosts", type=int, default=64)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--target", required=True, help="the real pinger, HOST:PORT")
    p.add_argument("--interval-s", type=float, default=0.2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--floor", choices=("dealers", "router"), default=None,
                   help="be the floor pinger instead (see floor())")
    p.add_argument("--listen", default=None, help="--floor: where to answer pings")
    p.add_argument("--no-mutual", action="store_true",
                   help="ping every interval, whatever the pinger's pings to us say")
    a = p.parse_args(argv)
    return floor(a) if a.floor else Emulator(a).run()


def _floor_sender(ctx: zmq.Context, poller: zmq.Poller, how: str, peers: list[str],
                  pings: list[bytes]) -> Callable[[int], None]:
    """The floor's sockets toward the emulated hosts (``how``: one DEALER each, or one
    ROUTER connected to all), registered with ``poller``; a function that sends host
    ``i`` its ping."""
    if how == "router":
        out = ctx.socket(zmq.ROUTER)
        out.setsockopt(zmq.LINGER, 0)
        for i, peer in enumerate(peers):
            out.setsockopt(zmq.CONNECT_ROUTING_ID, b"p%d" % i)
            out.connect(f"tcp://{peer}")
        poller.register(out, zmq.POLLIN)

        def send_routed(i: int) -> None:
            try:
                out.send_multipart([b"p%d" % i, pings[i]], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        return send_routed
    dealers = []
    for peer in peers:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.IMMEDIATE, 1)
        d.connect(f"tcp://{peer}")
        poller.register(d, zmq.POLLIN)
        dealers.append(d)

    def send(i: int) -> None:
        try:
            dealers[i].send(pings[i], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    return send


def floor(a: argparse.Namespace) -> int:
    """The transport floor of a pinger (see the module docstring): the same frames, on
    the same tick as the agent loop (pings due within a tick leave together), no
    decoding and no state.  ``--floor dealers``: one DEALER per followed host, as the
    pinger has (it also has one monitor socket per host).  ``--floor router``: one ROUTER
    that connects to every followed host, so the poll set is two sockets whatever the
    number of hosts."""
    ctx = zmq.Context()
    ident = Identity(os.urandom(16), 1)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://{a.listen}")
    ack = encode_ack_raw(1, ident, a.listen, 1, None)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    peers = [f"{address(i)}:{a.port}" for i in range(a.hosts)]
    pings = [encode_ping(Ping(ident, a.listen, 1 + i)) for i in range(a.hosts)]
    t0 = time.monotonic()
    due = [t0 + random.uniform(0, a.interval_s) for _ in peers]
    send = _floor_sender(ctx, poller, a.floor, peers, pings)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    print("ready", flush=True)
    tick = AgentConfig().tick_s
    every = [a.interval_s] * len(peers)
    next_tick = t0
    while True:
        now = time.monotonic()
        if now >= next_tick:
            for i in range(len(peers)):
                if now >= due[i]:
                    send(i)
                    due[i] = max(due[i] + every[i], now)
            next_tick = max(next_tick + tick, now)
        for sock, _ in poller.poll(max(0, math.ceil((next_tick - time.monotonic()) * 1000))):
            if sock == stdin:
                line = os.read(stdin, 256).decode()
                if not line:
                    return 0
                if line.startswith("mutual "):  # the active side with the even hosts
                    mutual = line.split()[1].strip() == "1"
                    every = [REFRESH_S if mutual and i % 2 else a.interval_s
                             for i in range(len(peers))]
                    print("ok", flush=True)
                continue
            for _ in range(256):
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sock is router and len(parts) == 2:
                    try:
                        router.send_multipart([parts[0], ack], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass


if __name__ == "__main__":
    sys.exit(main())
