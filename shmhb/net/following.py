"""Which hosts the pinger follows, and what each may speak for: the watch table read
through the address door, one connection per followed host, rows adopted or freed, the
ping plan kept in step; and each followed host's record (``Target``) with the trust rules
applied to what arrives from it.

An object the network half (``pinger.NetworkHalf``) constructs and owns, given its
collaborators: the board, the transport, the row writer, the agent's words, the ping
plan, the outstanding pings and the rate-limited log.  It owns the followed set
(``targets``, by address and by routing id), the hosts skipped, and those whose
connection is down; the half reads them.  A stored watch
that fails the door (damaged, or written past it) or a host that cannot be connected to
(no CURVE key for it, an address ZMQ refuses) is skipped, reported in ``skipped`` (the
network half reads degraded) and tried again every ``SKIP_RETRY_NS``; never fatal.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..board.handle import Board
from ..board.core import board_words
from ..board.config import DEFAULT_PORT, format_hostport, parse_hostport
from ..errors import InvalidConfig, LockTimeout
from .evidence import host_ip
from .exchange import OutstandingPings
from .state import AgentWords, NetReason
from .plan import MIN_PINGS_PER_WINDOW, PingPlan
from .protocol import DigestEntry, Identity
from ..ratelog import RateLimitedLog
from .rowwriter import RemoteRow, RowWriter
from .suspicion import PeerState
from .transport import HostSkipped, Transport

# --- a followed host, and what it may speak for ---------------------------------------------
#
# What a followed host may speak for: the trust rules the pinger applies to what
# arrives on its connection to that host (pure functions, no I/O).
#
# An ack counts only on the connection to the address that was pinged (the caller
# matches it to a nonce sent there), naming as its own listen address the address that
# was pinged, the address the kernel says that connection reaches (a host followed by a
# name names the address the name resolved to), or a wildcard, which says nothing:
# otherwise it is another host's ack relayed.  One board identity may answer under
# several addresses (a host with several interfaces listening on all of them, a host
# followed by a name and by its address): each address is a path to it with its own
# verdict, and a host that answers our nonces reads alive under every address we reach
# it at.  An endpoint counts only from the host it names: a followed host cannot make
# another host's killed worker read ALIVE by listing that worker's endpoint.

_WILDCARDS = frozenset(("-", "0.0.0.0", "::", "*"))


@dataclass
class Target:
    """A followed host: its routing id on our client socket, our verdict, its rows."""

    address: str
    host: str
    rid: bytes
    endpoint: str
    state: PeerState
    row: int
    gen: int
    next_ping_ns: int  # retries while its connection is down (turns: the ping plan)
    reachable: bool = True
    evidence_nonce: int = 0  # highest nonce of its pings that counted as evidence
    #: acks to pings from this nonce on measure a round trip; earlier ones were sent
    #: while the host was not answering and waited for it to come back (see _on_ack)
    rtt_from_nonce: int = 0
    identity: Identity | None = None
    digest_gen: int = 0
    remotes: dict[str, RemoteRow] = field(default_factory=dict)
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None  # ``host`` if an IP literal
    #: the IP address our connection to it reaches, as the kernel reports it with its
    #: last ack that counted (``host`` itself for an IP literal; a name's resolution)
    reached: str | None = None
    confirm_ns: int = -(1 << 62)  # when a push last made us ping at once (pinger._on_push)
    capped: int = 0  # what its capped word says: slots not stored here (reports.Reports.digest)
    capped_since_ns: int = 0  # when that word was set (0: it reads 0)
    #: when its own frame last failed authentication here (badinput: it reads UNKNOWN)
    auth_failed_ns: int = -(1 << 62)
    # Challenges (shmhb.net.evidence), without a secret: the ones we sent it lately, and
    # the last one it sent us (echoed in our pings).
    issued: tuple[int, ...] = ()
    their_challenge: int = 0


#: at most one ping per host per this period is sent at once to confirm a push
CONFIRM_GAP_NS = 50_000_000


def confirm_now(t: Target, now_ns: int) -> bool:
    """Whether a push from ``t`` that told of what only an ack may say (a new key,
    ALIVE again: a push answers no nonce of ours) is confirmed by a ping sent now.  One
    round trip, so a new registration reaches the hosts that watch it about as fast as
    a death does: a KV connector must not take the dead predecessor at an address for
    the engine that replaced it.  A stream of forged pushes costs at most one such ping
    per ``CONFIRM_GAP_NS`` per host; past that the host's next turn asks."""
    if not t.reachable or now_ns - t.confirm_ns < CONFIRM_GAP_NS:
        return False
    t.confirm_ns = now_ns
    return True


def host_of(text: str) -> str | None:
    try:
        return parse_hostport(text)[0].lower()
    except InvalidConfig:
        return None


def names_another(t: Target, address: str, source: str | None) -> bool:
    """Whether an ack on ``t``'s connection names another host's listen address than
    the one we reach: neither ``t``'s address, nor a wildcard, nor ``source`` (the IP
    address the kernel says that connection reaches: a name we follow resolved to it)
    at ``t``'s port."""
    if address == t.address or address in _WILDCARDS:
        return False
    try:
        h, port = parse_hostport(address)
    except InvalidConfig:
        return True
    h = h.lower()
    if h in _WILDCARDS or address.lower() == t.address.lower():
        return False
    return source is None or h != source.lower() or port != parse_hostport(t.address)[1]


def own_hosts(t: Target) -> tuple[str, ...]:
    """The hosts ``t``'s endpoints may name: the one we follow it by, and the address
    our connection to it reaches (a name's resolution)."""
    return (t.host,) if t.reached is None or t.reached == t.host else (t.host, t.reached)


def own_endpoints(t: Target, e: DigestEntry) -> DigestEntry:
    """``e`` with only the endpoints on ``t``'s own host (``e`` itself if all are)."""
    mine = own_hosts(t)
    eps = tuple(ep for ep in e.endpoints if host_of(ep) in mine)
    if len(eps) == len(e.endpoints):
        return e
    return DigestEntry(e.key, e.incarnation, e.status, e.pid, e.age_ms, eps)


# --- the followed hosts -------------------------------------------------------------------

log = logging.getLogger("shmhb.net.pinger")

SKIP_RETRY_NS = 5 * 10**9


class Following:
    """The followed hosts of one network half."""

    def __init__(self, board: Board, net: Transport, rows: RowWriter, writer: AgentWords,
                 plan: PingPlan, outstanding: OutstandingPings, ratelog: RateLimitedLog,
                 me: str) -> None:
        """``me``: the half's listen address ("host:port"); the rest are the half's
        collaborators, shared with it (``rows`` writes the peer and remote rows,
        ``writer.changed()`` tells readers the board changed)."""
        self.b = board
        self.bw = board_words(board)
        self.net = net
        self.rows = rows
        self.w = writer
        self.plan = plan
        self.outstanding = outstanding
        self._ratelog = ratelog
        self.address = me
        self.host, self.port = parse_hostport(me)
        self.targets: dict[str, Target] = {}
        self.by_rid: dict[bytes, Target] = {}
        # by the board identity its acks established: how a host's own pings are told
        # apart, whatever address they name (NAT, a name: shmhb.net.evidence)
        self.by_identity: dict[Identity, Target] = {}
        self.skipped: dict[str, tuple[NetReason, str]] = {}  # address -> (reason, why)
        self.down: set[str] = set()  # targets whose connection is down: retried every tick
        self._states: list[PeerState] | None = None  # the targets' verdict states, cached
        self._adopted = rows.adopt_peers()  # rows an earlier holder left: address -> row
        self._watch_gen = -1
        self._next_reclaim_ns = 0
        self._next_skip_retry_ns = 0

    def states(self) -> list[PeerState]:
        """The followed hosts' verdict states (rebuilt only when the set changes)."""
        if self._states is None:
            self._states = [t.state for t in self.targets.values()]
        return self._states

    def _desired(self) -> tuple[set[str], dict[str, tuple[NetReason, str]]]:
        """Pinger addresses to follow: watched hosts, at the cluster's pinger port
        unless ``--peer`` gave that host another one; and the stored watches that do not
        pass the address door (an older version let them in), skipped, never fatal."""
        ports: dict[str, int] = {}
        bad: dict[str, tuple[NetReason, str]] = {}
        try:
            watched = self.bw.watches.watched_hosts()
            refused = self.bw.watches.refused_watches()
        except (UnicodeError, ValueError) as e:  # a row that does not even decode
            bad["(watch table)"] = (NetReason.ADDRESS, f"unreadable watch row: {e}")
            return set(self.targets), bad
        for text in refused:
            bad[text] = (NetReason.ADDRESS, f"stored watch address {text!r} is not valid "
                         "(written by an older shmhb?); unwatch it")
        specs = sorted(watched, key=lambda sp: ":" not in sp.split("]")[-1])
        for spec in specs:  # explicit host:port (from --peer) first: they win
            try:
                host, p = parse_hostport(spec, default_port=self.port or DEFAULT_PORT)
            except InvalidConfig as e:
                bad[spec] = (NetReason.ADDRESS, str(e))
                continue
            ports.setdefault(host, p)
        out = {format_hostport(h, p) for h, p in ports.items()}
        out.discard(self.address)
        return out, bad

    def _skip(self, address: str, reason: NetReason, why: str) -> None:
        self.skipped[address] = (reason, why)
        self._ratelog.warn(f"skip:{reason.label}", "pinger: not following %s: %s", address, why)

    def _add_target(self, address: str, now_ns: int) -> None:
        host, port = parse_hostport(address)
        rid = b"shmhb:" + address.encode()
        try:
            endpoint = self.net.connect(self.host, host, port, rid)
        except HostSkipped as e:
            self._skip(address, e.reason, str(e))
            return
        self.skipped.pop(address, None)
        adopted = self._adopted.pop(address, None)
        if adopted is not None:
            row, gen = adopted
            remotes = self.rows.adopt_remotes(row, gen)
        else:
            got = self.rows.new_peer(address)
            if got is None:
                self.net.disconnect(endpoint)
                return
            row, gen = got
            remotes = {}
        t = Target(address, host.lower(), rid, endpoint, PeerState(address), row, gen,
                    now_ns, remotes=remotes, ip=host_ip(host))
        if adopted is not None:  # an earlier holder's capped word stands until it settles
            t.capped = self.rows.capped_of(row, gen)
            t.capped_since_ns = now_ns if t.capped else 0
        self.targets[address] = t
        self.by_rid[rid] = t
        # what we know of it is nothing yet, whatever an earlier holder wrote there
        self.rows.peer_status(row, gen, t.state.status, 0)
        log.info("pinger: following %s", address)

    def set_identity(self, t: Target, identity: Identity) -> None:
        """``t``'s acks to our nonces established ``identity`` (a first ack, a reboot).
        Several followed addresses may hold one identity (one host reached under each):
        ``by_identity`` names the first, and another once that one lets it go."""
        old = t.identity
        t.identity = identity
        if old is not None:
            self._rehome(old, t)
        self.by_identity.setdefault(identity, t)

    def _rehome(self, identity: Identity, t: Target) -> None:
        """``t`` no longer holds ``identity``: another address that does stands for it."""
        if self.by_identity.get(identity) is t:
            other = next((o for o in self.targets.values()
                          if o is not t and o.identity == identity), None)
            if other is None:
                del self.by_identity[identity]
            else:
                self.by_identity[identity] = other

    def alias_hosts(self, t: Target) -> set[str]:
        """The hosts of every followed address that holds ``t``'s identity: endpoints on
        them that ``t``'s digest lists are the same host's, reached another way (not
        counted as spoofed; each address keeps those on its own host).  An address not
        heard from yet may turn out to be one: not counted either (the count is a
        diagnosis; the endpoint is dropped from ``t``'s rows all the same)."""
        return {h for o in self.targets.values()
                if o is t or o.identity is None or o.identity == t.identity
                for h in own_hosts(o)}

    def _drop_target(self, address: str) -> None:
        t = self.targets.pop(address)
        self.by_rid.pop(t.rid, None)
        if t.identity is not None:
            self._rehome(t.identity, t)
        self.net.disconnect(t.endpoint)
        self.outstanding.drop_peer(address)
        self.down.discard(address)
        for held in t.remotes.values():
            self.rows.free_remote(held.row)
        self.rows.free_peer(t.row)
        self.w.changed()
        log.info("pinger: no longer following %s", address)

    def reconcile(self, now_ns: int) -> None:
        """Follow what the watch table asks for now: add and drop targets, free the rows
        of hosts nobody follows, replan.  Cheap when the table has not changed."""
        if now_ns >= self._next_reclaim_ns:  # watches of processes that died unwatching
            self._next_reclaim_ns = now_ns + 1_000_000_000
            try:
                # Never wait for the registry lock here: its holder may be stopped, and
                # every second of waiting is a second nobody watches this host (5 s, and
                # the LockTimeout killed the agent).  Dead processes' watches can wait.
                self.bw.watches.reclaim_watches(timeout_s=0.005)
            except LockTimeout:
                self._ratelog.warn("reclaim", "pinger: registry lock busy; watches of dead "
                                   "processes are dropped later")
            except OSError as e:  # EMFILE reading /proc: later
                self._ratelog.warn("reclaim-os", "pinger: cannot check watch owners: %s", e)
        rg = self.bw.words[self.bw.reg_gen_index]
        if self.skipped and now_ns >= self._next_skip_retry_ns:
            self._next_skip_retry_ns = now_ns + SKIP_RETRY_NS
            self._watch_gen = -1  # try the skipped hosts again (a key may have appeared)
        if rg == self._watch_gen:
            return
        self._watch_gen = rg
        want, bad = self._desired()
        # hosts skipped at connect stay skipped while wanted; bad stored rows are
        # recomputed from the watch table on every pass
        self.skipped = {a: v for a, v in self.skipped.items() if a in want}
        for a, (reason, why) in bad.items():
            self._skip(a, reason, why)
        for a in list(self.targets):
            if a not in want:
                self._drop_target(a)
        for a in sorted(want - set(self.targets)):
            self._add_target(a, now_ns)
        self._reshare()
        self._replan(now_ns)
        for a, (row, _gen) in list(self._adopted.items()):
            if a not in want:  # rows of hosts nobody follows any more
                for held in self.rows.adopt_remotes(row, _gen).values():
                    self.rows.free_remote(held.row)
                self.rows.free_peer(row)
                del self._adopted[a]

    def share(self) -> int:
        """Remote rows each followed host may hold: an even share of the table, so one
        host listing thousands of workers cannot leave none for the others."""
        return self.b.sizes.nremote // max(1, len(self.targets))

    def _reshare(self) -> None:
        """The followed set changed: a host over its new share gives rows back, and one
        that was capped may get more, at its next full digest (asked for at its next
        ping)."""
        share = self.share()
        for t in self.targets.values():
            if t.capped or len(t.remotes) > share:
                t.digest_gen = 0

    def _replan(self, now_ns: int) -> None:
        self._states = None
        before = (self.plan.hosts, self.plan.interval_ns)
        self.plan.set_hosts(self.targets, now_ns)
        if self.plan.hosts and (self.plan.hosts, self.plan.interval_ns) != before:
            log.info("pinger: %d hosts, each pinged every %.2f s (%.0f pings/s; budget %g%s)",
                     self.plan.hosts, self.plan.interval_ns / 1e9, self.plan.rate_pps,
                     self.plan.budget_pps, ", exceeded to give each host %d pings per dead-after "
                     "window" % MIN_PINGS_PER_WINDOW if self.plan.over_budget else "")
