"""shmhb on simulated clusters: ``python -m bench.cluster [--quick]``.

Hosts are loopback addresses (host h is 127.0.0.(2+h)); hosts x ranks per host = 4 x 16
and 32 x 16 (``--quick``: 4 x 16 only, shorter windows, fewer kills).  Every host follows
every other host.  Each host: one board, one ``python -m shmhb pinger --listen
127.0.0.X:P --interval-s 0.2`` process (the pinger's default interval: 5 pings/s to each
followed host; its default tick, 0.1 s), and one ranks process that registers the
host's 16 rank slots, beats them every 0.1 s from one thread and watches every other
host (``bench.cluster_hosts``).  Kill victims are extra worker processes on the board.
The seed's per-rank design measured beside it is the design study's (bench/STUDY.md).
Then, separately:

* **pinger CPU target**: one real pinger following 64 remote hosts at 5 pings/s each,
  the hosts emulated by one light process (``bench.emulator``) answering with valid
  acks on 64 loopback addresses; windows alternate "follow only" and "follow + answer
  64 hosts' pings"; then two bare pyzmq "floors" moving the same frames take its place.
* **pushes** (``bench.push``): remote kill -> DEAD with pushes and pings only,
  ping interval 1 s.

What is measured and what is computed is said in each table and in
bench/results_cluster.md, which the run overwrites (``--out`` to write elsewhere).
Everything started is stopped and every board unlinked at the end, on Ctrl-C too.
Traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import shmhb
from shmhb.board.core import board_words
from shmhb.board.config import AgentConfig
from shmhb.net.plan import DEFAULT_BUDGET_PPS, host_interval_ns
from shmhb.testing.loopback import child_env, free_port, loopback_addrs
from shmhb.status import Status

from . import push as push_bench
from .emulator import address as emulated_address
from . import stats
from .harness import (
    REPO,
    Dist,
    HostServer,
    attach_when_ready,
    board_name,
    cpu_delta,
    kill_and_time,
    sample_cpu,
    start_pinger,
    stop_process,
    wait_quiet,
    wait_remote_alive,
)

SHMHB_INTERVAL_S = 0.2
BEAT_S = 0.1


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- one cluster shape -------------------------------------------------------------------------

@dataclass
class ShapeResult:
    H: int
    R: int
    window_s: float = 0.0
    sh_msgs: float = 0.0
    sh_parts: dict[str, float] = field(default_factory=dict)
    sh_cpu: list[float] = field(default_factory=list)  # per host, whole window, % of a core
    sh_msgs_w: list[float] = field(default_factory=list)  # per sub-window
    sh_cpu_w: list[float] = field(default_factory=list)  # per sub-window, mean over hosts
    sh_sched_w: list[float] = field(default_factory=list)
    sh_beats: list[float] = field(default_factory=list)
    sh_kill: Dist = field(default_factory=Dist)
    sh_local: Dist = field(default_factory=Dist)
    sh_within: int = 0  # kills seen remotely within local verdict + one interval
    sh_late: list[float] = field(default_factory=list)  # worst agent-loop lateness, ms, per kill
    dead_after_s: float = 10.0
    problems: list[str] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)


def wait_converged(boards: list[shmhb.Board], slots: int, timeout_s: float) -> bool:
    """Every host sees every other host ALIVE with at least ``slots`` slots."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ok = True
        for b in boards:
            ps = b.peers()
            if len(ps) < len(boards) - 1 or any(
                    p.status is not Status.ALIVE or len(p.slots) < slots for p in ps):
                ok = False
                break
        if ok:
            return True
        time.sleep(0.5)
    return False


class ShmhbCluster:
    """H simulated shmhb hosts: pingers, ranks processes, one victim worker per host."""

    def __init__(self, st: contextlib.ExitStack, H: int, R: int, port: int) -> None:
        self.H, self.R = H, R
        self.addrs = loopback_addrs(H)
        self.names = [board_name(f"c{H}x{R}-h{h}") for h in range(H)]
        self.pingers = [start_pinger(st, self.names[h], f"{self.addrs[h]}:{port}", SHMHB_INTERVAL_S)
                        for h in range(H)]
        self.boards = attach_when_ready(st, self.names, timeout_s=120, procs=self.pingers)
        self.hs = HostServer(st)
        for h in range(H):
            self.hs.start_ranks(self.names[h], R, self.addrs[h], BEAT_S,
                                [f"{a}:30000" for a in self.addrs if a != self.addrs[h]])
        self.ranks_pids = self.hs.wait_ranks(H, timeout_s=120)
        for h in range(H):
            self.hs.request_victim(self.names[h], "victim", f"{self.addrs[h]}:31000")
        self.victims = [self.hs.wait_victim(self.names[h], "victim", f"{self.addrs[h]}:31000")
                        for h in range(H)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.pingers]

    def stop(self) -> None:
        for p in self.pingers:
            p.terminate()  # all at once; the ExitStack waits for each
        self.hs.close()


def measure_steady(res: ShapeResult, sh: ShmhbCluster, window_s: float, subwindows: int) -> None:
    """Messages and CPU over one window cut into sub-windows; figures are medians over the
    sub-windows (robust to bursts of other load)."""
    pp, rp = sh.pids, sh.ranks_pids
    snaps = []
    for k in range(subwindows + 1):
        if k:
            time.sleep(window_s / subwindows)
        snaps.append(([b.stats() for b in sh.boards], sample_cpu(pp + rp)))
    (st0, c0), (st1, c1) = snaps[0], snaps[-1]
    dt = res.window_s = c1.t - c0.t
    for k in ("pings_sent", "pings_answered", "pushes_sent", "acks_received"):
        res.sh_parts[k] = sum(b[k] - a[k] for a, b in zip(st0, st1)) / dt
    res.sh_cpu = [100 * cpu_delta(c0, c1, [p])[0] / dt for p in pp]  # whole window, per host
    res.sh_beats = [100 * cpu_delta(c0, c1, [p])[1] / dt for p in rp]
    for (a_st, a_c), (b_st, b_c) in itertools.pairwise(snaps):
        w = b_c.t - a_c.t
        res.sh_msgs_w.append(sum(b[k] - a[k] for a, b in zip(a_st, b_st)
                                 for k in ("pings_sent", "pings_answered", "pushes_sent")) / w)
        u, sch = cpu_delta(a_c, b_c, pp)
        res.sh_cpu_w.append(100 * u / w / sh.H)
        res.sh_sched_w.append(100 * sch / w / sh.H)
    res.sh_msgs = stats.median(res.sh_msgs_w)


def shmhb_kills(res: ShapeResult, sh: ShmhbCluster, n: int, rng: random.Random) -> None:
    """Kill victims on each host in turn; a random other host is the watcher."""
    H, boards = sh.H, sh.boards
    res.dead_after_s = boards[0].policy.dead_after_s
    timeout = res.dead_after_s + SHMHB_INTERVAL_S + 5.0
    last_change = [time.monotonic()] * H
    for k in range(n):
        vh = k % H
        wh = rng.choice([h for h in range(H) if h != vh])
        v = sh.victims[vh]
        if not wait_remote_alive(boards[wh], v, 10.0):
            res.problems.append(f"shmhb: victim on host {vh} never seen ALIVE by host {wh}")
            res.sh_kill.add(None)
        else:
            time.sleep(rng.uniform(0, SHMHB_INTERVAL_S))
            wait_quiet(last_change[vh])
            r = kill_and_time(boards[vh], boards[wh], v, timeout_s=timeout)
            res.sh_kill.add(r.remote_ms)
            res.sh_local.add(r.local_ms)
            res.sh_late.append(max(board_words(boards[vh]).lateness_ms(), board_words(boards[wh]).lateness_ms()))
            if r.remote_ms is not None and r.local_ms is not None and \
                    r.remote_ms <= r.local_ms + SHMHB_INTERVAL_S * 1e3:
                res.sh_within += 1
        sh.hs.request_victim(sh.names[vh], v.key, v.endpoint)
        sh.victims[vh] = sh.hs.wait_victim(sh.names[vh], v.key, v.endpoint)
        last_change[vh] = time.monotonic()


def run_shape(H: int, R: int, *, window_s: float, subwindows: int, sh_kills: int,
              rng: random.Random) -> ShapeResult:
    """One shape: the cluster up and converged, its steady state, then ``sh_kills`` kills."""
    res = ShapeResult(H, R)
    load0 = stats.loadavg()
    with contextlib.ExitStack() as st:
        log(f"{H}x{R}: starting {H} shmhb hosts")
        sh = ShmhbCluster(st, H, R, free_port(loopback_addrs(H), rng=rng))
        if not wait_converged(sh.boards, R + 1, 120):
            res.problems.append("shmhb: not every host saw every other ALIVE within 120 s")
        time.sleep(2.0)
        measure_steady(res, sh, window_s, subwindows)
        log(f"{H}x{R}: shmhb {res.sh_msgs:.0f} msgs/s; {sh_kills} kills")
        shmhb_kills(res, sh, sh_kills, rng)
        log(f"{H}x{R}: done")
        sh.stop()
    res.load = (load0, stats.loadavg())
    return res


# -- pinger CPU with N followed hosts ------------------------------------------------------------

#: the pinger CPU targets: (followed hosts, mode) -> % of a core, median of the windows
CPU_TARGETS = {(64, "follow"): 2.0, (250, "both"): 3.0, (250, "both-nat"): 5.0}
CPU_HOSTS = 64  # the default host count of run_cpu_target
CPU_KILL_HOSTS = 250  # host kill -> DEAD is measured at this count
TARGET_KILL_SLACK_S = 1.0  # host kill -> DEAD <= peer_dead_after + this


def emulated_interval_s(hosts: int) -> float:
    """The per-host interval of a default-settings pinger following ``hosts`` hosts: what
    each emulated host uses to ping the real pinger (it follows the whole cluster)."""
    th = shmhb.Policy()
    return host_interval_ns(hosts, DEFAULT_BUDGET_PPS, int(SHMHB_INTERVAL_S * 1e9),
                            int(th.peer_dead_after_s * 1e9)) / 1e9


@dataclass
class CpuResult:
    hosts: int = CPU_HOSTS
    windows: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    # mode -> [(utime+stime %, schedstat %, pings sent/s, pings answered/s)]
    peers_alive: int = 0
    interval_s: float = SHMHB_INTERVAL_S  # each emulated host's ping interval
    kills_s: list[float] = field(default_factory=list)  # host kill -> DEAD on the board
    kills_missed: int = 0
    not_alive: int = 0  # samples in which a live emulated host read other than ALIVE
    samples: int = 0
    hog_s: float = 0.0  # how long every core was hogged (0: not run)
    hog_episodes: dict[str, int] = field(default_factory=dict)  # status -> entries, live hosts
    hog_polls: int = 0
    hog_load: float = 0.0
    problems: list[str] = field(default_factory=list)

    def median(self, mode: str, i: int) -> float:
        return stats.median([w[i] for w in self.windows[mode]])

    def label(self, mode: str) -> str:
        return cpu_label(mode, self.hosts)


CPU_MODES = ("idle", "follow", "both", "both-nat", "both-plain", "floor-dealers-follow", "floor-dealers-both", "floor-dealers-both-v2",
             "floor-router-follow", "floor-router-both", "floor-router-both-v2")


def cpu_label(mode: str, hosts: int) -> str:
    return {
        "idle": "idle: 16 local slots, no remote host",
        "follow": f"follow {hosts} hosts",
        "both": f"follow {hosts} hosts + answer their pings",
        "both-nat": f"follow {hosts} hosts + answer their pings, behind NAT (pings name another address)",
        "both-plain": f"follow {hosts} hosts + answer their pings, no mutual pairs",
        "floor-dealers-follow": f"floor, {hosts} DEALERs: follow {hosts}",
        "floor-dealers-both": f"floor, {hosts} DEALERs: follow + answer {hosts}",
        "floor-dealers-both-v2": f"floor, {hosts} DEALERs: follow + answer {hosts}, mutual pairs' count",
        "floor-router-follow": f"floor, one ROUTER: follow {hosts}",
        "floor-router-both": f"floor, one ROUTER: follow + answer {hosts}",
        "floor-router-both-v2": f"floor, one ROUTER: follow + answer {hosts}, mutual pairs' count",
    }[mode]


def _settle(res: CpuResult) -> None:
    """Before a CPU window: the last mode's frames drained, and every emulated host's
    side of its pair taken (its first evidence comes within two intervals)."""
    time.sleep(max(1.5, 2 * res.interval_s))


def _cpu_window(res: CpuResult, mode: str, pid: int, board: shmhb.Board | None, window_s: float,
                live: set[str] | None = None,
                counts: Callable[[], tuple[int, int]] | None = None) -> None:
    """One window of ``pid``'s CPU; its pings sent and answered from its board's
    counters, or (a floor: no board) from ``counts()``, the emulator's view of them."""
    n0 = counts() if counts is not None else None
    s0, c0 = board.stats() if board else None, sample_cpu([pid])
    end = time.monotonic() + window_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))
        if board is not None and live:  # no live host may read SUSPECT (or worse)
            res.samples += 1
            res.not_alive += sum(1 for p in board.peers() if p.address in live and p.status is not Status.ALIVE)
    s1, c1 = board.stats() if board else None, sample_cpu([pid])
    dt = c1.t - c0.t
    u, s = cpu_delta(c0, c1, [pid])
    sent = (s1["pings_sent"] - s0["pings_sent"]) / dt if s0 and s1 else float("nan")
    ans = (s1["pings_answered"] - s0["pings_answered"]) / dt if s0 and s1 else float("nan")
    if counts is not None and n0 is not None:  # (both or neither: mypy needs the pair)
        n1 = counts()
        sent, ans = (n1[0] - n0[0]) / dt, (n1[1] - n0[1]) / dt
    res.windows[mode].append((100 * u / dt, 100 * s / dt, sent, ans))


_HOG = "while True: pass"


def _hogged(res: CpuResult, board: shmhb.Board, live: set[str], duration_s: float,
            st: contextlib.ExitStack) -> None:
    """One CPU hog per core for ``duration_s``; count every entry of a live host into a
    status other than ALIVE (an episode), polling ``board.peers()`` every ~0.1 s."""
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in os.sched_getaffinity(0)]
    for hp in hogs:
        st.callback(stop_process, hp)
    prev: dict[str, Status] = {}
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end:
            for p in board.peers():
                if p.address in live:
                    if p.status is not Status.ALIVE and prev.get(p.address) is not p.status:
                        res.hog_episodes[p.status.value] = res.hog_episodes.get(p.status.value, 0) + 1
                    prev[p.address] = p.status
            res.hog_polls += 1
            time.sleep(0.1)
        res.hog_load = stats.loadavg()
    finally:
        for hp in hogs:
            stop_process(hp)
    res.hog_s = duration_s


class _Emulated:
    """The emulator process (``bench.emulator``) and the windows measured against it."""

    PINGS = {"follow": "ping 0", "both": "ping 1", "both-plain": "ping 2", "both-nat": "ping 3"}

    def __init__(self, st: contextlib.ExitStack, res: CpuResult, port: int, target: str,
                 window_s: float, live: set[str]) -> None:
        self.res, self.window_s, self.live = res, window_s, live
        self.p = subprocess.Popen(
            [sys.executable, "-m", "bench.emulator", "--hosts", str(res.hosts), "--port", str(port),
             "--target", target, "--interval-s", str(res.interval_s)],
            cwd=REPO, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            bufsize=1)
        st.callback(stop_process, self.p)
        assert self.p.stdin is not None and self.p.stdout is not None
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError("the emulator did not start")

    def command(self, line: str) -> tuple[int, int]:
        """A command to the emulator; its counts so far, as the process under test sees
        them: (pings it sent that the emulated hosts answered, pings they sent it)."""
        self.p.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        got = self.p.stdout.readline().split()  # type: ignore[union-attr]
        return (int(got[1]), int(got[2])) if len(got) == 4 and got[0] == "stats" else (0, 0)

    def abba(self, pid: int, a: str, b: str, brd: shmhb.Board | None, rounds: int) -> None:
        """Windows of modes ``a`` and ``b`` in ABBA order."""
        for k in range(rounds * 2):
            mode = (a, b)[k % 2] if (k // 2) % 2 == 0 else (b, a)[k % 2]
            self.command(self.PINGS.get(mode, "ping 1" if mode == b else "ping 0"))
            _settle(self.res)
            _cpu_window(self.res, mode, pid, brd, self.window_s, self.live if brd else None,
                        counts=None if brd else (lambda: self.command("stats")))

    def host_kills(self, board: shmhb.Board, addrs: list[str], kills: int,
                   rng: random.Random) -> None:
        """``kills`` emulated hosts die one by one (the others go on pinging): the time
        to DEAD on ``board``."""
        self.command("ping 1")
        dead_after = board.policy.peer_dead_after_s
        for i in rng.sample(range(len(addrs)), kills):
            time.sleep(rng.uniform(0, 1.0))  # a random phase of the ping cycle
            self.live.discard(addrs[i])
            self.command(f"kill {i}")
            t0 = time.monotonic()
            while time.monotonic() - t0 < dead_after + 10:
                p = board.peer(addrs[i])
                if p is not None and p.status is Status.DEAD:
                    self.res.kills_s.append(time.monotonic() - t0)
                    break
                time.sleep(0.005)
            else:
                self.res.kills_missed += 1
        log(f"{self.res.hosts} hosts: host kill -> DEAD "
            f"{', '.join(f'{x:.2f}' for x in self.res.kills_s)} s")

    def floor_windows(self, st: contextlib.ExitStack, kind: str, listen: str, port: int,
                      rounds: int) -> None:
        """A floor pinger (``bench.emulator --floor KIND``) in the pinger's place (same
        address; the emulator reconnects), and its windows."""
        floor = subprocess.Popen(
            [sys.executable, "-m", "bench.emulator", "--floor", kind, "--listen", listen,
             "--hosts", str(self.res.hosts), "--port", str(port), "--target", "-",
             "--interval-s", str(self.res.interval_s)],
            cwd=REPO, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        st.callback(stop_process, floor)
        assert floor.stdout is not None and floor.stdin is not None
        if floor.stdout.readline().strip() != "ready":
            raise RuntimeError("the floor pinger did not start")
        time.sleep(1.0)
        self.abba(floor.pid, f"floor-{kind}-follow", f"floor-{kind}-both", None, rounds)
        # the same messages as this release's pinger in "both": mutual pairs, one side
        # pinging every interval and the other once per refresh
        floor.stdin.write("mutual 1\n")
        floor.stdin.flush()
        floor.stdout.readline()
        self.command("ping 4")
        for _ in range(rounds):
            _settle(self.res)
            _cpu_window(self.res, f"floor-{kind}-both-v2", floor.pid, None, self.window_s,
                        counts=lambda: self.command("stats"))
        stop_process(floor)


def _wait_alive(res: CpuResult, board: shmhb.Board, hosts: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sum(1 for p in board.peers() if p.status is Status.ALIVE) == hosts:
            break
        time.sleep(0.5)
    res.peers_alive = sum(1 for p in board.peers() if p.status is Status.ALIVE)
    if res.peers_alive != hosts:
        res.problems.append(f"only {res.peers_alive}/{hosts} emulated hosts ALIVE")


def run_cpu_target(window_s: float, rounds: int, floor_rounds: int, rng: random.Random,
                   hosts: int = CPU_HOSTS, kills: int = 0, hog_s: float = 0.0) -> CpuResult:
    """One real pinger at the default settings (and then the floor) under the load of
    ``hosts`` emulated hosts; each emulated host pings it as a default-settings pinger
    following the whole cluster would.  Then ``kills`` emulated hosts die one by one
    (while the others keep pinging) and the time to DEAD on the board is measured."""
    res = CpuResult(hosts=hosts, windows={m: [] for m in CPU_MODES},
                    interval_s=emulated_interval_s(hosts))
    with contextlib.ExitStack() as st:
        # 127.0.0.1: the one loopback address a pinger's pings leave from (the kernel's
        # source on lo), so that they count as evidence at the emulated hosts, as the
        # pings of a host from its own address do between hosts
        me = "127.0.0.1"
        emu_addrs = [emulated_address(i) for i in range(hosts)]
        port = free_port([me, *emu_addrs], rng=rng)
        name = board_name(f"cpu{hosts}")
        log(f"pinger CPU: one pinger, then the floor, following {hosts} emulated hosts; they "
            f"ping it every {res.interval_s:.3g} s each")
        pinger = start_pinger(st, name, f"{me}:{port}", SHMHB_INTERVAL_S)
        (board,) = attach_when_ready(st, [name], procs=[pinger])
        hs = HostServer(st)
        hs.start_ranks(name, 16, me, BEAT_S, [])
        hs.wait_ranks(1)
        time.sleep(1.0)
        _cpu_window(res, "idle", pinger.pid, board, window_s)
        live = {f"{a}:{port}" for a in emu_addrs}
        emu = _Emulated(st, res, port, f"{me}:{port}", window_s, live)
        for a in emu_addrs:
            board.watch(f"{a}:30000")
        _wait_alive(res, board, hosts)
        emu.abba(pinger.pid, "follow", "both", board, rounds)
        # hosts known by another address than the one they name (NAT, a name): their
        # pings count by identity, and the pairs are mutual as in "both"
        emu.abba(pinger.pid, "both", "both-nat", board, rounds)
        # what a cluster pays where no pair is mutual (pings that count as no host's
        # evidence, as on loopback): both sides of every pair ping every interval
        for _ in range(rounds):
            emu.command("ping 2")
            _settle(res)
            _cpu_window(res, "both-plain", pinger.pid, board, window_s, live)
        if kills:
            emu.host_kills(board, [f"{a}:{port}" for a in emu_addrs], kills, rng)
        if hog_s:
            emu.command("ping 1")
            log(f"{hosts} hosts: {hog_s:g} s with every core hogged")
            _hogged(res, board, live, hog_s, st)
            log(f"{hosts} hosts: episodes of live hosts leaving ALIVE: {res.hog_episodes or 0}")
        stop_process(pinger)
        for kind in ("dealers", "router") if floor_rounds else ():
            emu.floor_windows(st, kind, f"{me}:{port}", port, floor_rounds)
        emu.p.stdin.close()  # type: ignore[union-attr]
    return res


# -- report ----------------------------------------------------------------------------------------

def pct(x: float) -> str:
    return f"{x:.2f} %" if x < 10 else f"{x:.1f} %"


def rate(x: float) -> str:
    return f"{x:,.0f}/s"


def dist_cells(values: list[float], unit: str, scale: float = 1.0) -> list[str]:
    if not values:
        return ["-", "-"]
    return [stats.fmt(stats.median(values) * scale, unit), stats.fmt(stats.p99(values) * scale, unit)]


def cpu_section(cpu: CpuResult) -> str:
    """The markdown section of one run_cpu_target run."""
    out = [f"## Pinger CPU: {cpu.hosts} remote hosts, default settings\n"]
    rows = []
    window_s = shmhb.Policy().peer_dead_after_s
    for m in CPU_MODES:
        w = cpu.windows[m]
        if not w:
            continue
        sent, ans = cpu.median(m, 2), cpu.median(m, 3)
        # each ping sent brings an ack back, each one answered sent an ack: two messages
        per_pair = 2 * (sent + ans) * window_s / cpu.hosts
        rows.append([cpu.label(m), pct(cpu.median(m, 0)), pct(max(x[0] for x in w)), pct(cpu.median(m, 1)),
                     "-" if math.isnan(sent) else f"{sent:.0f}/s",
                     "-" if math.isnan(sent) else f"{ans:.0f}/s",
                     "-" if math.isnan(sent) or not cpu.hosts else f"{per_pair:.1f}", str(len(w))])
    out.append(stats.table(["process under test", "CPU median (utime+stime)", "max window", "(schedstat)",
                            "pings sent", "pings answered",
                            f"messages per host pair per {window_s:g} s (peer dead-after)", "windows"],
                           rows))
    floors_ran = any(cpu.windows[m] for m in CPU_MODES if m.startswith("floor"))
    mine = host_interval_ns(cpu.hosts, DEFAULT_BUDGET_PPS, int(SHMHB_INTERVAL_S * 1e9),
                            int(shmhb.Policy().peer_dead_after_s * 1e9)) / 1e9
    out.append(f"\n- {cpu.peers_alive}/{cpu.hosts} emulated hosts ALIVE on the board. The pinger runs "
               f"at its defaults (interval {SHMHB_INTERVAL_S:g} s, budget {DEFAULT_BUDGET_PPS:g} pings/s): "
               f"it pings each host every {mine:.3g} s. Each emulated host pings it as a default "
               f"pinger following the whole cluster would: from its own address, and where it is the "
               f"passive side of the mutual pair (the larger board identity: about half of them; the "
               f"pinger is passive for the others) only once per refresh while the pinger's pings "
               f"count as evidence; behind NAT the same, its pings naming an address the pinger does "
               f"not follow it by; with no mutual pairs (pings that count as no host's evidence), "
               f"every {cpu.interval_s:.3g} s. Live hosts read "
               f"other than ALIVE in {cpu.not_alive} of {cpu.samples * max(1, cpu.hosts)} samples "
               "(every 0.5 s, every host). The pinger's board holds 16 beating rank slots (its acks "
               "carry their digest). Windows alternate A B B A."
               + ("" if not floors_ran else " The floors replace the pinger on the same address, under "
               "the same emulated load: bare Python + pyzmq processes moving the same frames on the "
               "same tick as the pinger's (prebuilt frames, nothing decoded, no board), with one DEALER per host "
               f"or with one ROUTER connected to all {cpu.hosts} hosts. A floor's pings count as no "
               "host's evidence, so in \"follow + answer\" every host pings it every turn (the "
               "count of pairs that are not mutual); the \"mutual pairs' count\" rows move the "
               "messages of this release's mutual pairs instead: the floor pings half the hosts "
               "every interval and the other half once per refresh, and they it the other way "
               "round. Its pings sent and answered are the emulated hosts' counts."))
    if cpu.kills_s or cpu.kills_missed:
        out.append(f"- Host kill -> DEAD on the board (an emulated host's sockets closed at a random "
                   f"phase, the others still pinging): {', '.join(f'{x:.2f} s' for x in cpu.kills_s)}"
                   + (f"; {cpu.kills_missed} not DEAD within 15 s" if cpu.kills_missed else "") + ".")
    if cpu.hog_s:
        out.append(f"- {cpu.hog_s:g} s with one CPU hog per core (load {cpu.hog_load:.1f} at the end), "
                   f"the emulated hosts still pinging: entries of live hosts into another status than "
                   f"ALIVE, by status: {cpu.hog_episodes or 'none'} ({cpu.hog_polls} polls of "
                   "`board.peers()`). UNKNOWN is this host's own pinger starved past `agent_stale_s` "
                   "(nobody observing), not a verdict on the host.")
    out.append("")
    return "\n".join(out)


def cpu_targets(cpu: CpuResult) -> list[tuple[list[str], bool]]:
    out = []
    for (n, mode), limit in CPU_TARGETS.items():
        if n == cpu.hosts and cpu.windows[mode]:
            c = cpu.median(mode, 0)
            ok = c <= limit and cpu.peers_alive == cpu.hosts
            out.append(([f"pinger CPU <= {limit:g} % of a core: {cpu.label(mode)}, default settings",
                         f"{pct(c)} (median of {len(cpu.windows[mode])} windows)"], ok))
    if cpu.kills_s or cpu.kills_missed:
        limit = shmhb.Policy().peer_dead_after_s + TARGET_KILL_SLACK_S
        ok = not cpu.kills_missed and max(cpu.kills_s) <= limit
        out.append(([f"host kill -> DEAD <= peer dead-after + {TARGET_KILL_SLACK_S:g} s ({limit:g} s), "
                     f"{cpu.hosts} followed hosts",
                     f"median {stats.median(cpu.kills_s):.2f} s, max {max(cpu.kills_s):.2f} s "
                     f"({len(cpu.kills_s)} kills)" if cpu.kills_s else "none"], ok))
    if cpu.hog_s:
        # UNKNOWN is not a verdict on a host: it says this host's own pinger was stalled
        # for more than agent_stale (starved of CPU), so nobody was observing.
        n = sum(v for k, v in cpu.hog_episodes.items() if k in ("suspect", "dead"))
        out.append(([f"0 SUSPECT or DEAD episodes of live hosts, {cpu.hog_s:g} s with every core "
                     f"hogged, {cpu.hosts} followed hosts",
                     f"{n} (episodes by status: {cpu.hog_episodes or 'none'}; {cpu.hog_polls} polls, "
                     f"load {cpu.hog_load:.1f})"], n == 0))
    if cpu.samples:
        ok = cpu.not_alive == 0
        out.append(([f"live hosts always ALIVE while measured, {cpu.hosts} followed hosts",
                     f"{cpu.not_alive} non-ALIVE samples"], ok))
    return [([*row, "met" if ok else "MISSED"], ok) for row, ok in out]


def report_cpu(cpus: list[CpuResult], info: list[tuple[str, str]], wall_s: float) -> str:
    out = ["# shmhb pinger CPU under a ping budget\n",
           f"`python -m bench.cluster --only-cpu`, {wall_s:.0f} s wall.\n"]
    out.extend(f"- {k}: {v}" for k, v in info)
    out.append("")
    trows: list[list[str]] = []
    for cpu in cpus:
        out.append(cpu_section(cpu))
        trows.extend(row for row, _ in cpu_targets(cpu))
    out.append("## Targets\n")
    out.append(stats.table(["target", "figure", ""], trows))
    probs = [p for c in cpus for p in c.problems]
    out.extend(f"- problem: {p}" for p in probs)
    return "\n".join(out)


def report(shapes: list[ShapeResult], cpus: list[CpuResult], pr: push_bench.PushResult,
           info: list[tuple[str, str]], wall_s: float, quick: bool) -> tuple[str, list[bool]]:
    """bench/results_cluster.md's text, and each target's verdict."""
    out = ["# shmhb on simulated clusters\n",
           f"`python -m bench.cluster{' --quick' if quick else ''}`, {wall_s:.0f} s wall. "
           "Written by the run; figures differ run to run (2 shared cores).\n"]
    out += [f"- {k}: {v}" for k, v in info]
    out.append("")
    out += steady_section(shapes) + kills_section(shapes)
    out += [cpu_section(cpu) for cpu in cpus]
    out += pushes_section(pr)
    text, met = targets_section(shapes, cpus, pr)
    out += text
    probs = [p for s in shapes for p in s.problems] + [p for c in cpus for p in c.problems]
    if probs:
        out.append("## Problems seen\n")
        out.extend(f"- {p}" for p in probs[:20])
        out.append("")
    out.append(MEASURED_VS_COMPUTED)
    return "\n".join(out), met


def steady_section(shapes: list[ShapeResult]) -> list[str]:
    rows = [[f"{s.H} x {s.R}", rate(s.sh_msgs), pct(stats.median(s.sh_cpu_w)),
             pct(stats.median(s.sh_sched_w)), pct(max(s.sh_cpu)), pct(stats.median(s.sh_beats))]
            for s in shapes]
    out = ["## Steady state: messages and CPU\n",
           stats.table(["hosts x ranks", "msgs/s, whole cluster (measured: all hosts)",
                        "pinger CPU per host (utime+stime)", "(schedstat)", "busiest pinger",
                        "beats, 16 slots"], rows), ""]
    for s in shapes:
        p = s.sh_parts
        out.append(f"- {s.H} x {s.R}: window {s.window_s:.1f} s in {len(s.sh_msgs_w)} sub-windows; msgs/s "
                   f"and CPU are medians over sub-windows (pinger CPU per host: "
                   f"{', '.join(f'{x:.2f}' for x in s.sh_cpu_w)} %). Whole-window means per second: "
                   f"{p['pings_sent']:.0f} pings, {p['pings_answered']:.0f} acks sent, "
                   f"{p['acks_received']:.0f} acks received, {p['pushes_sent']:.1f} pushes. "
                   f"Load average {s.load[0]:.1f} before, {s.load[1]:.1f} after.")
    out.append("")
    return out


def kills_section(shapes: list[ShapeResult]) -> list[str]:
    rows = []
    for s in shapes:
        shape = f"{s.H} x {s.R}"
        rows.append([shape, "DEAD on the watching host's board (push)", *dist_cells(s.sh_kill.values, "ms"),
                     f"{len(s.sh_kill.values)}" + (f" (+{s.sh_kill.missed} missed)" if s.sh_kill.missed else "")])
        rows.append([shape, "DEAD on the victim's own board (pidfd)", *dist_cells(s.sh_local.values, "ms"),
                     str(len(s.sh_local.values))])
    out = ["## Kill a remote worker: time to the verdict on a watching host\n",
           stats.table(["hosts x ranks", "verdict (measured)", "median", "p99", "kills"], rows), ""]
    for s in shapes:
        if s.sh_late:
            out.append(f"- {s.H} x {s.R}: agent loops (victim's host and watcher) ran up to "
                       f"{stats.median(s.sh_late):.0f} ms late (median over kills of the worse of the two; "
                       f"max {max(s.sh_late):.0f} ms; the tick is {AgentConfig().tick_s * 1000:.0f} ms): CPU "
                       f"starvation: this machine runs all {s.H} pingers, the benchmark and other work on 2 cores.")
    out.append("")
    return out


def pushes_section(pr: push_bench.PushResult) -> list[str]:
    out: list[str] = []
    out.append("## Pushes: remote kill -> DEAD, ping interval 1 s\n")
    out.append(stats.table(push_bench.HEADERS, push_bench.rows(pr)))
    out.append(f"\n- pings only: the watcher follows the victim's host through a relay that drops "
               f"PUSH frames ({pr.relay_dropped} dropped; that watcher received "
               f"{pr.pings_watcher_pushes_received} pushes, the direct one {pr.push_watcher_pushes_received}). "
               "Kills alternate between the two pairs; before a pings-only kill a random 0-1 s wait "
               "puts it at a random phase of the ping cycle.")
    out.append("")

    return out


def targets_section(shapes: list[ShapeResult], cpus: list[CpuResult],
                    pr: push_bench.PushResult) -> tuple[list[str], list[bool]]:
    out: list[str] = []
    met: list[bool] = []
    out.append("## Targets\n")
    trows = []
    for cpu in cpus:
        for row, ok in cpu_targets(cpu):
            met.append(ok)
            trows.append(row)
    for s in shapes:
        if not s.sh_kill.values:
            continue
        dead_after = s.dead_after_s
        p99v = stats.p99(s.sh_kill.values)
        ok = not s.sh_kill.missed and max(s.sh_kill.values) <= (dead_after + SHMHB_INTERVAL_S) * 1e3
        met.append(ok)
        trows.append([(f"remote kill seen <= dead-after + one interval ({dead_after + SHMHB_INTERVAL_S:g} s), "
                       f"{s.H} x {s.R}"),
                      f"max {stats.fmt(max(s.sh_kill.values), 'ms')}, p99 {stats.fmt(p99v, 'ms')}",
                      "met" if ok else "MISSED"])
        n = len(s.sh_kill.values) + s.sh_kill.missed
        ok2 = s.sh_within == n
        met.append(ok2)
        trows.append([(f"stricter: each kill seen <= its host's pidfd verdict + one interval (200 ms), "
                       f"{s.H} x {s.R}"), f"{s.sh_within}/{n} kills", "met" if ok2 else "MISSED"])
    ok, why = push_bench.verdict(pr)
    met.append(ok)
    trows.append(["pushes: remote kill -> DEAD median <= 10 ms, interval 1 s", why, "met" if ok else "MISSED"])
    out.append(stats.table(["target", "figure", ""], trows))
    out.append("")
    return out, met


MEASURED_VS_COMPUTED = """## What is measured, what is computed

- **Messages** are counted from each board's `stats()` (pings sent + acks sent + pushes
  sent, all hosts), never estimated; steady-state figures are medians over sub-windows.
  The analytic figure at 32 x 16 is 2 x 32 x 31 x 5 = 9,920 msgs/s; fewer are measured
  when starved pingers tick late.
- **CPU** is utime + stime from /proc/PID/stat (all threads) over each sub-window, as %
  of one core; schedstat (ns run time of the live threads) is shown beside it: each
  host's `shmhb pinger` process (the agent role: pidfd watch of local workers, pings,
  acks, the board tick); the ranks process that beats 16 slots is shown apart.
- **Kill -> DEAD** (measured): SIGKILL of a victim worker to the first poll (~0.2 ms
  apart) at which another host's `board.remote(endpoint)` reads DEAD.  Victim hosts take
  turns, the watcher is drawn at random, a random 0-0.2 s wait puts each kill at a
  random phase of the ping cycle, and each kill is the only change on its host for the
  pinger's push gap (50 ms) plus two ticks before it: the pinger sends at most one push
  per gap, so a death right after another change there (the registration of the
  previous victim's replacement) waits for the gap, by design.  The stricter check
  compares each remote verdict with the victim host's own (pidfd) verdict plus one ping
  interval.
- **Pinger CPU target** (measured) on one real pinger at its default settings; the 64
  or 250 remote hosts are emulated by one process answering with valid `shmhb.net.protocol`
  acks and pinging the real pinger as a default-settings pinger would (its CPU is not
  counted).  At 250 hosts, emulated hosts are also killed (their sockets closed) and the
  time to DEAD on the real pinger's board is measured.
- **Pushes** (measured): see bench/push.py.  Pings only is measured without any switch
  in shmhb: the watcher reaches the victim's host through a relay that drops PUSH frames.
- **Noise.**  This machine has 2 cores shared with other work; the run prints the load
  average.  The 32 x 16 kill figures mostly measure CPU starvation: all 32 pingers run
  here, and their agent loops run hundreds of ms late (see the lateness notes above);
  on real hosts each pinger has its host's CPUs.
"""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="4 x 16 only, short windows, fewer kills, no floors (< 1 min)")
    p.add_argument("--out", default=str(REPO / "bench" / "results_cluster.md"),
                   help="markdown report to overwrite (default bench/results_cluster.md)")
    p.add_argument("--seed", type=int, default=None, help="random seed (choices of victims, phases)")
    p.add_argument("--cpu-hosts", type=int, nargs="+", default=[CPU_HOSTS, CPU_KILL_HOSTS],
                   help=f"emulated host counts of the pinger CPU runs (default {CPU_HOSTS} "
                        f"{CPU_KILL_HOSTS}; host kills at {CPU_KILL_HOSTS})")
    p.add_argument("--only-cpu", action="store_true",
                   help="run the pinger CPU runs only (no shapes, no pushes; printed, written "
                        "only with --out)")
    p.add_argument("--cpu-window-s", type=float, default=4.0, help="--only-cpu: window length")
    p.add_argument("--cpu-rounds", type=int, default=2, help="--only-cpu: A B B A rounds")
    p.add_argument("--cpu-floor-rounds", type=int, default=1,
                   help="--only-cpu: A B B A rounds of each bare-pyzmq floor (0: none)")
    p.add_argument("--kills", type=int, default=5, help=f"--only-cpu: host kills at {CPU_KILL_HOSTS}")
    p.add_argument("--hog-s", type=float, default=0.0,
                   help=f"--only-cpu: then hog every core this long at {CPU_KILL_HOSTS} hosts")
    a = p.parse_args(argv)
    a.out_set = "--out" in (argv if argv is not None else sys.argv)
    return a


def only_cpu(a: argparse.Namespace, rng: random.Random) -> int:
    """``--only-cpu``: the pinger CPU runs alone, printed (written only with --out)."""
    t0, info, load0 = time.monotonic(), stats.machine_info(), stats.loadavg()
    cpus = [run_cpu_target(a.cpu_window_s, a.cpu_rounds, a.cpu_floor_rounds, rng, hosts=h,
                           kills=a.kills if h == CPU_KILL_HOSTS else 0,
                           hog_s=a.hog_s if h == CPU_KILL_HOSTS else 0.0) for h in a.cpu_hosts]
    text = report_cpu(cpus, info, time.monotonic() - t0)
    note = stats.noise_note(load0, stats.loadavg())
    text += f"\n- load average (1 min) {load0:.1f} before, {stats.loadavg():.1f} after\n"
    if note:
        text += "\n" + note + "\n"
    print(text)
    if a.out_set:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    rng = random.Random(a.seed)
    if a.only_cpu:
        return only_cpu(a, rng)
    t0 = time.monotonic()
    info = stats.machine_info()
    load0 = stats.loadavg()
    shapes: list[ShapeResult] = []
    if a.quick:
        shapes.append(run_shape(4, 16, window_s=3.0, subwindows=2, sh_kills=20, rng=rng))
        cpus = [run_cpu_target(2.5, 1, 0, rng, hosts=h) for h in a.cpu_hosts]
        with contextlib.ExitStack() as st:
            log("pushes: 10 kills per mode")
            pr = push_bench.run(st, 10, log=log)
    else:
        shapes.append(run_shape(4, 16, window_s=8.0, subwindows=4, sh_kills=30, rng=rng))
        shapes.append(run_shape(32, 16, window_s=12.0, subwindows=4, sh_kills=30, rng=rng))
        cpus = [run_cpu_target(4.0, 2, 1, rng, hosts=h, kills=5 if h == CPU_KILL_HOSTS else 0,
                               hog_s=60.0 if h == CPU_KILL_HOSTS else 0.0)
                for h in a.cpu_hosts]
        with contextlib.ExitStack() as st:
            log("pushes: 30 kills per mode")
            pr = push_bench.run(st, 30, log=log)
    wall = time.monotonic() - t0
    text, met = report(shapes, cpus, pr, info, wall, a.quick)
    note = stats.noise_note(load0, stats.loadavg())
    if note:
        text += "\n" + note + "\n"
    print(text)
    with open(a.out, "w") as f:
        f.write(text)
    log(f"wrote {a.out}; {sum(met)}/{len(met)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
