"""A stopped daemon holder, as the other hosts see it: ``python -m bench.stopped_holder``.

Host B runs ``shmhb pinger`` and three workers (their embedded agents stand by); host A
follows B's workers.  B's daemon is SIGSTOPped for ``--stop-s`` (20 by default, a frozen
container or a debugger) while the workers run on; A's view of B and of each worker is
sampled every 5 ms.  Each run prints when A first read B not alive (suspect), whether and
when it read anything DEAD, and when it read B and every worker alive again, seconds
from the stop.  The policy is the default for remote hosts and for the agent (peer
dead-after 5 s, stall bound 3 s): the new holder takes the role 4 s into the stop.

Run from the repository root (it uses the test suite's simulated hosts on 127.0.0.2-3).
"""

from __future__ import annotations

import argparse
import tempfile

from tests.agent.stopped_holder import start_b, watch_through_stop
from tests.conftest import Procs
from tests.hosts import Cluster


def one_run(stop_s: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs()
        cluster = Cluster(tmp, procs)
        try:
            a, b, daemon = start_b(cluster)
            tl = watch_through_stop(a, b, daemon, stop_s)
        finally:
            procs.cleanup()
            cluster.close()

    def at(s: float | None) -> str:
        return "never" if s is None else f"{s:.2f} s"

    return (f"suspect at {at(tl.first_not_alive_s)}, DEAD at {at(tl.first_dead_s)}, "
            f"alive again at {at(tl.alive_again_s)}  [{tl}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stop-s", type=float, default=20.0, help="how long the daemon is stopped")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for n in range(args.runs):
        print(f"run {n + 1}: daemon stopped {args.stop_s:g} s: {one_run(args.stop_s)}", flush=True)


if __name__ == "__main__":
    main()
