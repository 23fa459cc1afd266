"""``shmhb demo``: a first run for a new user.

Starts a private board and a few worker processes, then kills one (SIGKILL), hangs one
(SIGSTOP, later SIGCONT), and restarts one, printing what the board reports and when.
Leaves no process and no segment behind, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from .agent import Agent
from .board import Board
from .status import SlotStatus, Status

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker if the demo dies first."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the demo's finally block still reaps its workers


def worker_main(argv: list[str]) -> int:
    """One demo worker: register, beat from a thread, leave on SIGTERM."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--board", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--endpoint", default="127.0.0.1:30000")
    a = ap.parse_args(argv)
    _die_with_parent()
    board = Board.attach(a.board)
    hb = board.register(a.key, endpoints=(a.endpoint,), agent=False).start(0.05)
    done = False

    def _term(*_: object) -> None:
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, _term)
    print("ready", flush=True)
    while not done:
        signal.pause() if hasattr(signal, "pause") else time.sleep(0.1)
    hb.close()
    board.close()
    return 0


class Demo:
    def __init__(self, quick: bool) -> None:
        self.name = f"shmhb-demo-{os.getpid()}"
        pol = dict(suspect_after_s=0.3, dead_after_s=1.0) if quick else dict(
            suspect_after_s=1.0, dead_after_s=3.0)
        self.board = Board.create(self.name, slots=16, **pol)
        self.agent = Agent(self.name, network=False).start()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.3f}s] {msg}", flush=True)

    def spawn(self, key: str) -> None:
        p = subprocess.Popen(
            [sys.executable, "-m", "shmhb.demo", "--board", self.name, "--key", key,
             "--endpoint", f"127.0.0.1:{30000 + len(self.procs)}"],
            stdout=subprocess.PIPE,
        )
        assert p.stdout is not None
        p.stdout.readline()  # "ready": registered and beating
        self.procs[key] = p

    def wait(self, key: str, pred: Callable[[SlotStatus], bool], what: str, timeout_s: float = 30.0) -> SlotStatus:
        start = time.monotonic()
        while True:
            s = self.board.slot(key)
            if s is not None and pred(s):
                self.say(f"board: {key} {s.status.value} (incarnation {s.incarnation}) "
                         f"after {(time.monotonic() - start) * 1000:.1f} ms - {what}")
                return s
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{key} never became {what}")
            time.sleep(0.0005)

    def table(self) -> None:
        for s in sorted(self.board.slots(), key=lambda s: s.key):
            self.say(f"  {s.key:8} {s.status.value:8} pid {s.pid:<7} inc {s.incarnation:<3} "
                     f"age {s.age_s * 1000:6.1f} ms")

    def run(self) -> None:
        b = self.board
        self.say(f"board {self.name}: suspect after {b.policy.suspect_after_s} s, dead after "
                 f"{b.policy.dead_after_s} s; starting 4 workers")
        for k in range(4):
            self.spawn(f"rank-{k}")
        if not self.agent.holding.wait(5):
            raise TimeoutError("the agent never took its role")
        self.table()

        self.say("SIGKILL rank-1 (the agent sees the exit through its pidfd)")
        self.procs["rank-1"].kill()
        self.wait("rank-1", lambda s: s.status is Status.DEAD, "killed")

        self.say("SIGSTOP rank-2 (a hang: only its silence tells)")
        os.kill(self.procs["rank-2"].pid, signal.SIGSTOP)
        self.wait("rank-2", lambda s: s.status is Status.SUSPECT, "silent past suspect-after")
        self.wait("rank-2", lambda s: s.status is Status.DEAD, "silent past dead-after")
        self.say("SIGCONT rank-2")
        os.kill(self.procs["rank-2"].pid, signal.SIGCONT)
        self.wait("rank-2", lambda s: s.status is Status.ALIVE, "beating again, same incarnation")

        old = b.slot("rank-3")
        assert old is not None
        self.say("restart rank-3: graceful stop, then a new process")
        self.procs["rank-3"].terminate()
        self.procs["rank-3"].wait()
        self.wait("rank-3", lambda s: s.status is Status.LEFT, "left gracefully")
        self.spawn("rank-3")
        self.wait("rank-3", lambda s: s.incarnation != old.incarnation and s.status is Status.ALIVE,
                  f"restarted: links made with incarnation {old.incarnation} are stale")
        self.table()

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.agent.stop()
        self.board.unlink()
        self.board.close()
        self.say("cleaned up: no worker and no segment left")


def run_demo(quick: bool = False) -> int:
    demo = Demo(quick)
    try:
        demo.run()
    except KeyboardInterrupt:
        demo.say("interrupted")
        return 130
    finally:
        demo.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
