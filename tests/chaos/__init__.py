"""A chaos harness for shmhb: simulated hosts on loopback, a seeded schedule of faults,
and invariants checked continuously against the ground truth of what was injected.

Run it standalone (``python -m tests.chaos --seed 7 --duration-s 600``) or through
``tests/test_chaos.py`` (a short run inside the normal suite).  See docs/CHAOS.md.
"""

from .harness import ChaosConfig, Report, run

__all__ = ["ChaosConfig", "Report", "run"]
