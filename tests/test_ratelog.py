"""RateLimitedLog, the one rate-limited log: timed by the clock it is given, at the level
asked for, each kind on its own."""

from __future__ import annotations

import logging

import pytest

from shmhb.clock import FakeClock
from shmhb.ratelog import RateLimitedLog



def test_it_is_timed_by_the_injected_clock_and_counts_what_it_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logging.getLogger("shmhb.test_ratelog"), 10.0, now_ns=clock.monotonic_ns)
    with caplog.at_level(logging.WARNING, logger="shmhb.test_ratelog"):
        rl.warn("a", "first %d", 1)
        rl.warn("a", "held back %d", 2)
        rl.warn("b", "another kind %d", 3)  # its own interval
        clock.advance(9.9)
        rl.warn("a", "still held back %d", 4)
        clock.advance(0.1)  # 10 s on the injected clock, whatever the host's says
        rl.warn("a", "again %d", 5)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["first 1 [logged at most every 10 s]",
                    "another kind 3 [logged at most every 10 s]",
                    "again 5 (2 more since the last report) [logged at most every 10 s]"], msgs
    assert {r.levelno for r in caplog.records} == {logging.WARNING}


def test_error_logs_at_error_level_within_the_same_limit(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logging.getLogger("shmhb.test_ratelog"), 1.0, now_ns=clock.monotonic_ns)
    with caplog.at_level(logging.WARNING, logger="shmhb.test_ratelog"):
        rl.error("down", "degraded: %s", "x")
        rl.error("down", "degraded: %s", "y")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "degraded: x [logged at most every 1 s]")]
