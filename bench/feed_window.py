"""``python -m bench.feed_window``: where the time between a prefill's SIGKILL and a
router's removal goes, for a router that does not retry (vllm-router, PD mode).

A stack of tests/routers/stack.py (prefills p1, p2, decode d1 on three simulated hosts,
each its own board and ``shmhb pinger``), vllm-router in front, and the feeder of
``shmhb feed`` run in this process (``shmhb.cli.feeder.Feeder``, its defaults but the
ones given) so each step can be timed: p1 is SIGKILLed and

- *verdict*: kill -> p1's host board reads p1 dead (its pinger's death watch writes it;
  polled here every 0.1 ms),
- *poll*: verdict -> the feeder's read of the boards that sees it (``poll_s``),
- *plan*: that read -> the applier starting the router's call (its wake-up and the plan),
- *call*: the ``DELETE /workers/...`` itself (HTTP on loopback, new connection).

``--repeats`` fresh stacks; medians and maxima in ms.  As root it runs in a network
namespace of loopback only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from shmhb import Status
from shmhb.board.instances import board_instances
from shmhb.cli.feed import reader
from shmhb.cli.feeder import Feeder, FeederConfig
from shmhb.cli.routerapi import RouterWorker, VllmRouter
from tests.routers.stack import bench_refusal
from tests.routers.stack import PdStack, wait_for


class TimedRouter(VllmRouter):
    """vllm-router's client, noting when each removal's call starts and ends."""

    def __init__(self, base: str) -> None:
        super().__init__(base)
        self.calls: list[tuple[str, int, int]] = []

    def remove(self, w: RouterWorker) -> None:
        t0 = time.monotonic_ns()
        super().remove(w)
        self.calls.append((w.url, t0, time.monotonic_ns()))


def once(poll_s: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="shmhb-bench-window-") as tmp:
        s = PdStack(tmp)
        f = None
        try:
            p1 = s.add_instance("p1", "prefill", 0)
            s.add_instance("p2", "prefill", 1)
            s.add_instance("d1", "decode", 2)
            s.start_router("vllm")
            boards = list(s.boards.values())
            read, changes = reader(boards, False)
            seen: dict[str, int] = {}

            def timed_read() -> list[Any]:
                insts = read()
                if "read" not in seen and any(i.serving == p1.url[7:] and i.status is Status.DEAD
                                              for i in insts):
                    seen["read"] = time.monotonic_ns()
                return insts
            client = TimedRouter(f"http://127.0.0.1:{s.router_port}")
            f = Feeder(timed_read, changes, client, FeederConfig(poll_s=poll_s)).start()
            wait_for(lambda: f.latest() is not None, 10, "the feeder's first read")
            time.sleep(0.5)  # past the feeder's first listing of the router
            home = s.boards[p1.ip]
            stop = threading.Event()

            def watch() -> None:
                while not stop.is_set():
                    if any(i.serving == p1.url[7:] and i.status is Status.DEAD
                           for i in board_instances(home, remote=False)):
                        seen["verdict"] = time.monotonic_ns()
                        return
                    time.sleep(0.0001)
            w = threading.Thread(target=watch, daemon=True)
            w.start()
            t_kill = s.kill("p1")
            wait_for(lambda: client.calls, 10, "the feeder's DELETE")
            stop.set()
            w.join(2)
            _, c0, c1 = client.calls[0]
            return {"verdict": (seen["verdict"] - t_kill) / 1e6,
                    "poll": (seen["read"] - seen["verdict"]) / 1e6,
                    "plan": (c0 - seen["read"]) / 1e6, "call": (c1 - c0) / 1e6,
                    "total": (c1 - t_kill) / 1e6}
        finally:
            if f is not None:
                f.stop()
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--poll-ms", type=float, default=2.0)
    a = ap.parse_args(argv)
    why = bench_refusal(["vllm"])
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    runs = [once(a.poll_ms / 1000) for _ in range(a.repeats)]
    print(f"kill -> vllm-router's removal, ms, median (max) of {a.repeats}; feeder poll "
          f"{a.poll_ms:g} ms; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for k in ("verdict", "poll", "plan", "call", "total"):
        v = [r[k] for r in runs]
        print(f"  {k:8s} {statistics.median(v):7.2f} ({max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
