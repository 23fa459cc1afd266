"""Benchmark of the board: ``python -m bench.board [--quick] [--plain]``.

Four figures, each beside the floor it cannot beat, measured in one run:

1. the worker's hot path, ``hb.beat()``, on the C path (``shmhb._native``) and on the
   pure-Python path side by side, against CPython's own floor for the same work: one
   ``time.monotonic_ns()`` plus one store into a prepared 0-d numpy view of shared memory;
2. a reader's hot path, ``board.slot(key)`` and ``board.status(key)``, on both paths,
   against the same floor and a plain one-word read of shared memory, and a
   connector's read of a remote worker, ``board.remote(endpoint)``, when the clock has
   moved since its last read (its memo misses; the row is judged again from its words);
3. a scan of a full 1024-slot board: ``snapshot()`` + ``judge_local_array`` (the
   vectorised path) and ``board.slots()`` (the Python-object path);
4. the time from SIGKILL of a worker to a reader seeing DEAD, with the host agent
   running as its own process (``python -m shmhb pinger``), against the time the same
   polling reader sees the kernel report the exit on a pidfd of its own.

Micro-benchmarks are interleaved (a sample of each variant in turn) so machine noise
hits them alike.  Everything the run creates (boards, processes) is removed at the end,
on Ctrl-C too.  See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import os
import queue
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import importlib

import numpy as np
import posix_ipc

import shmhb
from shmhb.board.core import board_words
from shmhb.board.judge import judge_local_array, judge_local_array_numpy
from shmhb.board.layout import TS_SHIFT
from shmhb.testing.loopback import child_env
from shmhb.status import Status

from . import stats
from .stats import Summary, Variant

REPO = Path(__file__).resolve().parent.parent
# ns, ns, µs, ms; the hot-path targets are for the C path, with a ratio to the
# pure-Python floor (clock + store) of the same run as well
TARGETS = {"beat": 60.0, "slot": 120.0, "scan": 10.0, "kill": 5.0}
RATIO_TARGETS = {"beat": 0.7, "slot": 1.2}
# Verdicts come only from the agent in the kill test: silence takes 10 s to convict.
LONG_POLICY = {"suspect_after_s": 60.0, "dead_after_s": 120.0}


@dataclass
class Row:
    """One line of the result table."""

    what: str
    summary: Summary
    unit: str
    floor: float | None = None  # the median this figure is compared with
    target: float | None = None  # met when the median is at most this
    max_ratio: float | None = None  # ... and at most this many times the floor

    def met(self) -> bool | None:
        if self.target is None:
            return None
        ok = self.summary.median <= self.target
        if self.max_ratio is not None and self.floor:
            ok = ok and self.summary.median <= self.max_ratio * self.floor
        return ok

    def cells(self) -> list[str]:
        s = self.summary
        met = self.met()
        want = "" if self.target is None else f"<= {self.target:g} {self.unit}"
        if self.max_ratio is not None:
            want += f", <= {self.max_ratio:g}x floor"
        return [self.what, stats.fmt(s.median, self.unit), stats.fmt(s.p99, self.unit), str(s.ops),
                "" if self.floor is None else stats.ratio(s.median, self.floor), want,
                "-" if met is None else ("yes" if met else "NO")]


def unique_name(tag: str) -> str:
    """A board name no other run (or concurrent benchmark) uses."""
    return f"shmhb-bench-{os.getpid()}-{secrets.token_hex(3)}-{tag}"


def new_board(stack: contextlib.ExitStack, tag: str, slots: int, **create: Any) -> shmhb.Board:
    """A fresh board (``Board.create`` keywords) unlinked and closed when ``stack`` unwinds."""
    board = shmhb.Board.create(unique_name(tag), slots=slots, **create)
    stack.callback(board.close)
    stack.callback(board.unlink)
    return board


def floor_memory() -> mmap.mmap:
    """A page of POSIX shared memory, the same kind as a board, for the floor variants.
    Unlinked at once: the mapping lives on, nothing is left behind."""
    shm = posix_ipc.SharedMemory(f"/{unique_name('floor')}", posix_ipc.O_CREX, mode=0o600, size=4096)
    try:
        return mmap.mmap(shm.fd, 4096)
    finally:
        shm.close_fd()
        shm.unlink()


# -- 1 and 2: the hot paths ---------------------------------------------------------------

class SteppingClock:
    """A clock that moves one board time unit (2**20 ns) at every read, so no two reads
    of a slot see the same "now": whatever a reader remembers from its previous call
    cannot answer the next one.  ``count.__next__`` is a C call, cheaper than
    ``time.monotonic_ns`` (compare the rows), so this figure errs on the fast side."""

    def __init__(self) -> None:
        self.monotonic_ns = itertools.count(time.monotonic_ns(), 1 << TS_SHIFT).__next__


@contextlib.contextmanager
def hot_path(native: bool) -> Iterator[None]:
    """Boards attached inside take the C (``native``) or the pure-Python hot path."""
    sel = importlib.import_module("shmhb.board.native")  # the module; ``shmhb.native`` is its bool
    saved = sel._ext
    if not native:
        sel._ext = None
    try:
        yield
    finally:
        sel._ext = saved


def path_boards(stack: contextlib.ExitStack, tag: str, key: str, native: bool
                ) -> tuple[shmhb.Board, shmhb.Heartbeat, shmhb.Board]:
    """A board on the C (``native``) or the pure-Python hot path, with ``key`` registered
    and read once, and a board whose clock steps one unit per read."""
    with hot_path(native):
        board = new_board(stack, f"hot-{tag}", 64, **LONG_POLICY)
        hb = board.register(key, agent=False)
        stack.callback(hb.close)
        hb.beat()
        assert board.status(key) is Status.ALIVE  # also fills the reader's key cache
        # Policy long enough that a clock stepping ~1 ms per read keeps the slot ALIVE.
        stepping = new_board(stack, f"step-{tag}", 64, clock=SteppingClock(),
                             suspect_after_s=1e6, dead_after_s=2e6)
        stack.callback(stepping.register(key, agent=False).close)
        assert stepping.status(key) is Status.ALIVE
    assert board.native is native and stepping.native is native
    return board, hb, stepping


#: the endpoint of the remote worker ``remote_board`` writes
REMOTE_EP = "10.0.0.2:30003"


def remote_board(stack: contextlib.ExitStack, tag: str, native: bool) -> shmhb.Board:
    """A board whose clock steps one unit per read, holding what a pinger writes for a
    followed host and its worker at ``REMOTE_EP`` (ALIVE, its agent fresh for good), read
    once: ``board.remote(REMOTE_EP)`` then misses its memo at every call, as a
    connector's read does when a millisecond passed since the last."""
    from shmhb.board.layout import header_index, pack_hb
    from shmhb.net.protocol import DigestEntry
    from shmhb.net.rowwriter import RowWriter
    clock = SteppingClock()
    with hot_path(native):
        b = new_board(stack, f"remote-{tag}", 8, clock=clock, policy=shmhb.Policy(
            suspect_after_s=1e6, dead_after_s=2e6, agent_stale_s=1e6))
    now = clock.monotonic_ns()
    board_words(b).words[header_index("agent_hb")] = pack_hb(1, now >> TS_SHIFT)
    w = RowWriter(b)
    peer = w.new_peer("10.0.0.2:45645")
    assert peer is not None
    w.peer_status(peer[0], peer[1], Status.ALIVE, now)
    w.put_remote(peer[0], peer[1], None,
                 DigestEntry("remote-worker", 1, Status.ALIVE.code, 4242, 0, (REMOTE_EP,)), now)
    got = b.remote(REMOTE_EP)
    assert got is not None and got.status is Status.ALIVE and b.native is native
    return b


def bench_hot_paths(stack: contextlib.ExitStack, samples: int) -> list[Row]:
    """``beat``, ``slot`` and ``status`` on both paths (the C one only where it was
    built), interleaved with the floors they are made of."""
    key = "bench-worker"
    paths = ["C", "Python"] if shmhb.native else ["Python"]
    mm = floor_memory()
    ns: dict[str, Any] = {
        "KEY": key, "MONO": time.monotonic_ns,
        "WORD": np.ndarray((), np.uint64, buffer=mm, offset=64),  # 0-d view, like Heartbeat's
        "BASE": 7 << 40, "ARR": np.ndarray(512, np.uint64, buffer=mm),
        "Q": memoryview(mm).cast("B").cast("Q"),  # how Board reads words
    }
    for p in paths:
        ns[f"BOARD_{p}"], ns[f"HB_{p}"], ns[f"STEP_{p}"] = path_boards(stack, p.lower(), key, p == "C")
        ns[f"REMOTE_{p}"] = remote_board(stack, p.lower(), p == "C")
    ns["EP"] = REMOTE_EP
    vs = [
        Variant("loop overhead (empty statement)", "pass", ns),
        Variant("time.monotonic_ns()", "mono()", ns, setup="mono = MONO"),
        Variant("floor: clock + store into 0-d uint64 view of shm", "word[()] = mono()", ns,
                setup="word, mono = WORD, MONO"),
        Variant("clock + store through memoryview 'Q' of shm", "q[8] = mono()", ns,
                setup="q, mono = Q, MONO"),
        Variant("clock + pack + store (beat's body, inline)",
                f"word[()] = base | (mono() >> {TS_SHIFT})", ns,
                setup="word, base, mono = WORD, BASE, MONO"),
        *[Variant(f"hb.beat() [{p}]", "hb.beat()", ns, setup=f"hb = HB_{p}") for p in paths],
        Variant("floor: read q[i] (memoryview 'Q' of shm, as Board)", "q[9]", ns, setup="q = Q"),
        Variant("read arr[i] (numpy uint64 view of shm)", "arr[9]", ns, setup="arr = ARR"),
        *[Variant(f"board.slot(key) [{p}]", "board.slot(key)", ns,
                  setup=f"board, key = BOARD_{p}, KEY") for p in paths],
        *[Variant(f"board.status(key) [{p}]", "board.status(key)", ns,
                  setup=f"board, key = BOARD_{p}, KEY") for p in paths],
        *[Variant(f"board.slot(key), clock moves every call [{p}]", "board.slot(key)", ns,
                  setup=f"board, key = STEP_{p}, KEY") for p in paths],
        *[Variant(f"board.remote(endpoint), clock moves every call [{p}]",
                  "board.remote(ep)", ns, setup=f"board, ep = REMOTE_{p}, EP") for p in paths],
    ]
    got = stats.interleaved(vs, samples)
    rows = [Row(v.name, Summary.of(got[v.name], samples * v.batch), "ns") for v in vs]
    by = {r.what: r for r in rows}
    floor = by["floor: clock + store into 0-d uint64 view of shm"].summary.median
    read_floor = by["floor: read q[i] (memoryview 'Q' of shm, as Board)"].summary.median
    for r in rows[2:]:
        # beats and slot reads against CPython's floor for a clock read and one store (the
        # issue's yardstick); the raw reads against the raw read
        r.floor = read_floor if r.what.startswith("read arr") else floor
    by["floor: read q[i] (memoryview 'Q' of shm, as Board)"].floor = None
    if "C" in paths:
        for name, what in (("beat", "hb.beat() [C]"), ("slot", "board.slot(key) [C]")):
            by[what].target, by[what].max_ratio = TARGETS[name], RATIO_TARGETS[name]
    return rows


# -- 3: scanning a full board -------------------------------------------------------------

def bench_scan(stack: contextlib.ExitStack, samples: int, slots: int = 1024) -> list[Row]:
    """All slots of a full board: the snapshot judged in one pass (C, where built) or
    in numpy (the pure-Python path), against ``slots()``."""
    board = new_board(stack, "scan", slots, **LONG_POLICY)
    for k in range(slots):
        stack.callback(board.register(f"scan-{k:04d}", agent=False).close)
    hbs, verdicts, now = board.snapshot()
    codes, _ = judge_local_array(hbs, verdicts, int(now), board.thresholds)
    assert int((codes == Status.ALIVE.code).sum()) == slots and len(board.slots()) == slots
    # judge_local_array takes the C pass where the extension is active; the numpy twin
    # is what the pure-Python path runs
    paths = ["C", "Python"] if shmhb.native else ["Python"]
    judges = {"C": judge_local_array, "Python": judge_local_array_numpy}
    ns = {"BOARD": board, "SNAP": board.snapshot(), **{f"JUDGE_{p}": judges[p] for p in paths}}
    setup = "board, th = BOARD, BOARD.thresholds; judge = JUDGE_"
    vs = [
        *[Variant(f"snapshot() + judge_local_array, {slots} slots [{p}]",
                  "judge(*board.snapshot(), th)", ns, batch=100, setup=setup + p) for p in paths],
        Variant("  of which snapshot()", "board.snapshot()", ns, batch=100, setup="board = BOARD"),
        *[Variant(f"  of which judge_local_array [{p}]", "judge(*snap, th)", ns, batch=100,
                  setup=setup + p + "; snap = SNAP") for p in paths],
        Variant(f"board.slots(), {slots} SlotStatus objects", "board.slots()", ns, batch=2,
                setup="board = BOARD"),
    ]
    got = stats.interleaved(vs, samples)
    s = {v.name: Summary.of([x / 1000 for x in got[v.name]], samples * v.batch) for v in vs}
    scan = s[vs[0].name].median
    rows = [Row(v.name, s[v.name], "µs") for v in vs]
    if "C" in paths:  # the target is the C pass's, as for the other hot-path rows
        rows[0].target = TARGETS["scan"]
    rows[-1].floor = scan
    return rows


# -- 4: SIGKILL to DEAD -------------------------------------------------------------------

class Victims:
    """Victim workers forked on request by ``bench.worker``; each key is reused, so its
    slot is recycled with a new incarnation."""

    def __init__(self, stack: contextlib.ExitStack, board_name: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.worker", board_name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env(OPENBLAS_NUM_THREADS="1"), cwd=REPO)
        self.live: dict[str, int] = {}  # key -> pid
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        stack.callback(self.close)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def request(self, key: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(key + "\n")
        self.proc.stdin.flush()

    def wait_ready(self, timeout_s: float = 20.0) -> tuple[str, int]:
        """The next worker that beats: (key, pid)."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"no victim worker became ready within {timeout_s} s") from None
        what, key, rest = line.rstrip("\n").split(" ", 2)
        if what != "ready":
            raise RuntimeError(f"victim worker {key!r} failed: {rest}")
        self.live[key] = int(rest)
        return key, int(rest)

    def close(self) -> None:
        for pid in self.live.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]  # the server exits on EOF
        _reap(self.proc)


def _reap(proc: subprocess.Popen[str] | subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """Wait for ``proc`` to end, killing it after ``grace_s``."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_agent(stack: contextlib.ExitStack, board: shmhb.Board, tick_s: float) -> None:
    """``python -m shmhb pinger`` for ``board``, stopped with SIGTERM when ``stack`` unwinds;
    returns once it holds the agent role."""
    log = stack.enter_context(tempfile.TemporaryFile("w+"))
    proc = subprocess.Popen([sys.executable, "-m", "shmhb", "pinger", "--board", board.name,
                             "--tick-s", str(tick_s)], stdout=log, stderr=log, cwd=REPO,
                            env=child_env())

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
        _reap(proc)

    stack.callback(stop)
    deadline = time.monotonic() + 30
    while board.agent().status is not Status.ALIVE:
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(f"the agent did not start; its log:\n{log.read()[-2000:]}")
        time.sleep(0.02)


def _time_kill(status: Callable[[str], Status | None], key: str, pid: int,
               poll_s: float) -> tuple[float, float] | None:
    """SIGKILL ``pid`` and poll ``status(key)`` until it reads DEAD: (ms to DEAD, ms to
    the floor, our own pidfd on the victim turning readable, checked by the same polling
    loop), or None where it did not read DEAD within 2 s."""
    clock, sleep = time.perf_counter_ns, time.sleep
    pidfd = os.pidfd_open(pid)
    exited = select.poll()
    exited.register(pidfd, select.POLLIN)
    t_exit = 0
    deadline = clock() + 2_000_000_000
    t0 = clock()
    os.kill(pid, signal.SIGKILL)
    while True:
        if not t_exit and exited.poll(0):
            t_exit = clock()
        st = status(key)
        t1 = clock()
        if st is Status.DEAD or t1 > deadline:
            break
        sleep(poll_s)
    os.close(pidfd)
    return ((t1 - t0) / 1e6, (t_exit - t0) / 1e6) if st is Status.DEAD else None


def bench_kill(stack: contextlib.ExitStack, kills: int, pool: int, tick_s: float = 0.05,
               poll_s: float = 50e-6) -> tuple[list[Row], list[str]]:
    """Kill ``kills`` workers one at a time; time SIGKILL to ``status(key) is DEAD``.

    ``pool`` workers are ready ahead of time; the one just killed is replaced (same key)
    before the next kill, so no fork or registration runs during a measurement.  A worker
    is killed only after it has beaten for ``settle_s``, so the agent, which notices new
    registrations on its tick, already holds a pidfd on it.
    """
    board = new_board(stack, "kill", 64)  # default policy: only a verdict reads DEAD in ms
    start_agent(stack, board, tick_s)
    victims = Victims(stack, board.name)
    keys = [f"victim-{k}" for k in range(pool)]
    since: dict[str, float] = {}
    for key in keys:
        victims.request(key)
    for _ in keys:
        since[victims.wait_ready()[0]] = time.monotonic()
    settle_s = 4 * tick_s
    status, sleep = board.status, time.sleep
    dead_ms: list[float] = []
    exit_ms: list[float] = []
    missed = 0
    for n in range(kills):
        key = keys[n % pool]
        sleep(max(0.0, since[key] + settle_s - time.monotonic()))
        if status(key) is not Status.ALIVE:  # also caches the new incarnation for the reader
            raise RuntimeError(f"victim {key!r} reads {status(key)} before the kill")
        got_ms = _time_kill(status, key, victims.live.pop(key), poll_s)
        if got_ms is not None:
            dead_ms.append(got_ms[0])
            exit_ms.append(got_ms[1])
        else:
            missed += 1
        victims.request(key)
        got, _ = victims.wait_ready()
        since[got] = time.monotonic()
    used = int(np.count_nonzero(board.snapshot()[0]))
    notes = [f"kill test: {kills} kills, {pool} keys reused in {used} of {board.sizes.nslots} "
             f"slots; agent tick {tick_s * 1e3:g} ms, reader polls every {poll_s * 1e6:g} µs "
             f"(+ sleep overshoot); agent counted {board.stats()['deaths_seen']} deaths"
             + (f"; {missed} kills NOT seen as DEAD within 2 s" if missed else "")]
    floor = Summary.of(exit_ms, len(exit_ms))
    return [Row("floor: SIGKILL -> own pidfd readable (same poll loop)", floor, "ms",
                floor=floor.median),
            Row("SIGKILL -> reader sees DEAD in board.status", Summary.of(dead_ms, len(dead_ms)),
                "ms", floor=floor.median, target=TARGETS["kill"])], notes


# -- the run ----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.board", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and kills (a smoke run)")
    ap.add_argument("--plain", action="store_true", help="plain columns instead of markdown")
    args = ap.parse_args(argv)
    samples, scan_samples, kills, pool = (100, 30, 20, 5) if args.quick else (1000, 300, 200, 10)

    load0 = stats.loadavg()
    print(stats.table(["machine", ""], stats.machine_info(), markdown=not args.plain))
    print()
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        rows = bench_hot_paths(stack, samples)
        rows += bench_scan(stack, scan_samples)
        kill_rows, notes = bench_kill(stack, kills, pool)
        rows += kill_rows
    load1 = stats.loadavg()
    print(stats.table(["what", "median", "p99", "ops", "x floor", "target", "met"],
                      [r.cells() for r in rows], markdown=not args.plain))
    print()
    print(f"ns figures are per call, timed {samples} samples x 1000 calls, interleaved; they "
          "include the loop overhead in the first row.  'x floor' divides the median by the "
          "pure-Python floor (clock + store into a 0-d view; arr[i]: by the q[i] read; scan "
          "rows: by the snapshot + judge row; kill rows: by the pidfd floor).")
    for note in notes + [stats.noise_note(load0, load1) or ""]:
        if note:
            print(note)
    print("[C] rows: the extension shmhb._native; [Python] rows: the pure-Python path "
          "(SHMHB_PURE_PYTHON=1, or installed without a compiler)." if shmhb.native else
          "shmhb._native is not active here (not built, or SHMHB_PURE_PYTHON=1): pure-Python rows only.")
    missed = [r.what for r in rows if r.met() is False]
    print("all targets met" if not missed else "targets missed: " + "; ".join(missed))
    print(f"run took {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: the boards and processes of this run are removed", file=sys.stderr)
        sys.exit(130)
