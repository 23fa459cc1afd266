"""The scenarios of the benchmark suite (``python -m bench``), one per question, each
returning its figures as a named record; bench/suite.py runs them, bench/report.py and
bench/figures.py turn the records into RESULTS.md and the plots.

1. cost of one heartbeat and one liveness read: shmhb against a ZMQ REQ round trip (what
   one check over the network costs), a multiprocessing.Manager dict, a Redis key with a TTL (only where a
   ``redis-server`` binary exists), and the physical floor (clock + store);
2. overhead on a worker's step loop (numpy, ~2 ms a step);
3. detection time: local kill, local hang, remote host kill (remote worker kill and the
   clusters are bench.push's and bench.cluster's);
4. cost that grows with the cluster: the message and memory models;
5. false verdicts with both cores saturated by CPU hogs, default policy.

Everything a scenario starts is stopped and removed through the ExitStack it is given.
Traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

import shmhb
from shmhb.board.config import Capacity, Policy
from shmhb.board.layout import Sizes
from shmhb.net.plan import LONG_REFRESH
from shmhb.testing.loopback import child_env, free_port, loopback_addrs
from shmhb.status import Status

from . import board as board_bench
from . import cluster as cluster_bench
from . import stats
from .harness import (
    HostServer,
    attach_when_ready,
    board_name,
    start_pinger,
    stop_process,
)
from .stats import Variant

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- 1: one heartbeat, one read ---------------------------------------------------------

#: a peer's listener: a ROUTER that answers each request with one frame, until stdin closes
_ZMQ_SERVER = """
import sys, threading, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(f"tcp://{sys.argv[1]}:{sys.argv[2]}")
def answer():
    while True:
        ident, empty, _ = sock.recv_multipart()
        sock.send_multipart((ident, empty, b"ack"))
threading.Thread(target=answer, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


class Resp:
    """A minimal RESP2 client (SET/GET/PING), for when redis-py is not installed."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.f = self.s.makefile("rb")

    def cmd(self, *args: bytes) -> Any:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.s.sendall(b"".join(out))
        line = self.f.readline()
        t, rest = line[:1], line[1:-2]
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if t == b"-":
            raise RuntimeError(rest.decode())
        return rest

    def close(self) -> None:
        self.f.close()
        self.s.close()


def start_redis(stack: contextlib.ExitStack) -> tuple[Any, str] | None:
    """A private redis-server on 127.0.0.1 (no persistence), and a client; None if there
    is no redis-server binary."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    port = free_port(["127.0.0.1"])
    d = stack.enter_context(tempfile.TemporaryDirectory())
    p = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                          "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    stack.callback(stop_process, p)
    deadline = time.monotonic() + 10
    while True:
        try:
            try:
                import redis  # type: ignore[import-not-found]
                cli: Any = redis.Redis(host="127.0.0.1", port=port)
                cli.ping()
                how = f"redis-py {redis.__version__}"
            except ImportError:
                cli = Resp(port)
                cli.cmd(b"PING")
                stack.callback(cli.close)
                how = "minimal RESP client over a socket"
            break
        except (OSError, ConnectionError) as e:  # not listening yet
            if time.monotonic() > deadline or p.poll() is not None:
                log(f"redis-server did not start: {e}")
                return None
            time.sleep(0.05)
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    return cli, f"{ver.split(' ')[2] if ver.count(' ') >= 2 else ver}; {how}"


@dataclass
class Q1:
    got: dict[str, list[float]]  # variant -> per-call ns samples
    redis: str | None  # how, or None (skipped)
    samples: int
    native: bool  # whether the "shmhb" rows ran on the C path


def zmq_check(stack: contextlib.ExitStack) -> Callable[[], bool]:
    """One check over the network: a REQ socket to a peer's ROUTER, answered by a
    listener thread in another process."""
    port = free_port(["127.0.0.1"])
    srv = subprocess.Popen([sys.executable, "-c", _ZMQ_SERVER, "127.0.0.1", str(port)], cwd=REPO,
                           env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stack.callback(stop_process, srv)
    assert srv.stdout is not None
    if srv.stdout.readline().strip() != "ready":
        raise RuntimeError("the ZMQ heartbeat server did not start")
    ctx = zmq.Context()
    stack.callback(ctx.term)
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    stack.callback(req.close)
    req.connect(f"tcp://127.0.0.1:{port}")
    req.send(b"heartbeat")
    assert req.recv() == b"ack"

    def check() -> bool:
        req.send(b"heartbeat")
        return req.recv() == b"ack"
    return check


def redis_variants(stack: contextlib.ExitStack, ns: dict[str, object], key: str,
                   vs: list[Variant]) -> str | None:
    """Redis's SET and GET added to ``vs`` where a private server could be started; how
    it was talked to, or None."""
    r = start_redis(stack)
    if r is None:
        return None
    cli, how = r
    if isinstance(cli, Resp):
        ns["RSET"] = lambda: cli.cmd(b"SET", b"hb:" + key.encode(), b"%d" % time.monotonic_ns(),
                                     b"PX", b"10000")
        ns["RGET"] = lambda: cli.cmd(b"GET", b"hb:" + key.encode())
    else:
        ns["RSET"] = lambda: cli.set("hb:" + key, time.monotonic_ns(), px=10000)
        ns["RGET"] = lambda: cli.get("hb:" + key)
    vs += [Variant("Redis: SET key ts PX 10000", "rset()", ns, batch=20, setup="rset = RSET"),
           Variant("Redis: GET key", "rget()", ns, batch=20, setup="rget = RGET")]
    return how


def q1_costs(stack: contextlib.ExitStack, samples: int) -> Q1:
    key = "bench-worker"
    # the active path (C where it was built), and the pure-Python path beside it
    board, hb, _ = board_bench.path_boards(stack, "q1", key, shmhb.native)
    pure_board, pure_hb, _ = board_bench.path_boards(stack, "q1-py", key, False)
    mm = board_bench.floor_memory()
    check = zmq_check(stack)
    mgr = multiprocessing.Manager()
    stack.callback(mgr.shutdown)
    d = mgr.dict()
    d[key] = time.monotonic_ns()
    ns: dict[str, object] = {
        "HB": hb, "BOARD": board, "KEY": key, "MONO": time.monotonic_ns,
        "PHB": pure_hb, "PBOARD": pure_board,
        "WORD": np.ndarray((), np.uint64, buffer=mm, offset=64), "Q": memoryview(mm).cast("B").cast("Q"),
        "ZMQ": check, "D": d,
    }
    vs = [
        Variant("floor: clock + store (0-d uint64 view of shm)", "word[()] = mono()", ns,
                setup="word, mono = WORD, MONO"),
        Variant("floor: one 8-byte load (memoryview of shm)", "q[9]", ns, setup="q = Q"),
        Variant("shmhb hb.beat()", "hb.beat()", ns, setup="hb = HB"),
        Variant("shmhb board.slot(key)", "board.slot(key)", ns, setup="board, key = BOARD, KEY"),
        Variant("shmhb hb.beat(), pure Python", "hb.beat()", ns, setup="hb = PHB"),
        Variant("shmhb board.slot(key), pure Python", "board.slot(key)", ns,
                setup="board, key = PBOARD, KEY"),
        Variant("ZMQ REQ->ROUTER round trip (one check)", "zmq()", ns, batch=20,
                setup="zmq = ZMQ"),
        Variant("Manager dict: d[key] = monotonic_ns()", "d[key] = mono()", ns, batch=20,
                setup="d, key, mono = D, KEY, MONO"),
        Variant("Manager dict: d[key]", "d[key]", ns, batch=20, setup="d, key = D, KEY"),
    ]
    how = redis_variants(stack, ns, key, vs)
    got = stats.interleaved(vs, samples)
    return Q1(got, how, samples, shmhb.native)


# -- 2: step-loop overhead --------------------------------------------------------------

@dataclass
class Q2:
    step_ms: dict[str, list[float]]  # per block: mean step in ms
    ratios: dict[str, list[float]]  # per round: variant / plain in the same round
    steps: int
    reps: int


def q2_step_loop(stack: contextlib.ExitStack, rounds: int, steps: int = 100) -> Q2:
    board = board_bench.new_board(stack, "q2", 64, **board_bench.LONG_POLICY)
    hb = board.register("stepper", agent=False)
    stack.callback(hb.close)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 128))
    b = rng.standard_normal((128, 128))

    def work(reps: int) -> None:
        x = a
        for _ in range(reps):
            x = np.tanh(x @ b)

    # calibrate: ~2 ms a step
    reps = 1
    while True:
        t = time.perf_counter()
        for _ in range(5):
            work(reps)
        if (time.perf_counter() - t) / 5 >= 2e-3 or reps >= 256:
            break
        reps *= 2

    def block(mode: str) -> float:
        w, beat = work, hb.beat
        if mode == "beat thread":
            hb.start(0.1)
        t0 = time.perf_counter()
        if mode == "beat() per step":
            for _ in range(steps):
                w(reps)
                beat()
        else:
            for _ in range(steps):
                w(reps)
        t1 = time.perf_counter()
        if mode == "beat thread":
            hb.stop()
        return (t1 - t0) / steps * 1e3

    modes = ["no heartbeat", "beat thread", "beat() per step"]
    out: dict[str, list[float]] = {k: [] for k in modes}
    ratios: dict[str, list[float]] = {k: [] for k in modes[1:]}
    block("no heartbeat")
    for r in range(rounds):
        got = {}
        for j in range(3):
            mode = modes[(r + j) % 3]
            got[mode] = block(mode)
            out[mode].append(got[mode])
        for k in modes[1:]:
            ratios[k].append(got[k] / got["no heartbeat"])
    return Q2(out, ratios, steps, reps)


# -- 3: detection -----------------------------------------------------------------------

@dataclass
class Verdicts:
    """Times in ms from each fault to SUSPECT and to DEAD, and the faults never judged DEAD."""
    dead_ms: list[float] = field(default_factory=list)
    suspect_ms: list[float] = field(default_factory=list)
    missed: int = 0

    def time(self, read: Callable[[], Status | None], t0: float, limit_s: float, poll_s: float) -> None:
        """Poll ``read`` every ``poll_s`` from the fault at ``t0`` (``perf_counter``) until
        it reads DEAD or ``limit_s`` has passed."""
        t_s = None
        while True:
            st = read()
            t = time.perf_counter()
            if t_s is None and st in (Status.SUSPECT, Status.DEAD):
                t_s = t
            if st is Status.DEAD or t - t0 > limit_s:
                break
            time.sleep(poll_s)
        if st is Status.DEAD:
            self.dead_ms.append((t - t0) * 1e3)
            self.suspect_ms.append(((t_s or t) - t0) * 1e3)
        else:
            self.missed += 1


@dataclass
class Hang(Verdicts):
    suspect_after_s: float = 0.0
    dead_after_s: float = 0.0


def q3_hang(stack: contextlib.ExitStack, n: int, suspect_s: float = 0.2, dead_s: float = 0.5) -> Hang:
    """SIGSTOP a beating worker (thread every 0.05 s); time to SUSPECT and to DEAD on a
    board whose policy is shortened to suspect_s / dead_s."""
    board = board_bench.new_board(stack, "hang", 64, suspect_after_s=suspect_s, dead_after_s=dead_s)
    board_bench.start_agent(stack, board, 0.05)
    victims = board_bench.Victims(stack, board.name)
    res = Hang(suspect_after_s=suspect_s, dead_after_s=dead_s)
    key = "hung"
    victims.request(key)
    victims.wait_ready()
    for _ in range(n):
        deadline = time.monotonic() + 5
        while board.status(key) is not Status.ALIVE and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(random.uniform(0.1, 0.2))
        pid = victims.live[key]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)
        res.time(lambda: board.status(key), t0, dead_s + 5, 0.0005)
        # SIGKILL ends a stopped process too (no SIGCONT needed): the victim's parent,
        # the fork server, ignores SIGCHLD, so the kernel reaps the victim at once and a
        # later signal to its pid would raise ProcessLookupError (or reach a reused pid).
        # The pidfd names this very process, whatever happens to the pid.
        pidfd = os.pidfd_open(pid)
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone (killed by something else): nothing left to end
        select.select([pidfd], [], [], 5.0)  # gone, so its key can be registered again
        os.close(pidfd)
        deadline = time.monotonic() + 5
        while board.status(key) is not Status.DEAD and time.monotonic() < deadline:
            time.sleep(0.005)  # the agent has recorded the death
        del victims.live[key]
        victims.request(key)
        victims.wait_ready()
    return res


@dataclass
class HostKill(Verdicts):
    policy: Policy = field(default_factory=Policy)
    interval_s: float = 0.2


def q3_host_kill(stack: contextlib.ExitStack, n: int) -> HostKill:
    """Host A follows hosts B and C (pinger interval 0.2 s); SIGKILL B's pinger and its
    ranks (the whole host going away, as seen from the network) and time until A's board
    reads B DEAD.  A's peer policy is shortened (suspect 0.5 s, dead 1 s) for the run;
    a second followed host (C) is needed because a pinger that loses every peer at once
    blames itself and never convicts."""
    pol = Policy(peer_suspect_after_s=0.5, peer_dead_after_s=1.0)
    res = HostKill(policy=pol)
    addrs = dict(zip("abc", loopback_addrs(3)))
    port = free_port(list(addrs.values()))
    names = {h: board_name(f"hk-{h}") for h in addrs}
    own = shmhb.Board.create(names["a"], policy=pol)  # the pinger opens it with this policy
    stack.callback(own.close)
    procs = {h: start_pinger(stack, names[h], f"{addrs[h]}:{port}", res.interval_s) for h in addrs}
    boards = dict(zip(addrs, attach_when_ready(stack, list(names.values()), procs=list(procs.values()))))

    def b_from_a() -> Status | None:
        p = boards["a"].peer(addrs["b"])
        return p.status if p else None

    with contextlib.ExitStack() as hs_stack:
        for _ in range(n):
            hs = HostServer(hs_stack)
            hs.start_ranks(names["b"], 4, addrs["b"], 0.1, [])
            hs.start_ranks(names["c"], 4, addrs["c"], 0.1, [])
            hs.wait_ranks(2)
            for h in ("b", "c"):
                boards["a"].watch(f"{addrs[h]}:30000")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                ps = {p.address.split(":")[0]: p.status for p in boards["a"].peers()}
                if ps.get(addrs["b"]) is Status.ALIVE and ps.get(addrs["c"]) is Status.ALIVE:
                    break
                time.sleep(0.02)
            time.sleep(random.uniform(0.5, 0.7))
            t0 = time.perf_counter()
            procs["b"].kill()
            os.kill(hs.ranks_pids[0], signal.SIGKILL)
            res.time(b_from_a, t0, 15, 0.001)
            procs["b"].wait()
            hs.close()
            procs["b"] = start_pinger(stack, names["b"], f"{addrs['b']}:{port}", res.interval_s)
            boards["b"] = attach_when_ready(stack, [names["b"]], procs=[procs["b"]])[0]
    return res


# -- 5: false verdicts under stress -----------------------------------------------------

_WORKERS = """
import ctypes, os, signal, sys, time
import shmhb
name, n = sys.argv[1], int(sys.argv[2])
parent = os.getpid()
for i in range(n):
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        hb = shmhb.Board.attach(name).register(f"worker-{i}", agent=False).start(0.1)
        os.write(1, b"ready\\n")  # one write: print() may split it, and siblings interleave
        while True:
            signal.pause()
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
while True:
    signal.pause()
"""
_HOG = "while True:\n    pass\n"


@dataclass
class Stress:
    duration_s: float = 0.0
    polls: int = 0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # scope -> status -> observations
    episodes: dict[str, dict[str, int]] = field(default_factory=dict)  # scope -> status -> entries
    entities: dict[str, int] = field(default_factory=dict)
    poll_gap_ms: list[float] = field(default_factory=list)
    load: float = 0.0
    hogs: int = 0


def _stress_cluster(stack: contextlib.ExitStack, workers: int) -> shmhb.Board:
    """Three pingers (a, b, c), ``workers`` local workers on a and as many ranks on b and
    c, a following b and c: a's board, once the peers read ALIVE (or 30 s passed)."""
    addrs = dict(zip("abc", loopback_addrs(3)))
    port = free_port(list(addrs.values()))
    names = {h: board_name(f"st-{h}") for h in addrs}
    procs = [start_pinger(stack, names[h], f"{addrs[h]}:{port}", cluster_bench.SHMHB_INTERVAL_S)
             for h in addrs]
    boards = dict(zip(addrs, attach_when_ready(stack, list(names.values()), procs=procs)))
    board = boards["a"]
    assert board.policy == Policy(), "the stress test runs with the default policy"
    w = subprocess.Popen([sys.executable, "-c", _WORKERS, names["a"], str(workers)], cwd=REPO,
                         env=child_env(), stdout=subprocess.PIPE, text=True)
    stack.callback(stop_process, w)
    assert w.stdout is not None
    for i in range(workers):
        line = w.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"stress worker {i} did not start: read {line!r}, "
                               f"launcher exit status {w.poll()}")
    hs = HostServer(stack)
    for h in ("b", "c"):
        hs.start_ranks(names[h], workers, addrs[h], 0.1, [])
    hs.wait_ranks(2)
    for h in ("b", "c"):
        board.watch(f"{addrs[h]}:30000")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ps = board.peers()
        if len(ps) == 2 and all(p.status is Status.ALIVE and len(p.slots) >= workers for p in ps):
            break
        time.sleep(0.05)
    else:
        log("stress: peers not all ALIVE before the hogs started")
    return board


def _observe(board: shmhb.Board) -> list[tuple[str, str, Status]]:
    """(scope, who, status) of everything the stress run watches, as one poll reads it."""
    obs: list[tuple[str, str, Status]] = []
    for s in board.slots():
        if s.key.startswith("worker-"):
            obs.append(("local workers", s.key, s.status))
    for p in board.peers():
        obs.append(("remote hosts", p.address, p.status))
        for s in p.slots:
            obs.append(("remote workers", f"{p.address}/{s.key}", s.status))
    return obs


def q5_stress(stack: contextlib.ExitStack, duration_s: float, workers: int = 8) -> Stress:
    board = _stress_cluster(stack, workers)
    ncores = len(os.sched_getaffinity(0))
    res = Stress(duration_s=duration_s, hogs=ncores)
    scopes = ("local workers", "remote hosts", "remote workers")
    res.counts = {s: {} for s in scopes}
    res.episodes = {s: {} for s in scopes}
    prev: dict[tuple[str, str], Status] = {}
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(ncores)]
    for hp in hogs:
        stack.callback(stop_process, hp)
    t_end = time.monotonic() + duration_s
    last = time.monotonic()
    seen: set[tuple[str, str]] = set()
    try:
        while True:
            now = time.monotonic()
            if now >= t_end:
                break
            res.poll_gap_ms.append((now - last) * 1e3)
            last = now
            for scope, ident, st in _observe(board):
                seen.add((scope, ident))
                if st is not Status.ALIVE:
                    c = res.counts[scope]
                    c[st.value] = c.get(st.value, 0) + 1
                    if prev.get((scope, ident)) is not st:
                        e = res.episodes[scope]
                        e[st.value] = e.get(st.value, 0) + 1
                prev[(scope, ident)] = st
            res.polls += 1
            time.sleep(0.02)
        res.load = stats.loadavg()
    finally:
        for hp in hogs:
            hp.kill()
            hp.wait()
    for scope, _ in seen:
        res.entities[scope] = res.entities.get(scope, 0) + 1
    return res


# -- 4: memory --------------------------------------------------------------------------

def memory_rows() -> list[tuple[int, int, int]]:
    d = Capacity()
    out = []
    for n in (16, 64, 256, 1024, 4096):
        full = Sizes(n, d.peers, d.remote_slots, d.watches).total_bytes
        local = Sizes(n, 1, 1, 1).total_bytes
        out.append((n, full, local))
    return out


def shmhb_interval_s(H: int) -> float:
    """The per-host ping interval of a default pinger following the other H - 1 hosts."""
    return cluster_bench.emulated_interval_s(H - 1)


def msgs_model(H: int) -> float:
    """Messages/s, whole cluster, every host following every other, without mutual pairs
    (hosts that cannot see each other's source address: ping + ack per followed host per
    budgeted interval, both directions)."""
    return 2 * H * (H - 1) / shmhb_interval_s(H)


def msgs_model_mutual(H: int) -> float:
    """shmhb at its defaults: in each pair one side pings every interval, the other once
    per ``LONG_REFRESH`` peer dead-after windows (the first side's pings count as
    evidence: authenticated, or echoing its challenge, and tell its digest generation)."""
    pairs = H * (H - 1) / 2
    return pairs * 2 * (1 / shmhb_interval_s(H) + 1 / (LONG_REFRESH * shmhb.Policy().peer_dead_after_s))


@dataclass
class Kills:
    """Local kill -> DEAD (``bench.board.bench_kill``): its table rows (floor first), its
    notes, and the raw kill -> DEAD times in ms (for the plot)."""
    rows: list[Any]
    notes: list[str]
    values_ms: list[float]


def bench_kill_values(stack: contextlib.ExitStack, kills: int, pool: int) -> Kills:
    """``bench.board.bench_kill``, keeping the raw times too: bench_kill summarises them
    with ``Summary.of``; a recording stand-in keeps them."""
    seen: list[list[float]] = []

    class Recording(stats.Summary):
        @classmethod
        def of(cls, per_call: Any, ops: int) -> stats.Summary:
            seen.append(list(per_call))
            return stats.Summary.of(per_call, ops)

    board_bench.Summary = Recording  # type: ignore[misc]
    try:
        rows, notes = board_bench.bench_kill(stack, kills, pool)
    finally:
        board_bench.Summary = stats.Summary  # type: ignore[misc]
    return Kills(rows, notes, seen[-1] if seen else [])
