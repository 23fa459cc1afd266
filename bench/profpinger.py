"""``python -m bench.profpinger OUT.prof pinger ARGS...``: ``shmhb pinger`` with its
agent thread (where the network half runs) under cProfile; the profile is written to
OUT.prof when the agent stops (SIGTERM).  ``bench.harness.start_pinger`` uses it when
``SHMHB_BENCH_PROFILE`` names a folder.  Call counts do not depend on machine load:
compare them, not times, between runs on a shared machine."""

from __future__ import annotations

import cProfile
import sys

from shmhb.cli import main as cli
from shmhb.agent import role as agent


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    run = agent.Agent.run

    def profiled(self: agent.Agent) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()
            prof.dump_stats(out)

    agent.Agent.run = profiled  # type: ignore[method-assign]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
