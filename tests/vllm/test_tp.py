"""One decode rank pulling from two producer ranks: a prefill engine with TP 2 (two rank
processes in one gloo group, each holding one of the two KV heads in its own KV cache
registered with Mooncake) and a decode engine with TP 1 (both heads), real transfers.

vLLM's Mooncake consumer pulls each request from both producer ranks (one task per
rank, one counter per request): each rank's share must settle exactly once, and the
request reach ``finished_recving`` exactly once, after both.  Killing one producer rank
with a load in flight must fail that load fast, once, with its blocks reported invalid,
whichever rank dies; the next request after the engine restarts is served."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import require_vllm

require_vllm()

from shmhb import Status  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

from .conftest import make_stack  # noqa: E402
from .engine import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, PROMPT_BLOCKS  # noqa: E402
from .stack import EngineProc, Stack, new_ids, zeros_digest  # noqa: E402

TP = 2
KILL_BOUND_S = 1.0  # kill -> failed load (as for one rank)
ENGINE = "tp2-prefill"


def rank_seed(seed: int, rank: int) -> int:
    """Each producer rank writes other bytes, so a transfer that swapped them shows."""
    return seed + 1000 * rank


def _rank_blocks(seed: int, rank: int) -> Any:
    """What producer rank ``rank`` writes into a request's blocks (its one head), as
    ``[block, K/V, head, token, channel]``, computed here, apart from the engines."""
    import torch
    g = torch.Generator().manual_seed(rank_seed(seed, rank))
    shape = (2, NUM_KV_HEADS // TP, BLOCK_SIZE, HEAD_SIZE)
    return torch.stack([torch.rand(shape, generator=g) + 1.0 for _ in range(PROMPT_BLOCKS)])


def _digest(t: Any) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def expected_decode_digest(seed: int) -> str:
    """The decode's blocks after a correct transfer: head h is producer rank h's."""
    import torch
    return _digest(torch.cat([_rank_blocks(seed, r) for r in range(TP)], dim=2))


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True)


def _prefill_ranks(stack: Stack) -> list[EngineProc]:
    ranks = [e for e in stack.engines if e.role == "prefill" and e.p.poll() is None]
    assert len(ranks) == TP, [e.tp_rank for e in ranks]
    return sorted(ranks, key=lambda e: e.tp_rank)


def _decode(stack: Stack) -> EngineProc:
    return [e for e in stack.engines if e.role == "decode" and e.p.poll() is None][-1]


def _wait_alive(stack: Stack, ranks: list[EngineProc]) -> None:
    """Until the decode host's board shows rank 0 (it serves the bootstrap address)."""
    ep = ranks[0].bootstrap.split("://", 1)[1]
    stack.decode_host.board.watch(ep)

    def alive() -> bool:
        s = stack.decode_host.board.remote(ep)
        return s is not None and s.status is Status.ALIVE and ranks[0].engine_id in s.key
    wait_until(alive, timeout_s=30, what=f"{ranks[0].engine_id} alive on the decode host")


def _prefill(ranks: list[EngineProc], rid: str, xid: str, seed: int) -> None:
    for r in ranks:
        ev = r.request("prefill", "prefilled", rid=rid, transfer_id=xid,
                       seed=rank_seed(seed, r.tp_rank))
        assert ev["digest"] == _digest(_rank_blocks(seed, r.tp_rank))


def _load(d: EngineProc, ranks: list[EngineProc], rid: str, xid: str) -> None:
    d.send("load", rid=rid, transfer_id=xid, engine_id=ranks[0].engine_id,
           bootstrap=ranks[0].bootstrap)


def _transfer(d: EngineProc, ranks: list[EngineProc], seed: int) -> dict[str, Any]:
    rid, xid = new_ids("tp")
    _prefill(ranks, rid, xid, seed)
    for r in ranks:
        r.send("finish", rid=rid)
        r.expect("finished", rid=rid)
    _load(d, ranks, rid, xid)
    d.expect("loading", rid=rid)
    return d.expect("loaded", "load_failed", rid=rid, timeout_s=60)


def _reports(d: EngineProc, rid: str) -> list[str]:
    """Every time ``rid`` was in the decode's ``finished_recving`` after the first (the
    events the test has not consumed)."""
    return [e["ev"] for e in d.seen if e.get("rid") == rid and e["ev"] in ("loaded", "load_failed")]


def test_tp2_to_tp1_moves_each_ranks_head(tp_stack: Stack) -> None:
    ranks = tp_stack.start_tp("prefill", TP, ENGINE, kv_layout="heads")
    d = tp_stack.start("decode", kv_layout="heads")
    _wait_alive(tp_stack, ranks)
    ev = _transfer(d, ranks, seed=21)
    assert ev["ev"] == "loaded"
    assert ev["digest"] == expected_decode_digest(21)


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_one_producer_rank_fails_the_load_once_restart_serves(
        tp_stack: Stack, victim: int) -> None:
    ranks, d = _prefill_ranks(tp_stack), _decode(tp_stack)
    _wait_alive(tp_stack, ranks)
    rid, xid = new_ids(f"kill{victim}")
    _prefill(ranks, rid, xid, seed=30 + victim)
    _load(d, ranks, rid, xid)
    d.expect("loading", rid=rid)
    for r in ranks:
        r.expect_asked(xid)  # both ranks hold the request; neither has written
    t_kill = ranks[victim].kill()
    ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=30)
    # (the engine says so only if its blocks came back invalid)
    assert ev["ev"] == "load_failed", (ev, d.log_tail(60))
    assert ev["t"] - t_kill <= KILL_BOUND_S, f"kill -> failed load took {ev['t'] - t_kill:.3f} s"
    assert ev["digest"] == zeros_digest()
    # The surviving rank, told to send, is denied: it frees the blocks at once.
    survivor = ranks[1 - victim]
    survivor.send("finish", rid=rid)
    survivor.expect("sent", rid=rid, timeout_s=15)
    # Until the engine restarts, a request to it is not loaded.  Rank 0 dead: the
    # scheduler vetoes it (rank 0 serves the bootstrap address).  Rank 1 dead: the
    # bootstrap server still names it, the load from it is refused at the start and
    # the one from rank 0 is given up with it.
    rid2, xid2 = new_ids(f"after{victim}")
    survivor.request("prefill", "prefilled", rid=rid2, transfer_id=xid2, seed=1)
    _load(d, ranks, rid2, xid2)
    ev2 = d.expect("vetoed", "load_failed", "loaded", rid=rid2, timeout_s=30)
    assert ev2["ev"] == ("vetoed" if victim == 0 else "load_failed"), (ev2, d.log_tail(60))
    # Restart the engine (the same id): the next request is served, by both ranks.
    survivor.kill()
    ranks2 = tp_stack.start_tp("prefill", TP, ENGINE, kv_layout="heads")
    _wait_alive(tp_stack, ranks2)
    ev3 = _transfer(d, ranks2, seed=40 + victim)
    assert ev3["ev"] == "loaded" and ev3["digest"] == expected_decode_digest(40 + victim)
    # Exactly once: the failed requests never came back, not even after the next one.
    assert _reports(d, rid) == [] and _reports(d, rid2) == []
