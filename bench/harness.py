"""Process plumbing shared by ``bench.cluster`` and ``bench.push``: simulated shmhb hosts
on loopback addresses, victim workers, CPU readings, and the kill -> DEAD measurement.

Everything started here is registered on an ``ExitStack``: processes are killed and
boards unlinked when it unwinds, on Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import shmhb
from shmhb.board.config import AgentConfig
from shmhb.testing.loopback import child_env
from shmhb.status import Status

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
RUN_TAG = f"{os.getpid()}-{secrets.token_hex(3)}"


def board_name(tag: str) -> str:
    return f"shmhb-bench-{RUN_TAG}-{tag}"


# -- CPU -----------------------------------------------------------------------------------

def cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid`` in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def sched_s(pid: int) -> float:
    """Time on CPU of every live thread of ``pid`` from schedstat (ns precision)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


@dataclass
class CpuSample:
    t: float
    cpu: dict[int, float]
    sched: dict[int, float]


def sample_cpu(pids: Iterable[int]) -> CpuSample:
    pids = list(pids)
    return CpuSample(time.monotonic(), {p: cpu_s(p) for p in pids}, {p: sched_s(p) for p in pids})


def cpu_delta(a: CpuSample, b: CpuSample, pids: Iterable[int]) -> tuple[float, float]:
    """(utime+stime, schedstat) seconds used by ``pids`` between two samples."""
    pids = list(pids)
    return (sum(b.cpu.get(p, 0) - a.cpu.get(p, 0) for p in pids),
            sum(b.sched.get(p, 0) - a.sched.get(p, 0) for p in pids))


# -- processes ------------------------------------------------------------------------------

def stop_process(p: subprocess.Popen, timeout_s: float = 3.0) -> None:
    if p.poll() is None:
        try:
            p.terminate()
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def unlink_board(name: str) -> None:
    try:
        shmhb.Board.attach(name).unlink()
    except Exception:  # noqa: BLE001 - gone already, or never made
        pass


def start_pinger(stack: contextlib.ExitStack, board: str, listen: str, interval_s: float,
                 tick_s: float | None = None, env: dict[str, str] | None = None,
                 log_dir: str | None = None) -> subprocess.Popen:
    """``python -m shmhb pinger`` for one simulated host (its loop at ``tick_s``, by
    default the pinger's own default); stopped and its board unlinked when ``stack``
    unwinds."""
    stack.callback(unlink_board, board)
    if log_dir:
        err = open(os.path.join(log_dir, f"{board}.log"), "w+")  # noqa: SIM115
    else:
        err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - read back if the pinger fails
    stack.callback(err.close)
    # SHMHB_BENCH_PROFILE=DIR runs each pinger's agent thread under cProfile, one file
    # per board in DIR (bench.profpinger); call counts do not depend on machine load.
    prof = os.environ.get("SHMHB_BENCH_PROFILE")
    cmd = ["-m", "bench.profpinger", os.path.join(prof, f"{board}.prof")] if prof else ["-m", "shmhb"]
    p = subprocess.Popen(
        [sys.executable, *cmd, "pinger", "--board", board, "--listen", listen,
         "--interval-s", str(interval_s), *(("--tick-s", str(tick_s)) if tick_s else ())],
        env=env or child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    stack.callback(stop_process, p)
    _logs[p.pid] = err
    return p


_logs: dict[int, object] = {}


def pinger_log(p: subprocess.Popen, lines: int = 5) -> str:
    """The last lines a pinger wrote to stderr (for error messages)."""
    f = _logs.get(p.pid)
    try:
        f.seek(0)  # type: ignore[union-attr]
        return " | ".join(f.read().splitlines()[-lines:])  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001
        return "?"


def attach_when_ready(stack: contextlib.ExitStack, names: Sequence[str],
                      timeout_s: float = 60.0,
                      procs: Sequence[subprocess.Popen] | None = None) -> list[shmhb.Board]:
    """Attach every board once its pinger holds the agent role."""
    out: list[shmhb.Board] = []
    deadline = time.monotonic() + timeout_s
    for n in names:
        while True:
            try:
                b = shmhb.Board.attach(n)
            except Exception:  # noqa: BLE001 - not created yet
                b = None
            if b is not None:
                if b.agent().status is Status.ALIVE:
                    stack.callback(b.close)
                    out.append(b)
                    break
                b.close()
            p = procs[len(out)] if procs else None
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"board {n}: its pinger exited ({p.returncode}): {pinger_log(p)}")
            if time.monotonic() > deadline:
                why = f": {pinger_log(p)}" if p is not None else ""
                raise RuntimeError(f"board {n}: no agent after {timeout_s:g} s{why}")
            time.sleep(0.05)
    return out


@dataclass
class Victim:
    board: str
    key: str
    endpoint: str
    pid: int
    incarnation: int


class HostServer:
    """The ``bench.cluster_hosts`` fork server: ranks processes and victim workers."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "bench.cluster_hosts"], env=child_env(),
                                  cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  bufsize=1)
        stack.callback(self.close)
        self._ranks: queue.Queue[tuple[str, int]] = queue.Queue()
        self._victims: dict[str, queue.Queue[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self.errors: list[str] = []
        self.ranks_pids: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "ranks-ready":
                self._ranks.put((parts[1], int(parts[2])))
            elif parts[0] == "ready":
                self._vq(f"{parts[1]}/{parts[2]}").put((int(parts[3]), int(parts[4])))
            else:
                self.errors.append(line.strip())
                if parts[0] == "error" and len(parts) > 1:
                    self._vq(parts[1]).put((-1, -1))

    def _vq(self, key: str) -> queue.Queue[tuple[int, int]]:
        with self._lock:
            return self._victims.setdefault(key, queue.Queue())

    def _send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def start_ranks(self, board: str, n: int, addr: str, beat_s: float, watches: Sequence[str]) -> None:
        self._send(f"ranks {board} {n} {addr} {beat_s} {','.join(watches) or '-'}")

    def wait_ranks(self, count: int, timeout_s: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while len(self.ranks_pids) < count:
            try:
                _, pid = self._ranks.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"ranks processes: {len(self.ranks_pids)}/{count} ready; "
                                   f"errors: {self.errors[-3:]}") from None
            self.ranks_pids.append(pid)
        return self.ranks_pids

    def request_victim(self, board: str, key: str, endpoint: str) -> None:
        self._vq(f"{board}/{key}")
        self._send(f"victim {board} {key} {endpoint}")

    def wait_victim(self, board: str, key: str, endpoint: str, timeout_s: float = 30.0) -> Victim:
        try:
            pid, inc = self._vq(f"{board}/{key}").get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"victim {key}: not ready after {timeout_s:g} s") from None
        if pid < 0:
            raise RuntimeError(f"victim {key}: {self.errors[-1:]}")
        return Victim(board, key, endpoint, pid, inc)

    def close(self) -> None:
        if self.p.stdin is not None:
            with contextlib.suppress(OSError):
                self.p.stdin.close()
        stop_process(self.p)


# -- kill -> DEAD ---------------------------------------------------------------------------

def _push_gap_s() -> float:
    from shmhb.net import pinger
    return getattr(pinger, "PUSH_GAP_NS", 0) / 1e9


#: Quiet time on a victim's host before a kill: the pinger sends at most one push per
#: gap (``shmhb.net.pinger.PUSH_GAP_NS``) and notices a registration at its next tick, so a
#: death that follows another change on the same host (say, the registration of the
#: previous victim's replacement) within the gap waits for it.  Each timed kill is kept
#: the only change on its host for this long before it (gap + two of the pinger's ticks).
QUIET_S = _push_gap_s() + 2 * AgentConfig().tick_s


def wait_quiet(last_change: float) -> None:
    time.sleep(max(0.0, last_change + QUIET_S - time.monotonic()))


def wait_remote_alive(watcher: shmhb.Board, v: Victim, timeout_s: float) -> bool:
    """Whether ``watcher`` sees the victim's incarnation ALIVE within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = watcher.remote(v.endpoint)
        if r is not None and r.incarnation == v.incarnation and r.status is Status.ALIVE:
            return True
        time.sleep(0.005)
    return False


@dataclass
class KillResult:
    local_ms: float | None
    remote_ms: float | None


def kill_and_time(local: shmhb.Board, watcher: shmhb.Board, v: Victim, timeout_s: float,
                  poll_s: float = 0.0002) -> KillResult:
    """SIGKILL the victim; time until its own host's board, then the watcher's, say DEAD.
    One loop polls both every ``poll_s`` (plus the sleep's overshoot)."""
    remote = watcher.remote
    status = local.status
    t0 = time.monotonic()
    os.kill(v.pid, signal.SIGKILL)
    t_local = None
    while True:
        now = time.monotonic()
        if t_local is None and status(v.key) is Status.DEAD:
            t_local = now
        r = remote(v.endpoint)
        if r is not None and r.incarnation == v.incarnation and r.status is Status.DEAD:
            if t_local is None:
                t_local = now
            return KillResult((t_local - t0) * 1e3, (now - t0) * 1e3)
        if now - t0 > timeout_s:
            return KillResult(None if t_local is None else (t_local - t0) * 1e3, None)
        time.sleep(poll_s)


@dataclass
class Dist:
    """A distribution of samples with its summary."""

    values: list[float] = field(default_factory=list)
    missed: int = 0

    def add(self, v: float | None) -> None:
        if v is None:
            self.missed += 1
        else:
            self.values.append(v)
