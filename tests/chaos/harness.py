"""The chaos harness: simulated hosts on loopback, faults from a seeded schedule, and
the invariants of ``invariants.py`` checked every poll.

Hosts (``tests.hosts.Cluster``): host i is 127.0.0.(2+i) with its own board and its own
``shmhb pinger`` (configured with ``--listen``), plus a bare standby pinger that takes
the role over when the holder dies.  Where the run is root with iproute2, two more hosts
live in a pair of network namespaces joined by a veth (their own group: they follow each
other, not the loopback hosts), so the veth can be cut.  Each host runs ``workers``
worker processes (key ``h<i>-w<j>``, endpoint ``<ip>:3100<j>``) that beat every 50 ms
and report their own beat gaps.  The harness process holds one LinkReaper per host (on
a Board handle of its own) tracking a link to every worker of the other hosts of its
group, and a standing watch on each of those hosts (a connector's other links).

Everything started is stopped at the end, on Ctrl-C and on SIGTERM too: workers, pingers,
CPU hogs, namespaces, boards; then the leak checks run.
"""

from __future__ import annotations

import heapq
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

import shmhb
from shmhb.board.core import board_words
from shmhb import Board, LinkReaper
from shmhb.board import locks
from shmhb.cli.check import check_rows
from shmhb.board.layout import LOCK_REGISTRY
from shmhb.net.protocol import Ack, Identity, encode_ack

from ..children import child
from ..conftest import ROOT, Procs
from ..hosts import Cluster, Host, NetNs, netns_unavailable
from ..stopping import kill, resume
from .invariants import (
    ALIVE,
    NS,
    Bounds,
    Checker,
    Inc,
    LinkRec,
    Snapshot,
    Truth,
    View,
    child_pids,
    now_ns,
    pids_with,
    read_view,
)
from .hostile import LIAR_IP, HostileFaults
from .localfaults import LocalFaults
from .schedule import NEEDS_NETNS, NEEDS_ROOT, Fault, Timing, make_schedule

WORKER = child("chaos_worker")

HOG = child("hog")

SHM_FULL = child("shm_full")

REG_HOLDER = child("registry_holder")

WATCHER = child("chaos_watcher")

#: the harness itself is late when a poll comes this much after the previous one: the
#: whole machine was starved, and nothing that happened in the gap is held against shmhb
LATE_S = 0.3
#: an agent whose heartbeat is older than this is disturbed (stalled or starved)
STALE_OBS_S = 0.3
#: an agent whose heartbeat stays stale this long with no cause the harness knows of
#: (a stop, a kill, an outage, a hog, the machine starved) has hung
AGENT_STALL_S = 2.0
#: the watches of a dead process are gone within this much healthy time (reclaim: 1 s)
RECLAIM_S = 3.0
#: a standby running for a while takes the role over within this (election poll 0.2 s)
TAKEOVER_S = 1.5
PARTITION_MARGIN_S = 8.0  # TCP retransmits with backoff after the veth comes back
GAP_REPORT_S = 0.5
PRLIMIT = shutil.which("prlimit")
SCAN_EVERY_S = 0.25


@dataclass
class ChaosConfig:
    seed: int = 1
    duration_s: float = 60.0
    hosts: int = 3
    workers: int = 4
    partition: bool | None = None  # None: where possible (root, iproute2)
    shm_full: bool | None = None  # None: where possible (root, unshare)
    slack_s: float = 2.0
    poll_s: float = 0.015
    settle_s: float = 60.0
    mean_gap_s: float = 1.0
    timing: Timing = field(default_factory=Timing)
    kinds: tuple[str, ...] | None = None  # only these fault kinds
    embedded: bool = True  # worker 0 of host 0 runs an embedded agent
    progress: Callable[[str], None] | None = None
    keep_tmp: bool = False


@dataclass
class Report:
    seed: int
    duration_s: float
    hosts: int
    workers: int
    partition_pair: bool
    date: str
    wall_s: float = 0.0
    injected: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    breaches: list[Any] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    tmp: str | None = None
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.breaches and not self.leaks and not self.interrupted

    def format(self) -> str:
        lines = [
            f"shmhb chaos run: seed {self.seed}, {self.duration_s:g} s of faults, "
            f"{self.hosts} loopback hosts x {self.workers} workers"
            + (" + a namespaced pair" if self.partition_pair else "")
            + f", {self.date}, {self.wall_s:.0f} s wall",
            "faults injected: " + (", ".join(f"{k} {n}" for k, n in sorted(self.injected.items())) or "none"),
        ]
        if self.skipped:
            lines.append("skipped (target busy, or not possible here): "
                         + ", ".join(f"{k} {n}" for k, n in sorted(self.skipped.items())))
        for k, v in self.stats.items():
            lines.append(f"{k}: {v}")
        if self.leaks:
            lines.append("LEAKS: " + "; ".join(self.leaks))
        lines.append(f"invariant breaches: {len(self.breaches)}")
        for n, br in enumerate(self.breaches, 1):
            lines.append(f"--- breach {n}: {br.kind} at t={br.t_rel:.3f} s (seed {self.seed})")
            lines.append(f"    {br.msg}")
            lines.extend(br.timeline)
        if self.tmp:
            lines.append(f"logs kept in {self.tmp}")
        lines.append("RESULT: " + ("PASS" if self.ok else "INTERRUPTED" if self.interrupted else "FAIL"))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        # not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting them
        d = {k: getattr(self, k) for k in ("seed", "duration_s", "hosts", "workers",
                                           "partition_pair", "date", "wall_s", "stats",
                                           "leaks", "tmp", "interrupted")}
        d["injected"] = dict(self.injected)
        d["skipped"] = dict(self.skipped)
        d["breaches"] = [{"kind": b.kind, "t": b.t_rel, "msg": b.msg, "timeline": b.timeline}
                         for b in self.breaches]
        d["ok"] = self.ok
        return d


# -- processes ---------------------------------------------------------------------------------

class _Worker:
    def __init__(self, host: _Host, widx: int) -> None:
        self.host = host
        self.widx = widx
        self.key = f"h{host.idx}-w{widx}"
        self.endpoint = f"{host.ip}:{31000 + widx}"
        self.tag = f"h{host.idx}/w{widx}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""
        self.inc: Inc | None = None
        self.state = "down"  # starting, running, leaving, dying, down
        self.stopped = False
        self.busy = False
        self.respawn_at: int | None = 0
        self.down_s = 0.0
        self.kill_early: float | None = None
        self.kill_t = 0
        self.spawn_t = 0
        self.embedded = False  # it runs an embedded agent (joins the election)
        self.holder_stop = False  # stopped while it held the agent role
        self.log = ""
        self.n = 0


class _Pinger:
    def __init__(self, proc: subprocess.Popen[bytes], label: str) -> None:
        self.proc = proc
        self.label = label
        self.spawn_t = now_ns()
        self.expect_exit = False
        self.stopped = False


class _Host:
    def __init__(self, idx: int, host: Host, group: int) -> None:
        self.idx = idx
        self.h = host
        self.ip = host.ip
        self.name = host.name
        self.group = group
        self.board = host.board
        self.pingers: list[_Pinger] = []
        self.workers: list[_Worker] = []
        self.busy = False  # a pinger fault is in progress
        self.outage = False
        self.term_before = 0
        self.back: tuple[int, int] | None = None  # a new holder's (role taken ns, answered then)
        self.stop_term: int | None = None  # the term of a holder stopped now (pstop)
        self.reaper: LinkReaper | None = None
        self.rboard: Board | None = None
        self.garbage: zmq.Socket | None = None
        self.garbage_busy = False
        self.reg_stall: dict[str, Any] | None = None
        self.takeover: dict[str, Any] | None = None  # a failover in progress
        self.all_pids: set[int] = set()  # every process that may have held its agent role
        self.holder_fds: dict[int, tuple[int, int]] = {}  # pid -> (since ns, fds then)
        self.wall_offset_s = 0.0  # clock_step: pingers spawned from now on run this far off

    def live_pingers(self) -> list[_Pinger]:
        return [p for p in self.pingers if p.proc.poll() is None]

    def pids(self) -> set[int]:
        """Live processes that may hold the agent role: pingers, embedded workers."""
        out = {p.proc.pid for p in self.pingers}
        out |= {w.proc.pid for w in self.workers if w.embedded and w.proc is not None}
        return out


class Harness(HostileFaults, LocalFaults):
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.t = cfg.timing
        self.bounds = Bounds.of(self.t, cfg.slack_s)
        self.report = Report(cfg.seed, cfg.duration_s, cfg.hosts, cfg.workers, False,
                             time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        self.hosts: list[_Host] = []
        self.timers: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = 0
        self.drops: deque[tuple[int, int, int, str]] = deque()
        self.views: dict[int, View] = {}
        self.last_link: dict[tuple[int, int, int], LinkRec] = {}
        self._link_id = 0
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.jobs: list[tuple[subprocess.Popen[bytes], int, str, Callable[[str, int], None]]] = []
        self.ns: NetNs | None = None
        self.ctx: zmq.Context | None = None
        self._last_step: int | None = None
        self._next_scan = 0
        self._garbage_checks: list[dict[str, Any]] = []
        self._watchers: list[dict[str, Any]] = []
        self.tmp = tempfile.mkdtemp(prefix="shmhb-chaos-")
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = ROOT + os.pathsep + self.env.get("PYTHONPATH", "")
        self.procs = Procs()
        self.cluster: Cluster | None = None
        self.truth: Truth | None = None
        self.checker: Checker | None = None

    # -- helpers --------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        if self.cfg.progress is not None:
            self.cfg.progress(msg)

    def note(self, text: str, *tags: str, t: int | None = None) -> None:
        assert self.truth is not None
        self.truth.note(now_ns() if t is None else t, text, *tags)

    def at(self, delay_s: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (now_ns() + int(delay_s * NS), self._seq, fn))

    def breach(self, kind: str, msg: str, *tags: str) -> None:
        assert self.checker is not None
        self.checker.breach(kind, now_ns(), msg, *tags)

    # -- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, tm = self.cfg, self.t
        self.before = Snapshot.take()
        self.root = os.geteuid() == 0
        want_ns = cfg.partition is not False and (cfg.kinds is None or "partition" in cfg.kinds)
        why = netns_unavailable() if want_ns else "not asked for"
        if cfg.partition and why:
            raise RuntimeError(f"--partition: {why}")
        self.shm_ok = (self.root and shutil.which("unshare") is not None and cfg.shm_full is not False)
        self.cluster = Cluster(self.tmp, self.procs)
        policy = shmhb.Policy(suspect_after_s=tm.suspect_after_s, dead_after_s=tm.dead_after_s,
                              agent_stale_s=tm.agent_stale_s,
                              peer_suspect_after_s=tm.peer_suspect_after_s,
                              peer_dead_after_s=tm.peer_dead_after_s)
        slots = max(8, 2 * cfg.workers)
        groups = []
        for i in range(cfg.hosts):
            h = self.cluster.host(policy=policy, slots=slots, interval_s=tm.interval_s, start=False)
            self.hosts.append(_Host(i, h, 0))
            groups.append(0)
        if why is None:
            self.ns = NetNs()
            for ip, ns in ((self.ns.ip_a, self.ns.a), (self.ns.ip_b, self.ns.b)):
                h = self.cluster.host(policy=policy, slots=slots, interval_s=tm.interval_s,
                                      ip=ip, netns=ns, start=False)
                self.hosts.append(_Host(len(self.hosts), h, 1))
                groups.append(1)
            self.report.partition_pair = True
        self.host_of_ip = {h.ip: h.idx for h in self.hosts}
        t0 = now_ns()
        self.truth = Truth(t0, len(self.hosts), groups)
        self.checker = Checker(self.truth, tm, self.bounds, cfg.seed)
        self.say(f"{len(self.hosts)} hosts, port {self.cluster.port}, logs in {self.tmp}")
        # pingers: the configured one first (it stores the settings), then a bare standby
        first = [(h, self._spawn_pinger(h, configure=True)) for h in self.hosts]
        for h, p in first:
            h.h.wait_pinger(p.proc, timeout_s=60)
        for h in self.hosts:
            self._spawn_pinger(h, configure=False)
        for h in self.hosts:
            for w in range(cfg.workers):
                h.workers.append(_Worker(h, w))
            if cfg.embedded and h.idx == 0:
                # one host's worker 0 joins the election too: its embedded agent takes the
                # role when the pingers are gone (only one host, so that pinger faults,
                # which need a pinger holding the role, keep their targets elsewhere)
                h.workers[0].embedded = True
        # standing watches: each host follows the others of its group
        for o in self.hosts:
            for s in self.truth.followed(o.idx):
                o.board.watch(f"{self.hosts[s].ip}:30000")
            o.rboard = Board.attach(o.name)
            o.reaper = LinkReaper(o.rboard, on_drop=self._on_drop_cb(o.idx)).start(0.05)
        self.ctx = zmq.Context()  # for the garbage DEALERs
        self.hostile_setup()  # a lying followed host, watched by every loopback host
        # everything up, every view converged, every link tracked
        deadline = now_ns() + 120 * NS
        while True:
            self.step()
            missing = self.converged()
            if missing is None:
                break
            if now_ns() > deadline:
                raise RuntimeError(f"the cluster never came up: {missing}")
        self.note("cluster up: every host sees every worker alive, every link tracked", "*")
        self.say("cluster up")

    def _spawn_pinger(self, h: _Host, *, configure: bool) -> _Pinger:
        assert self.cluster is not None
        h.h._n += 1
        label = f"{h.name}-pinger{h.h._n}"
        cmd = h.h.pinger_cmd(configure=configure, wall_offset_s=h.wall_offset_s)
        if PRLIMIT:  # the file descriptors a systemd unit gets by default
            cmd = [PRLIMIT, "--nofile=1024:1024", *cmd]
        proc = self.cluster.spawn(cmd, label)
        p = _Pinger(proc, label)
        h.pingers.append(p)
        h.all_pids.add(proc.pid)
        if self.truth is not None:
            self.note(f"h{h.idx} pinger started (pid {proc.pid}{', configured' if configure else ''})",
                      f"h{h.idx}")
        return p

    def _on_drop_cb(self, o: int) -> Callable[[Any, Any], None]:
        def cb(link: Any, reason: Any) -> None:
            self.drops.append((now_ns(), o, int(link.payload), str(reason)))
        return cb

    # -- workers ------------------------------------------------------------------------

    def _spawn_worker(self, w: _Worker) -> None:
        w.n += 1
        w.log = os.path.join(self.tmp, f"{w.key}-{w.n}.log")
        with open(w.log, "wb") as log:
            cmd = [sys.executable, WORKER, w.host.name, w.key, w.endpoint,
                   str(self.t.beat_s), str(GAP_REPORT_S), "1" if w.embedded else "0"]
            if w.host.h.netns:  # a host's processes share its network (an embedded agent binds there)
                cmd = ["ip", "netns", "exec", w.host.h.netns, *cmd]
            w.proc = subprocess.Popen(cmd,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=self.env)
        assert w.proc.stdout is not None
        os.set_blocking(w.proc.stdout.fileno(), False)
        w.buf = b""
        w.spawn_t = now_ns()
        if w.embedded:
            w.host.all_pids.add(w.proc.pid)
        w.state = "starting"
        w.respawn_at = None
        if w.kill_early is not None:
            proc, d = w.proc, w.kill_early
            w.kill_early = None
            self.at(d, lambda: self._early_kill(w, proc))
        self.note(f"{w.tag} started (pid {w.proc.pid})", w.tag, f"h{w.host.idx}")

    def _read_worker(self, w: _Worker) -> None:
        assert w.proc is not None and w.proc.stdout is not None
        try:
            chunk = os.read(w.proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        w.buf += chunk
        while b"\n" in w.buf:
            line, w.buf = w.buf.split(b"\n", 1)
            self._worker_line(w, line.decode(errors="replace").split())

    def _worker_line(self, w: _Worker, parts: list[str]) -> None:
        assert self.truth is not None and self.checker is not None and w.proc is not None
        if not parts:
            return
        if parts[0] == "ready":
            inc = Inc(w.host.idx, w.widx, w.key, w.endpoint, int(parts[1]), w.proc.pid, int(parts[3]),
                      t_reg=int(parts[4]))
            old = self.truth.current(w.host.idx, w.widx)
            if old is not None and old.inc >= inc.inc:
                self.breach("incarnation-not-new", f"{w.tag} registered again with incarnation "
                            f"{inc.inc}, not above {old.inc}", w.tag)
            self.truth.new_inc(inc)
            w.inc = inc
            if w.state == "dying_early":  # registered, then killed before we read it
                inc.t_killed = w.kill_t
                self.note(f"{w.tag} had registered inc {inc.inc} before the kill", w.tag, t=inc.t_ready)
                self.checker.on_end(inc, w.kill_t)
                return
            w.state = "running"
            self.note(f"{w.tag} ready: inc {inc.inc}, pid {inc.pid}", w.tag, f"h{w.host.idx}",
                      t=inc.t_ready)
        elif parts[0] == "gap" and w.inc is not None:
            a, b = int(parts[1]), int(parts[2])
            w.inc.silences.add("gap", a, b)
            self.note(f"{w.tag} beat gap {(b - a) / NS:.2f} s", w.tag, t=b)
        elif parts[0] == "closed" and w.inc is not None:
            t = int(parts[1])
            w.inc.t_closed = t
            self.note(f"{w.tag} closed (LEFT), inc {w.inc.inc}", w.tag, f"h{w.host.idx}", t=t)
            self.checker.on_end(w.inc, t)
        elif parts[0] == "keyinuse":
            self.breach("key-in-use", f"{w.tag}: KeyInUse although its previous holder is "
                        "gone (reaped)", w.tag)

    def _reap_worker(self, w: _Worker, t: int) -> None:
        assert w.proc is not None and self.checker is not None
        self._read_worker(w)
        rc = w.proc.returncode
        if w.state == "running":
            assert w.inc is not None
            w.inc.crashed = True
            w.inc.t_killed = t
            self.checker.on_end(w.inc, t)
            self.breach("worker-crashed", f"{w.tag} (pid {w.proc.pid}) exited by itself with {rc}: "
                        + _tail(w.log), w.tag)
        elif w.state == "leaving" and (rc != 0 or w.inc is None or w.inc.t_closed is None):
            self.breach("leave-failed", f"{w.tag} did not close cleanly (rc {rc}): " + _tail(w.log), w.tag)
            if w.inc is not None and w.inc.t_closed is None:
                w.inc.t_closed = t
                self.checker.on_end(w.inc, t)
        elif w.state == "starting":
            tail = _tail(w.log)
            if "LockTimeout" in tail and self._reg_stalled(w.host, w.spawn_t, t):
                # attach or register gave up on the registry lock a stopped process held:
                # the documented LockTimeout; the orchestrator (here: we) starts it again
                self.checker.stats["start-failed-registry-held"] += 1
                w.down_s = 0.5
            else:
                self.breach("worker-start-failed", f"{w.tag} exited with {rc} before registering: "
                            + tail, w.tag)
        self.note(f"{w.tag} exited ({rc})", w.tag)
        if w.proc.stdout is not None:
            w.proc.stdout.close()
        w.proc = None
        w.state = "down"
        w.stopped = False
        w.busy = False
        w.respawn_at = t + int(w.down_s * NS)
        w.down_s = 0.0

    # -- the loop -----------------------------------------------------------------------

    def step(self) -> None:
        assert self.truth is not None and self.checker is not None
        t = now_ns()
        late = self._last_step is not None and t - self._last_step > LATE_S * NS
        if late:
            assert self._last_step is not None
            self.truth.glob.add("late", self._last_step, t, int(self.bounds.margin_s * NS))
            self.checker.stats["harness-late"] += 1
        self._pump(t)
        for h in self.hosts:
            v = read_view(h.board, self.host_of_ip)
            self.views[h.idx] = v
            self._agent_health(h, v)
        t = now_ns()
        self.checker.accrue(t, late)
        for h in self.hosts:
            self.checker.observe(h.idx, self.views[h.idx])
        while self.drops:
            td, _o, lid, reason = self.drops.popleft()
            self.checker.on_drop(td, lid, reason)
        self._retrack(t)
        self.checker.check_links(t)
        if t >= self._next_scan:
            self._next_scan = t + int(SCAN_EVERY_S * NS)
            for h in self.hosts:
                probs = check_rows(h.board, pinger_pids=h.all_pids)
                self.checker.torn(h.idx, t, probs, self.truth.pinger_stopped[h.idx])
        self._check_garbage(t)
        self.hostile_check(t)
        self.checker.judge(t)
        self._last_step = now_ns()

    def _pump(self, t: int) -> None:
        while self.timers and self.timers[0][0] <= t:
            _, _, fn = heapq.heappop(self.timers)
            fn()
        for h in self.hosts:
            for w in h.workers:
                if w.proc is not None:
                    self._read_worker(w)
                    if w.proc.poll() is not None:
                        self._reap_worker(w, now_ns())
                if w.proc is None and w.respawn_at is not None and t >= w.respawn_at:
                    self._spawn_worker(w)
            for p in list(h.pingers):
                if p.proc.poll() is not None:
                    h.pingers.remove(p)
                    tail = self.cluster.log_tail(p.proc, 15)  # type: ignore[union-attr]
                    if (not p.expect_exit and p.proc.returncode == 2 and "stayed locked" in tail
                            and self._reg_stalled(h, p.spawn_t, now_ns())):
                        # `shmhb pinger` could not attach while a stopped process held the
                        # registry lock: it says so and exits (its supervisor restarts it)
                        self.checker.stats["pinger-start-failed-registry-held"] += 1  # type: ignore[union-attr]
                        self.note(f"h{h.idx} pinger pid {p.proc.pid} could not start: registry held",
                                  f"h{h.idx}")
                    elif not p.expect_exit:
                        self.breach("pinger-crashed", f"h{h.idx} pinger pid {p.proc.pid} exited by "
                                    f"itself ({p.proc.returncode}): "
                                    + self.cluster.log_tail(p.proc, 15), f"h{h.idx}")  # type: ignore[union-attr]
                    else:
                        self.note(f"h{h.idx} pinger pid {p.proc.pid} gone ({p.proc.returncode})", f"h{h.idx}")
            if not h.outage and len(h.live_pingers()) < 2:
                self._spawn_pinger(h, configure=False)
        for h in self.hosts:
            if h.reg_stall is not None:
                self._pump_reg_stall(h)
        self._pump_watchers(t)
        for job in list(self.jobs):
            p, deadline, _what, done = job
            if p.poll() is not None or t > deadline:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                out = p.stdout.read().decode(errors="replace") if p.stdout else ""
                if p.stdout:
                    p.stdout.close()
                self.jobs.remove(job)
                done(out, p.returncode)

    def _agent_health(self, h: _Host, v: View) -> None:
        assert self.truth is not None and self.checker is not None
        tl = self.truth.host[h.idx]
        fresh = v.agent_status is ALIVE and v.agent_age_s is not None and v.agent_age_s < STALE_OBS_S
        margin = int(self.bounds.margin_s * NS)
        if not fresh:
            if not tl.is_open("stale"):
                age = v.agent_age_s or 0.0
                tl.open_("stale", v.t - int(age * NS), margin)
                self.note(f"h{h.idx} agent stale ({v.agent_status.value}, {age:.2f} s)", f"h{h.idx}", t=v.t)
        elif tl.is_open("stale"):
            iv = tl.close("stale", v.t)
            if iv is not None and iv.length(v.t) > 1 * NS:
                self.checker.stats["agent-stalls>1s"] += 1
            self.note(f"h{h.idx} agent fresh again", f"h{h.idx}", t=v.t)
        st = tl.open.get("stale")
        if st and not getattr(st, "judged", False) and st.length(v.t) > AGENT_STALL_S * NS:
            st.judged = True  # type: ignore[attr-defined]
            causes = [iv.kind for iv in tl.overlapping(st.start, v.t) if iv.kind != "stale"]
            causes += [iv.kind for iv in self.truth.glob.overlapping(st.start, v.t)]
            if causes:
                self.checker.stats["agent-stalls-explained"] += 1
            else:
                self.breach("agent-stall", f"h{h.idx}: the agent's heartbeat was stale for "
                            f"{st.length(v.t) / NS:.2f} s with no stop, kill, outage or CPU "
                            "starvation to explain it", f"h{h.idx}")
        # file descriptors of the holder, 5 s after it took the role (checked at the end)
        if fresh and v.agent_pid in h.all_pids:
            since, n = h.holder_fds.setdefault(v.agent_pid, (v.t, 0))
            if n == 0 and v.t - since > 5 * NS:
                h.holder_fds[v.agent_pid] = (since, _fd_count(v.agent_pid))
        to = h.takeover
        if to is not None and tl.is_open(to["kind"]):
            # a warm standby takes the role within the election poll, whatever else is
            # going on on the host (the clock pauses only while the machine is starved)
            if not self.truth.glob.any(to["last"], v.t) and not (
                    self._last_step is not None and v.t - self._last_step > LATE_S * NS):
                to["healthy"] += v.t - to["last"]
            to["last"] = v.t
            if to["warm"] and to["healthy"] > TAKEOVER_S * NS and not to.get("breached"):
                to["breached"] = True
                self.breach("slow-takeover", f"h{h.idx}: no new agent {(v.t - to['t']) / NS:.2f} s "
                            f"after its holder was ended ({to['kind']}), although a standby was "
                            f"running (bound {TAKEOVER_S:g} s)", f"h{h.idx}")
        if (tl.is_open("pstop") and h.stop_term is not None and fresh
                and v.agent_term > h.stop_term and v.agent_pid in h.pids()):
            # A standby replaced the stopped holder, and listens beside it (a shared
            # port): the host has an agent again, which its peers hear, so no DEAD of
            # the host is owed any more (one that comes is still excused by the stop).
            h.stop_term = None
            self.checker.on_host_up(h.idx, "pstop")
            self.note(f"h{h.idx} agent role taken from the stopped holder by pid "
                      f"{v.agent_pid} (term {v.agent_term})", f"h{h.idx}", t=v.t)
        for kind in ("pkill", "pterm", "outage"):
            if not tl.is_open(kind):
                continue
            if h.back is None and fresh and v.agent_term > h.term_before and v.agent_pid in h.pids():
                h.back = (v.t, v.answered)
                self.checker.on_host_up(h.idx, kind)
                iv = tl.open[kind]
                if kind != "outage":
                    self.checker.lat["takeover"].append((v.t - iv.start) / NS)
                if h.takeover is not None and h.takeover["kind"] == kind:
                    h.takeover = None
                self.note(f"h{h.idx} agent role taken by pid {v.agent_pid} (term {v.agent_term})",
                          f"h{h.idx}", t=v.t)
            # The host is silent towards its peers until the new holder answers a ping
            # (its network half starts after the role, and a loaded machine delays it):
            # the span ends then, or a reporting lag after the role at the latest.
            if h.back is not None and (v.answered > h.back[1]
                                       or v.t - h.back[0] > self.bounds.lag_s * NS):
                tl.close(kind, v.t)
                if v.answered <= h.back[1]:
                    self.checker.stats["new-holder-answered-late"] += 1
                self.note(f"h{h.idx} new holder answering pings", f"h{h.idx}", t=v.t)
                h.back = None
                h.busy = False

    def _retrack(self, t: int) -> None:
        assert self.truth is not None and self.checker is not None
        for o in self.hosts:
            for s in self.truth.followed(o.idx):
                for w in self.hosts[s].workers:
                    k = (o.idx, s, w.widx)
                    if k in self.checker.live_links:
                        continue
                    inc = w.inc
                    if inc is None or w.state != "running" or w.stopped or inc.ended_by(t):
                        continue
                    last = self.last_link.get(k)
                    if last is not None and last.inc is inc:
                        # the same incarnation again (it was dead to us for a while): a
                        # connector re-handshakes once it answers, i.e. reads ALIVE here
                        r = self.views[o.idx].remote.get(s)
                        if r is None or r[0] is not ALIVE or r[1].get(w.key) != (inc.inc, ALIVE):
                            continue
                    if locks.is_held(o.board._seg.fd, LOCK_REGISTRY):
                        continue  # track() would wait for it (and stall the checks)
                    self._link_id += 1
                    lid = self._link_id
                    assert o.reaper is not None
                    try:
                        o.reaper.track(w.endpoint, lid, incarnation=inc.inc)
                    except shmhb.ShmhbError as e:
                        self.note(f"h{o.idx}: track {w.endpoint} failed: {e}", f"h{o.idx}")
                        continue
                    lk = LinkRec(lid, o.idx, inc, w.endpoint, now_ns())
                    self.last_link[k] = lk
                    self.checker.on_track(lk)

    def converged(self) -> str | None:
        """None when every host has a fresh agent and a standby, every worker runs and
        reads ALIVE everywhere with its current incarnation, and every link is tracked;
        else what is missing."""
        assert self.truth is not None and self.checker is not None
        for h in self.hosts:
            v = self.views.get(h.idx)
            if v is None or v.agent_status is not ALIVE or v.agent_pid not in h.pids():
                return f"h{h.idx} agent {v and v.agent_status}"
            if len(h.live_pingers()) < 2:
                return f"h{h.idx} has {len(h.live_pingers())} pingers"
            for w in h.workers:
                if w.state != "running" or w.stopped or w.inc is None:
                    return f"{w.tag} {w.state}"
        for o in self.hosts:
            v = self.views[o.idx]
            for s in self.truth.observers(o.idx):
                for w in self.hosts[s].workers:
                    assert w.inc is not None
                    if s == o.idx:
                        e = v.local.get(w.key)
                        if e is None or e[:2] != (w.inc.inc, ALIVE):
                            return f"{w.tag} reads {e} locally, not inc {w.inc.inc} alive"
                    else:
                        r = v.remote.get(s)
                        if r is None or r[0] is not ALIVE or r[1].get(w.key) != (w.inc.inc, ALIVE):
                            return f"h{o.idx} reads {w.tag} as {r and (r[0], r[1].get(w.key))}"
                        lk = self.checker.live_links.get((o.idx, s, w.widx))
                        if lk is None or lk.inc is not w.inc:
                            return f"h{o.idx} has no link to {w.tag} inc {w.inc.inc}"
        for o in self.hosts:
            # what the reaper holds is what the harness thinks it holds: no link lost
            # without a callback, none kept after one
            assert o.reaper is not None
            held = {(int(lk.payload), lk.incarnation) for lk in o.reaper.links()}
            mine = {(lk.id, lk.inc.inc) for lk in self.checker.live_links.values() if lk.o == o.idx}
            if held != mine:
                return f"h{o.idx}'s reaper holds links {sorted(held - mine)} the harness does not, lacks {sorted(mine - held)}"
        return None

    # -- faults ---------------------------------------------------------------------------

    def fire(self, f: Fault) -> None:
        assert self.truth is not None and self.checker is not None
        cfg = self.cfg
        if cfg.kinds is not None and f.kind not in cfg.kinds:
            return
        if f.kind in NEEDS_ROOT and not self.root or (f.kind == "shm_full" and not self.shm_ok):
            self.report.skipped[f.kind] += 1
            return
        if f.kind in NEEDS_NETNS and self.ns is None:
            self.report.skipped[f.kind] += 1
            return
        ok = getattr(self, "_f_" + f.kind)(f)
        if ok is False:
            self.report.skipped[f.kind] += 1
        else:
            self.report.injected[f.kind] += 1

    def _worker_of(self, f: Fault, *, stopped_ok: bool = False) -> _Worker | None:
        """The running worker a fault names; a stopped one only for ``stopped_ok`` (a
        hung worker is what an orchestrator kills and restarts)."""
        h = self.hosts[f.host % len(self.hosts)]
        w = h.workers[f.worker % len(h.workers)]
        if w.state != "running" or w.proc is None:
            return None
        if (w.busy or w.stopped) and not stopped_ok:
            return None
        return w

    def _holds_role(self, w: _Worker) -> bool:
        v = self.views.get(w.host.idx)
        return w.embedded and w.proc is not None and v is not None and v.agent_pid == w.proc.pid

    def _role_ends(self, w: _Worker, t: int, kind: str) -> None:
        """The worker being killed (``pkill``) or leaving (``pterm``) holds the host's
        agent role: the same as ending a holding pinger."""
        assert self.truth is not None and self.checker is not None
        h = w.host
        if w.holder_stop:  # killed while stopped: the stop of the role ends here
            self._role_continues(w, t)
        h.term_before = self.views[h.idx].agent_term
        h.back = None
        self.truth.host[h.idx].open_(kind, t, int(self.bounds.margin_s * NS))
        warm = any(not q.expect_exit and t - q.spawn_t > 5 * NS for q in h.live_pingers())
        h.takeover = {"t": t, "warm": warm, "healthy": 0, "last": t, "kind": kind}
        self.note(f"{w.tag} holds the agent role of h{h.idx}: it ends with it", f"h{h.idx}", t=t)
        self.checker.on_host_down(h.idx, t, kind)

    def _role_continues(self, w: _Worker, t: int) -> None:
        assert self.truth is not None and self.checker is not None
        h = w.host
        w.holder_stop = False
        self.truth.host[h.idx].close("pstop", t)
        self.truth.pinger_stopped[h.idx] = False
        self.checker.on_host_up(h.idx, "pstop")

    def _kill_worker(self, w: _Worker, down_s: float, why: str) -> None:
        assert w.proc is not None and w.inc is not None and self.checker is not None
        t = now_ns()
        if self._holds_role(w):
            self._role_ends(w, t, "pkill")
        w.inc.t_killed = t
        self.note(f"FAULT {why} {w.tag} inc {w.inc.inc} pid {w.proc.pid} (SIGKILL"
                  + (", while stopped)" if w.stopped else ")"), w.tag, f"h{w.host.idx}", t=t)
        for iv in w.inc.silences.items:
            if iv.end is None:
                iv.end = t  # it was stopped: its silence ends with it
        w.stopped = False
        w.proc.kill()
        w.state = "dying"
        w.down_s = down_s
        self.checker.on_end(w.inc, t)

    def _f_worker_kill(self, f: Fault) -> bool:
        w = self._worker_of(f, stopped_ok=True)
        if w is None:
            return False
        self._kill_worker(w, f.duration_s, "worker_kill")
        return True

    def _f_worker_restart(self, f: Fault) -> bool:
        w = self._worker_of(f, stopped_ok=True)
        if w is None:
            return False
        self._kill_worker(w, 0.0, "worker_restart")
        return True

    def _f_worker_kill_early(self, f: Fault) -> bool:
        """Restart a worker, and SIGKILL the new process ``duration_s`` after it starts:
        while it imports, registers, or has just registered."""
        w = self._worker_of(f)
        if w is None:
            return False
        self._kill_worker(w, 0.0, "worker_kill_early")
        w.kill_early = f.duration_s
        return True

    def _early_kill(self, w: _Worker, proc: subprocess.Popen[bytes]) -> None:
        if w.proc is not proc or proc.poll() is not None:
            return
        self._read_worker(w)
        if w.state == "running":
            self._kill_worker(w, 0.0, "worker_kill_early, just registered:")
        elif w.state == "starting":
            t = now_ns()
            if self._holds_role(w):  # its embedded agent won the election already
                self._role_ends(w, t, "pkill")
            self.note(f"FAULT worker_kill_early {w.tag} pid {proc.pid} while starting (SIGKILL)",
                      w.tag, f"h{w.host.idx}", t=t)
            proc.kill()
            w.state = "dying_early"
            w.kill_t = t

    def _f_worker_leave(self, f: Fault) -> bool:
        w = self._worker_of(f)
        if w is None:
            return False
        assert w.proc is not None and w.inc is not None
        t = now_ns()
        if self._holds_role(w):
            self._role_ends(w, t, "pterm")  # close() stops its embedded agent: a hand-over
        w.inc.t_term = t
        self.note(f"FAULT worker_leave {w.tag} inc {w.inc.inc} (SIGTERM)", w.tag, f"h{w.host.idx}", t=t)
        w.proc.terminate()
        w.state = "leaving"
        w.down_s = f.duration_s
        return True

    def _f_worker_stop_short(self, f: Fault) -> bool:
        return self._stop_worker(f, "short")

    def _f_worker_stop_long(self, f: Fault) -> bool:
        return self._stop_worker(f, "long")

    def _stop_worker(self, f: Fault, what: str) -> bool:
        w = self._worker_of(f)
        if w is None:
            return False
        assert w.proc is not None and w.inc is not None
        t = now_ns()
        iv = w.inc.silences.add("stop", t)
        self.note(f"FAULT worker_stop_{what} {w.tag} inc {w.inc.inc} for {f.duration_s:.2f} s (SIGSTOP)",
                  w.tag, f"h{w.host.idx}", t=t)
        if self._holds_role(w):  # its embedded agent stops with it: like a stopped pinger
            assert self.truth is not None and self.checker is not None
            w.holder_stop = True
            self.truth.host[w.host.idx].open_("pstop", t, int(self.bounds.margin_s * NS))
            self.truth.pinger_stopped[w.host.idx] = True
            self.checker.on_host_down(w.host.idx, t, "pstop")
            self.note(f"{w.tag} holds the agent role of h{w.host.idx}: stopped with it",
                      f"h{w.host.idx}", t=t)
        os.kill(w.proc.pid, signal.SIGSTOP)
        w.stopped = w.busy = True
        proc = w.proc

        def cont() -> None:
            if w.proc is not proc or proc.poll() is not None:
                return  # killed meanwhile (which closed the stop)
            resume(proc.pid)
            iv.end = now_ns()
            if w.holder_stop:
                self._role_continues(w, iv.end)
            w.stopped = w.busy = False
            self.note(f"{w.tag} continued (SIGCONT)", w.tag, f"h{w.host.idx}", t=iv.end)
        self.at(f.duration_s, cont)
        return True

    def _holder(self, h: _Host) -> _Pinger | None:
        v = self.views.get(h.idx)
        if v is None or v.agent_status is not ALIVE:
            return None
        for p in h.live_pingers():
            if p.proc.pid == v.agent_pid and not p.stopped:
                return p
        return None

    def _pinger_host(self, f: Fault) -> tuple[_Host, _Pinger] | None:
        h = self.hosts[f.host % len(self.hosts)]
        if h.busy or h.outage:
            return None
        p = self._holder(h)
        if p is None:
            return None
        return h, p

    def _f_pinger_kill(self, f: Fault) -> bool:
        return self._end_holder(f, signal.SIGKILL, "pkill")

    def _f_pinger_term(self, f: Fault) -> bool:
        return self._end_holder(f, signal.SIGTERM, "pterm")

    def _end_holder(self, f: Fault, sig: int, kind: str) -> bool:
        got = self._pinger_host(f)
        if got is None:
            return False
        h, p = got
        assert self.truth is not None and self.checker is not None
        t = now_ns()
        h.term_before = self.views[h.idx].agent_term
        h.back = None
        h.busy = True
        self.truth.host[h.idx].open_(kind, t, int(self.bounds.margin_s * NS))
        self.note(f"FAULT {f.kind} h{h.idx}: holder pid {p.proc.pid} ({signal.Signals(sig).name})",
                  f"h{h.idx}", t=t)
        # a standby that has been up for a while (imports done, polling the election), and
        # not on its way out itself (a pinger just sent SIGTERM is still alive meanwhile)
        warm = any(q is not p and not q.expect_exit and t - q.spawn_t > 5 * NS
                   for q in h.live_pingers())
        h.takeover = {"t": t, "warm": warm, "healthy": 0, "last": t, "kind": kind}
        p.expect_exit = True
        os.kill(p.proc.pid, sig)
        self.checker.on_host_down(h.idx, t, kind)
        return True

    def _f_pinger_stop_short(self, f: Fault) -> bool:
        return self._stop_holder(f)

    def _f_pinger_stop_long(self, f: Fault) -> bool:
        return self._stop_holder(f)

    def _stop_holder(self, f: Fault) -> bool:
        got = self._pinger_host(f)
        if got is None:
            return False
        h, p = got
        assert self.truth is not None and self.checker is not None
        t = now_ns()
        tl = self.truth.host[h.idx]
        tl.open_("pstop", t, int(self.bounds.margin_s * NS))
        self.note(f"FAULT {f.kind} h{h.idx}: holder pid {p.proc.pid} for {f.duration_s:.2f} s (SIGSTOP)",
                  f"h{h.idx}", t=t)
        os.kill(p.proc.pid, signal.SIGSTOP)
        p.stopped = True
        h.busy = True
        h.stop_term = self.views[h.idx].agent_term
        self.truth.pinger_stopped[h.idx] = True
        self.checker.on_host_down(h.idx, t, "pstop")

        def cont() -> None:
            if p.proc.poll() is None:
                resume(p.proc.pid)
            p.stopped = False
            h.stop_term = None
            t2 = now_ns()
            tl.close("pstop", t2)
            self.truth.pinger_stopped[h.idx] = False  # type: ignore[union-attr]
            self.checker.on_host_up(h.idx, "pstop")  # type: ignore[union-attr]
            h.busy = False
            self.note(f"h{h.idx} holder pid {p.proc.pid} continued (SIGCONT)", f"h{h.idx}", t=t2)
            self._burst(h)
        self.at(f.duration_s, cont)
        return True

    def _burst(self, h: _Host, seconds: float = 0.25) -> None:
        """Read one board as fast as possible for a moment: a pinger that just resumed
        acts on everything it missed at once, and a wrong verdict written then may last
        only until the next ack (a millisecond), too short for the regular poll."""
        assert self.checker is not None
        end = now_ns() + int(seconds * NS)
        while now_ns() < end:
            self.checker.observe(h.idx, read_view(h.board, self.host_of_ip))

    def _f_host_outage(self, f: Fault) -> bool:
        got = self._pinger_host(f)
        if got is None:
            return False
        h, _ = got
        assert self.truth is not None and self.checker is not None
        t = now_ns()
        h.term_before = self.views[h.idx].agent_term
        h.back = None
        h.busy = h.outage = True
        self.truth.host[h.idx].open_("outage", t, int(self.bounds.margin_s * NS))
        self.note(f"FAULT host_outage h{h.idx} for {f.duration_s:.2f} s: every pinger SIGKILLed",
                  f"h{h.idx}", t=t)
        for p in h.live_pingers():
            p.expect_exit = True
            p.proc.kill()
        self.checker.on_host_down(h.idx, t, "outage")

        def back() -> None:
            h.outage = False  # _pump starts a holder and a standby (bare: settings from the board)
            self.note(f"h{h.idx} outage over: starting pingers", f"h{h.idx}")
        self.at(f.duration_s, back)
        return True

    def _reg_stalled(self, h: _Host, a: int, b: int) -> bool:
        assert self.truth is not None
        return self.truth.reg[h.idx].any(a, b)

    def _f_registry_stall(self, f: Fault) -> bool:
        """A process stopped while it holds a board's registry lock (a worker frozen in
        the middle of registering, a debugger): the kernel releases the lock when its
        holder dies, not when it stops.  Registrations and watches wait up to their
        timeout and fail with LockTimeout; nothing else may break.  Every other stall
        begins with a connector on that host that watches another host and dies as soon
        as the lock is held, so its watches must be reclaimed by an agent that cannot
        take the lock yet (and must not wait for it)."""
        h = self.hosts[f.host % len(self.hosts)]
        if h.reg_stall is not None:
            return False
        h.reg_stall = {"p": None, "d": f.duration_s, "iv": None, "t": now_ns(), "salt": f.salt,
                       "watcher": None}
        if f.salt % 2 == 0 and self._f_watcher_kill(
                Fault(f.at_s, "watcher_kill", h.idx, f.worker, 3600.0)):
            h.reg_stall["watcher"] = self._watchers[-1]
        self.note(f"FAULT registry_stall h{h.idx}: a process takes its registry lock and stops "
                  f"for {f.duration_s:.2f} s" + (", a connector dies meanwhile"
                                                 if h.reg_stall["watcher"] else ""), f"h{h.idx}")
        return True

    def _pump_reg_stall(self, h: _Host) -> None:
        assert self.truth is not None and h.reg_stall is not None
        st = h.reg_stall
        w = st["watcher"]
        if st["p"] is None:
            if w is not None and "due" not in w and w["killed"] is None and now_ns() - st["t"] < 30 * NS:
                return  # its connector is not watching yet
            log = os.path.join(self.tmp, f"h{h.idx}-regholder-{st['salt']:08x}.log")
            with open(log, "wb") as lf:
                st["p"] = subprocess.Popen([sys.executable, REG_HOLDER, h.name],
                                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=lf, env=self.env)
            st["log"] = log
            assert st["p"].stdout is not None
            os.set_blocking(st["p"].stdout.fileno(), False)
        p: subprocess.Popen[bytes] = st["p"]
        if st["iv"] is None:
            try:
                got = os.read(p.stdout.fileno(), 100)  # type: ignore[union-attr]
            except BlockingIOError:
                got = b""
            if b"held" in got:
                t = now_ns()
                st["iv"] = self.truth.reg[h.idx].add("registry", t)
                self.note(f"h{h.idx} registry lock held by stopped pid {p.pid}", f"h{h.idx}", t=t)
                for c in self._watchers:  # a connector that dies now: reclaim must wait
                    if c["h"] is h and c["killed"] is None and "due" in c:
                        c["due"] = t

                def cont() -> None:
                    if p.poll() is None:
                        resume(p.pid)
                self.at(st["d"], cont)
            elif p.poll() is None and now_ns() - st["t"] > 60 * NS:
                p.kill()
        if p.poll() is not None:
            if st["iv"] is not None:
                st["iv"].end = now_ns()
                self.note(f"h{h.idx} registry lock released (pid {p.pid} exited)", f"h{h.idx}",
                          t=st["iv"].end)
            else:
                self.note(f"h{h.idx} registry_stall helper exited without the lock: "
                          + _tail(st["log"]), f"h{h.idx}")
            if p.stdout is not None:
                p.stdout.close()
            h.reg_stall = None

    def _f_watcher_kill(self, f: Fault) -> bool:
        """A connector process on a host watches another host and is SIGKILLed
        ``duration_s`` later, without unwatching: the agent must reclaim its watches."""
        h = self.hosts[f.host % len(self.hosts)]
        others = self.truth.followed(h.idx) if self.truth is not None else []
        if not others or len(self._watchers) >= 4:
            return False
        s = self.hosts[others[f.worker % len(others)]]
        p = subprocess.Popen([sys.executable, WATCHER, h.name, f"{s.ip}:32000",
                              f"{s.ip}:32001"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=self.env)
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), False)
        self._watchers.append({"h": h, "p": p, "d": f.duration_s, "t0": now_ns(), "killed": None,
                               "healthy": 0, "last": 0})
        self.note(f"FAULT watcher_kill h{h.idx}: a connector watching h{s.idx} (pid {p.pid}), "
                  f"killed {f.duration_s:.2f} s after it watches", f"h{h.idx}")
        return True

    def _pump_watchers(self, t: int) -> None:
        assert self.truth is not None
        for c in list(self._watchers):
            h: _Host = c["h"]
            p: subprocess.Popen[bytes] = c["p"]
            if c["killed"] is None:
                try:
                    got = os.read(p.stdout.fileno(), 100)  # type: ignore[union-attr]
                except BlockingIOError:
                    got = b""
                if b"watching" in got and "due" not in c:
                    c["due"] = t + int(c["d"] * NS)
                if ("due" in c and t >= c["due"]) or p.poll() is not None or t - c["t0"] > 60 * NS:
                    p.kill()
                    p.wait()
                    if p.stdout is not None:
                        p.stdout.close()
                    c["killed"] = c["last"] = now_ns()
                    self.note(f"h{h.idx} connector pid {p.pid} SIGKILLed", f"h{h.idx}", t=c["killed"])
                continue
            w = board_words(h.board).watch_table.copy()
            left = [i for i in range(len(w)) if int(w[i]["checksum"]) and int(w[i]["owner_pid"]) == p.pid]
            if not left:
                self._watchers.remove(c)
                self.checker.lat["reclaim"].append((t - c["killed"]) / NS)  # type: ignore[union-attr]
                self.note(f"h{h.idx} watches of dead pid {p.pid} reclaimed", f"h{h.idx}")
                continue
            # the clock pauses while the agent is disturbed or the registry lock is held
            if not (self.truth.disturbed(h.idx, c["last"], t) or self.truth.reg[h.idx].any(c["last"], t)
                    or self.truth.glob.any(c["last"], t)):
                c["healthy"] += t - c["last"]
            c["last"] = t
            if c["healthy"] > RECLAIM_S * NS:
                self._watchers.remove(c)
                self.breach("watch-not-reclaimed", f"h{h.idx}: the watches of dead pid {p.pid} "
                            f"are still there {(t - c['killed']) / NS:.1f} s after its death", f"h{h.idx}")

    def _f_garbage(self, f: Fault) -> bool:
        main = [h for h in self.hosts if h.group == 0]
        h = main[f.host % len(main)]
        if h.garbage_busy or self.ctx is None:
            return False
        if h.garbage is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100000)
            s.connect(f"tcp://{h.h.listen}")
            h.garbage = s
        rng = random.Random(f.salt)
        frames = garbage_frames(rng, f.n)
        assert self.truth is not None
        v = self.views[h.idx]
        before = _bad_total(h.board)
        sent = 0
        for parts in frames:
            try:
                h.garbage.send_multipart(parts, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                break
        t = now_ns()
        self.note(f"FAULT garbage h{h.idx}: {sent} bad frames at its pinger", f"h{h.idx}", t=t)
        h.garbage_busy = True
        self._garbage_checks.append({"h": h, "t": t, "sent": sent, "before": before,
                                     "term": v.agent_term, "healthy": 0, "last": t})
        return True

    def _check_garbage(self, t: int) -> None:
        assert self.truth is not None
        for c in list(self._garbage_checks):
            h: _Host = c["h"]
            v = self.views[h.idx]
            got = _bad_total(h.board) - c["before"]
            if v.agent_term != c["term"]:
                # another holder: frames in flight to the old one died with it
                self._garbage_checks.remove(c)
                h.garbage_busy = False
                self.note(f"h{h.idx} garbage count not checked: the holder changed", f"h{h.idx}")
                continue
            if not self.truth.disturbed(h.idx, c["last"], t):
                c["healthy"] += t - c["last"]
            c["last"] = t
            if got >= c["sent"] and c["healthy"] >= 0.5 * NS or c["healthy"] >= 10 * NS:
                self._garbage_checks.remove(c)
                h.garbage_busy = False
                assert self.checker is not None
                self.checker.stats["garbage-frames"] += c["sent"]
                if got != c["sent"]:
                    self.breach("garbage-miscounted", f"h{h.idx}: {c['sent']} bad frames sent, its "
                                f"pinger counted {got}", f"h{h.idx}")

    def _f_cpu_hog(self, f: Fault) -> bool:
        if self.hogs:
            return False
        assert self.truth is not None
        t = now_ns()
        n = os.cpu_count() or 2
        iv = self.truth.glob.add("hog", t, None, int(self.bounds.margin_s * NS))
        self.note(f"FAULT cpu_hog: {n} busy processes for {f.duration_s:.2f} s", "*", t=t)
        for _ in range(n):
            self.hogs.append(subprocess.Popen([sys.executable, HOG, str(f.duration_s)],
                                              stdin=subprocess.DEVNULL))

        def end() -> None:
            for p in self.hogs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            self.hogs.clear()
            iv.end = now_ns()
            self.note("cpu_hog over", "*", t=iv.end)
        self.at(f.duration_s, end)
        return True

    def _f_shm_full(self, f: Fault) -> bool:
        name = f"shmhb-chaos-full-{os.getpid()}-{f.salt:08x}"
        script = ('mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$1" "$2" "$3"')
        p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                              sys.executable, SHM_FULL, name],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=self.env)
        self.note(f"FAULT shm_full: creating board {name} on a 64 KiB /dev/shm", "*")

        def done(out: str, rc: int) -> None:
            leaked = os.path.exists(f"/dev/shm/{name}")
            if leaked:
                os.unlink(f"/dev/shm/{name}")
            if "mount" in out and "nospace" not in out and "error" not in out:
                self.note(f"shm_full not possible here: {out.strip()[:200]}", "*")
                self.report.skipped["shm_full(mount)"] += 1
                return
            if not out.startswith("nospace") or rc != 0 or leaked:
                self.breach("shm-full", f"creating a board on a full /dev/shm: rc {rc}, "
                            f"output {out.strip()[:300]!r}" + (", and it leaked into the real /dev/shm" if leaked else ""))
            else:
                self.note("shm_full: BoardSpaceError, cleanly", "*")
        self.jobs.append((p, now_ns() + 60 * NS, "shm_full", done))
        return True

    def _f_partition(self, f: Fault) -> bool:
        ns = self.ns
        assert ns is not None and self.truth is not None and self.checker is not None
        a, b = [h.idx for h in self.hosts if h.group == 1]
        tl = self.truth.part[frozenset((a, b))]
        if tl.is_open("partition"):
            return False
        t = now_ns()
        iv = tl.open_("partition", t, int(PARTITION_MARGIN_S * NS))
        self.note(f"FAULT partition h{a} | h{b} for {f.duration_s:.2f} s (veth down)",
                  f"h{a}", f"h{b}", t=t)
        ns.link(up=False)
        self.checker.on_host_down(a, t, "partition")
        self.checker.on_host_down(b, t, "partition")

        def heal() -> None:
            ns.link(up=True)
            tl.close("partition", now_ns())
            self.checker.on_host_up(a, "partition")  # type: ignore[union-attr]
            self.checker.on_host_up(b, "partition")  # type: ignore[union-attr]
            self.note(f"partition h{a} | h{b} healed (veth up)", f"h{a}", f"h{b}", t=iv.end)
        self.at(f.duration_s, heal)
        return True

    # -- phases ---------------------------------------------------------------------------

    def chaos(self) -> None:
        cfg = self.cfg
        sched = make_schedule(cfg.seed, cfg.duration_s, len(self.hosts), cfg.workers, self.t,
                              mean_gap_s=cfg.mean_gap_s)
        self.say(f"{len(sched)} faults scheduled over {cfg.duration_s:g} s")
        start = now_ns()
        self.note(f"chaos starts: {len(sched)} faults scheduled", "*", t=start)
        i = 0
        next_say = start + 60 * NS
        end = start + int(cfg.duration_s * NS)
        while True:
            t = now_ns()
            if t >= end:
                break
            while i < len(sched) and start + int(sched[i].at_s * NS) <= t:
                self.fire(sched[i])
                i += 1
            self.step()
            if t >= next_say:
                next_say += 60 * NS
                self.say(f"{(t - start) / NS:.0f} s: {sum(self.report.injected.values())} faults, "
                         f"{len(self.checker.breaches)} breaches")  # type: ignore[union-attr]
            self._sleep()

    def _sleep(self) -> None:
        nxt = (self._last_step or now_ns()) + int(self.cfg.poll_s * NS)
        d = (nxt - now_ns()) / NS
        if d > 0:
            time.sleep(d)

    def settle(self) -> None:
        """Stop injecting, undo what is still in progress, and wait for the system to
        converge: every worker alive everywhere with its current incarnation, every link
        tracked, every death seen."""
        assert self.truth is not None and self.checker is not None
        self.note("chaos over: settling", "*")
        self.say("settling")
        while self.timers:  # SIGCONT, the end of hogs and outages, the veth back up
            _, _, fn = heapq.heappop(self.timers)
            fn()
        for c in self._watchers:
            c["due"] = 0  # connectors die now (or as soon as they watch)
        for h in self.hosts:
            for w in h.workers:
                if w.respawn_at is not None:
                    w.respawn_at = 0
                elif w.state == "dying":
                    w.down_s = 0.0
        deadline = now_ns() + int(self.cfg.settle_s * NS)
        missing: str | None = "?"
        while now_ns() < deadline:
            self.step()
            missing = self.converged()
            if (missing is None and not self.checker.seen and not self._garbage_checks
                    and not self.jobs and not self._watchers):
                break
            self._sleep()
        if missing is not None:
            self.breach("no-convergence", f"{self.cfg.settle_s:g} s after the last fault: {missing}", "*")
        # a little more of the converged state, then the last judgements
        end = now_ns() + 2 * NS
        while now_ns() < end:
            self.step()
            self._sleep()
        self._check_watches()
        self.checker.finish(now_ns())

    def _check_watches(self) -> None:
        """The harness's watch rows on each board count exactly its standing watch plus
        one per link the reaper tracks to that host: a reaper that forgot an unwatch (or
        did one too many) would leave a host followed for nobody, or unfollowed."""
        assert self.checker is not None
        me = os.getpid()
        for o in self.hosts:
            want: dict[bytes, int] = {}
            for s in self.truth.followed(o.idx):  # type: ignore[union-attr]
                want[self.hosts[s].ip.encode()] = 1
            if self.liar is not None and o.group == 0:
                want[LIAR_IP.encode()] = 1  # the lying followed host (hostile.py)
            for lk in o.reaper.links() if o.reaper is not None else []:
                k = lk.endpoint.rsplit(":", 1)[0].encode()
                want[k] = want.get(k, 0) + 1
            w = board_words(o.board).watch_table.copy()
            got = {bytes(w[i]["address"]): int(w[i]["refs"]) for i in range(len(w))
                   if int(w[i]["checksum"]) and int(w[i]["owner_pid"]) == me}
            if got != want:
                self.breach("watch-refs", f"h{o.idx}: the harness's watches count {got}, "
                            f"its standing watches and links say {want}", f"h{o.idx}")

    # -- teardown -------------------------------------------------------------------------

    def teardown(self) -> None:
        errors = []
        self.hostile_teardown()
        for h in self.hosts:
            if h.reaper is not None:
                h.reaper.stop()
        for p in self.hogs:
            _kill(p)
        for h in self.hosts:
            if h.reg_stall is not None:
                if h.reg_stall["p"] is not None:
                    _kill(h.reg_stall["p"])
                    if h.reg_stall["p"].stdout is not None:
                        h.reg_stall["p"].stdout.close()
                h.reg_stall = None
        for c in self._watchers:
            _kill(c["p"])
            if c["p"].stdout is not None and not c["p"].stdout.closed:
                c["p"].stdout.close()
        self._watchers.clear()
        for p, _, _, _ in self.jobs:
            _kill(p)
            if p.stdout:
                p.stdout.close()
        self.jobs.clear()
        grew = []
        for h in self.hosts:
            for p in h.live_pingers():
                got = h.holder_fds.get(p.proc.pid)
                if got is not None and got[1] > 0:
                    n1 = _fd_count(p.proc.pid)
                    if n1 > got[1] + 16:
                        grew.append(f"h{h.idx} pinger pid {p.proc.pid}: {got[1]} fds 5 s into "
                                    f"holding the role, {n1} at the end")
            for w in h.workers:
                if w.proc is not None:
                    _kill(w.proc)
                    if w.proc.stdout is not None:
                        w.proc.stdout.close()
                    w.proc = None
            if h.garbage is not None:
                h.garbage.close(0)
                h.garbage = None
            if h.rboard is not None:
                h.rboard.close()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.cluster is not None:
            try:
                self.cluster.close()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                errors.append(f"cluster close: {e}")
        self.procs.cleanup()
        if self.ns is not None:
            self.ns.close()
        self.report.leaks.extend(grew)
        self.report.leaks.extend(errors)

    def check_leaks(self) -> None:
        leaks = self.report.leaks
        names = [h.name for h in self.hosts]
        left = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
        left += [n for n in os.listdir("/dev/shm") if n.startswith(f"shmhb-chaos-full-{os.getpid()}-")]
        if left:
            leaks.append(f"segments left in /dev/shm: {left}")
        after = Snapshot.take()
        if after.fds > self.before.fds:
            leaks.append(f"file descriptors: {self.before.fds} before, {after.fds} after: "
                         + ", ".join(_fds()))
        if after.threads > self.before.threads:
            leaks.append(f"threads: {self.before.threads} before, {after.threads} after: "
                         + ", ".join(t.name for t in threading.enumerate()))
        kids = child_pids() - self.before.children
        if kids:
            leaks.append(f"child processes left: {sorted(kids)}")
        strays = [p for n in names for p in pids_with(n)]
        if strays:
            leaks.append(f"processes still using the run's boards: {sorted(set(strays))}")
        if self.ns is not None:
            out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                 check=False).stdout
            if self.ns.a in out or self.ns.b in out:
                leaks.append("network namespaces left")


def garbage_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """``n`` frames (each a list of parts) that a pinger's ROUTER must count as bad,
    exactly once each: every kind of rejection a foreign DEALER can provoke."""
    ack = encode_ack(Ack(1, Identity(bytes(16), 1), "127.0.0.9:1", 1, True))
    out: list[list[bytes]] = []

    def rb(lo: int, hi: int) -> bytes:
        return rng.randbytes(rng.randrange(lo, hi))

    for _ in range(n):
        k = rng.randrange(8)
        if k == 0:
            b = rb(0, 120)
            if b[:4] == b"SHHB":
                b = b"X" + b[1:]
            parts = [b]  # magic (or truncated)
        elif k == 1:
            parts = [b"SHHB" + bytes([rng.randrange(2, 256)]) + rb(3, 60)]  # version
        elif k == 2:
            parts = [b"SHHB\x01" + bytes([rng.choice([0, 4, 5, 9, 255])]) + rb(2, 60)]  # type
        elif k == 3:
            parts = [b"SHHB\x01\x01" + bytes([rng.choice([2, 4, 0x80])]) + b"\x00" + rb(0, 40)]  # flags
        elif k == 4:
            parts = [b"SHHB\x01\x01\x00\x00" + rb(0, 40)]  # truncated ping
        elif k == 5:
            parts = [rb(1, 30), rb(0, 30)]  # multipart: malformed
        elif k == 6:
            parts = [b"SHHB\x01\x01\x01\x00" + rb(0, 40)]  # a tag, no secret configured
        else:
            parts = [ack]  # a valid frame of the wrong type for a ROUTER
        out.append(parts)
    return out


#: what the garbage frames provoke.  Not "replay" nor "unsolicited": honest traffic makes
#: those too (a watcher's old holder's pings queued behind its new holder's are replays)
_GARBAGE_REASONS = ("bad_truncated", "bad_oversized", "bad_magic", "bad_version", "bad_type",
                    "bad_malformed", "bad_auth")


def _bad_total(b: Board) -> int:
    st = b.stats()
    return sum(st[k] for k in _GARBAGE_REASONS)


def _fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def _kill(p: subprocess.Popen[Any]) -> None:
    kill(p)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: str, n: int = 6) -> str:
    try:
        with open(path, "rb") as f:
            return " | ".join(ln.decode(errors="replace").rstrip() for ln in f.readlines()[-n:])
    except OSError:
        return ""


class _Interrupted(Exception):
    pass


def run(cfg: ChaosConfig) -> Report:
    """One chaos run: set up, inject faults for ``cfg.duration_s``, settle, tear down,
    check for leaks; the report says what was injected and every breach."""
    h = Harness(cfg)
    t0 = time.monotonic()
    main = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.getsignal(sig) for sig in stops} if main else {}

    def on_stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if main:
        # Ctrl-C, kill, a closed terminal: all end the run the same way, with the cleanup.
        # Installed explicitly: a process started in the background by a shell that has
        # no job control inherits SIGINT ignored, and Python then leaves it so.
        for sig in stops:
            signal.signal(sig, on_stop)
    interrupted = False
    try:
        try:
            h.setup()
            h.chaos()
            h.settle()
        except KeyboardInterrupt:
            interrupted = True
            h.say("interrupted: cleaning up")
        finally:
            # a second Ctrl-C (or a SIGTERM) must not stop the cleanup half-way
            if main:
                for sig in stops:
                    signal.signal(sig, signal.SIG_IGN)
            h.teardown()
    finally:
        if main:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    h.check_leaks()
    rep = h.report
    rep.interrupted = interrupted
    rep.wall_s = time.monotonic() - t0
    ck = h.checker
    if ck is not None and h.truth is not None:
        ck.timelines()
        for br in ck.breaches:
            br.t_rel = h.truth.rel(br.t)
        rep.breaches = ck.breaches
        rep.stats = _summary(ck)
    if h.truth is not None and (cfg.keep_tmp or not rep.ok):
        with open(os.path.join(h.tmp, "events.log"), "w") as f:
            f.writelines(f"{h.truth.rel(t):10.3f}  {text}\n" for t, text, _tags in sorted(h.truth.log, key=lambda e: e[0]))
    if rep.ok and not cfg.keep_tmp:
        shutil.rmtree(h.tmp, ignore_errors=True)
    else:
        rep.tmp = h.tmp
    return rep


def _summary(ck: Checker) -> dict[str, Any]:
    def pct(xs: list[float]) -> str:
        if not xs:
            return "none"
        s = sorted(xs)
        q = lambda p: s[min(len(s) - 1, int(p * len(s)))]
        return f"n={len(s)} p50={q(0.5) * 1000:.0f} ms p99={q(0.99) * 1000:.0f} ms max={s[-1] * 1000:.0f} ms"

    out: dict[str, Any] = {}
    out["death seen locally"] = pct(ck.lat["local"])
    out["death seen remotely"] = pct(ck.lat["remote"])
    out["the same in healthy time (what the bounds hold)"] = (
        f"local {pct(ck.lat['healthy-local'])}; remote {pct(ck.lat['healthy-remote'])}")
    out["host declared dead"] = pct(ck.lat["host-dead"])
    out["agent role taken over"] = pct(ck.lat["takeover"])
    out["watches of a dead connector reclaimed"] = pct(ck.lat["reclaim"])
    out["link dropped after death"] = pct(ck.lat["link"])
    out["counters"] = ", ".join(f"{k} {v}" for k, v in sorted(ck.stats.items()))
    return out
