"""``python -m tests.chaos --seed N --duration-s S [--hosts 3] [--workers 4]``: one chaos
run, its report on stdout; exit status 0 only if no invariant was breached and nothing
leaked.  See docs/CHAOS.md."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .harness import ChaosConfig, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    p.add_argument("--duration-s", type=float, default=60.0,
                   help="how long to inject faults (settling and setup come on top)")
    p.add_argument("--hosts", type=int, default=3, help="loopback hosts (2..7, default 3)")
    p.add_argument("--workers", type=int, default=4, help="workers per host (default 4)")
    p.add_argument("--no-partition", action="store_true",
                   help="no namespaced pair of hosts (and no partition faults)")
    p.add_argument("--slack-s", type=float, default=2.0,
                   help="added to every time bound, for a loaded machine (default 2)")
    p.add_argument("--mean-gap-s", type=float, default=1.0,
                   help="mean pause between two faults (default 1)")
    p.add_argument("--kinds", default=None,
                   help="comma-separated fault kinds to inject (default: all)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep the process logs even on a pass")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    if not 2 <= a.hosts <= 7:
        p.error("--hosts must be 2..7")
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    cfg = ChaosConfig(seed=a.seed, duration_s=a.duration_s, hosts=a.hosts, workers=a.workers,
                      partition=False if a.no_partition else None, slack_s=a.slack_s,
                      mean_gap_s=a.mean_gap_s,
                      kinds=tuple(a.kinds.split(",")) if a.kinds else None,
                      progress=None if a.quiet else progress, keep_tmp=a.keep_logs)
    rep = run(cfg)
    print(rep.format())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep.to_json(), f, indent=2, default=str)
    return 0 if rep.ok else (130 if rep.interrupted else 1)


if __name__ == "__main__":
    sys.exit(main())
