"""The network half of the host agent: one ZMQ pinger per host.

It pings the pinger of every host that local processes watch (or that ``--peer``
names), answers the pings of others with a digest of this host's slots, writes what it
learns into the board's peer and remote tables, and pushes local deaths, leaves and
restarts at once to the hosts that watch us.  The wire format is ``shmhb.protocol``;
verdicts on hosts are decided by ``shmhb.suspicion``; table writes by ``shmhb.rows``.

Sockets: one ROUTER bound to the listen address answers pings and sends pushes back over
the connection each watcher opened; one more ROUTER, connected to every followed host
under a routing id of our choosing (CONNECT_ROUTING_ID), sends our pings and receives
acks and pushes.  Two sockets whatever the number of hosts, so one wake-up of the loop
costs the same for 2 hosts or 256.  LINGER 0 everywhere (exit never hangs); both are
ROUTER_MANDATORY: a ping to a host whose connection is down fails at once instead of
queueing and being replayed in a burst when it comes back, and a push to a departed
watcher fails loudly instead of vanishing; small high-water marks; MAXMSGSIZE bounds
what a peer can make us allocate (libzmq drops such a connection before we see a byte).

Settings live in the board (written by ``shmhb pinger``) so that whoever holds the role
-- the daemon, or a worker after the daemon died -- runs the same network half.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.auth

from .board import Board
from .clock import Clock
from .config import DEFAULT_PORT, PingerConfig, format_hostport, has_port, parse_hostport
from .errors import InvalidConfig, LockTimeout
from .judge import judge_local_array
from .layout import (
    HEADER_DTYPE, INC_MASK, INC_SHIFT, checksum,
)
from .protocol import (
    MAX_ACK_ENTRIES, MAX_FRAME_BYTES, MAX_PUSH_ENTRIES, Ack, DigestEntry, FrameRejected,
    Identity, OutstandingPings, Ping, Push, ReplayGuard, decode, encode_ack_raw,
    encode_entries, encode_ping, encode_push, wants_full_digest,
)
from .evidence import counts_as_evidence
from .pingplan import DEFAULT_BUDGET_PPS, MIN_PINGS_PER_WINDOW, PingPlan
from .rows import RowWriter
from .status import Status
from .suspicion import PeerState, Suspicion

log = logging.getLogger(__name__)

_RECV_BATCH = 256  # frames handled per readiness event: a flood cannot starve the loop
_LOG_EVERY_NS = 10 * 10**9
_RETRY_NS = 50_000_000
# plain ints: pyzmq's enum flags cost an enum operation per send
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_CFG_GEN_I = HEADER_DTYPE.fields["cfg_gen"][1] // 8  # ping retry period while a host's connection is down
# At most one push per this gap.  The first change after a quiet spell goes out at once;
# changes within the gap are held and sent together by the first flush after it (every
# tick runs one).  Workers killed together die one by one over milliseconds to tens of
# milliseconds (the kernel tears their memory down in turn), and without a gap each
# agent wake-up in between sent its own push: 5 to 11 messages for 32 deaths were seen
# on a 2-core machine.  The price: a change that follows another within the gap waits
# for it (plus up to one tick).
_PUSH_GAP_NS = 50_000_000
_CODES_OF = {1: Status.ALIVE, 2: Status.SUSPECT, 3: Status.DEAD, 4: Status.LEFT}


# -- settings stored in the board ---------------------------------------------------------

def _cfg_checksum(h: np.ndarray) -> int:
    # The budget word came later: a board written before it holds 0 there and a checksum
    # without it, so 0 stays out of the sum and such a board still reads (as the default).
    budget = int(h["cfg_budget_mpps"])
    return checksum(int(h["cfg_gen"]), bytes(h["cfg_listen"]), bytes(h["cfg_secret_path"]),
                    bytes(h["cfg_curve_dir"]), int(h["cfg_interval_ns"]),
                    *((budget,) if budget else ()))


def store_config(board: Board, cfg: PingerConfig) -> None:
    """Write the pinger settings into the board, replacing the configured peer list.
    Under the registry lock; the agent applies them at its next tick."""
    with board.registry():
        h = board._head
        h["cfg_checksum"] = 0
        h["cfg_gen"] = int(h["cfg_gen"]) + 1
        h["cfg_listen"] = (cfg.listen or "").encode()
        h["cfg_secret_path"] = (cfg.secret_file or "").encode()
        h["cfg_curve_dir"] = (cfg.curve_keys or "").encode()
        h["cfg_interval_ns"] = int(cfg.interval_s * 1e9)
        h["cfg_budget_mpps"] = max(1, round(cfg.ping_budget_pps * 1000))
        h["cfg_checksum"] = _cfg_checksum(h)
        w = board._watches
        for i in np.flatnonzero((w["checksum"] != 0) & (w["owner_pid"] == 0)):
            w[int(i)]["checksum"] = 0
        h["reg_gen"] = int(h["reg_gen"]) + 1
    for p in cfg.peers:  # "host" (the cluster's port) or "host:port"
        board._watch_change(p, +1, owner_pid=0, keep_port=has_port(p))


def load_config(board: Board) -> tuple[int, PingerConfig] | None:
    """(generation, settings) stored in the board, or None if none were ever stored or
    the copy read was caught mid-write (try again next tick).  ``InvalidConfig`` if the
    stored settings are not valid."""
    h = board._head.copy()
    gen, ck = int(h["cfg_gen"]), int(h["cfg_checksum"])
    if gen == 0 or ck != _cfg_checksum(h):
        return None

    def text(f: str) -> str | None:
        return bytes(h[f]).rstrip(b"\0").decode(errors="replace") or None

    budget = int(h["cfg_budget_mpps"])
    return gen, PingerConfig(listen=text("cfg_listen"), interval_s=int(h["cfg_interval_ns"]) / 1e9,
                             secret_file=text("cfg_secret_path"), curve_keys=text("cfg_curve_dir"),
                             ping_budget_pps=budget / 1000 if budget else DEFAULT_BUDGET_PPS)


def read_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise InvalidConfig(f"cannot read the secret file {path!r}: {e.strerror}") from None
    if len(secret) < 16:
        raise InvalidConfig(f"the secret in {path!r} is shorter than 16 bytes; use e.g. "
                            "`head -c 32 /dev/urandom | base64 > FILE`")
    return secret


# -- CLI hooks (``shmhb pinger``) -------------------------------------------------------------

def add_pinger_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--listen", metavar="HOST:PORT", default=None,
                    help=f"address to answer pings on (port default {DEFAULT_PORT}, "
                         "one number for the whole cluster)")
    sp.add_argument("--peer", metavar="HOST[:PORT]", action="append", default=[],
                    help="a host to follow even if no local process watches it (repeatable)")
    sp.add_argument("--interval-s", type=float, default=0.2,
                    help="shortest ping interval per host (default 0.2); longer when the "
                         "budget needs it")
    sp.add_argument("--ping-budget-pps", type=float, default=DEFAULT_BUDGET_PPS, metavar="N",
                    help=f"pings per second to all followed hosts together (default "
                         f"{DEFAULT_BUDGET_PPS:g}); each host still gets at least "
                         f"{MIN_PINGS_PER_WINDOW} pings per peer dead-after window")
    auth = sp.add_mutually_exclusive_group()
    auth.add_argument("--secret-file", metavar="F", default=None,
                      help="shared secret: HMAC on every frame, unauthenticated pings unanswered")
    auth.add_argument("--curve-keys", metavar="DIR", default=None,
                      help="CURVE keys: DIR/<host>.key public keys of all hosts, "
                           "DIR/<listen host>.key_secret this host's")


def configure_from_args(args: argparse.Namespace) -> bool:
    """Store the command line's pinger settings in the board; True: network half on."""
    cfg = PingerConfig(listen=args.listen, peers=tuple(args.peer), interval_s=args.interval_s,
                       secret_file=args.secret_file, curve_keys=args.curve_keys,
                       ping_budget_pps=args.ping_budget_pps)
    if cfg.secret_file:
        read_secret(cfg.secret_file)  # fail now, with the reason, not in the agent thread
    with Board.open(args.board) as b:
        store_config(b, cfg)
    return True


# -- the component --------------------------------------------------------------------------

@dataclass
class _Target:
    """A followed host: its routing id on our client socket, our verdict, its rows."""

    address: str
    rid: bytes
    endpoint: str
    state: PeerState
    row: int
    gen: int
    next_ping_ns: int  # retries while its connection is down (turns: self.plan)
    reachable: bool = True
    evidence_nonce: int = 0  # highest nonce of its pings that counted as evidence
    identity: Identity | None = None
    digest_gen: int = 0
    remotes: dict[str, tuple[int, int, int]] = field(default_factory=dict)


class NetworkHalf:
    """The pinger, as a component of the agent loop (see ``shmhb.agent``)."""

    def __init__(self, board: Board, writer: object, clock: Clock) -> None:
        self.b = board
        self.w = writer  # AgentWriter
        self.clock = clock
        self.rows = RowWriter(board)
        self.identity = Identity(board.boot_id, board.board_inc)
        self.ctx = zmq.Context()
        self.router: zmq.Socket | None = None
        self.client: zmq.Socket | None = None
        self.pollables_gen = 0  # moves whenever the set of sockets to poll changes
        self.cfg_gen = -1
        self.cfg = PingerConfig()
        self.secret: bytes | None = None
        self.address = ""
        self.targets: dict[str, _Target] = {}
        self._by_rid: dict[bytes, _Target] = {}
        self.outstanding = OutstandingPings()
        self.ping_guard = ReplayGuard()
        self.push_guard = ReplayGuard()
        self.suspicion = Suspicion(board.thresholds, late_ns=int(0.25e9))
        self.plan = self._new_plan()
        self._down: set[str] = set()  # targets whose connection is down: retried every tick
        self._states: list[PeerState] | None = None  # the targets' verdict states, cached
        self._next_expire_ns = 0
        self.watchers: dict[bytes, int] = {}  # ROUTER routing id -> last ping ns
        self._nonce = time.time_ns()
        self._push_seq = time.time_ns()
        self._watch_gen = -1
        self._next_reclaim_ns = 0
        self._adopted = self.rows.adopt_peers()
        self._last_log: dict[str, int] = {}
        # local digest.  The generation starts at a random value, not 0: the board's
        # identity outlives this process, so a restarted pinger (or a standby taking
        # over) that counted from 0 again could reach the very generation number a
        # watcher already holds, with different contents (a worker died meanwhile),
        # and answer "unchanged": the watcher would keep a stale ALIVE for good.
        self._dgen = random.getrandbits(62) | 1
        self._dkey: tuple[bytes, bytes] | None = None
        self._dentries: dict[str, DigestEntry] = {}
        self._dbody = encode_entries(())
        self._changes_seen = -1
        self._unpushed: dict[str, DigestEntry] = {}  # changes held back by _PUSH_GAP_NS
        self._last_push_ns: int | None = None

    # -- configuration ----------------------------------------------------------------------

    def _new_plan(self) -> PingPlan:
        return PingPlan(self.cfg.ping_budget_pps, int(self.cfg.interval_s * 1e9),
                        self.b.thresholds.peer_dead << 20, me=self.cfg.listen or "")

    def _configure(self, now_ns: int) -> None:
        if self.b._q[_CFG_GEN_I] == self.cfg_gen:
            return  # one word: unchanged settings cost nothing per tick
        try:
            got = load_config(self.b)
        except InvalidConfig as e:
            self.cfg_gen = self.b._q[_CFG_GEN_I]  # report it once, not every tick
            log.error("pinger settings stored in board %s are invalid (%s): run `shmhb "
                      "pinger` with valid options", self.b.name, e)
            return
        if got is None or got[0] == self.cfg_gen:
            return
        gen, cfg = got
        try:
            secret = read_secret(cfg.secret_file) if cfg.secret_file else None
        except InvalidConfig as e:
            log.error("pinger settings not applied: %s", e)
            self.cfg_gen = gen
            return
        self.cfg_gen, self.cfg, self.secret = gen, cfg, secret
        if self.router is not None:
            self.router.close(0)
            self.router = None
        for t in list(self.targets.values()):
            self._drop_target(t.address, keep_row=True)  # reconnect with the new settings
        if self.client is not None:
            self.client.close(0)
            self.client = None
        self.pollables_gen += 1
        if cfg.listen:
            host, port = parse_hostport(cfg.listen)
            r = self._socket(zmq.ROUTER)
            r.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._curve_server(r, host)
            try:
                r.bind(f"tcp://{format_hostport(host, port)}")
            except zmq.ZMQError as e:
                log.error("pinger cannot listen on %s: %s", cfg.listen, e)
                r.close(0)
            else:
                self.router = r
        self.address = cfg.listen or ""
        self._watch_gen = -1
        self.plan = self._new_plan()
        log.info("pinger settings applied: listen %s, interval %.3f s, budget %g pings/s, auth %s",
                 cfg.listen or "(none)", cfg.interval_s, cfg.ping_budget_pps,
                 "hmac" if secret else "curve" if cfg.curve_keys else "none")

    def _socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        s.setsockopt(zmq.SNDHWM, 64)
        s.setsockopt(zmq.RCVHWM, 1024)
        return s

    def _curve_server(self, s: zmq.Socket, host: str) -> None:
        if not self.cfg.curve_keys:
            return
        pub, sec = zmq.auth.load_certificate(os.path.join(self.cfg.curve_keys, f"{host}.key_secret"))
        s.curve_secretkey, s.curve_publickey, s.curve_server = sec, pub, True
        if not hasattr(self, "_auth"):
            from zmq.auth.thread import ThreadAuthenticator
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=self.cfg.curve_keys)

    def _client(self) -> zmq.Socket:
        """The socket our pings leave from, created on first use."""
        if self.client is None:
            c = self._socket(zmq.ROUTER)
            c.setsockopt(zmq.ROUTER_MANDATORY, 1)
            c.setsockopt(zmq.RECONNECT_IVL, 100)
            c.setsockopt(zmq.RECONNECT_IVL_MAX, 0)  # no backoff: a restarted pinger is seen soon
            if self.cfg.curve_keys:
                me = parse_hostport(self.cfg.listen)[0] if self.cfg.listen else "client"
                pub, sec = zmq.auth.load_certificate(
                    os.path.join(self.cfg.curve_keys, f"{me}.key_secret"))
                c.curve_secretkey, c.curve_publickey = sec, pub
            self.client = c
            self.pollables_gen += 1
        return self.client

    def _curve_server_key(self, c: zmq.Socket, host: str) -> None:
        """CURVE: the key of the host we connect to next (read by connect())."""
        if not self.cfg.curve_keys:
            return
        server_pub, _ = zmq.auth.load_certificate(os.path.join(self.cfg.curve_keys, f"{host}.key"))
        c.curve_serverkey = server_pub

    # -- targets --------------------------------------------------------------------------

    def _desired(self) -> set[str]:
        """Pinger addresses to follow: watched hosts, at the cluster's pinger port
        unless ``--peer`` gave that host another one."""
        port = parse_hostport(self.cfg.listen)[1] if self.cfg.listen else DEFAULT_PORT
        ports: dict[str, int] = {}
        specs = sorted(self.b.watched_hosts(), key=lambda sp: ":" not in sp.split("]")[-1])
        for spec in specs:  # explicit host:port (from --peer) first: they win
            host, p = parse_hostport(spec, default_port=port)
            ports.setdefault(host, p)
        out = {format_hostport(h, p) for h, p in ports.items()}
        out.discard(self.address)
        return out

    def _add_target(self, address: str, now_ns: int) -> None:
        adopted = self._adopted.pop(address, None)
        if adopted is not None:
            row, gen = adopted
            remotes = self.rows.adopt_remotes(row, gen)
        else:
            got = self.rows.new_peer(address)
            if got is None:
                return
            row, gen = got
            remotes = {}
        host, port = parse_hostport(address)
        c = self._client()
        self._curve_server_key(c, host)
        rid = b"shmhb:" + address.encode()
        endpoint = f"tcp://{format_hostport(host, port)}"
        c.setsockopt(zmq.CONNECT_ROUTING_ID, rid)
        c.connect(endpoint)
        t = _Target(address, rid, endpoint, PeerState(address), row, gen,
                    now_ns, remotes=remotes)
        self.targets[address] = t
        self._by_rid[rid] = t
        # what we know of it is nothing yet, whatever an earlier holder wrote there
        self.rows.peer_status(row, gen, t.state.status, 0)
        log.info("pinger: following %s", address)

    def _drop_target(self, address: str, keep_row: bool = False) -> None:
        t = self.targets.pop(address)
        self._by_rid.pop(t.rid, None)
        if self.client is not None:
            self.client.disconnect(t.endpoint)
        self.outstanding.drop_peer(address)
        self._down.discard(address)
        if keep_row:
            self._adopted[address] = (t.row, t.gen)
            return
        for held in t.remotes.values():
            self.rows.free_remote(held[0])
        self.rows.free_peer(t.row)
        self.w.changed()  # type: ignore[attr-defined]
        log.info("pinger: no longer following %s", address)

    def _reconcile(self, now_ns: int) -> None:
        if now_ns >= self._next_reclaim_ns:  # watches of processes that died unwatching
            self._next_reclaim_ns = now_ns + 1_000_000_000
            try:
                # Never wait for the registry lock here: its holder may be stopped, and
                # every second of waiting is a second nobody watches this host (5 s, and
                # the LockTimeout killed the agent).  Dead processes' watches can wait.
                self.b.reclaim_watches(timeout_s=0.005)
            except LockTimeout:
                self._rate_log("reclaim", "pinger: registry lock busy; watches of dead "
                               "processes are dropped later")
        rg = self.b._q[self.b._reg_gen_i]
        if rg == self._watch_gen:
            return
        self._watch_gen = rg
        want = self._desired()
        for a in list(self.targets):
            if a not in want:
                self._drop_target(a)
        for a in sorted(want - set(self.targets)):
            self._add_target(a, now_ns)
        self._replan(now_ns)
        for a, (row, _gen) in list(self._adopted.items()):
            if a not in want:  # rows of hosts nobody follows any more
                for held in self.rows.adopt_remotes(row, _gen).values():
                    self.rows.free_remote(held[0])
                self.rows.free_peer(row)
                del self._adopted[a]

    def _replan(self, now_ns: int) -> None:
        self._states = None
        before = (self.plan.hosts, self.plan.interval_ns)
        self.plan.set_hosts(self.targets, now_ns)
        if self.plan.hosts and (self.plan.hosts, self.plan.interval_ns) != before:
            log.info("pinger: %d hosts, each pinged every %.2f s (%.0f pings/s; budget %g%s)",
                     self.plan.hosts, self.plan.interval_ns / 1e9, self.plan.rate_pps,
                     self.plan.budget_pps, ", exceeded to give each host %d pings per dead-after "
                     "window" % MIN_PINGS_PER_WINDOW if self.plan.over_budget else "")

    # -- Component interface ----------------------------------------------------------------

    def pollables(self) -> list[zmq.Socket | int]:
        # The listen socket is not polled: pings to us are answered once per tick, all
        # that came in since the last one together (see _drain_router).
        return [self.client] if self.client is not None else []

    def on_ready(self, what: zmq.Socket | int, now_ns: int) -> None:
        if what is self.router:
            self._drain_router(now_ns)
        elif what is self.client:
            self._drain_client(now_ns)

    def tick(self, now_ns: int, late_ns: int) -> None:
        if self.router is not None:
            self._drain_router(now_ns)
        self._configure(now_ns)
        self._reconcile(now_ns)
        self.flush(now_ns)
        if self._states is None:  # rebuilt only when the followed set changes
            self._states = [t.state for t in self.targets.values()]
        for st, old, new in self.suspicion.tick(self._states, now_ns):
            t = self.targets[st.address]
            log.info("pinger: host %s %s -> %s", t.address, old.value, new.value)
            self.rows.peer_status(t.row, t.gen, new, st.last_ack_ns)
            self.w.changed()  # type: ignore[attr-defined]
        # Turns come from the plan (the budget, phased: see shmhb.pingplan).  A turn
        # counts as a ping for the verdict even if the host's connection is down.
        for a in self.plan.due(now_ns):
            due = self.targets.get(a)
            if due is not None:
                self.suspicion.on_ping(due.state)
                self._ping(due, now_ns)
        # No connection to its pinger: evidence about that process only, not its
        # workers.  Silence keeps accruing as usual; we just try again every tick (a
        # failed send costs no message), so a restarted pinger is confirmed at once.
        for a in list(self._down):
            down = self.targets.get(a)
            if down is None:
                self._down.discard(a)
            elif now_ns >= down.next_ping_ns:
                self._ping(down, now_ns)
        if now_ns >= self._next_expire_ns:  # once a second: O(watchers)
            self._next_expire_ns = now_ns + 1_000_000_000
            cutoff = now_ns - 3 * (self.b.thresholds.peer_dead << 20)
            for rid, seen in list(self.watchers.items()):
                if seen < cutoff:
                    del self.watchers[rid]

    # -- pings and acks -------------------------------------------------------------------

    def _ping(self, t: _Target, now_ns: int) -> bool:
        """Send one ping; False if the host's connection is down (nothing is queued)."""
        self._nonce = max(self._nonce + 1, time.time_ns())
        frame = encode_ping(Ping(self.identity, self.address or "-", self._nonce,
                                 t.digest_gen, t.identity), self.secret)
        try:
            c = self._client()
            c.send(t.rid, _MORE)
            c.send(frame, _NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            t.next_ping_ns = now_ns + _RETRY_NS
            if t.reachable:
                t.reachable = False
                self._down.add(t.address)
                log.info("pinger: no connection to %s; retrying every tick", t.address)
            return False
        if not t.reachable:
            t.reachable = True
            self._down.discard(t.address)
            log.info("pinger: connection to %s is back", t.address)
        self.outstanding.add(t.address, self._nonce, now_ns)
        self.w.count("pings_sent")  # type: ignore[attr-defined]
        return True

    def _drain_client(self, now_ns: int) -> None:
        c = self.client
        assert c is not None
        for _ in range(_RECV_BATCH):
            if not c.getsockopt(zmq.EVENTS) & _POLLIN:
                return  # drained (cheaper than letting recv raise Again)
            parts = c.recv_multipart(_NOBLOCK)
            t = self._by_rid.get(parts[0]) if len(parts) == 2 else None
            if t is None:  # not [routing id of a host we follow, frame]
                self._bad("malformed", "client")
                continue
            try:
                msg = decode(parts[1], self.secret)
            except FrameRejected as e:
                self._bad(e.reason, t.address)
                continue
            if isinstance(msg, Ack):
                self._on_ack(t, msg, now_ns)
            elif isinstance(msg, Push):
                self._on_push(t, msg, now_ns)
            else:
                self._bad("type", t.address)

    def _on_ack(self, t: _Target, a: Ack, now_ns: int) -> None:
        sent = self.outstanding.take(t.address, a.nonce)
        if sent is None:
            self._bad("unsolicited", t.address)  # replayed, duplicated or never asked for
            return
        self.w.count("acks_received")  # type: ignore[attr-defined]
        if t.identity != a.identity:
            if t.identity is not None:
                log.info("pinger: %s has a new board (rebooted or recreated): its slots are new peers",
                         t.address)
            t.identity, t.digest_gen = a.identity, 0
            self.rows.peer_identity(t.row, a.identity)
            if not a.full:
                for held in t.remotes.values():
                    self.rows.free_remote(held[0])
                t.remotes.clear()
        if a.full:
            self._apply_digest(t, a.entries, now_ns)
            t.digest_gen = a.gen
        elif a.gen != t.digest_gen:
            t.digest_gen = 0  # we do not hold what it thinks we hold: ask for all of it
        # else: the same digest, confirmed as of now.  The rows stay as they are: readers
        # take a remote worker's age from its host's last ack (board._remote_age).
        old = self.suspicion.on_ack(t.state, now_ns, now_ns - sent)
        self.rows.peer_status(t.row, t.gen, t.state.status, now_ns)
        self.rows.peer_rtt(t.row, t.gen, now_ns - sent)
        if old is not None:
            log.info("pinger: host %s %s -> alive", t.address, old.value)
            self.w.changed()  # type: ignore[attr-defined]

    def _apply_digest(self, t: _Target, entries: tuple[DigestEntry, ...], now_ns: int) -> None:
        seen = set()
        changed = False
        for e in entries:
            seen.add(e.key)
            held = t.remotes.get(e.key)
            # The status code this row held before: read it before put_remote rewrites
            # the word, or a status-only change (ALIVE -> SUSPECT) would compare equal
            # to itself and never bump the change counter that readers rely on.
            before = (int(self.b._remotes[held[0]]["status"]) >> 40) & 0xF if held else None
            got = self.rows.put_remote(t.row, t.gen, held, e, now_ns)
            if got is None:
                continue
            if held is None or got[2] != held[2] or got[1] != held[1] or before != e.status:
                changed = True
            t.remotes[e.key] = got
        for key in list(t.remotes):
            if key not in seen:
                self.rows.free_remote(t.remotes.pop(key)[0])
                changed = True
        if changed:
            self.w.changed()  # type: ignore[attr-defined]

    def _on_push(self, t: _Target, p: Push, now_ns: int) -> None:
        """Apply pushed evidence of death, leave or restart.  Never makes anything ALIVE
        that was not: a push is not an answer to our ping."""
        if t.identity is None or p.identity != t.identity:
            self._bad("unsolicited", t.address)  # we have no ack from that board yet
            return
        if not self.push_guard.accept(p.identity, p.seq):
            self._bad("replay", t.address)
            return
        self.w.count("pushes_received")  # type: ignore[attr-defined]
        changed = False
        for e in p.entries:
            held = t.remotes.get(e.key)
            if held is None or e.incarnation > held[2]:
                got = self.rows.put_remote(t.row, t.gen, held, e, now_ns)
                if got is not None:
                    t.remotes[e.key] = got
                    changed = True
            elif e.incarnation == held[2] and e.status in (Status.DEAD.code, Status.LEFT.code):
                self.rows.remote_status(held, e.status, now_ns)
                changed = True
        if changed:
            t.digest_gen = 0  # the next ack brings the whole truth
            self.w.changed()  # type: ignore[attr-defined]

    def _drain_router(self, now_ns: int) -> None:
        r = self.router
        assert r is not None
        for _ in range(_RECV_BATCH):
            if not r.getsockopt(zmq.EVENTS) & _POLLIN:
                return  # drained (cheaper than letting recv raise Again)
            parts = r.recv_multipart(_NOBLOCK)
            if len(parts) != 2:
                self._bad("malformed", "router")
                continue
            rid, frame = parts
            try:
                msg = decode(frame, self.secret)
            except FrameRejected as e:
                self._bad(e.reason, "router")
                continue
            if not isinstance(msg, Ping):
                self._bad("type", "router")
                continue
            if not self.ping_guard.accept(msg.identity, msg.nonce):
                self._bad("replay", "router")
                continue
            self.suspicion.inbound(now_ns)
            self.watchers[rid] = now_ns
            self._inbound_evidence(msg, now_ns)
            full = wants_full_digest(msg, self.identity, self._dgen)
            ack = encode_ack_raw(msg.nonce, self.identity, self.address or "-", self._dgen,
                                 self._dbody if full else None, self.secret)
            try:
                r.send(rid, _MORE)
                r.send(ack, _NOBLOCK)
                self.w.count("pings_answered")  # type: ignore[attr-defined]
            except zmq.ZMQError as e:  # EHOSTUNREACH (gone), EAGAIN (slow reader)
                self._rate_log("ack", "pinger: ack to a watcher not sent: %s", e)

    @property
    def _authenticated(self) -> bool:
        """Frames are authenticated: HMAC with the shared secret, or CURVE."""
        return self.secret is not None or bool(self.cfg.curve_keys)

    def _inbound_evidence(self, msg: Ping, now_ns: int) -> None:
        """A followed host's own ping as evidence that its pinger runs, if
        ``shmhb.evidence`` says it counts."""
        t = self.targets.get(msg.address)
        if t is None or not counts_as_evidence(msg, authenticated=self._authenticated, known=t.identity,
                                               last_nonce=t.evidence_nonce, me=self.identity,
                                               my_gen=self._dgen):
            return
        t.evidence_nonce = msg.nonce
        self.w.count("pings_evidence")  # type: ignore[attr-defined]
        old = self.suspicion.on_evidence(t.state, now_ns)
        self.rows.peer_status(t.row, t.gen, t.state.status, now_ns)
        self.plan.evidence(t.address, now_ns)
        if old is not None:
            log.info("pinger: host %s %s -> alive (its own ping)", t.address, old.value)
            self.w.changed()  # type: ignore[attr-defined]

    # -- the local digest, and pushes -----------------------------------------------------

    def flush(self, now_ns: int) -> None:
        """Rebuild the digest of local slots if anything changed, and push deaths, leaves
        and restarts to the hosts that pinged us recently (batched: see _PUSH_GAP_NS)."""
        for e in self._rebuild_digest():
            self._unpushed[e.key] = e  # the latest change of a slot wins
        if not self._unpushed:
            return
        if self.router is None or not self.watchers:
            self._unpushed.clear()  # nobody to tell: a watcher's next ack tells it all
            return
        if self._last_push_ns is not None and now_ns - self._last_push_ns < _PUSH_GAP_NS:
            return  # held back: a later flush sends everything held so far in one push
        self._last_push_ns = now_ns
        entries, self._unpushed = list(self._unpushed.values()), {}
        self._push(entries)

    def _rebuild_digest(self) -> list[DigestEntry]:
        """Rebuild the digest if a local slot changed; returns the changes worth a push."""
        b = self.b
        hb, v, now = b.snapshot()
        codes, _ = judge_local_array(hb, v, int(now), b.thresholds)
        key = (codes.tobytes(), (hb >> np.uint64(INC_SHIFT)).tobytes())
        if key == self._dkey:
            return []
        self._dkey = key
        entries: dict[str, DigestEntry] = {}
        for i in np.flatnonzero(codes):
            info = b._read_slot(int(i))
            if info is None:
                continue
            k, pid, inc, eps = info
            if (int(hb[i]) >> INC_SHIFT) != inc & INC_MASK:
                continue
            entries[k] = DigestEntry(k, inc, int(codes[i]), pid,
                                     int((int(now) - (int(hb[i]) & ((1 << 39) - 1))) * 1.048576), eps)
        news = [e for k, e in entries.items()
                if (old := self._dentries.get(k)) is None or old.incarnation != e.incarnation
                or (old.status != e.status and e.status in (Status.DEAD.code, Status.LEFT.code))]
        if [(e.key, e.incarnation, e.status) for e in entries.values()] == [
                (e.key, e.incarnation, e.status) for e in self._dentries.values()]:
            return []
        self._dentries = entries
        self._dgen += 1
        items = list(entries.values())[:MAX_ACK_ENTRIES]
        self._dbody = encode_entries(items)
        return news

    def _push(self, entries: list[DigestEntry]) -> None:
        for k in range(0, len(entries), MAX_PUSH_ENTRIES):
            self._push_seq = max(self._push_seq + 1, time.time_ns())
            frame = encode_push(Push(self.identity, self.address or "-", self._push_seq,
                                     self._dgen, tuple(entries[k:k + MAX_PUSH_ENTRIES])),
                                self.secret)
            for rid in list(self.watchers):
                try:
                    self.router.send(rid, _MORE)  # type: ignore[union-attr]
                    self.router.send(frame, _NOBLOCK)  # type: ignore[union-attr]
                    self.w.count("pushes_sent")  # type: ignore[attr-defined]
                except zmq.ZMQError:
                    del self.watchers[rid]  # that connection is gone; its host re-pings us

    # -- bad input --------------------------------------------------------------------------

    def _bad(self, reason: str, source: str) -> None:
        self.w.count(f"bad_{reason}")  # type: ignore[attr-defined]
        self._rate_log(reason, "pinger: dropped a bad frame from %s (%s)", source, reason)

    def _rate_log(self, what: str, msg: str, *args: object) -> None:
        now = time.monotonic_ns()
        last = self._last_log.get(what)
        if last is None or now - last >= _LOG_EVERY_NS:
            self._last_log[what] = now
            log.warning(msg + " [further ones logged at most every 10 s]", *args)

    def close(self) -> None:
        if self.client is not None:
            self.client.close(0)
        if self.router is not None:
            self.router.close(0)
        auth = getattr(self, "_auth", None)
        if auth is not None:
            auth.stop()
        self.ctx.term()
