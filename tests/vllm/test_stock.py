"""Stock vLLM 0.32 MooncakeConnector, as the user has it today: what goes wrong after a
peer dies or restarts.  Only what shows within seconds is asserted here (the 540 s
timeout itself is measured by ``python -m bench.vllm``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_vllm

require_vllm()

from .conftest import make_stack
from .stack import Stack, expected_digest, new_ids, transfer

#: how long "still waiting" is checked: well past what the wrapped connector needs
#: (dead-after + 1 s), far below stock's timeout
STILL_WAITING_S = 5.0


@pytest.fixture(scope="module")
def stock(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=False)


def test_stock_healthy_transfer(stock: Stack) -> None:
    p, d = stock.start("prefill", "stock-p"), stock.start("decode")
    a, b = transfer(p, d, seed=7)
    assert b["ev"] == "loaded" and a["digest"] == b["digest"] == expected_digest(7)


def test_stock_kill_prefill_then_restart_same_id(stock: Stack) -> None:
    p = next(e for e in stock.engines if e.role == "prefill" and e.p.poll() is None)
    d = next(e for e in stock.engines if e.role == "decode")
    rid, xid = new_ids()
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid)
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    d.expect("loading", rid=rid)
    p.expect("asked", timeout_s=30)
    p.kill()
    with pytest.raises(AssertionError, match="no"):
        d.expect("loaded", "load_failed", rid=rid, timeout_s=STILL_WAITING_S)
    # Restart under the same engine id: the decode side keeps the dead side channel.
    p2 = stock.start("prefill", p.engine_id)
    assert p.engine_id in d.request("inner", "inner")["remote_agents"]
    rid2, xid2 = new_ids()
    p2.request("prefill", "prefilled", rid=rid2, transfer_id=xid2)
    p2.send("finish", rid=rid2)
    d.send("load", rid=rid2, transfer_id=xid2, engine_id=p2.engine_id, bootstrap=p2.bootstrap)
    d.expect("loading", rid=rid2)
    with pytest.raises(AssertionError, match="no"):
        d.expect("loaded", "load_failed", rid=rid2, timeout_s=STILL_WAITING_S)
    p2.kill()


def test_stock_restart_new_id_leaves_dead_entry(stock: Stack) -> None:
    d = next(e for e in stock.engines if e.role == "decode")
    dead = sorted({e.engine_id for e in stock.engines if e.role == "prefill"})
    p3 = stock.start("prefill")
    _, b = transfer(p3, d, seed=7)
    assert b["ev"] == "loaded" and b["digest"] == expected_digest(7)
    agents = d.request("inner", "inner")["remote_agents"]
    assert set(dead) <= set(agents), agents  # the dead engine's entry stays for good
