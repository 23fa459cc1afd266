"""A short chaos run inside the normal suite.

Several simulated hosts on loopback (and a namespaced pair where the run is root),
each with its own board, pinger, standby pinger and workers; a LinkReaper per host;
faults from a fixed seed for about 45 s, then the system must settle.  Every invariant
of ``tests/chaos/invariants.py`` is checked throughout; the report (printed, shown by
pytest on failure) names each breach with the seed and the events around it.

The long soak is the same harness for longer: see docs/CHAOS.md.
"""

from __future__ import annotations

import pytest

from .chaos import ChaosConfig, run

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

#: its 45 s schedule holds every kind of fault at least once (with 5 hosts: as root)
SEED = 13


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_short_chaos_run_breaks_no_invariant() -> None:
    rep = run(ChaosConfig(seed=SEED, duration_s=45.0, hosts=3, workers=3, settle_s=60.0))
    text = rep.format()
    print(text)
    assert not rep.interrupted
    assert sum(rep.injected.values()) >= 20, text  # it did inject a fair number of faults
    assert rep.ok, text
