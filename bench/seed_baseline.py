"""The seed's per-connector heartbeat, rebuilt as a baseline for ``bench.cluster``.

What it models (the first design proposed for this problem, never merged: docs/DESIGN.md,
"The problem"):

* **Every rank runs its own monitor.**  One process per rank (forked, as vLLM runs one
  worker process per accelerator rank), each with its own ZMQ context, its own
  ``HeartbeatMonitor`` thread, and one **REQ** socket per peer rank port it links to.
  Here a rank links to every rank on every other host (the cluster shape of
  ``bench.cluster``: every host watches every other host).
* **Rounds.**  Every ``poll_interval`` (1 s) the monitor sends ``HEARTBEAT_MSG`` on every
  REQ socket, then waits up to ``timeout`` (1 s) for the replies, recording the time of
  each reply.  A peer is *alive* while ``now - last_reply <= 3 * poll_interval +
  timeout`` (4 s): ``is_alive`` is evaluated when a caller asks, as in the seed.
* **The REQ trap.**  A REQ socket that sent a ping and never got the reply refuses the
  next send (EFSM).  The seed caught the error and went on ("send error: keep _alive as
  is; next round will try again"), so after one lost reply that target was never
  pinged again: the seed's monitor could not recover a target after one lost reply
  (docs/DESIGN.md, "Facts that shaped it").  ``HeartbeatMonitor(recreate_on_timeout=False)`` reproduces exactly
  that.  **The benchmark runs with ``recreate_on_timeout=True``**: a REQ socket whose
  reply missed the deadline is closed and recreated (the zguide's "lazy pirate"), which
  is what the seed would need to keep pinging a peer after one slow reply.  Without it,
  one starved second on a loaded 2-core machine silences a monitor for good (seen in a
  trial run: a rank whose 496 sockets all refused every send), and the baseline would
  undercount its own messages.  Recreations are counted (RECREATED).  Send errors,
  replies missing at the deadline and late replies (read in a later round) are counted
  too.
* **Answering.**  Each rank answers pings on its own port, as the connector's existing
  ROUTER listener did: ``(identity, b"", HEARTBEAT_MSG)`` -> ``(identity, b"",
  HEARTBEAT_ACK)``, from a thread of its own.
* **Purge.**  A separate watcher thread wakes every 60 s and purges the cached link
  information of peers that are not alive.  It runs here too, but no benchmark phase
  lasts 60 s, so the purge *time* is modelled: the first wake of a 60 s timer with a
  uniformly random phase after the moment ``is_alive`` turns false
  (:func:`purge_model`).

Where it differs from the original:

* Messages are raw bytes; the seed's connector encoded its messages with msgpack and
  decoded every request in Python, so this baseline is, if anything, cheaper per ping.
* The seed's connector thread also served ``GET_META_MSG`` and sent KV data; here the
  rank processes do heartbeat work only, so all their CPU is heartbeat CPU.
* The seed's exact wait loop is not public in the discussion; this one sends every ping
  of a round and then polls all REQ sockets until every reply is in or the timeout
  expires (poll timeouts rounded up to whole ms: pyzmq truncates float ms, which would
  spin).  Rounds start on a fixed 1 s cadence with a random phase per rank (ranks start
  at different moments).  Monitors start pinging once every rank of the simulated
  cluster listens (in a real cluster the peers are up long before), so there is no
  start-up churn of timeouts.
* Counters, readiness and the kill checker live in a shared table (bench
  instrumentation): a rank writes its counters once per round (monitor) or per message
  (listener); the checker (the rank's main thread: ``is_alive`` of one target every
  2 ms) runs only while the benchmark arms it, and sleeps 0.25 s at a time otherwise.
  Ranks that do not monitor only answer.

Run by ``bench.cluster`` as a launcher: ``python -m bench.seed_baseline launch --shm NAME
--hosts H --ranks R --base-port P [--monitor-hosts N] [--monitor-ranks K] [--recreate]``
(NAME: a shared table the caller created, see :class:`Table`; ``--recreate``: see the
REQ trap above).  The launcher forks every rank, prints ``ready`` once every monitor has
had a complete round of replies, and kills every rank when its stdin closes (each rank
also dies with it, ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import mmap
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc
import zmq

from shmhb.testing.loopback import loopback_addrs

HEARTBEAT_MSG = b"heartbeat"
HEARTBEAT_ACK = b"heartbeat_ack"
POLL_INTERVAL_S = 1.0
TIMEOUT_S = 1.0
PURGE_INTERVAL_S = 60.0

# The shared table: one row of float64 per rank (counts stay exact below 2**53).
PID, READY, SENT, ACKS, ANSWERED, SEND_ERR, TIMEOUTS, LATE, ROUNDS, WATCH, DEAD_T, LAST_T, \
    DEAD_FOR, RECREATED, BOUND = range(15)
NCOLS = 16
_PR_SET_PDEATHSIG = 1


def host_addr(h: int) -> str:
    """Host h's loopback address: $SHMHB_LOOPBACK_BASE (default 127.0.0.2) + h."""
    return loopback_addrs(h + 1)[h]


def table_bytes(nranks: int) -> int:
    return max(mmap.PAGESIZE, nranks * NCOLS * 8)


class Table:
    """The ranks' shared table (POSIX shared memory), as a flat memoryview of doubles.
    Every word has one writer: its rank, except WATCH, written by the benchmark."""

    def __init__(self, name: str, nranks: int, create: bool = False) -> None:
        size = table_bytes(nranks)
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=size if create else 0)
        try:
            self.mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.name = name
        self.n = nranks
        self.d = memoryview(self.mm).cast("d")

    def get(self, r: int, c: int) -> float:
        return self.d[r * NCOLS + c]

    def set(self, r: int, c: int, v: float) -> None:
        self.d[r * NCOLS + c] = v

    def add(self, r: int, c: int, v: float = 1.0) -> None:
        i = r * NCOLS + c
        self.d[i] = self.d[i] + v

    def column(self, c: int) -> list[float]:
        return [self.d[r * NCOLS + c] for r in range(self.n)]

    def close(self) -> None:
        self.d.release()
        self.mm.close()

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass


# -- the seed's monitor ------------------------------------------------------------------

@dataclass
class _Target:
    host: str
    port: int
    sock: zmq.Socket
    awaiting: bool = False


class HeartbeatMonitor:
    """One rank's monitor thread: pings every target port each round over REQ sockets."""

    def __init__(self, ctx: zmq.Context, *, poll_interval: float = POLL_INTERVAL_S,
                 timeout: float = TIMEOUT_S, table: Table | None = None, row: int = 0,
                 recreate_on_timeout: bool = False) -> None:
        self.ctx = ctx
        self.poll_interval = poll_interval
        self.timeout = timeout
        self._down_threshold = 3 * poll_interval + timeout
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, int], _Target] = {}
        self._by_sock: dict[zmq.Socket, _Target] = {}
        self._alive: dict[tuple[str, int], float] = {}
        self._poller = zmq.Poller()
        self.table, self.row = table, row
        self.recreate_on_timeout = recreate_on_timeout
        self.complete_rounds = 0
        self._stop = threading.Event()

    def _req(self, host: str, port: int) -> zmq.Socket:
        s = self.ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{host}:{port}")
        return s

    def add_target(self, host: str, port: int) -> None:
        with self._lock:
            key = (host, port)
            if key in self._targets:
                return
            t = _Target(host, port, self._req(host, port))
            self._targets[key] = t
            self._by_sock[t.sock] = t
            self._poller.register(t.sock, zmq.POLLIN)
            self._alive[key] = time.monotonic()  # unknown yet: given the benefit of the doubt

    def is_alive(self, host: str, port: int) -> bool:
        with self._lock:
            last = self._alive.get((host, port))
        return last is not None and time.monotonic() - last <= self._down_threshold

    def last_reply(self, host: str, port: int) -> float | None:
        with self._lock:
            return self._alive.get((host, port))

    def start(self) -> threading.Thread:
        th = threading.Thread(target=self.run, name="hb-monitor", daemon=True)
        th.start()
        return th

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        next_round = time.monotonic() + random.uniform(0, self.poll_interval)
        while not self._stop.is_set():
            delay = next_round - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return
            self._round()
            next_round += self.poll_interval
            # fell behind: start the next round now, never a burst of rounds
            next_round = max(next_round, time.monotonic())

    def _round(self) -> None:
        with self._lock:
            targets = list(self._targets.values())
        sent = errors = acks = late = 0
        pending: set[zmq.Socket] = set()
        for t in targets:
            try:
                t.sock.send(HEARTBEAT_MSG, zmq.NOBLOCK)
            except zmq.ZMQError:
                # EFSM: still waiting for an earlier reply (the REQ trap); EAGAIN: no
                # connection yet.  The seed: keep _alive as is; next round will try again.
                errors += 1
                continue
            t.awaiting = True
            pending.add(t.sock)
            sent += 1
        deadline = time.monotonic() + self.timeout
        poll = self._poller.poll
        while pending:
            left_ms = (deadline - time.monotonic()) * 1000.0
            if left_ms <= 0:
                break
            for sock, _ev in poll(math.ceil(left_ms)):  # pyzmq truncates float ms: would spin
                try:
                    reply = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                t = self._by_sock[sock]
                t.awaiting = False
                if reply == HEARTBEAT_ACK:
                    now = time.monotonic()
                    with self._lock:
                        self._alive[(t.host, t.port)] = now
                    acks += 1
                if sock in pending:
                    pending.discard(sock)
                else:
                    late += 1
        if not pending:
            self.complete_rounds += 1
        tb = self.table
        if self.recreate_on_timeout:
            for sock in pending:
                self._recreate(self._by_sock[sock])
            if tb is not None and pending:
                tb.add(self.row, RECREATED, len(pending))
        if tb is not None:
            r = self.row
            tb.add(r, SENT, sent)
            tb.add(r, ACKS, acks)
            tb.add(r, SEND_ERR, errors)
            tb.add(r, TIMEOUTS, len(pending))
            tb.add(r, LATE, late)
            tb.add(r, ROUNDS, 1)

    def _recreate(self, t: _Target) -> None:
        with self._lock:
            self._poller.unregister(t.sock)
            del self._by_sock[t.sock]
            t.sock.close(0)
            t.sock = self._req(t.host, t.port)
            t.awaiting = False
            self._by_sock[t.sock] = t
            self._poller.register(t.sock, zmq.POLLIN)


def serve_heartbeats(ctx: zmq.Context, host: str, port: int, table: Table | None = None,
                     row: int = 0) -> zmq.Socket:
    """Bind the rank's ROUTER and answer pings from a thread (the connector listener's
    heartbeat branch).  Returns the bound socket; the thread runs until the process ends."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:{port}")

    def loop() -> None:
        recv, send = sock.recv_multipart, sock.send_multipart
        while True:
            msg = recv()
            if len(msg) == 3 and msg[2] == HEARTBEAT_MSG:
                try:
                    send((msg[0], b"", HEARTBEAT_ACK))
                except zmq.ZMQError:
                    pass  # as the seed did
                if table is not None:
                    table.add(row, ANSWERED)

    threading.Thread(target=loop, name="hb-listener", daemon=True).start()
    return sock


class PurgeWatcher:
    """The seed's watcher: every ``period`` s, drop cached link info of peers that are not
    alive.  Runs in every monitoring rank; its timing is modelled by :func:`purge_model`."""

    def __init__(self, mon: HeartbeatMonitor, period: float = PURGE_INTERVAL_S) -> None:
        self.mon, self.period = mon, period
        self.cache: dict[tuple[str, int], str] = {}

    def start(self) -> None:
        threading.Thread(target=self._run, name="hb-purge", daemon=True).start()

    def _run(self) -> None:
        time.sleep(random.uniform(0, self.period))
        while True:
            for key in list(self.cache):
                if not self.mon.is_alive(*key):
                    del self.cache[key]
            time.sleep(self.period)


def purge_model(dead_after_kill_s: Sequence[float], period: float = PURGE_INTERVAL_S,
                phases: int = 600) -> list[float]:
    """Kill -> purge times: each measured kill -> not-alive time plus the wait for the
    next wake of a ``period`` timer of uniformly random phase (``phases`` evenly spaced
    phases per measurement, so the result is the exact mixture, not a random draw)."""
    return [d + period * (k + 0.5) / phases for d in dead_after_kill_s for k in range(phases)]


# -- the launcher and the rank processes ---------------------------------------------------

def _die_with_parent(parent: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _rank_main(args: argparse.Namespace, h: int, r: int, parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's business
    row = h * args.ranks + r
    tb = Table(args.shm, args.hosts * args.ranks)
    tb.set(row, PID, os.getpid())
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 8192)  # 496 REQ sockets, plus recreated ones being reaped
    serve_heartbeats(ctx, host_addr(h), args.base_port + r, tb, row)
    tb.set(row, BOUND, 1)
    mon = None
    if h < args.monitor_hosts and r < args.monitor_ranks:
        # Start pinging once every rank listens (in a real cluster the peers are up long
        # before): no startup churn of timeouts and recreated sockets.
        while sum(1 for v in tb.column(BOUND) if v) < tb.n:
            time.sleep(0.05)
        mon = HeartbeatMonitor(ctx, table=tb, row=row, recreate_on_timeout=args.recreate)
        for hh in range(args.hosts):
            if hh != h:
                for rr in range(args.ranks):
                    mon.add_target(host_addr(hh), args.base_port + rr)
        watcher = PurgeWatcher(mon)
        watcher.cache.update({k: "link" for k in mon._targets})
        watcher.start()
        mon.start()
    else:
        tb.set(row, READY, 1)
        while True:
            signal.pause()  # answering only: nothing else to do
    # The kill checker (benchmark instrumentation), armed through WATCH = target row + 1:
    # asks is_alive() every 2 ms and writes DEAD_T (and the last reply time), then
    # DEAD_FOR = the WATCH value it answers.
    while True:
        if tb.get(row, READY) == 0 and mon.complete_rounds >= 1:
            tb.set(row, READY, 1)
        w = int(tb.get(row, WATCH))
        if w <= 0 or w == int(tb.get(row, DEAD_FOR)):
            time.sleep(0.25)
            continue
        th, tr = divmod(w - 1, args.ranks)
        key = (host_addr(th), args.base_port + tr)
        while int(tb.get(row, WATCH)) == w:
            if not mon.is_alive(*key):
                tb.set(row, LAST_T, mon.last_reply(*key) or 0.0)
                tb.set(row, DEAD_T, time.monotonic())
                tb.set(row, DEAD_FOR, w)
                break
            time.sleep(0.002)


def launch(args: argparse.Namespace) -> int:
    parent = os.getpid()
    n = args.hosts * args.ranks
    kids: list[int] = []

    def kill_all(*_: object) -> None:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, kill_all)
    signal.signal(signal.SIGINT, kill_all)
    for h in range(args.hosts):
        for r in range(args.ranks):
            pid = os.fork()
            if pid == 0:
                try:
                    _rank_main(args, h, r, parent)
                except BaseException as e:  # noqa: BLE001 - report, never run the launcher's code
                    os.write(2, f"rank {h}/{r}: {e!r}\n".encode())
                os._exit(1)
            kids.append(pid)
    tb = Table(args.shm, n)
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        ready = sum(1 for v in tb.column(READY) if v)
        if ready == n:
            break
        time.sleep(0.05)
    ready = sum(1 for v in tb.column(READY) if v)
    print("ready" if ready == n else f"ready-partial {ready}/{n}", flush=True)
    try:
        while sys.stdin.readline():
            pass
    finally:
        kill_all()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.seed_baseline", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("launch", help="fork a simulated cluster of seed-style ranks")
    lp.add_argument("--shm", required=True, help="shared table (created by the caller)")
    lp.add_argument("--hosts", type=int, required=True)
    lp.add_argument("--ranks", type=int, required=True)
    lp.add_argument("--base-port", type=int, required=True)
    lp.add_argument("--monitor-hosts", type=int, default=None,
                    help="hosts whose ranks run monitors (default all)")
    lp.add_argument("--monitor-ranks", type=int, default=None,
                    help="ranks per monitoring host that run monitors (default all)")
    lp.add_argument("--ready-timeout", type=float, default=60.0)
    lp.add_argument("--recreate", action="store_true",
                    help="recreate a REQ socket whose reply missed the deadline (not the seed's code)")
    args = p.parse_args(argv)
    if args.monitor_hosts is None:
        args.monitor_hosts = args.hosts
    if args.monitor_ranks is None:
        args.monitor_ranks = args.ranks
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
