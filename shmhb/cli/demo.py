"""``shmhb demo``: the whole system on one machine, for a new user.

Two simulated hosts on loopback (127.0.0.2 and 127.0.0.3 by default; ``--base-addr`` or
``$SHMHB_LOOPBACK_BASE`` moves them, see ``shmhb.testing.loopback``), each with its own board, its
own ``shmhb pinger`` and a few worker processes; each host follows the other's workers.
On each side the demo kills a worker (SIGKILL), hangs one (SIGSTOP, later SIGCONT) and
restarts one, and reports when each host's board saw it.  On a terminal it shows host
A's live view meanwhile (``shmhb monitor``) and prints the timeline after; with
``--quick`` or without a terminal it prints the timeline as it goes.  It leaves no
process and no segment behind, also when interrupted with Ctrl-C.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..board.handle import Board
from ..board.config import Policy
from ..testing.loopback import free_port, loopback_addrs
from ..status import SlotStatus, Status
from .stopsignal import stop_on_signals

_PR_SET_PDEATHSIG = 1
RANKS = 3


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process if the demo dies first."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the demo's finally block still reaps its workers


def worker_main(argv: list[str]) -> int:
    """One demo worker: register, beat from a thread, leave on SIGTERM."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--board", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--endpoint", required=True)
    a = ap.parse_args(argv)
    _die_with_parent()
    board = Board.attach(a.board)
    hb = board.register(a.key, endpoints=(a.endpoint,)).start(0.05)
    done = threading.Event()
    stop_on_signals(done, (signal.SIGTERM,))  # not done.set() in a handler: see stopsignal
    print("ready", flush=True)
    while not done.wait(0.5):
        pass
    hb.close()
    board.close()
    return 0


class Host:
    """A simulated host: a board, its pinger process and its workers."""

    def __init__(self, demo: Demo, label: str, ip: str, port: int, policy: Policy) -> None:
        self.demo, self.label, self.ip = demo, label, ip
        self.name = f"shmhb-demo-{os.getpid()}-{label.lower()}"
        self.board = Board.create(self.name, slots=16, policy=policy)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.pinger = subprocess.Popen(
            [sys.executable, "-m", "shmhb", "pinger", "--board", self.name, "--tick-s", "0.02",
             "--listen", f"{ip}:{port}", "--interval-s", "0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def endpoint(self, rank: int) -> str:
        return f"{self.ip}:{30000 + rank}"

    def key(self, rank: int) -> str:
        return f"{self.label.lower()}-rank-{rank}"

    def spawn(self, rank: int) -> None:
        p = subprocess.Popen(
            [sys.executable, "-m", "shmhb.cli.demo", "--board", self.name, "--key", self.key(rank),
             "--endpoint", self.endpoint(rank)], stdout=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.readline()  # "ready": registered and beating
        self.procs[self.key(rank)] = p

    def proc(self, rank: int) -> subprocess.Popen[bytes]:
        return self.procs[self.key(rank)]

    def cleanup(self) -> None:
        for p in [*self.procs.values(), self.pinger]:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.board.unlink()
        self.board.close()


class Demo:
    def __init__(self, quick: bool, live: bool, base_addr: str | None = None) -> None:
        self.live = live
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        pol = Policy(suspect_after_s=0.5 if quick else 1.0, dead_after_s=1.5 if quick else 3.0,
                     peer_suspect_after_s=1.0, peer_dead_after_s=3.0)
        ip_a, ip_b = loopback_addrs(2, base_addr)
        port = free_port([ip_a, ip_b])
        self.hosts: list[Host] = []
        self.a = self._host("A", ip_a, port, pol)
        self.b = self._host("B", ip_b, port, pol)

    def _host(self, label: str, ip: str, port: int, pol: Policy) -> Host:
        h = Host(self, label, ip, port, pol)
        self.hosts.append(h)
        return h

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.3f}s] {msg}"
        self.lines.append(line)
        if not self.live:
            print(line, flush=True)

    def other(self, h: Host) -> Host:
        return self.b if h is self.a else self.a

    def wait(self, what: str, get: Callable[[], SlotStatus | None],
             pred: Callable[[SlotStatus], bool], start: float, timeout_s: float = 30.0) -> None:
        while True:
            s = get()
            if s is not None and pred(s):
                self.say(f"  {what}: {s.status.value}, incarnation {s.incarnation}, "
                         f"after {(time.monotonic() - start) * 1000:.0f} ms")
                return
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{what} never got there")
            time.sleep(0.0005)

    def both(self, h: Host, rank: int, pred: Callable[[SlotStatus], bool], start: float) -> None:
        """Wait until the worker's own host, then the other host, see ``pred``."""
        o = self.other(h)
        key, ep = h.key(rank), h.endpoint(rank)
        self.wait(f"host {h.label} sees {key}", lambda: h.board.slot(key), pred, start)
        self.wait(f"host {o.label} sees {key}", lambda: o.board.remote(ep), pred, start)

    def run(self) -> None:
        a, b = self.a, self.b
        self.say(f"hosts A ({a.ip}) and B ({b.ip}): one board and one pinger each; "
                 f"suspect after {a.board.policy.suspect_after_s} s, dead after "
                 f"{a.board.policy.dead_after_s} s")
        for h in self.hosts:
            for r in range(RANKS):
                h.spawn(r)
                self.other(h).board.watch(h.endpoint(r))  # each host follows the other's ranks
        t = time.monotonic()
        for h in self.hosts:
            for r in range(RANKS):
                self.both(h, r, lambda s: s.status is Status.ALIVE, t)
        for h in self.hosts:
            self.say(f"SIGKILL {h.key(0)} on host {h.label}: its pinger sees the exit through "
                     "a pidfd and pushes it to the other host at once")
            h.proc(0).kill()
            self.both(h, 0, lambda s: s.status is Status.DEAD, time.monotonic())
        for h in self.hosts:
            self.say(f"SIGSTOP {h.key(1)} on host {h.label}: a hang, told only by its silence")
            os.kill(h.proc(1).pid, signal.SIGSTOP)
            t = time.monotonic()
            self.both(h, 1, lambda s: s.status is Status.SUSPECT, t)
            self.both(h, 1, lambda s: s.status is Status.DEAD, t)
            self.say(f"SIGCONT {h.key(1)}: it beats again, same incarnation")
            os.kill(h.proc(1).pid, signal.SIGCONT)
            self.both(h, 1, lambda s: s.status is Status.ALIVE, time.monotonic())
        for h in self.hosts:
            old = h.board.slot(h.key(2))
            assert old is not None
            self.say(f"restart {h.key(2)} on host {h.label}: a graceful stop, then a new process")
            h.proc(2).terminate()
            h.proc(2).wait()
            self.both(h, 2, lambda s: s.status is Status.LEFT, time.monotonic())
            h.spawn(2)
            old_inc = old.incarnation

            def restarted(s: SlotStatus) -> bool:
                return s.incarnation != old_inc and s.status is Status.ALIVE

            self.both(h, 2, restarted, time.monotonic())
            self.say(f"  links made with incarnation {old.incarnation} are stale now")
        for h in self.hosts:
            self.say(f"host {h.label}'s board:")
            for s in sorted(h.board.slots(), key=lambda s: s.key):
                self.say(f"  {s.key:10} {s.status.value:8} inc {s.incarnation}")
            for p in h.board.peers():
                self.say(f"  @{p.address} {p.status.value}: " + ", ".join(
                    f"{s.key} {s.status.value}" for s in p.slots))

    def cleanup(self) -> None:
        for h in self.hosts:
            h.cleanup()
        self.say("cleaned up: no process and no segment left")


def run_demo(quick: bool = False, live: bool | None = None, base_addr: str | None = None) -> int:
    """Run the tour; ``live``: show host A's live view meanwhile (default: on a terminal
    and not quick); ``base_addr``: host A's loopback address (B gets the next one)."""
    if live is None:
        live = sys.stdout.isatty() and not quick
    demo = Demo(quick, live, base_addr)
    stop = threading.Event()
    mon: threading.Thread | None = None
    if live:
        from .monitor import run_monitor
        mon = threading.Thread(target=run_monitor, args=(demo.a.board,),
                               kwargs={"stop": stop, "refresh_hz": 8}, daemon=True)
        mon.start()
    code = 0
    try:
        demo.run()
        if live:
            demo.say("done: the live view closes in 3 s")
            stop.wait(3)
    except KeyboardInterrupt:
        demo.say("interrupted")
        code = 130
    finally:
        stop.set()
        if mon is not None:
            mon.join(5)
        demo.cleanup()
        if live:
            print("\n".join(demo.lines))
    return code


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
