"""ShmhbConnector around vLLM 0.32's and 0.33's MooncakeConnector, real transfers: a dead, hung or
restarted peer fails fast, the restarted engine serves the very next request, no dead
engine is left in the inner connector's caches, and no byte lands in the
consumer's blocks after their load was reported failed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from .conftest import require_vllm

require_vllm()

from tests.conftest import wait_until

from .conftest import make_stack
from .engine import BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS, NUM_KV_HEADS
from .stack import (
    DECODE_IP, POLICY, PREFILL_IP, EngineProc, Stack, bootstrap_ep, expected_digest, inner_engines,
    live, new_ids, transfer, wait_alive_on_decode_host, zeros_digest,
)

KILL_BOUND_S = 1.0  # kill -> failed load
HANG_BOUND_S = POLICY.dead_after_s + 1.0  # SIGSTOP -> failed load


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True)


def test_wrapped_healthy_moves_the_same_bytes(wrapped: Stack) -> None:
    p, d = wrapped.start("prefill", "w-prefill"), wrapped.start("decode")
    wait_alive_on_decode_host(wrapped, p)
    a, b = transfer(p, d, seed=7)
    assert b["ev"] == "loaded"
    assert a["digest"] == b["digest"] == expected_digest(7)  # what stock moves, byte for byte


def test_kill_fails_fast_then_restart_same_id_serves_next(wrapped: Stack) -> None:
    p, d = live(wrapped, "prefill"), live(wrapped, "decode")
    rid, xid = new_ids()
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid)
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    d.expect("loading", rid=rid)
    p.expect_asked(xid)
    t_kill = p.kill()
    ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=30)
    assert ev["ev"] == "load_failed"
    assert ev["t"] - t_kill <= KILL_BOUND_S, f"kill -> failed load took {ev['t'] - t_kill:.3f} s"
    assert ev["digest"] == zeros_digest()
    # The next request to the dead engine is computed locally, not loaded.
    rid2, xid2 = new_ids()
    d.send("load", rid=rid2, transfer_id=xid2, engine_id=p.engine_id, bootstrap=p.bootstrap)
    d.expect("vetoed", rid=rid2)
    wait_until(lambda: p.engine_id not in inner_engines(d), timeout_s=5,
               what="the dead engine evicted from the inner connector")
    # Restart under the same engine id: the very next request is served by it.
    p2 = wrapped.start("prefill", p.engine_id)
    wait_alive_on_decode_host(wrapped, p2)
    a, b = transfer(p2, d, seed=8)
    assert b["ev"] == "loaded" and b["digest"] == a["digest"] == expected_digest(8)


@pytest.mark.parametrize("placement", ["after", "before", "during"])
def test_sigstop_prefill_fails_within_dead_after_and_never_writes_later(
        wrapped: Stack, placement: str) -> None:
    p, d = live(wrapped, "prefill"), live(wrapped, "decode")
    for rep in range(3):
        wait_alive_on_decode_host(wrapped, p)
        rid, xid = new_ids(f"{placement}{rep}")
        seed = 100 + rep
        p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=seed)
        d.request("stats", "stats")  # counts from here on
        if placement == "before":
            t_stop = p.stop()
            d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
        else:
            d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
            d.expect("loading", rid=rid)
            p.expect_asked(xid)
            if placement == "during":
                p.send("finish", rid=rid)  # the write starts as soon as this is read
            t_stop = p.stop()
        try:
            ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=HANG_BOUND_S + 10)
        except AssertionError:
            # The stop landed inside a granted write: the one window the fence leaves
            # to the inner connector (a granted load is never failed early).  Only
            # "during" can land there, and only a granted load may wait: once the
            # producer resumes, its write completes, and the bytes are the right ones.
            stats = d.request("stats", "stats")["data"]
            assert placement == "during" and stats is not None \
                and stats["shmhb"].get("granted_loads", 0) >= 1, stats
            p.cont()
            ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=30)
            assert ev["ev"] == "loaded" and ev["digest"] == expected_digest(seed), ev
            continue
        if ev["ev"] == "loaded":  # the write finished before the stop: a good transfer
            assert placement == "during" and ev["digest"] == expected_digest(seed)
            p.cont()
            continue
        assert ev["t"] - t_stop <= HANG_BOUND_S, f"hang -> failed load took {ev['t'] - t_stop:.3f} s"
        assert ev["digest"] == zeros_digest()
        p.cont()
        if placement != "during":
            p.send("finish", rid=rid)
        if placement == "after":
            # It resumed holding the request: it frees the blocks at once, never writes.
            p.expect("sent", rid=rid, timeout_s=15)
        # (Stopped before it read the request, it never gets it: the consumer withdrew
        # it with the fence.  Its blocks then wait for the stock abort timeout.)
        # A good transfer on the same pair afterwards: whatever the resumed producer
        # still had to do is done by then, and not one byte of it is in our blocks.
        wait_alive_on_decode_host(wrapped, p)
        _, b = transfer(p, d, seed=seed + 50)
        assert b["ev"] == "loaded" and b["digest"] == expected_digest(seed + 50)
        assert d.request("digest", "digest", rid=rid)["digest"] == zeros_digest()


def test_restart_new_engine_id_leaves_no_dead_entry(wrapped: Stack) -> None:
    d = live(wrapped, "decode")
    old = live(wrapped, "prefill")
    old.kill()
    p3 = wrapped.start("prefill")
    wait_alive_on_decode_host(wrapped, p3)
    _, b = transfer(p3, d, seed=9)
    assert b["ev"] == "loaded" and b["digest"] == expected_digest(9)
    dead = {e.engine_id for e in wrapped.engines if e.role == "prefill"} - {p3.engine_id}
    wait_until(lambda: not (dead & inner_engines(d)), timeout_s=10,
               what=f"dead engines {dead} evicted from the inner connector")


def test_decode_killed_during_send_freed_at_once_restarted_decode_untouched(wrapped: Stack) -> None:
    p, d = live(wrapped, "prefill"), live(wrapped, "decode")
    rid, xid = new_ids()
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=11)
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    d.expect("loading", rid=rid)
    p.expect_asked(xid)
    d.kill()
    d2 = wrapped.start("decode")  # a new incarnation on the same host, maybe the same ports
    p.send("finish", rid=rid)
    p.expect("sent", rid=rid, timeout_s=10)  # freed at once, not after the 480 s abort timeout
    assert xid not in p.request("inner", "inner")["reqs_need_send"]
    zeros = np.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), np.float32)
    assert d2.request("digest_all", "digest_all")["digest"] == \
        hashlib.sha256(zeros.tobytes()).hexdigest()[:16]
    stats = p.request("stats", "stats")["data"]
    assert stats is not None and stats["shmhb"].get("denied_writes", 0) >= 1, stats


#: the consumer's lease in the test below, and its inner connector's give-up: Mooncake's
#: request socket times out after VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s (540 s by
#: default), so -57 makes it 3 s
LEASE_S = 5.0
INNER_GIVE_UP_S = 3.0


def test_a_producer_stopped_between_its_grant_and_its_write_never_writes_after_the_failure(
        wrapped: Stack) -> None:
    """The producer is granted the write (asked as it read the request), then stopped
    right before the write, past its consumer's inner give-up.  The consumer reports the
    load failed only once the grant's lease has run out (vLLM then reuses the blocks),
    and the producer, resumed, finds the lease over and does not write: the blocks stay
    all zeros.  Before, the consumer reported the failure at its give-up and the resumed
    producer, still holding "granted", wrote into blocks handed back to vLLM."""
    port = wrapped.new_port([PREFILL_IP, DECODE_IP])
    p = wrapped.start("prefill", wrapped=True, bootstrap_port=port)
    d = wrapped.start("decode", wrapped=True, bootstrap_port=port, env={
        "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(int(INNER_GIVE_UP_S) - 60),
        "SHMHB_VLLM_GRANT_LEASE_S": str(LEASE_S)})
    wait_alive_on_decode_host(wrapped, p)
    _, b = transfer(p, d, seed=300)  # the pair works (and the connections are made)
    assert b["ev"] == "loaded" and b["digest"] == expected_digest(300)
    rid, xid = new_ids("stopped")
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=301)
    p.send("finish", rid=rid)
    p.expect("finished", rid=rid)
    p.request("stop_before_write", "will_stop")
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    t_loading = d.expect("loading", rid=rid)["t"]
    p.expect("stopping_before_write", timeout_s=30)
    try:
        ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=LEASE_S + 30)
        assert ev["ev"] == "load_failed", ev
        # not at the inner's give-up (3 s), but once the lease ran out (5 s after the
        # ask was read, which came after "loading")
        assert ev["t"] - t_loading >= LEASE_S - 0.05, ev["t"] - t_loading
    finally:
        p.cont()
    assert p.expect("wrote_after_stop", timeout_s=30)["ret"] != 0  # not written
    wait_alive_on_decode_host(wrapped, p)
    _, b = transfer(p, d, seed=302)
    assert b["ev"] == "loaded" and b["digest"] == expected_digest(302)
    assert d.request("digest", "digest", rid=rid)["digest"] == zeros_digest()
    expired = p.request("stats", "stats")["data"]
    assert expired is not None and expired["shmhb"].get("expired_grants", 0) == 1, expired
    held = d.request("stats", "stats")["data"]
    assert held is not None and held["shmhb"].get("held_failures", 0) == 1, held
