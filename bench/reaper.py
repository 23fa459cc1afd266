"""Benchmark of the LinkReaper: ``python -m bench.reaper [--quick] [--plain]``.

What a connector pays per step for ``reaper.poll()`` with 1,000 tracked links:

1. nothing changed (the common case, every step): target <= 20 us.  For remote links
   that is one read of the board's change counter; for local links also a vectorised
   staleness check of the slots they point at; also with links still pending (tracked
   without an incarnation, for endpoints no report names yet), which wait for the board
   to change instead of being judged at every poll;
2. one change (a slot closed, its 8 links dropped), for comparison: the poll that
   judges every link once.

Two simulated hosts on loopback, as in the tests: a "remote" board on 127.0.0.3 where
this process registers 125 workers with 8 endpoints each (1,000 endpoints), and a
"watcher" board on 127.0.0.2; each has its own ``python -m shmhb pinger``.  One reaper
tracks the 1,000 endpoints as local links (on the remote board itself), another as
remote links (on the watcher board, through the pingers).  Everything the run creates
is removed at the end, on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shmhb
from shmhb import Heartbeat, LinkReaper, Status
from shmhb.testing.loopback import child_env, free_port, loopback_addrs

from . import stats
from .stats import Summary, Variant

REPO = Path(__file__).resolve().parent.parent
TARGET_US = 20.0
WORKERS, PER = 125, 8  # 1,000 links
PENDING = 100  # links tracked without an incarnation that no report names
LONG = shmhb.Policy(suspect_after_s=600.0, dead_after_s=1200.0)  # nothing goes stale by itself
IPS = tuple(loopback_addrs(2))  # $SHMHB_LOOPBACK_BASE moves them


@dataclass
class Row:
    what: str
    summary: Summary
    target: float | None = None
    floor: float | None = None

    def cells(self) -> list[str]:
        s = self.summary
        met = "-" if self.target is None else ("yes" if s.median <= self.target else "NO")
        return [self.what, stats.fmt(s.median, "µs"), stats.fmt(s.p99, "µs"), str(s.ops),
                "" if self.floor is None else stats.ratio(s.median, self.floor),
                "" if self.target is None else f"<= {self.target:g} µs", met]


def wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.002)


class Hosts:
    """The two boards, their pingers, and the 125 workers registered by this process."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        tag = f"shmhb-bench-{os.getpid()}-{secrets.token_hex(3)}"
        port = free_port(IPS)
        env = child_env()
        self.boards: dict[str, shmhb.Board] = {}
        for host, ip in (("watcher", IPS[0]), ("remote", IPS[1])):
            b = shmhb.Board.create(f"{tag}-{host}", slots=256, policy=LONG)
            stack.callback(b.close)
            stack.callback(b.unlink)
            self.boards[host] = b
            p = subprocess.Popen([sys.executable, "-m", "shmhb", "pinger", "--board", b.name,
                                  "--listen", f"{ip}:{port}", "--interval-s", "0.2"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(p.wait)
            stack.callback(p.kill)
            wait(lambda b=b, p=p: b.agent().pid == p.pid and b.agent().status is Status.ALIVE,
                 30, f"the {host} pinger")
        self.watcher, self.remote = self.boards["watcher"], self.boards["remote"]
        self.hbs = []
        for i in range(WORKERS - 1):  # the last worker comes and goes in the change rows
            hb = self.remote.register(f"w{i}", endpoints=self.endpoints(i), agent=False)
            stack.callback(hb.close)
            self.hbs.append(hb)

    @staticmethod
    def endpoints(i: int) -> tuple[str, ...]:
        return tuple(f"{IPS[1]}:{30000 + i * PER + j}" for j in range(PER))

    def settle(self, reaper: LinkReaper) -> None:
        """Until the reaper has judged every link and the board stopped changing."""
        def quiet() -> bool:
            c = reaper.board.changes()
            assert reaper.poll() == [], "a link was dropped while settling"
            return (not reaper.pending and reaper.board.changes() == c
                    and all(lk.key is not None for lk in reaper.links()))
        wait(quiet, 30, "the links to settle")


def pure_handle(stack: contextlib.ExitStack, board: shmhb.Board) -> shmhb.Board:
    """A second handle on ``board`` on the pure-Python hot path (``shmhb.native``)."""
    sel = importlib.import_module("shmhb.board.native")  # the module; ``shmhb.native`` is its bool
    saved, sel._ext = sel._ext, None
    try:
        b = shmhb.Board.attach(board.name)
    finally:
        sel._ext = saved
    stack.callback(b.close)
    assert not b.native
    return b


def bench_nothing_changed(hosts: Hosts, local: LinkReaper, remote: LinkReaper,
                          pending: LinkReaper, samples: int,
                          pure: tuple[LinkReaper, LinkReaper] | None = None) -> list[Row]:
    """``pure``: the same links on pure-Python handles, measured in the same run."""
    ns = {"LOCAL": local, "REMOTE": remote, "BOARD": hosts.watcher, "PENDING": pending}
    tag = " [C]" if hosts.watcher.native else ""
    vs = [
        Variant("floor: board.changes() (one read of the counter)", "changes()", ns,
                setup="changes = BOARD.changes"),
        Variant(f"poll(), {len(remote.links())} remote links, nothing changed{tag}", "poll()", ns,
                setup="poll = REMOTE.poll"),
        Variant(f"poll(), {len(local.links())} local links, nothing changed{tag}", "poll()", ns,
                setup="poll = LOCAL.poll"),
        Variant(f"poll(), {len(pending.links())} remote links of which {PENDING} pending, "
                "nothing changed", "poll()", ns,
                setup="poll = PENDING.poll"),
    ]
    if pure is not None:
        ns["PLOCAL"], ns["PREMOTE"] = pure
        vs += [
            Variant(f"poll(), {len(pure[1].links())} remote links, nothing changed [Python]",
                    "poll()", ns, setup="poll = PREMOTE.poll"),
            Variant(f"poll(), {len(pure[0].links())} local links, nothing changed [Python]",
                    "poll()", ns, setup="poll = PLOCAL.poll"),
        ]
    got = stats.interleaved(vs, samples)
    floor = stats.median(got[vs[0].name]) / 1000
    rows = [Row(vs[0].name, Summary.of([x / 1000 for x in got[vs[0].name]], samples * vs[0].batch))]
    for v in vs[1:]:
        rows.append(Row(v.name, Summary.of([x / 1000 for x in got[v.name]], samples * v.batch),
                        TARGET_US, floor))
    return rows


def bench_one_change(hosts: Hosts, local: LinkReaper, remote: LinkReaper, samples: int) -> list[Row]:
    """One slot (the 125th worker, 8 links) registered, tracked, then closed: time the
    first poll after the close, which judges all 1,000 links and drops those 8."""
    loc: list[float] = []
    rem: list[float] = []
    eps = hosts.endpoints(WORKERS - 1)
    for _ in range(samples):
        hb = hosts.remote.register(f"w{WORKERS - 1}", endpoints=eps, agent=False)
        for ep in eps:
            local.track(ep)
            remote.track(ep, incarnation=hb.incarnation)
        hosts.settle(local)
        hosts.settle(remote)
        seen = hosts.watcher.changes()
        hb.close()  # a local change at once; the watcher learns it from a push
        t = time.perf_counter_ns()
        dropped = local.poll()
        loc.append((time.perf_counter_ns() - t) / 1000)
        assert len(dropped) == PER, dropped
        wait(lambda seen=seen: hosts.watcher.changes() != seen, 10, "the push")
        t = time.perf_counter_ns()
        dropped = remote.poll()
        rem.append((time.perf_counter_ns() - t) / 1000)
        if len(dropped) != PER:  # the counter moved for something else first: no sample
            rem.pop()
            wait(lambda: remote.poll() is not None and not any(lk.endpoint in eps for lk in remote.links()),
                 10, "the remote drop")
    n = len(local.links())
    return [Row(f"poll() after one slot closed, {n + PER} local links (8 dropped)",
                Summary.of(loc, len(loc))),
            Row(f"poll() after one slot closed, {n + PER} remote links (8 dropped)",
                Summary.of(rem, len(rem)))]


@dataclass
class Reapers:
    """The reapers the rows measure, every link tracked and settled."""
    local: LinkReaper  # the workers' own board: local links
    remote: LinkReaper  # the other host's board: remote links
    pending: LinkReaper  # the remote links plus links no report names
    last: Heartbeat  # the 125th worker, whose 8 links make 1,000
    pure: tuple[LinkReaper, LinkReaper] | None  # local and remote through pure-Python handles


def reapers(stack: contextlib.ExitStack, hosts: Hosts) -> Reapers:
    """Track every link (see ``Reapers``); the pure-Python pair only where the C path is
    active."""
    local = LinkReaper(hosts.remote)  # the workers' own board: local links
    remote = LinkReaper(hosts.watcher)  # the other host's board: remote links
    for i, hb in enumerate(hosts.hbs):
        for ep in hosts.endpoints(i):
            local.track(ep)
            remote.track(ep, incarnation=hb.incarnation)
    hosts.settle(local)
    hosts.settle(remote)
    # the 125th worker's 8 links make 1,000 for the nothing-changed rows
    last = hosts.remote.register(f"w{WORKERS - 1}", endpoints=hosts.endpoints(WORKERS - 1),
                                 agent=False)
    for ep in hosts.endpoints(WORKERS - 1):
        local.track(ep)
        remote.track(ep, incarnation=last.incarnation)
    hosts.settle(local)
    hosts.settle(remote)
    assert len(local.links()) == len(remote.links()) == WORKERS * PER
    pure = None
    if shmhb.native:  # the same links through pure-Python handles, side by side
        plocal = LinkReaper(pure_handle(stack, hosts.remote))
        premote = LinkReaper(pure_handle(stack, hosts.watcher))
        for i, hb in enumerate(hosts.hbs + [last]):
            for ep in hosts.endpoints(i):
                plocal.track(ep)
                premote.track(ep, incarnation=hb.incarnation)
        hosts.settle(plocal)
        hosts.settle(premote)
        pure = (plocal, premote)
    # the same 1,000 remote links plus 100 that no report names (no incarnation given)
    pending = LinkReaper(hosts.watcher)
    for lk in remote.links():
        pending.track(lk.endpoint, incarnation=lk.incarnation)
    for j in range(PENDING):
        pending.track(f"{IPS[1]}:{40000 + j}")
    wait(lambda: pending.poll() == [] and len(pending.links()) == WORKERS * PER + PENDING
         and pending.pending, 30, "the pending links")
    return Reapers(local, remote, pending, last, pure)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reaper", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    ap.add_argument("--plain", action="store_true", help="plain columns instead of markdown")
    args = ap.parse_args(argv)
    samples, changes = (100, 10) if args.quick else (1000, 100)
    load0 = stats.loadavg()
    print(stats.table(["machine", ""], stats.machine_info(), markdown=not args.plain))
    print()
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        hosts = Hosts(stack)
        rp = reapers(stack, hosts)
        local, remote, pending, last, pure = rp.local, rp.remote, rp.pending, rp.last, rp.pure
        rows = bench_nothing_changed(hosts, local, remote, pending, samples, pure)
        if pure is not None:
            for r in pure:
                for lk in r.links():
                    r.untrack(lk.endpoint)
        for ep in hosts.endpoints(WORKERS - 1):
            local.untrack(ep)
            remote.untrack(ep)
        last.close()
        hosts.settle(local)
        hosts.settle(remote)
        rows += bench_one_change(hosts, local, remote, changes)
    load1 = stats.loadavg()
    print(stats.table(["what", "median", "p99", "ops", "x floor", "target", "met"],
                      [r.cells() for r in rows], markdown=not args.plain))
    print()
    print(f"Nothing-changed rows: per call, {samples} samples x 1000 calls, interleaved with the "
          "floor.  One-change rows: each sample is one poll, right after a slot closed.")
    note = stats.noise_note(load0, load1)
    if note:
        print(note)
    missed = [r.what for r in rows if r.target is not None and r.summary.median > r.target]
    print("all targets met" if not missed else "targets missed: " + "; ".join(missed))
    print(f"run took {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: the boards and processes of this run are removed", file=sys.stderr)
        sys.exit(130)
