"""No client request fails because its vllm-ascend producer died, stopped or restarted.

The decode engine runs vLLM 0.23's real ``Scheduler`` and KVCacheManager around the wrapped
``MooncakeConnectorV1`` (tests/vllm/scheduled.py), with the deterministic stand-in model
(tests/vllm/model.py): "served with the tokens of an undisturbed run" means the request's KV
was right, loaded or computed locally.  The prefill is the hand-driven producer.  In every
window the request is served right and the decode side's KVCacheManager ends with every
block free and no request left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_vllm_ascend

require_vllm_ascend()

from tests.vllm import model
from tests.vllm.stack import SERVE_TOKENS, EngineProc, no_leak, recovering_decode, served_right

from .conftest import make_stack
from .stack import AscendStack, alive_on, dead_on, prefilled

#: vllm-ascend's producer frees a request's blocks this long after it finished if no
#: consumer said it pulled them (stock: 480 s); short here so a stopped test ends
SHORT_ABORT = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "30"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[AscendStack]:
    yield from make_stack(tmp_path_factory, wrapped=True)


@pytest.fixture(scope="module")
def decode(stack: AscendStack) -> EngineProc:
    return recovering_decode(stack)


def fresh_prefill(stack: AscendStack, engine_id: str | None = None) -> EngineProc:
    p = stack.replace_prefill(engine_id, env=SHORT_ABORT)
    alive_on(stack, p)
    return p


def serve(p: EngineProc, d: EngineProc, seed: int, before: Any = None) -> tuple[str, list[int]]:
    """The proxy's two steps: the prefill computes the prompt's KV and finishes, the
    decode gets the request with the params the prefill returned."""
    prompt = model.prompt_for(seed)
    rid, params, _ = prefilled(p, prompt=prompt)
    if before is not None:
        before()
    d.send("serve", rid=rid, prompt=prompt, max_tokens=SERVE_TOKENS, params=params)
    return rid, prompt


def test_undisturbed_request_is_loaded_and_matches_a_local_run(stack: AscendStack,
                                                               decode: EngineProc) -> None:
    prompt = model.prompt_for(0)
    decode.send("serve", rid="local-0", prompt=prompt, max_tokens=SERVE_TOKENS, params=None)
    served_right(decode, "local-0", prompt)
    p = fresh_prefill(stack)
    rid, prompt = serve(p, decode, 1)
    served_right(decode, rid, prompt)
    p.expect("sent", rid=rid, timeout_s=15)  # pulled: the producer was told
    no_leak(decode)


def test_producer_dead_before_the_request_is_vetoed_and_served(stack: AscendStack,
                                                               decode: EngineProc) -> None:
    p = fresh_prefill(stack)
    rid, prompt = serve(p, decode, 2, before=lambda: (p.kill(), dead_on(stack, p)))
    served_right(decode, rid, prompt)
    assert decode.request("veto_counts", "veto_counts")["data"].get("vetoes.dead", 0) >= 1
    no_leak(decode)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_producer_lost_as_the_request_comes(stack: AscendStack, decode: EngineProc,
                                            how: str) -> None:
    """Lost just before the decode asks its side channel (a new engine: its first
    request asks its metadata): the load is failed and recomputed."""
    p = fresh_prefill(stack)
    t: list[float] = []
    rid, prompt = serve(p, decode, 3, before=lambda: t.append(p.stop() if how == "stop"
                                                             else p.kill()))
    ev = served_right(decode, rid, prompt, timeout_s=30)
    print(f"producer {how} -> request served after {ev['t'] - t[0]:.3f} s")
    assert ev["t"] - t[0] < 5.0
    no_leak(decode)
    if how == "stop":
        p.cont()
        p.kill()


def test_restart_under_the_same_engine_id(stack: AscendStack, decode: EngineProc) -> None:
    p = fresh_prefill(stack)
    rid, prompt = serve(p, decode, 5)
    served_right(decode, rid, prompt)
    p2 = fresh_prefill(stack, p.engine_id)
    rid2, prompt2 = serve(p2, decode, 6)
    served_right(decode, rid2, prompt2)
    p2.expect("sent", rid=rid2, timeout_s=15)  # loaded from the restarted engine
    no_leak(decode)


def test_restart_under_a_new_engine_id(stack: AscendStack, decode: EngineProc) -> None:
    p = fresh_prefill(stack)
    rid, prompt = serve(p, decode, 7)
    served_right(decode, rid, prompt)
    p2 = fresh_prefill(stack)
    rid2, prompt2 = serve(p2, decode, 8)
    served_right(decode, rid2, prompt2)
    p2.expect("sent", rid=rid2, timeout_s=15)
    no_leak(decode)
