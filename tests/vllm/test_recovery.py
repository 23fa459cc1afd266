"""No client request fails because its producer died, hung or restarted.

The decode engine runs vLLM's real ``Scheduler`` and KVCacheManager, with the worker
connector inside vLLM's own model-runner connector context (tests/vllm/scheduled.py),
and the deterministic stand-in model (tests/vllm/model.py): a request's output tokens
are a digest of its whole KV, so "served with the tokens of an undisturbed run" means
its KV was right, whether it was loaded or computed locally.  The prefill engine is the
hand-driven producer of tests/vllm/engine.py, so each window can be hit on purpose:

* before the scheduler sees the request (the producer is already dead);
* while the bootstrap query is in flight (the producer stopped or killed then);
* while the transfer request waits at the producer (read, not yet written);
* after the go-ahead, in the middle of the write (half the descriptors written);
* restarts under the same engine id and under a new one.

In every window the request finishes with the output of an undisturbed run, and the
decode side's KVCacheManager ends with every block free and no request left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_vllm

require_vllm()

from shmhb import Status
from tests.conftest import wait_until

from . import model
from .conftest import make_stack
from .stack import (
    POLICY, SERVE_TOKENS, EngineProc, Stack, new_ids, no_leak, recovering_decode, remote_params,
    served_right,
)
from .stack import submit as stack_submit

TOKENS = SERVE_TOKENS
#: the decode side's Mooncake receive timeout: (this + 60) s = 10 s (stock: 480 + 60 =
#: 540 s), so the one window the wrapper leaves open shows in 10 s.  Everything the
#: wrapper recovers is served well before it (asserted where a stop is involved).
INNER_TIMEOUT_S = 10.0
SHORT_ABORT = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(int(INNER_TIMEOUT_S) - 60)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True)


@pytest.fixture(scope="module")
def decode(stack: Stack) -> EngineProc:
    return recovering_decode(stack, env=SHORT_ABORT)


def submit(p: EngineProc, d: EngineProc, seed: int, *, finish: bool = True
           ) -> tuple[str, str, list[int]]:
    return stack_submit(p, d, seed, TOKENS, finish=finish)


def alive_here(stack: Stack, p: EngineProc) -> None:
    ep = p.bootstrap.split("://", 1)[1]
    stack.decode_host.board.watch(ep)
    wait_until(lambda: (s := stack.decode_host.board.remote(ep)) is not None
               and s.status is Status.ALIVE and p.engine_id in s.key,
               timeout_s=20, what=f"{p.engine_id} alive on the decode host")


def fresh_prefill(stack: Stack, engine_id: str | None = None) -> EngineProc:
    """A prefill engine on the one bootstrap address, its predecessor killed first."""
    return stack.replace_prefill(engine_id)


def loaded(p: EngineProc, rid: str) -> None:
    """The prefill sent this request's blocks: the decode loaded them."""
    p.expect("sent", rid=rid, timeout_s=15)


def test_undisturbed_request_is_loaded_and_matches_a_local_run(stack: Stack, decode: EngineProc) -> None:
    prompt = model.prompt_for(0)
    decode.send("serve", rid="local-0", prompt=prompt, max_tokens=TOKENS, params=None)
    served_right(decode, "local-0", prompt)
    p = fresh_prefill(stack)
    alive_here(stack, p)
    rid, _, prompt = submit(p, decode, 1)
    served_right(decode, rid, prompt)
    loaded(p, rid)
    no_leak(decode)


def test_producer_dead_before_the_request_is_vetoed_and_served(stack: Stack, decode: EngineProc) -> None:
    p = fresh_prefill(stack)
    alive_here(stack, p)
    rid, xid = new_ids("pre")
    prompt = model.prompt_for(2)
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, prompt=prompt)
    p.kill()
    wait_until(lambda: stack.decode_host.board.remote(p.bootstrap.split("://")[1]).status
               is Status.DEAD, timeout_s=5, what="the producer DEAD on the decode host")
    decode.send("serve", rid=rid, prompt=prompt, max_tokens=TOKENS, params=remote_params(p, xid))
    served_right(decode, rid, prompt)
    assert decode.request("sched_stats", "sched_stats")["data"].get("vetoes.dead", 0) >= 1
    no_leak(decode)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_producer_lost_during_the_bootstrap_query(stack: Stack, decode: EngineProc, how: str) -> None:
    p = fresh_prefill(stack)  # a new engine: its first request asks its bootstrap server
    alive_here(stack, p)
    rid, xid = new_ids(f"boot-{how}")
    prompt = model.prompt_for(3)
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, prompt=prompt)
    if how == "stop":
        t0 = p.stop()  # its bootstrap server answers nothing now
    decode.send("serve", rid=rid, prompt=prompt, max_tokens=TOKENS, params=remote_params(p, xid))
    if how == "kill":
        t0 = p.kill()
    ev = served_right(decode, rid, prompt)
    print(f"producer {how} -> request served after {ev['t'] - t0:.3f} s")
    assert ev["t"] - t0 < INNER_TIMEOUT_S, "served by the inner timeout, not by the wrapper's fence"
    if how == "stop":
        p.cont()
        p.kill()
    no_leak(decode)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_producer_lost_while_the_transfer_request_waits(stack: Stack, decode: EngineProc, how: str) -> None:
    p = fresh_prefill(stack)
    alive_here(stack, p)
    rid, xid, prompt = submit(p, decode, 4, finish=False)
    p.expect_asked(xid)
    t0 = p.stop() if how == "stop" else p.kill()
    ev = served_right(decode, rid, prompt, timeout_s=POLICY.dead_after_s + 20)
    print(f"producer {how} with the request waiting -> served after {ev['t'] - t0:.3f} s")
    assert ev["t"] - t0 < INNER_TIMEOUT_S, "served by the inner timeout, not by the wrapper's fence"
    if how == "stop":
        p.cont()
        p.send("finish", rid=rid)
        p.expect("sent", rid=rid, timeout_s=15)  # resumed: refused the write, freed its blocks
        p.kill()
    no_leak(decode)


def test_restart_under_the_same_engine_id_mid_flight(stack: Stack, decode: EngineProc) -> None:
    p = fresh_prefill(stack)
    alive_here(stack, p)
    rid, xid, prompt = submit(p, decode, 5, finish=False)
    p.expect_asked(xid)
    p.kill()
    p2 = stack.start("prefill", p.engine_id)
    served_right(decode, rid, prompt)
    alive_here(stack, p2)
    rid2, _, prompt2 = submit(p2, decode, 6)
    served_right(decode, rid2, prompt2)
    loaded(p2, rid2)  # the restarted engine served the next request
    no_leak(decode)
    p2.kill()


def test_restart_under_a_new_engine_id_is_served_not_vetoed(stack: Stack, decode: EngineProc) -> None:
    """vLLM's default: a new uuid per process.  The decode host may still show only the
    dead predecessor at the bootstrap address when the first request for the new engine
    comes; that slot says nothing about the new engine, so the request is loaded."""
    p = fresh_prefill(stack)
    alive_here(stack, p)
    rid, _, prompt = submit(p, decode, 7)
    served_right(decode, rid, prompt)
    loaded(p, rid)
    decode.request("sched_stats", "sched_stats")  # reset the counts
    p.kill()
    p2 = stack.start("prefill")  # its registration happened just now
    rid2, _, prompt2 = submit(p2, decode, 8)  # at once: no wait for it on the decode host
    served_right(decode, rid2, prompt2)
    loaded(p2, rid2)
    counts = decode.request("sched_stats", "sched_stats")["data"]
    assert not any(k.startswith("vetoes.") for k in counts), counts
    no_leak(decode)
    p2.kill()


def test_producer_killed_in_the_middle_of_a_granted_write(stack: Stack, decode: EngineProc) -> None:
    """The one window the wrapper leaves to the inner connector: the go-ahead was given
    and half the write landed when the producer died.  The blocks stay out of vLLM's
    hands until Mooncake's own receive timeout (here 10 s; stock 540 s), then vLLM
    recomputes them: the request is served right, late."""
    d = decode
    p = fresh_prefill(stack)
    alive_here(stack, p)
    p.request("hold_writes", "holding")
    rid, _, prompt = submit(p, d, 9)
    half = p.expect("half_written", timeout_s=30)
    assert half["ret"] == 0 and 0 < half["written"] < half["bytes"], half
    t0 = p.kill()
    ev = served_right(d, rid, prompt, timeout_s=60)
    print(f"killed mid-write -> served after {ev['t'] - t0:.3f} s (the inner receive timeout)")
    assert ev["t"] - t0 >= INNER_TIMEOUT_S - 0.5, "failed before the inner timeout: the fence was not kept"
    no_leak(d)


def test_on_dead_peer_fail_keeps_vllms_policy(stack: Stack) -> None:
    d = stack.start("decode", scheduler=True, on_dead_peer="fail")
    blocks = d.request("blocks", "blocks")
    assert blocks["policy"] == "fail" and not blocks["recompute"], blocks
    p = fresh_prefill(stack)
    alive_here(stack, p)
    rid, xid, prompt = submit(p, d, 10, finish=False)
    p.expect_asked(xid)
    p.kill()
    ev = d.expect("served", rid=rid, timeout_s=30)
    assert ev["finish_reason"] == "error", ev  # failed fast, as asked: no recompute
    no_leak(d)
    d.close()
