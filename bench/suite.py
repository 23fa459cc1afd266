"""The whole benchmark suite in one run: ``python -m bench [--quick | --smoke]``.

Five questions, each answered side by side with the alternatives: the scenarios
(bench/scenarios.py, and bench.board, bench.push, bench.cluster where they answer one)
each return their figures as a record; ``run`` gathers them all into one ``Results``; bench/report.py writes bench/RESULTS.md from it and bench/figures.py the
plots (only where matplotlib is installed: ``pip install shmhb[bench]``).  Everything a
scenario starts (processes, boards, the Redis server) is stopped and removed at its end,
on Ctrl-C and SIGTERM too.  Traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from shmhb.testing.loopback import set_base

from . import report, stats
from . import cluster as cluster_bench
from . import push as push_bench
from .scenarios import (
    Q1, Q2, Hang, HostKill, Kills, Stress, bench_kill_values, log, memory_rows, q1_costs,
    q2_step_loop, q3_host_kill, q3_hang, q5_stress,
)

REPO = Path(__file__).resolve().parent.parent
OUT_MD = REPO / "bench" / "RESULTS.md"
PLOTS = REPO / "bench" / "plots"
#: where --quick and --smoke write by default: never over the full run's results and
#: plots, which the README's table is generated from (bench.headline); not committed
QUICK_DIR = REPO / "bench" / "quick"


@dataclass(frozen=True)
class Profile:
    """How much each scenario samples."""
    q1_samples: int
    q2_rounds: int
    kills: int
    kill_pool: int
    hangs: int
    host_kills: int
    push_kills: int  # 0: no remote worker kill
    stress_s: float
    clusters: bool  # bench.cluster's 4 x 16 shape and pinger CPU


PROFILES = {
    "smoke": Profile(15, 3, 3, 2, 1, 1, 0, 3.0, clusters=False),
    "quick": Profile(60, 8, 10, 5, 4, 2, 0, 10.0, clusters=False),
    "full": Profile(400, 30, 100, 10, 20, 6, 15, 60.0, clusters=True),
}


@dataclass
class Results:
    """Everything one run measured, and how it ran."""
    run_name: str
    smoke: bool
    profile: Profile
    started: datetime.datetime
    info: list[tuple[str, str]]
    load0: tuple[float, float, float]
    q1: Q1
    q2: Q2
    kills: Kills
    hang: Hang
    host: HostKill
    push: push_bench.PushResult | None  # remote worker kills (full runs only)
    shape: cluster_bench.ShapeResult | None  # 4 x 16 (full runs only)
    cpu: list[cluster_bench.CpuResult]
    stress: Stress
    mem: list[tuple[int, int, int]]
    load1: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0

    @property
    def stamp(self) -> str:
        """The run, as the plots' feet say it."""
        return (f"{self.run_name}, {self.started:%Y-%m-%d %H:%M %Z}; {self.info[0][1]}; "
                f"load {self.load0[0]:.1f} -> {self.load1[0]:.1f}")


T = TypeVar("T")


def _scenario(what: str, fn: Callable[[contextlib.ExitStack], T]) -> T:
    """Run one scenario; what it started is stopped and removed when it returns."""
    log(what)
    with contextlib.ExitStack() as st:
        return fn(st)


def clusters(p: Profile) -> tuple[cluster_bench.ShapeResult | None, list[cluster_bench.CpuResult]]:
    """bench.cluster's 4 x 16 shape and the pinger's CPU with 64 and 250 emulated hosts
    (none in a short run)."""
    if not p.clusters:
        return None, []
    log("Q4: 4 x 16 cluster (bench.cluster.run_shape)")
    rng = random.Random()
    shape = cluster_bench.run_shape(4, 16, window_s=4.0, subwindows=2, sh_kills=10, rng=rng)
    cpu = []
    for n in (cluster_bench.CPU_HOSTS, cluster_bench.CPU_KILL_HOSTS):
        log(f"Q4: pinger CPU, {n} emulated hosts (bench.cluster.run_cpu_target)")
        # 8 s windows at 250 hosts: CPU time comes in 10 ms ticks, so a 3 s window
        # reads in steps of 0.33 % against a target of 3 %
        window_s = 8.0 if n == cluster_bench.CPU_KILL_HOSTS else 3.0
        cpu.append(cluster_bench.run_cpu_target(window_s, 1, 0, rng, hosts=n,
                                                kills=3 if n == cluster_bench.CPU_KILL_HOSTS else 0))
    return shape, cpu


def run(name: str, run_name: str) -> Results:
    """Every scenario of profile ``name``, in turn."""
    p = PROFILES[name]
    t0 = time.monotonic()
    started = datetime.datetime.now().astimezone()
    info, load0 = stats.machine_info(), os.getloadavg()
    q1 = _scenario("Q1: one heartbeat / one read", lambda st: q1_costs(st, p.q1_samples))
    q2 = _scenario("Q2: step-loop overhead", lambda st: q2_step_loop(st, p.q2_rounds))
    kills = _scenario("Q3: local kill -> DEAD (bench.board.bench_kill)",
                      lambda st: bench_kill_values(st, p.kills, p.kill_pool))
    hang = _scenario("Q3: local hang (SIGSTOP) -> DEAD", lambda st: q3_hang(st, p.hangs))
    host = _scenario("Q3: remote host kill -> DEAD", lambda st: q3_host_kill(st, p.host_kills))
    push = None
    if p.push_kills:
        push = _scenario("Q3: remote worker kill (bench.push)",
                         lambda st: push_bench.run(st, p.push_kills, log=log))
    shape, cpu = clusters(p)
    stress = _scenario(f"Q5: false verdicts, {p.stress_s:g} s with every core hogged",
                       lambda st: q5_stress(st, p.stress_s))
    r = Results(run_name, name == "smoke", p, started, info, load0, q1, q2, kills, hang, host,
                push, shape, cpu, stress, memory_rows())
    r.load1, r.wall_s = os.getloadavg(), time.monotonic() - t0
    return r


def default_paths(quick: bool) -> tuple[Path, Path]:
    """Where a run writes its report and plots unless told: a short run never over the
    full run's (committed) files."""
    return (QUICK_DIR / "RESULTS.md", QUICK_DIR / "plots") if quick else (OUT_MD, PLOTS)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer samples, about a minute")
    mode.add_argument("--smoke", action="store_true",
                      help="the least that exercises every part (the test suite runs it); its "
                           "figures mean nothing")
    ap.add_argument("--out", default=None, help="markdown report (default bench/RESULTS.md; "
                    "with --quick or --smoke bench/quick/RESULTS.md)")
    ap.add_argument("--plots", default=None, help="directory for the plots (default bench/plots; "
                    "with --quick or --smoke bench/quick/plots)")
    ap.add_argument("--base-addr", default=None, metavar="ADDR",
                    help="first loopback address of the simulated hosts (default: "
                         "$SHMHB_LOOPBACK_BASE or 127.0.0.2; up to 5 consecutive ones are used)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    set_base(a.base_addr)
    name = "smoke" if a.smoke else "quick" if a.quick else "full"
    out_md, plots_dir = default_paths(name != "full")
    out, plots = Path(a.out or out_md), Path(a.plots or plots_dir)

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    r = run(name, "python -m bench" + ("" if name == "full" else f" --{name}"))
    text, targets = report.write(r, out, plots)
    print(text)
    met = sum(t.met for t in targets)
    log(f"wrote {out} in {r.wall_s:.0f} s; {met}/{len(targets)} targets met")
    if name == "full" and out.resolve() == OUT_MD.resolve():
        from . import headline  # the README's table follows the committed results
        headline.README.write_text(headline.update(headline.README.read_text(), text))
        log(f"regenerated the benchmark table of {headline.README}")
    return 0
