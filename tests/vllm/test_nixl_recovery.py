"""No client request fails because its NIXL producer died or restarted.

The decode engine runs vLLM's real ``Scheduler`` and KVCacheManager with the wrapped
``NixlConnector`` (tests/vllm/scheduled.py), the prefill is the hand-driven producer of
tests/vllm/engine.py, and the proxy's part is played by the test: the producer's own
transfer params (NIXL's, from its ``request_finished``) go with the request.  The
stand-in model makes "served with the tokens of an undisturbed run" mean "its KV was
right", whether loaded over NIXL or computed locally; every test ends with every decode
block free and no request left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_nixl

require_nixl()

from shmhb import Status
from tests.conftest import wait_until

from . import model
from .conftest import make_stack
from .stack import (
    POLICY, SERVE_TOKENS, EngineProc, Stack, bootstrap_ep, new_ids, no_leak, recovering_decode,
    served_right,
    wait_alive_on_decode_host,
)

TOKENS = SERVE_TOKENS


@pytest.fixture(scope="module")
def nixl(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True, inner="nixl")


@pytest.fixture(scope="module")
def decode(nixl: Stack) -> EngineProc:
    return recovering_decode(nixl)


def _prefill(stack: Stack, engine_id: str | None = None) -> EngineProc:
    """A prefill on the stack's one side-channel address, its predecessor killed first."""
    p = stack.replace_prefill(engine_id)
    wait_alive_on_decode_host(stack, p)
    return p


def _prefilled(p: EngineProc, seed: int) -> tuple[str, list[int], dict[str, Any]]:
    """A prompt computed and finished on ``p``: its rid, the prompt, the params a proxy
    hands the decode side (the producer's own, marked for a remote prefill)."""
    rid, xid = new_ids(f"n{seed}")
    prompt = model.prompt_for(seed)
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, prompt=prompt)
    p.send("finish", rid=rid)
    params = p.expect("finished", rid=rid)["params"]
    return rid, prompt, {**params, "do_remote_prefill": True, "do_remote_decode": False}


def _serve(d: EngineProc, rid: str, prompt: list[int], params: dict[str, Any] | None) -> None:
    d.send("serve", rid=rid, prompt=prompt, max_tokens=TOKENS, params=params)


def _counts(d: EngineProc) -> dict[str, int]:
    return dict(d.request("sched_stats", "sched_stats")["data"])


def test_nixl_undisturbed_request_is_loaded_and_matches_a_local_run(
        nixl: Stack, decode: EngineProc) -> None:
    local = model.prompt_for(40)
    _serve(decode, "nixl-local", local, None)
    served_right(decode, "nixl-local", local)
    p = _prefill(nixl)
    rid, prompt, params = _prefilled(p, 41)
    _counts(decode)
    _serve(decode, rid, prompt, params)
    served_right(decode, rid, prompt)
    p.expect("sent", rid=rid, timeout_s=15)  # the decode read its blocks over NIXL
    assert not _counts(decode).get("vetoes.dead"), "loaded, not vetoed"
    no_leak(decode)


def test_nixl_producer_dead_before_the_request_is_vetoed_and_served(
        nixl: Stack, decode: EngineProc) -> None:
    p = _prefill(nixl)
    rid, prompt, params = _prefilled(p, 42)
    p.kill()
    wait_until(lambda: (s := nixl.decode_host.board.remote(bootstrap_ep(p))) is not None
               and s.status is Status.DEAD, timeout_s=10, what="the producer DEAD on the decode host")
    _serve(decode, rid, prompt, params)
    served_right(decode, rid, prompt)
    assert _counts(decode).get("vetoes.dead", 0) >= 1
    no_leak(decode)


def test_nixl_producer_killed_before_the_board_knows_is_served_locally(
        nixl: Stack, decode: EngineProc) -> None:
    """The producer killed just before the request, inside dead-after: the scheduler
    cannot veto yet, the READ is posted (the engine is known: no handshake) and fails
    (the transport sees the peer gone), and vLLM's recovery policy, which the wrapper
    set, computes the request locally.  Stock fails it (the control below)."""
    p = _prefill(nixl)
    warm, wprompt, wparams = _prefilled(p, 43)  # the handshake, so the next READ posts at once
    _serve(decode, warm, wprompt, wparams)
    served_right(decode, warm, wprompt)
    rid, prompt, params = _prefilled(p, 44)
    t0 = p.kill()
    _serve(decode, rid, prompt, params)
    ev = served_right(decode, rid, prompt, timeout_s=60)
    print(f"killed just before the request: served {ev['t'] - t0:.3f} s after the kill")
    assert ev["t"] - t0 < POLICY.dead_after_s + 5, "served by a timeout, not by the recovery"
    no_leak(decode)


def test_nixl_restart_under_the_same_engine_id_is_served_by_the_new_engine(
        nixl: Stack, decode: EngineProc) -> None:
    p = _prefill(nixl, "nixl-same")
    rid, prompt, params = _prefilled(p, 45)
    _serve(decode, rid, prompt, params)
    served_right(decode, rid, prompt)
    p2 = _prefill(nixl, "nixl-same")  # kills p; the same engine id, a new agent
    rid, prompt, params = _prefilled(p2, 46)
    _counts(decode)
    _serve(decode, rid, prompt, params)
    served_right(decode, rid, prompt)
    p2.expect("sent", rid=rid, timeout_s=15)  # the new engine's blocks were read
    assert not _counts(decode).get("vetoes.dead"), "loaded from the new engine, not vetoed"
    no_leak(decode)


@pytest.fixture(scope="module")
def stock(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=False, inner="nixl")


def test_nixl_stock_fails_the_request_whose_producer_was_killed_just_before(
        stock: Stack) -> None:
    """The control: the same kill, stock NixlConnector and vLLM's default policy
    ("fail"): the client gets an error.  (The wrapper sets "recompute" where the
    deployment left the default: docs/VLLM.md, "No request fails".)"""
    d = stock.start("decode", scheduler=True)
    assert d.request("blocks", "blocks")["policy"] == "fail"
    p = stock.start("prefill", "nixl-stock")
    warm, wprompt, wparams = _prefilled(p, 47)
    _serve(d, warm, wprompt, wparams)
    served_right(d, warm, wprompt)
    rid, prompt, params = _prefilled(p, 48)
    p.kill()
    _serve(d, rid, prompt, params)
    ev = d.expect("served", rid=rid, timeout_s=60)
    print(f"stock: {ev['finish_reason']}, right tokens: {ev['tokens'] == model.generate(prompt, TOKENS)}")
    assert ev["finish_reason"] == "error", ev
