"""A wrapped engine's drain on SIGTERM (shmhb.board.drain, shmhb.vllm.owed), with the real
connector: the instance reads draining at once, a prefill serves the KV its decode has
not read yet, a decode finishes what it runs, then vLLM's own SIGTERM handling ends the
engine; bounded by drain_timeout_s."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_vllm

require_vllm()

from tests.conftest import wait_until  # noqa: E402

from shmhb import Status  # noqa: E402
from shmhb.board.instances import board_instances  # noqa: E402

from .conftest import make_stack  # noqa: E402
from .stack import EngineProc, Stack, expected_digest, new_ids, wait_alive_on_decode_host  # noqa: E402

DRAIN_S = 6.0  # drain_timeout_s of these engines


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True,
                          env={"SHMHB_VLLM_DRAIN_TIMEOUT_S": str(DRAIN_S)})


def instance_of(stack: Stack, p: EngineProc) -> Any:
    got = [i for i in board_instances(stack.prefill_host.board, remote=False)
           if i.engine == p.engine_id]
    return got[0] if got else None


def exits_within(e: EngineProc, timeout_s: float) -> int:
    e.p.wait(timeout_s)
    return e.p.returncode


def test_a_prefill_sigtermed_with_kv_unread_serves_it_then_stops(stack: Stack) -> None:
    p, d = stack.replace_prefill(), stack.start("decode")
    wait_alive_on_decode_host(stack, p)
    rid, xid = new_ids("drain")
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=11)
    fin = p.request("finish", "finished", rid=rid)
    assert fin["delay_free"]  # its blocks wait for the decode's read: owed
    p.p.send_signal(signal.SIGTERM)
    wait_until(lambda: (i := instance_of(stack, p)) is not None and i.draining, timeout_s=5,
               what="the prefill's instance read draining")
    assert instance_of(stack, p).status is Status.ALIVE  # draining is no death verdict
    time.sleep(0.5)  # a window: a drain that did not wait would have ended the process
    assert p.p.poll() is None, "the prefill stopped with KV its decode had not read"
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    got = d.expect("loaded", "load_failed", rid=rid, timeout_s=30)
    assert got["ev"] == "loaded" and got["digest"] == expected_digest(11)
    bye = p.expect("bye", timeout_s=10)  # vLLM's own SIGTERM handling ran (the stand-in's)
    took = bye["t"] - got["t"]
    assert took < DRAIN_S / 2, f"the drained prefill stopped {took:.1f} s after the read"
    assert exits_within(p, 20) == 0, p.log_tail()
    wait_until(lambda: instance_of(stack, p) is None
               or instance_of(stack, p).status is Status.LEFT, timeout_s=5,
               what="the drained prefill's instance reads LEFT")


def test_a_decode_sigtermed_finishes_what_it_runs(stack: Stack) -> None:
    p, d = stack.replace_prefill(), stack.start("decode")
    wait_alive_on_decode_host(stack, p)
    rid, xid = new_ids("run")
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=12)
    p.request("finish", "finished", rid=rid)
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    assert d.expect("loaded", "load_failed", rid=rid, timeout_s=30)["ev"] == "loaded"
    t0 = time.monotonic()
    d.p.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # a window: a drain that did not wait would have ended the process
    assert d.p.poll() is None, "the decode stopped in the middle of a request it ran"
    d.request("finish", "finished", rid=rid)  # its last token
    bye = d.expect("bye", timeout_s=10)
    assert bye["t"] - t0 < DRAIN_S, "the decode waited for its drain's timeout"
    assert exits_within(d, 20) == 0, d.log_tail()


def test_a_drain_ends_at_its_timeout_and_a_second_sigterm_ends_it_at_once(stack: Stack) -> None:
    p = stack.replace_prefill()
    rid, xid = new_ids("never")
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=13)
    p.request("finish", "finished", rid=rid)  # owed to a decode that never reads it
    t0 = time.monotonic()
    p.p.send_signal(signal.SIGTERM)
    took = p.expect("bye", timeout_s=DRAIN_S + 10)["t"] - t0
    assert DRAIN_S - 0.5 <= took <= DRAIN_S + 2, f"stopped {took:.1f} s after SIGTERM"
    assert exits_within(p, 20) == 0, p.log_tail()

    p2 = stack.replace_prefill()
    rid, xid = new_ids("again")
    p2.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=14)
    p2.request("finish", "finished", rid=rid)
    p2.p.send_signal(signal.SIGTERM)
    wait_until(lambda: (i := instance_of(stack, p2)) is not None and i.draining, timeout_s=5,
               what="the second prefill draining")
    t1 = time.monotonic()
    p2.p.send_signal(signal.SIGTERM)
    assert p2.expect("bye", timeout_s=5)["t"] - t1 < DRAIN_S / 2
    assert exits_within(p2, 20) == 0, p2.log_tail()
