"""Which hosts the pinger follows: the watch table read through the address door, one
connection per followed host, rows adopted or freed, the ping plan kept in step.

A mixin of ``pinger.NetworkHalf`` (its attributes are the half's own).  A stored watch
that fails the door (an older version let it in) or a host that cannot be connected to
(no CURVE key for it, an address ZMQ refuses) is skipped, reported in ``skipped`` (the
network half reads degraded) and tried again every ``SKIP_RETRY_NS``; never fatal.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import DEFAULT_PORT, format_hostport, parse_hostport
from .errors import InvalidConfig, LockTimeout
from .evidence import host_ip
from .followed import Target
from .netstate import NetReason
from .pingplan import MIN_PINGS_PER_WINDOW
from .suspicion import PeerState
from .transport import HostSkipped

log = logging.getLogger("shmhb.pinger")

SKIP_RETRY_NS = 5 * 10**9


class Following:
    """Target bookkeeping of the network half."""

    b: Any
    net: Any
    rows: Any
    w: Any
    plan: Any
    host: str
    port: int
    address: str
    targets: dict[str, Target]
    skipped: dict[str, tuple[NetReason, str]]
    _by_rid: dict[bytes, Target]
    _adopted: dict[str, tuple[int, int]]
    _down: set[str]
    _states: list[PeerState] | None
    _watch_gen: int
    _next_reclaim_ns: int
    _next_skip_retry_ns: int
    client: Any
    pollables_gen: int
    outstanding: Any

    def _rate_log(self, what: str, msg: str, *args: object) -> None: ...

    def _desired(self) -> tuple[set[str], dict[str, tuple[NetReason, str]]]:
        """Pinger addresses to follow: watched hosts, at the cluster's pinger port
        unless ``--peer`` gave that host another one; and the stored watches that do not
        pass the address door (an older version let them in), skipped, never fatal."""
        ports: dict[str, int] = {}
        bad: dict[str, tuple[NetReason, str]] = {}
        try:
            watched = self.b.watched_hosts()
            refused = self.b.refused_watches()
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
        self._rate_log(f"skip:{reason.label}", "pinger: not following %s: %s", address, why)

    def _add_target(self, address: str, now_ns: int) -> None:
        host, port = parse_hostport(address)
        rid = b"shmhb:" + address.encode()
        try:
            endpoint = self.net.connect(self.host, host, port, rid)
        except HostSkipped as e:
            self._skip(address, e.reason, str(e))
            return
        self.skipped.pop(address, None)
        if self.client is None:
            self.client = self.net.client
            self.pollables_gen += 1
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
        self.targets[address] = t
        self._by_rid[rid] = t
        # what we know of it is nothing yet, whatever an earlier holder wrote there
        self.rows.peer_status(row, gen, t.state.status, 0)
        log.info("pinger: following %s", address)

    def _drop_target(self, address: str) -> None:
        t = self.targets.pop(address)
        self._by_rid.pop(t.rid, None)
        self.net.disconnect(t.endpoint)
        self.outstanding.drop_peer(address)
        self._down.discard(address)
        for held in t.remotes.values():
            self.rows.free_remote(held.row)
        self.rows.free_peer(t.row)
        self.w.changed()
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
            except OSError as e:  # EMFILE reading /proc: later
                self._rate_log("reclaim-os", "pinger: cannot check watch owners: %s", e)
        rg = self.b.words[self.b.reg_gen_index]
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
        self._replan(now_ns)
        for a, (row, _gen) in list(self._adopted.items()):
            if a not in want:  # rows of hosts nobody follows any more
                for held in self.rows.adopt_remotes(row, _gen).values():
                    self.rows.free_remote(held.row)
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
