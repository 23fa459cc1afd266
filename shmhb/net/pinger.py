"""The network half of the host agent: one ZMQ pinger per host.

It pings the pinger of every host that local processes watch (or that ``--peer``
names), answers the pings of others with a digest of this host's slots, writes what it
learns into the board's peer and remote tables, and pushes local deaths, leaves and
restarts at once to the hosts that watch us.  The wire format is ``shmhb.net.protocol``;
verdicts on hosts are decided by ``shmhb.net.suspicion``; table writes by ``shmhb.net.rowwriter``;
sockets by ``shmhb.net.transport``; settings by ``shmhb.net.settings``.  ``shmhb.net.supervisor`` runs
it inside the agent loop, records its state and restarts it after a failure.

Sockets: one ROUTER bound to the listen address answers pings and sends pushes back over
the connection each watcher opened; one more ROUTER, connected to every followed host
under a routing id of our choosing (CONNECT_ROUTING_ID), sends our pings and receives
acks and pushes.  Two sockets whatever the number of hosts, so one wake-up of the loop
costs the same for 2 hosts or 256.

One NetworkHalf is one run with one set of settings: it is built with them (raising
``NetDown`` if it cannot run as configured: it never runs with less security than
configured) and replaced by a new one when they change.

Bounds: what a followed host may speak for is ``shmhb.net.following``; a push never creates
a row for a key the last full ack did not list; at most ``MAX_DIGEST_ENTRIES`` rows per
host; incoming frames cost at most ``DRAIN_BUDGET_NS`` per wake-up and
``INTAKE_PER_TICK_NS`` per tick.
"""

from __future__ import annotations

import errno
import logging
import os

import zmq

from .badinput import BadInput
from ..board.handle import Board
from ..board.core import board_words
from ..clock import Clock
from ..board.config import PingerConfig, parse_hostport
from ..errors import InvalidConfig
from .settings import board_group, load_config, read_secret, store_config  # re-exported
from .state import AgentWords, NetDown, NetReason
from .exchange import OutstandingPings, ReplayGuard, is_goodbye
from .protocol import (
    MAX_ACK_ENTRIES, U32_MAX, Ack, FrameRejected, Identity, Ping, Push, Secrets, decode,
    encode_ping,
)
from .responder import DRAIN_BUDGET_NS, PUSH_GAP_NS, RECV_BATCH, Responder  # PUSH_GAP_NS re-exported
from .evidence import echoed, issue, new_challenge
from .evidence import counts_as_evidence, passive
from .following import Target, confirm_now, names_another
from .following import Following
from .reports import Reports
from ..board.layout import units_to_ns
from .plan import PingPlan
from ..ratelog import RateLimitedLog
from .rowwriter import RowWriter
from .exchange import COUNTER_WORD, SendCounter
from ..status import Status
from .suspicion import Suspicion
from .transport import MORE, NOBLOCK, POLLIN, Transport, TransportFactory, recv_routed

log = logging.getLogger(__name__)

_RETRY_NS = 50_000_000  # ping retry period while a host's connection is down


#: Time the network half may spend on incoming frames between two ticks (a flood costs
#: at most this share of a core: 5 % at the default 100 ms tick).
INTAKE_PER_TICK_NS = 5_000_000


class NetworkHalf:
    """The pinger, as a component of the agent loop (see ``shmhb.agent.role``), for settings
    generation ``cfg_gen``.  Raises ``NetDown`` if it cannot run as configured; what it
    made by then is closed."""

    def __init__(self, board: Board, writer: AgentWords, clock: Clock, cfg_gen: int,
                 cfg: PingerConfig, *, transport: TransportFactory = Transport) -> None:
        self.b = board
        self.w = writer
        self.clock = clock
        self.cfg_gen = cfg_gen
        self.cfg = cfg
        assert cfg.listen, "no network half without a listen address"
        self.secret: Secrets | None = None
        self.plain = not cfg.curve_keys and not cfg.secret_file  # frames unauthenticated
        self._secret_seen: tuple[int, int, int] | None = None  # the file as last read
        self._next_secret_check_ns = 0
        if cfg.secret_file:
            self._secret_seen = _file_state(cfg.secret_file)
            try:
                self.secret = read_secret(cfg.secret_file, shared_gid=board_group(board))
            except InvalidConfig as e:
                raise NetDown(NetReason.SECRET, str(e)) from None
        self.address = cfg.listen
        self.host, self.port = parse_hostport(cfg.listen)
        self.rows = RowWriter(board)
        self.identity = Identity(board_words(board).boot_id, board.board_inc)
        self.net = transport(cfg.curve_keys)
        try:
            self.router: zmq.Socket[bytes] | None = self.net.listen(self.host, self.port)
        except BaseException:
            self.net.close()
            raise
        self.client: zmq.Socket[bytes] | None = None
        self.pollables_gen = 0  # moves whenever the set of sockets to poll changes
        self._intake_ns = 0  # time spent on incoming frames since the last tick
        self._muted = False
        self._linger_ms = 0  # a goodbye was sent: let close() flush it (see leave)
        self.outstanding = OutstandingPings()
        self.push_guard = ReplayGuard()
        self.suspicion = Suspicion(board.thresholds, late_ns=int(0.25e9))
        self.plan = PingPlan(cfg.ping_budget_pps, int(cfg.interval_s * 1e9),
                             units_to_ns(board.thresholds.peer_dead))
        self._next_expire_ns = 0
        # nonces and push seqs: one counter that only grows per board identity
        self.counter = SendCounter(board_words(board).words, COUNTER_WORD)
        self._nonce = 0
        self._ratelog = RateLimitedLog(log, now_ns=clock.monotonic_ns)
        self.following = Following(board, self.net, self.rows, writer, self.plan,
                                   self.outstanding, self._ratelog, cfg.listen)
        self.bad_input = BadInput(writer, self.rows, self.following.targets, self._ratelog,
                                  clock.monotonic_ns, units_to_ns(board.thresholds.peer_dead))
        self.reports = Reports(board, self.rows, writer, self.bad_input.bad,
                               self.following.alias_hosts, self._ratelog.warn)
        assert self.router is not None
        self.responder = Responder(board, self.router, self.identity, self.address,
                                   self.secret, self.suspicion, clock, writer.count,
                                   self.bad_input.bad, self.bad_input.rate_log,
                                   self._inbound_evidence, self.bad_input.bad_auth_ping,
                                   counter=self.counter)
        log.info("pinger settings applied: listen %s, interval %.3f s, budget %g pings/s, auth %s",
                 cfg.listen, cfg.interval_s, cfg.ping_budget_pps,
                 "hmac" if self.secret else "curve" if cfg.curve_keys else "none")

    @property
    def targets(self) -> dict[str, Target]:
        """The followed hosts by address (``Following``'s)."""
        return self.following.targets

    @property
    def skipped(self) -> dict[str, tuple[NetReason, str]]:
        """Hosts not followed, with why (``Following``'s): the half reads degraded."""
        return self.following.skipped

    def _inbound_evidence(self, msg: Ping, now_ns: int, source: str | None) -> bool:
        """A followed host's own ping as evidence that its pinger runs, if
        ``shmhb.net.evidence`` says it counts (the responder calls this for each ping).
        Returns whether it is that host's own (authenticated, or echoing a challenge of
        ours: ``shmhb.net.evidence``); the responder keeps such watchers apart.

        Which followed host sent it: the one whose acks established the identity it
        names, else the one at the address it names.  The address proves nothing (see
        ``shmhb.net.evidence``) and may not be one we know the host by (NAT, a name)."""
        t = self.following.by_identity.get(msg.identity) or self.targets.get(msg.address)
        if t is None:
            return False
        authenticated = self.secret is not None or bool(self.cfg.curve_keys)
        if authenticated:
            self.bad_input.auth_passed(t)  # its ping passed authentication
        elif msg.challenge and msg.identity == t.identity:
            t.their_challenge = msg.challenge  # echoed in our next pings to it
        ours = authenticated or echoed(t.issued, msg.echo)
        if not counts_as_evidence(msg, authenticated=authenticated, known=t.identity,
                                  last_nonce=t.evidence_nonce, me=self.identity,
                                  my_gen=self.responder.digest.gen, echoed=ours):
            return ours
        t.evidence_nonce = msg.nonce
        self.w.count("pings_evidence")
        if msg.gen and t.digest_gen and msg.gen != t.digest_gen and confirm_now(t, now_ns):
            # its ping says our copy of its digest is behind (a push lost, or a change
            # only an ack may tell): ask now, as a push that needs confirming does
            self.w.count("pings_confirm")
            self._ping(t, now_ns)
        old = self.suspicion.on_evidence(t.state, now_ns)
        if old is not None:  # as in _on_ack: pings sent before it was back measure nothing
            t.rtt_from_nonce = self.counter.peek()
            self.rows.clear_rtt(t.row)
        self.rows.peer_status(t.row, t.gen, t.state.status, now_ns)
        assert t.identity is not None  # counts_as_evidence checked it
        self.plan.evidence(t.address, now_ns, passive=passive(self.identity, t.identity))
        if old is not None:
            log.info("pinger: host %s %s -> alive (its own ping)", t.address, old.value)
            self.w.changed()
        return True

    # -- Component interface ----------------------------------------------------------------

    def pollables(self) -> list[zmq.Socket[bytes] | int]:
        # The listen socket is not polled: pings to us are answered once per tick, all
        # that came in since the last one together (see tick); nor is the client once
        # the intake of this tick is spent (see on_ready).
        return [self.client] if self.client is not None and not self._muted else []

    def on_ready(self, what: zmq.Socket[bytes] | int, now_ns: int) -> None:
        t0 = self.clock.monotonic_ns()
        if what is self.router:
            self.responder.drain(now_ns)
        elif what is self.client:
            self._drain_client(now_ns)
        # Bounded per tick, not only per wake-up (a flooded socket stays readable):
        # past INTAKE_PER_TICK_NS the sockets leave the poll until the next tick and
        # frames wait in ZMQ's queue (then TCP pushes back on the flooder).
        self._intake_ns += self.clock.monotonic_ns() - t0
        if self._intake_ns >= INTAKE_PER_TICK_NS and not self._muted:
            self._muted = True
            self.pollables_gen += 1
            self.w.count("intake_muted")

    def tick(self, now_ns: int, late_ns: int) -> None:
        self._intake_ns = 0
        if self._muted:
            self._muted = False
            self.pollables_gen += 1
        self.responder.drain(now_ns)  # pings to us: answered once per tick, all together
        f = self.following
        f.reconcile(now_ns)
        if self.client is None and f.targets:  # the first host followed: poll its socket
            self.client = self.net.client
            self.pollables_gen += 1
        self.flush(now_ns)
        for st, old, new in self.suspicion.tick(f.states(), now_ns):
            t = self.targets[st.address]
            log.info("pinger: host %s %s -> %s", t.address, old.value, new.value)
            self.rows.peer_status(t.row, t.gen, self.bad_input.shown(t, new, now_ns),
                                  st.last_ack_ns)
            self.w.changed()
        # Turns come from the plan (the budget, phased: see shmhb.net.plan).  A turn
        # counts as a ping for the verdict even if the host's connection is down.
        for a in self.plan.due(now_ns):
            due = self.targets.get(a)
            if due is not None:
                self.suspicion.on_ping(due.state, now_ns)
                self._ping(due, now_ns)
        # No connection to its pinger: silence accrues as usual; we try again every
        # tick (a failed send costs no message), so a restarted pinger is confirmed at once.
        for a in list(f.down):
            down = self.targets.get(a)
            if down is None:
                f.down.discard(a)
            elif now_ns >= down.next_ping_ns:
                self._ping(down, now_ns)
        if now_ns >= self._next_expire_ns:  # once a second: O(watchers)
            self._next_expire_ns = now_ns + 1_000_000_000
            self.responder.expire(now_ns - 3 * units_to_ns(self.b.thresholds.peer_dead))
            self._reload_secret()
        self.bad_input.expire(now_ns)
        self.reports.settle(now_ns, self.targets)

    def _reload_secret(self) -> None:
        """Take up a rewritten secret file (a rotation, docs/OPERATIONS.md), checked once
        a second: one stat.  A file that no longer passes ``read_secret`` leaves the
        secrets in use as they are (never weaker), with a warning at most every 10 s."""
        path = self.cfg.secret_file
        if not path:
            return
        seen = _file_state(path)
        if seen == self._secret_seen:
            return
        try:
            secret = read_secret(path, shared_gid=board_group(self.b))
        except InvalidConfig as e:
            self._ratelog.warn("secret-reload", "pinger: keeping the secrets in use: %s", e)
            return
        self._secret_seen = seen
        if secret != self.secret:
            self.secret = self.responder.secret = secret
            log.info("pinger: secret file reloaded (%s)", "two secrets: a rotation"
                     if secret.also is not None else "one secret")

    # -- pings and acks -------------------------------------------------------------------

    def _ping(self, t: Target, now_ns: int) -> bool:
        """Send one ping; False if the host's connection is down (nothing is queued)."""
        self._nonce = self.counter.next()
        # Without authentication, a challenge for it to echo (shmhb.net.evidence).
        ch = new_challenge() if self.plain else 0
        frame = encode_ping(Ping(self.identity, self.address, self._nonce, t.digest_gen,
                                 t.identity, ch, t.their_challenge if ch else 0,
                                 self.responder.digest.gen), self.secret)
        c = self.client
        assert c is not None
        try:
            c.send(t.rid, MORE)
            c.send(frame, NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            t.next_ping_ns = now_ns + _RETRY_NS
            if t.reachable:
                t.reachable = False
                self.following.down.add(t.address)
                log.warning("pinger: no connection to %s (nothing listens there, its name "
                            "does not resolve, or the network is down); retrying every tick",
                            t.address)
            return False
        if not t.reachable:
            t.reachable = True
            self.following.down.discard(t.address)
            log.info("pinger: connection to %s is back", t.address)
        self.outstanding.add(t.address, self._nonce, now_ns)
        if ch:
            t.issued = issue(t.issued, ch)
        self.w.count("pings_sent")
        return True

    def _drain_client(self, now_ns: int) -> None:
        c = self.client
        assert c is not None
        deadline = self.clock.monotonic_ns() + DRAIN_BUDGET_NS
        for n in range(RECV_BATCH):
            if not int(c.getsockopt(zmq.EVENTS)) & POLLIN:
                return  # drained (cheaper than letting recv raise Again)
            if n & 7 == 7 and self.clock.monotonic_ns() >= deadline:
                self.w.count("drain_budget_spent")
                return  # the rest waits for the next wake-up, after the local watch
            rid, frame, source = recv_routed(c)
            t = self.following.by_rid.get(rid) if frame is not None else None
            if t is None or frame is None:  # not [routing id of a host we follow, frame]
                self.bad_input.bad("malformed", "client")
                continue
            try:
                msg = decode(frame, self.secret)
            except FrameRejected as e:
                self.bad_input.bad(e.reason, t.address)
                continue
            if isinstance(msg, Ack):
                self._on_ack(t, msg, now_ns, source)
            elif isinstance(msg, Push):
                self._on_push(t, msg, now_ns)
            else:
                self.bad_input.bad("type", t.address)

    def _on_ack(self, t: Target, a: Ack, now_ns: int, source: str | None = None) -> None:
        """``source``: the IP address the kernel says the ack's connection reaches."""
        sent = self.outstanding.take(t.address, a.nonce)
        if sent is None:
            self.bad_input.bad("unsolicited", t.address)  # replayed, duplicated or never asked for
            return
        if names_another(t, a.address, source):
            self.bad_input.bad("spoofed", t.address)  # e.g. another host's ack relayed by t
            return
        if source is not None:
            t.reached = source.lower()  # its endpoints may name it (a name's resolution)
        self.w.count("acks_received")
        self.bad_input.auth_passed(t)  # it passed: the secret is shared now
        if t.identity != a.identity:
            if t.identity is not None:
                log.info("pinger: %s has a new board (rebooted or recreated): its slots are new peers",
                         t.address)
            self.following.set_identity(t, a.identity)
            t.digest_gen = 0
            self.rows.peer_identity(t.row, a.identity)
            if not a.full:
                for held in t.remotes.values():
                    self.rows.free_remote(held.row)
                t.remotes.clear()
        if a.full:
            if a.cut:  # slots it has beyond these read GONE here: never silently
                self.w.count("digest_cut_seen")
                self._ratelog.warn(f"cut {t.address}", "pinger: %s holds more slots than "
                                   "one ack carries: the %d it sent are live ones first, the "
                                   "rest read GONE here (see its digest_cut warning)",
                                   t.address, len(a.entries))
            # a full ack says how old its body is: its workers' own beats on our clock
            aged = a.body_age_ms < U32_MAX
            retry = self.reports.digest(t, a.entries, now_ns,
                                        now_ns - a.body_age_ms * 1_000_000 if aged else None,
                                        self.following.share())
            t.digest_gen = 0 if retry else a.gen  # no room yet: the whole digest again
        elif a.gen != t.digest_gen:
            t.digest_gen = 0  # we do not hold what it thinks we hold: ask for all of it
        # else: the same digest, confirmed as of now.  The rows stay as they are: readers
        # take a remote worker's age from its host's last ack (remotereads._remote_age).
        old = self.suspicion.on_ack(t.state, now_ns, now_ns - sent)
        self.rows.peer_status(t.row, t.gen, t.state.status, now_ns)
        if old is not None:
            # Back (or first heard): the pings still unanswered were sent while it was
            # down or restarting and waited for it (1.5 s "rtt" after a restart): none
            # of their acks is a round trip.  Readers see no rtt until one is.
            t.rtt_from_nonce = self.counter.peek()
            self.rows.clear_rtt(t.row)
        elif a.nonce >= t.rtt_from_nonce:
            self.rows.peer_rtt(t.row, t.gen, now_ns - sent)
        if old is not None:
            log.info("pinger: host %s %s -> alive", t.address, old.value)
            self.w.changed()

    def _on_push(self, t: Target, p: Push, now_ns: int) -> None:
        """Apply pushed evidence of death, leave or restart.  Never makes anything ALIVE
        that was not: a push is not an answer to our ping.  Never creates a row: only
        keys the last full ack listed are touched (a new key waits for the next ack,
        which the push makes full), so a flood of pushes cannot fill the remote table."""
        if t.identity is None or p.identity != t.identity:
            self.bad_input.bad("unsolicited", t.address)  # we have no ack from that board yet
            return
        if not self.push_guard.accept(p.identity, p.seq):
            self.bad_input.bad("replay", t.address)
            return
        self.w.count("pushes_received")
        if is_goodbye(p):
            old = self.suspicion.on_leave(t.state)
            if old is not None:
                log.info("pinger: host %s %s -> left (it said goodbye)", t.address, old.value)
                self.rows.peer_status(t.row, t.gen, Status.LEFT, t.state.last_ack_ns)
                self.w.changed()
            return
        got = self.reports.push(t, p.entries, now_ns)
        if got.unlisted:
            self.w.count("push_unlisted")
        if got.changed or got.unlisted or got.ask:
            t.digest_gen = 0  # the next ack brings the whole truth
        if got.unlisted or got.ask:  # only an ack may say so: ask now, within a bound
            if confirm_now(t, now_ns):
                self.w.count("pings_confirm")
                self._ping(t, now_ns)
            else:
                self.plan.nudge(t.address)  # its next turn pings, even on a passive side

    def flush(self, now_ns: int) -> None:
        self.responder.flush(now_ns)

    def leave(self, now_ns: int) -> None:
        """A graceful stop: say goodbye to the hosts that watch us (they read us LEFT),
        unless a local worker lives (it takes the role over at once)."""
        live = [s.key for s in self.b.slots() if s.status in (Status.ALIVE, Status.SUSPECT)]
        if live:
            log.info("pinger: stopping with %d live local worker(s): no goodbye (one of "
                     "them takes the agent role over)", len(live))
            return
        told = self.responder.goodbye(now_ns)
        if told:
            self._linger_ms = 250  # let it go out; close() waits for at most that
            log.info("pinger: said goodbye to %d watching host(s)", told)

    def close(self) -> None:
        """Close every socket; never blocks (but for a goodbye: at most 250 ms)."""
        self.router = self.client = None
        self.net.close(self._linger_ms)


def _file_state(path: str) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of ``path``, or None where it cannot be read: what says the
    file was rewritten."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


__all__ = ["DRAIN_BUDGET_NS", "MAX_ACK_ENTRIES", "PUSH_GAP_NS", "NetworkHalf",
           "load_config", "store_config"]
