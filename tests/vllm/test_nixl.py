"""ShmhbConnector around vLLM's NixlConnector (pull mode), with the real NIXL (UCX over
TCP on loopback, DRAM segments), stock and wrapped pairs side by side in one stack.

What stock does here (measured by these tests): a killed prefill fails the load in a
fraction of a second (the transport sees it), but a prefill restarted under the same
engine id is never served (its dead agent stays cached, every READ fails); a stopped
prefill holds a posted READ until it resumes.  What the wrapper adds: a dead or stopped
prefill is vetoed at the scheduler once the board says so; a load not posted yet (its
handshake pending) is failed within dead-after and nothing is read into its blocks
later; a posted READ (which NIXL cannot call back) is never failed early; the dead
engine's agent is evicted, so a restart under the same id is served at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_nixl

require_nixl()

from tests.conftest import wait_until

from .conftest import make_stack
from .stack import (
    POLICY, EngineProc, Stack, expected_digest, inner_engines, load_with, new_ids, pair,
    prefilled, start_pair, transfer, wait_alive_on_decode_host, zeros_digest,
)

HANG_BOUND_S = POLICY.dead_after_s + 1.0  # SIGSTOP -> failed load (what is not posted)
STILL_WAITING_S = HANG_BOUND_S + 1.0  # "not failed": past the bound


@pytest.fixture(scope="module")
def nixl(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True, inner="nixl")


def _granted(d: EngineProc) -> int:
    """Loads granted since the last look (each look takes the counts)."""
    stats = d.request("stats", "stats")["data"] or {}
    return int(stats.get("shmhb", {}).get("granted_loads", 0))


def test_nixl_a_load_whose_handshake_hangs_fails_within_dead_after_and_reads_nothing_later(
        nixl: Stack) -> None:
    p, d = start_pair(nixl, True, "nx-w")
    wait_alive_on_decode_host(nixl, p)
    rid, _, params = prefilled(p, seed=21)
    t_stop = p.stop()  # before the decode's first request: its handshake waits
    assert load_with(d, p, rid, params) == "loading"
    ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=HANG_BOUND_S + 10)
    assert ev["ev"] == "load_failed" and ev["digest"] == zeros_digest(), ev
    assert ev["t"] - t_stop <= HANG_BOUND_S, f"hang -> failed load took {ev['t'] - t_stop:.3f} s"
    p.cont()
    # The handshake completes now (the failed request is queued behind it): nothing is
    # read for it.  A good transfer after it makes the steps that would have posted it run.
    wait_alive_on_decode_host(nixl, p)
    a, b = transfer(p, d, seed=22)
    assert b["ev"] == "loaded" and a["digest"] == b["digest"] == expected_digest(22)
    assert d.request("digest", "digest", rid=rid)["digest"] == zeros_digest()


def test_nixl_a_posted_read_is_never_failed_early_and_lands_once_resumed(nixl: Stack) -> None:
    p, d = start_pair(nixl, False, "nx-s")  # the stock pair: a healthy transfer first
    a, b = transfer(p, d, seed=7)
    assert b["ev"] == "loaded" and a["digest"] == b["digest"] == expected_digest(7)
    for wrapped in (False, True):
        p, d = pair(nixl, wrapped)
        if wrapped:
            wait_alive_on_decode_host(nixl, p)
        rid, _, params = prefilled(p, seed=23)
        if wrapped:
            _granted(d)  # counts from here on
        p.stop()  # the engine is known: the READ is posted at once, and hangs
        assert load_with(d, p, rid, params) == "loading"
        with pytest.raises(AssertionError, match="no"):
            d.expect("loaded", "load_failed", rid=rid, timeout_s=STILL_WAITING_S)
        if wrapped:
            assert _granted(d) == 1  # the consumer's own go-ahead: held, not failed
            # the board says dead by now: a new request to it is computed locally at once
            assert load_with(d, p, rid + "-next", params) == "vetoed"
        p.cont()
        ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=30)
        assert ev["ev"] == "loaded" and ev["digest"] == expected_digest(23), (wrapped, ev)


def test_nixl_restart_under_the_same_id_is_served_only_wrapped(nixl: Stack) -> None:
    for wrapped in (False, True):
        p, d = pair(nixl, wrapped)
        if wrapped:
            wait_alive_on_decode_host(nixl, p)
        rid, _, params = prefilled(p, seed=24)
        p.kill()
        if wrapped:
            # dead on the board: vetoed (computed locally), and the agent evicted
            wait_until(lambda: load_with(d, p, new_ids()[0], params) == "vetoed", timeout_s=10,
                       what="a request to the killed prefill vetoed")
            wait_until(lambda: p.engine_id not in inner_engines(d), timeout_s=10,
                       what="the dead engine's agent evicted")
        else:
            assert load_with(d, p, rid, params) == "loading"
            ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=30)
            assert ev["ev"] == "load_failed"  # fast: the transport sees the peer gone
            assert p.engine_id in inner_engines(d)  # and the dead agent stays cached
        p2 = nixl.start("prefill", p.engine_id, wrapped=wrapped,
                        bootstrap_port=int(p.bootstrap.rsplit(":", 1)[1]))
        if wrapped:
            wait_alive_on_decode_host(nixl, p2)
        a, b = transfer(p2, d, seed=25)
        if wrapped:
            assert b["ev"] == "loaded" and a["digest"] == b["digest"] == expected_digest(25)
        else:  # stock reads from the dead process's agent: the restarted one is not served
            assert b["ev"] == "load_failed", b
