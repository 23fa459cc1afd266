"""``shmhb exporter``: the board as Prometheus metrics.

A custom collector reads the board once per scrape (one ``View``: lock-free, one
syscall) and turns it into metric families, so a scrape costs one board read however
many metrics it yields, and a board nobody scrapes costs nothing.  Every metric is
documented in docs/METRICS.md; keep the two in step.

The exporter follows the board's name, not one mapping: if the board is removed
(``shmhb gc``) or recreated (a reboot, a crashed creator), the next scrape reports
``shmhb_board_up 0`` or attaches to the new board.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..board.handle import Board
from ..board.config import board_name as _board_name
from ..errors import BoardNotFound, ShmhbError
from .gc import shm_path
from .httpserve import BoundedHandler, BoundedServer, BoundedServer6
from .instview import BoardInstances, with_instances
from ..board.records import shown  # label values escaped (keys reach dashboards)
from ..status import PeerStatus, Status
from .view import View, read_view

log = logging.getLogger(__name__)

DEFAULT_PORT = 9645
STATUSES = tuple(Status)
NETWORK_STATES = ("not configured", "starting", "listening", "degraded", "unknown")
#: worker incarnations remembered to count restarts, at most (one scrape sees at most
#: the board's slots and remote rows; this bounds a board made larger than that)
MAX_REMEMBERED = 16384

#: board counters (``Board.stats``) exported as plain counters, by metric name
MESSAGE_COUNTERS = {
    "pings_sent": ("shmhb_pings_sent", "Pings this host's pinger sent to remote hosts."),
    "acks_received": ("shmhb_acks_received", "Valid acks this host's pinger received."),
    "pings_answered": ("shmhb_pings_answered", "Pings from remote hosts this pinger answered."),
    "pings_evidence": ("shmhb_pings_evidence", "Pings from followed hosts that counted as "
                       "evidence of their pinger running (authenticated, or from the host's "
                       "own address)."),
    "pushes_sent": ("shmhb_pushes_sent", "Digest pushes this pinger sent."),
    "pushes_received": ("shmhb_pushes_received", "Digest pushes this pinger received."),
    "pings_confirm": ("shmhb_pings_confirm", "Pings sent at once because a push told of a "
                      "change only an ack may confirm (a new registration, ALIVE again)."),
    "digest_cut": ("shmhb_digest_cut", "Local slots left out of a new digest generation because "
                   "the digest was full (dead and left slots go first): other hosts read them gone."),
    "digest_cut_seen": ("shmhb_digest_cut_seen", "ACKs from followed hosts whose digest was "
                        "cut at the sender: their slots past the cut read gone here."),
    "pings_refused": ("shmhb_pings_refused", "Pings that failed authentication, answered "
                      "with a refusal (their sender holds another secret)."),
    "remote_capped": ("shmhb_remote_capped", "Workers listed by followed hosts and not stored "
                      "here, past each host's share of the remote table: they read unknown."),
}


def _build_info(native: bool) -> Metric:
    """``shmhb_build_info``: 1, labelled with what this exporter runs (the Prometheus
    convention for a build's version)."""
    import platform

    from ..version import __version__

    g = GaugeMetricFamily("shmhb_build_info", "Always 1; the labels say which shmhb runs: "
                          "its version, whether the C hot path is active, the Python version.",
                          labels=["version", "native", "python"])
    g.add_metric([__version__, "true" if native else "false", platform.python_version()], 1)
    return g


def _peer_auth_metrics(peers: Sequence[PeerStatus]) -> Iterator[Metric]:
    """Frames from each followed host that failed authentication, and whether it fails
    now (a secret that differs between two hosts reads as a dead host otherwise)."""
    c = CounterMetricFamily("shmhb_peer_bad_auth_frames", "Frames from each followed remote "
                            "host (acks to our pings, its own pings) that failed "
                            "authentication.", labels=["peer"])
    g = GaugeMetricFamily("shmhb_peer_auth_failing", "1 while the last frame from a followed "
                          "remote host failed authentication (the secrets differ).",
                          labels=["peer"])
    for p in peers:
        c.add_metric([p.address], p.auth_failures)
        g.add_metric([p.address], 1 if p.auth_failing else 0)
    yield c
    yield g

class BoardCollector:
    """Collects one board's metrics; safe to call from concurrent scrapes.

    Besides the board's own counters it keeps one piece of state: the incarnation of
    every worker the last scrape saw, to count restarts (``RestartCounter``).
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = _board_name(name)
        self._lock = threading.Lock()
        self._board: Board | None = None
        self._ino = 0
        self.restarts = RestartCounter()

    # -- following the board by name -----------------------------------------------------

    def _inode(self) -> int:
        try:
            return os.stat(shm_path(self.name)).st_ino
        except FileNotFoundError:
            return 0

    def _current(self) -> Board | None:
        """The board now behind the name: reattach if it was replaced, None if absent."""
        ino = self._inode()
        if self._board is not None and ino == self._ino and ino:
            return self._board
        if self._board is not None:
            log.info("board %s was removed or replaced; reattaching", self.name)
            self._board.close()
            self._board = None
        if not ino:
            return None
        try:
            board = Board.attach(self.name)
        except BoardNotFound:
            return None
        self._board, self._ino = board, ino
        return board

    def _native(self) -> bool:
        from ..board.native import native
        return bool(native)

    def close(self) -> None:
        with self._lock:
            if self._board is not None:
                self._board.close()
                self._board = None

    # -- the scrape ------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, why) for ``/readyz``: the board exists and an agent observes it."""
        with self._lock:
            try:
                board = self._current()
                view = None if board is None else read_view(board)
            except ShmhbError as e:
                return False, f"board {self.name!r} cannot be read: {e}"
        if view is None:
            return False, f"no board {self.name!r} on this host"
        why = view.agent_problem()
        return (why is None), (why or f"board {self.name}: agent pid {view.agent.pid} alive")

    def collect(self) -> Iterator[Metric]:
        yield _build_info(self._native())
        with self._lock:
            up = GaugeMetricFamily("shmhb_board_up",
                                   "1 if the board exists and was read by this scrape.")
            try:
                board = self._current()
                view = None if board is None else read_view(board)
            except ShmhbError as e:
                log.warning("board %s cannot be read: %s", self.name, e)
                view = None
            up.add_metric([], 0 if view is None else 1)
            yield up
            if view is None or board is None:
                return
            yield from self._families(view, board.capacity.slots)

    def _families(self, view: View, capacity: int) -> Iterator[Metric]:
        self.restarts.observe(view)
        yield from _slot_families(view, capacity)
        yield from _agent_families(view)
        yield from _network_families(view)
        yield from _peer_families(view)
        yield from _peer_auth_metrics(view.peers)
        yield from _counter_families(view)
        yield from self._restart_families()

    def _restart_families(self) -> Iterator[Metric]:
        yield CounterMetricFamily("shmhb_restarts", "Local workers seen with a new incarnation, "
                                  "as observed by this exporter since it started.",
                                  value=self.restarts.local)
        c = CounterMetricFamily("shmhb_remote_restarts", "Workers of each remote host seen with a "
                                "new incarnation, as observed by this exporter since it started.",
                                labels=["peer"])
        for host, n in sorted(self.restarts.remote.items()):
            c.add_metric([host], n)
        yield c
        yield GaugeMetricFamily("shmhb_restart_keys", "Workers (host and key) whose incarnation "
                                "this exporter remembers to count restarts: those its last "
                                f"scrape saw, at most {MAX_REMEMBERED}.",
                                value=self.restarts.remembered)
        yield CounterMetricFamily("shmhb_restart_keys_over_limit", "Workers a scrape saw past "
                                  "the limit of remembered incarnations (their restarts are "
                                  "not counted).",
                                  value=self.restarts.over_limit)


class RestartCounter:
    """Restarts seen scrape to scrape: a worker (host and key) whose incarnation changed
    since the last scrape.  Two restarts of one worker between two scrapes count once.
    Only what the last scrape saw is remembered: a key gone from the board or from a
    followed host's rows is forgotten (it counts as new if it comes back), as is a host
    no longer followed; and at most ``limit`` keys, those past it counted in
    ``over_limit``.  (Remembering every key ever seen grew to 12,000 entries on a
    64-slot board: vLLM rank keys carry a per-process engine id.)"""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._incs: dict[tuple[str, str], int] = {}
        self.local = 0
        self.remote: dict[str, int] = {}  # host -> restarts seen there
        self.over_limit = 0

    @property
    def remembered(self) -> int:
        return len(self._incs)

    def observe(self, view: View) -> None:
        seen: dict[tuple[str, str], int] = {}
        remote: dict[str, int] = {}
        for host, slots in [("", view.slots)] + [(p.address, p.slots) for p in view.peers]:
            if host:
                remote[host] = self.remote.get(host, 0)
            for s in slots:
                k = (host, s.key)
                if len(seen) >= self.limit and k not in seen:
                    self.over_limit += 1
                    continue
                old = self._incs.get(k)
                if old is not None and old != s.incarnation:
                    if host:
                        remote[host] += 1
                    else:
                        self.local += 1
                seen[k] = s.incarnation
        self._incs, self.remote = seen, remote


def _slot_families(view: View, capacity: int) -> Iterator[Metric]:
    yield GaugeMetricFamily("shmhb_board_capacity_slots", "Local slots the board has room for.",
                            value=capacity)

    st = GaugeMetricFamily("shmhb_slot_status", "Status of each local worker slot: 1 for "
                           "its current status, 0 for the others.", labels=["key", "status"])
    age = GaugeMetricFamily("shmhb_slot_age_seconds",
                            "Seconds since each local worker's last heartbeat.", labels=["key"])
    inc = GaugeMetricFamily("shmhb_slot_incarnation",
                            "Incarnation of each local worker's registration.", labels=["key"])
    for s in view.slots:
        for x in STATUSES:
            st.add_metric([shown(s.key), x.value], 1 if s.status is x else 0)
        age.add_metric([shown(s.key)], s.age_s)
        inc.add_metric([shown(s.key)], s.incarnation)
    yield from (st, age, inc)


def _agent_families(view: View) -> Iterator[Metric]:
    a = view.agent
    yield GaugeMetricFamily("shmhb_agent_up", "1 if the host agent's heartbeat is fresh.",
                            value=1 if a.status is Status.ALIVE else 0)
    yield from _role_families(view)
    yield GaugeMetricFamily("shmhb_agent_term", "Takeover counter of the agent role.",
                            value=a.term)
    if a.age_s is not None:
        yield GaugeMetricFamily("shmhb_agent_heartbeat_age_seconds",
                                "Seconds since the host agent's last heartbeat.",
                                value=a.age_s)
    yield GaugeMetricFamily("shmhb_agent_loop_lateness_seconds",
                            "Worst lateness of the agent loop over its last one-second window.",
                            value=view.lateness_ms / 1000.0)


def _network_families(view: View) -> Iterator[Metric]:
    net = view.network
    g = GaugeMetricFamily("shmhb_network_state", "State of the agent's network half: 1 "
                          "for the current state, 0 for the others.", labels=["state"])
    for state in NETWORK_STATES:
        g.add_metric([state], 1 if net.state == state else 0)
    yield g
    g = GaugeMetricFamily("shmhb_network_degraded", "1 if the network half is configured "
                          "but not working, by reason (see `shmhb status`).",
                          labels=["reason"])
    g.add_metric([net.reason or "none"], 0 if net.working else 1)
    yield g
    yield GaugeMetricFamily("shmhb_network_skipped_hosts",
                            "Followed hosts the network half cannot ping (no key, bad address).",
                            value=net.skipped_hosts)
    yield GaugeMetricFamily("shmhb_health_exit_code",
                            "What `shmhb status` would exit with now (0: healthy).",
                            value=view.health()[0])


def _peer_families(view: View) -> Iterator[Metric]:
    pst = GaugeMetricFamily("shmhb_peer_status", "Status of each followed remote host: 1 "
                            "for its current status, 0 for the others.", labels=["peer", "status"])
    rtt = GaugeMetricFamily("shmhb_peer_rtt_seconds",
                            "Last ping round-trip time to each remote host.", labels=["peer"])
    ack = GaugeMetricFamily("shmhb_peer_last_ack_age_seconds",
                            "Seconds since each remote host last acked a ping.", labels=["peer"])
    rst = GaugeMetricFamily("shmhb_remote_slot_status", "Status of each worker on a remote "
                            "host: 1 for its current status, 0 for the others.",
                            labels=["peer", "key", "status"])
    rinc = GaugeMetricFamily("shmhb_remote_slot_incarnation",
                             "Incarnation of each worker on a remote host.", labels=["peer", "key"])
    for p in view.peers:
        for x in STATUSES:
            pst.add_metric([p.address, x.value], 1 if p.status is x else 0)
        if p.rtt_ms is not None:
            rtt.add_metric([p.address], p.rtt_ms / 1000.0)
        if p.age_s is not None:
            ack.add_metric([p.address], p.age_s)
        for s in p.slots:
            for x in STATUSES:
                rst.add_metric([shown(p.address), shown(s.key), x.value], 1 if s.status is x else 0)
            rinc.add_metric([shown(p.address), shown(s.key)], s.incarnation)
    yield from (pst, rtt, ack, rst, rinc)
    yield from _peer_auth_metrics(view.peers)


def _counter_families(view: View) -> Iterator[Metric]:
    stats = view.stats
    yield CounterMetricFamily("shmhb_deaths", "Worker deaths the host agent recorded through "
                              "process exit (kills and crashes; hangs are not counted).",
                              value=stats.get("deaths_seen", 0))
    c = CounterMetricFamily("shmhb_bad_frames", "Network frames the pinger dropped, by reason.",
                            labels=["reason"])
    for reason, n in view.bad_frames().items():
        c.add_metric([reason], n)
    yield c
    yield CounterMetricFamily("shmhb_agent_late_loops",
                              "Agent loop iterations that ran more than four ticks late.",
                              value=stats.get("loop_late", 0))
    yield CounterMetricFamily("shmhb_network_failures",
                              "Times the network half failed and was closed for a retry.",
                              value=stats.get("net_failures", 0))
    for stat, (name, doc) in MESSAGE_COUNTERS.items():
        yield CounterMetricFamily(name, doc, value=stats.get(stat, 0))


# -- the HTTP side ---------------------------------------------------------------------------


_Server, _Server6 = BoundedServer, BoundedServer6  # bounded: see shmhb.cli.httpserve


class _QuietHandler(BoundedHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - " + format, self.address_string(), *args)


def _role_families(view: View) -> Iterator[GaugeMetricFamily]:
    """Who holds the agent role, and whether a daemon runs (a stopped one shows here)."""
    yield GaugeMetricFamily("shmhb_agent_role_held",
                            "1 if a live process holds the host agent role.",
                            value=1 if view.agent_held else 0)
    yield GaugeMetricFamily("shmhb_daemon_up", "1 if a `shmhb pinger` daemon runs on the "
                            "board (holding the agent role or waiting for it).",
                            value=1 if view.daemon else 0)
    g = GaugeMetricFamily("shmhb_agent_holder", "Who holds the agent role: 1 for the "
                          "holder (daemon or worker: embedded in a worker), 0 for the "
                          "other.", labels=["holder"])
    for who in ("daemon", "worker"):
        g.add_metric([who], 1 if view.holder() == who else 0)
    yield g


def probes_app(collector: BoardCollector, metrics: Any) -> Any:
    """The exporter's WSGI app: ``/metrics`` (Prometheus), ``/healthz`` (200 while this
    exporter serves: its own liveness), ``/readyz`` (200 when the board exists and an
    agent observes it, 503 with the reason otherwise), 404 for anything else (naming the
    paths served, ``/instances`` included: ``with_instances`` answers it in front)."""
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            code, body = "200 OK", "ok"
        elif path == "/readyz":
            ready, why = collector.readiness()
            code, body = ("200 OK" if ready else "503 Service Unavailable"), why
        else:
            code, body = "404 Not Found", ("not found: /metrics, /healthz, /readyz, /instances, "
                                           "/instances/changes")
        data = (body + "\n").encode()
        start_response(code, [("Content-Type", "text/plain; charset=utf-8"),
                              ("Content-Length", str(len(data)))])
        return [data]
    return app


class Exporter:
    """An HTTP server with ``/metrics``, ``/healthz`` and ``/readyz`` for one board,
    serving from a daemon thread."""

    def __init__(self, board: str | None = None, *, addr: str = "127.0.0.1",
                 port: int = DEFAULT_PORT) -> None:
        self.collector = BoardCollector(board)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)  # type: ignore[arg-type]
        server_cls = _Server6 if ":" in addr else _Server
        self.instances = BoardInstances(board)  # /instances beside /metrics (shmhb.cli.instview)
        app = with_instances(probes_app(self.collector, make_wsgi_app(self.registry)), self.instances)
        self.httpd = make_server(addr, port, app, server_cls, handler_class=_QuietHandler)
        self.addr = addr
        self.port = int(self.httpd.server_port)
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="shmhb-exporter", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> Exporter:
        self._thread.start()
        log.info("exporting board %s on %s", self.collector.name, self.url)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join(5)
        self.httpd.server_close()
        self.collector.close()
        self.instances.close()

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
