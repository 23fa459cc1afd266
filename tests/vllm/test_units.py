"""The pure parts of shmhb.vllm: the load table's one rule, the go-ahead wire, settings."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from .conftest import require_vllm

require_vllm()

import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from shmhb.errors import InvalidConfig  # noqa: E402
from shmhb.vllm.fence import FenceServer, ask_grant, decode_ask, parse_extra  # noqa: E402
from shmhb.vllm.loads import Load, LoadState, LoadTable  # noqa: E402
from shmhb.vllm.settings import ConnectorSettings, engine_prefix, rank_key  # noqa: E402

EP = "127.0.0.2:4000"


def _load(r: str, ep: str = EP, engine: str = "e1") -> Load:
    return Load(r, ep, engine, frozenset({1, 2}), token=object())


def test_grant_and_abandon_exclude_each_other_under_threads() -> None:
    for _ in range(200):
        t = LoadTable()
        t.start([_load("a")])
        got: dict[str, object] = {}
        go = threading.Barrier(2)

        def grant() -> None:
            go.wait()
            got["granted"] = t.grant(EP, ["a"])

        def abandon() -> None:
            go.wait()
            got["abandoned"] = [ld.req_id for ld in t.abandon(endpoint=EP)]
        th = [threading.Thread(target=grant), threading.Thread(target=abandon)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        assert (got["granted"] == ["a"]) != (got["abandoned"] == ["a"]), got


def test_grant_only_to_the_producer_asked_and_only_once() -> None:
    t = LoadTable()
    t.start([_load("a"), _load("b", ep="127.0.0.2:4001")])
    assert t.grant("127.0.0.9:1", ["a", "b"]) == []
    assert t.grant(EP, ["a", "b", "zz"]) == ["a"]
    assert t.grant(EP, ["a"]) == []  # granted already: a write may be under way
    assert t.abandon(endpoint=EP) == []  # a granted load is never given up early
    ab = t.abandon(engine_id="e1")
    assert [ld.req_id for ld in ab] == ["b"] and ab[0].state is LoadState.ABANDONED
    assert t.end(["b"], "127.0.0.2:4001")[0].state is LoadState.ABANDONED
    assert len(t) == 1


@pytest.mark.parametrize("frame", [
    b"", b"not json", b"[]", json.dumps({"v": 2, "n": 1, "inc": 1, "from": EP, "reqs": []}).encode(),
    json.dumps({"v": 1, "n": "x", "inc": 1, "from": EP, "reqs": []}).encode(),
    json.dumps({"v": 1, "n": 1, "inc": 1, "from": "a b:1", "reqs": []}).encode(),
    json.dumps({"v": 1, "n": 1, "inc": 1, "from": EP, "reqs": ["x" * 300]}).encode(),
    json.dumps({"v": 1, "n": 1, "inc": 1, "from": EP, "reqs": [1]}).encode(),
    json.dumps({"v": 1, "n": 1, "inc": 1, "from": EP, "reqs": ["r"] * 2000}).encode(),
    b"{" * 70000,
])
def test_malformed_asks_are_refused(frame: bytes) -> None:
    assert decode_ask(frame) is None


def test_fence_server_grants_only_its_incarnation_and_survives_garbage() -> None:
    t = LoadTable()
    t.start([_load("a", ep=EP), _load("b", ep=EP)])
    srv = FenceServer("127.0.0.1", 0, t.grant)
    try:
        srv.incarnation = 77
        ctx = zmq.asyncio.Context()
        raw = zmq.Context().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://{srv.endpoint}")
        raw.send(b"garbage")
        raw.send_multipart([b"two", b"frames"])

        async def run() -> tuple[list[str], list[str], list[str]]:
            stale = await ask_grant(ctx, srv.endpoint, 76, EP, ["a"], 2.0)  # a restarted consumer
            ok = await ask_grant(ctx, srv.endpoint, 77, EP, ["a", "nope"], 2.0)
            nobody = await ask_grant(ctx, "127.0.0.1:1", 77, EP, ["b"], 0.2)
            return stale, ok, nobody
        stale, ok, nobody = asyncio.run(run())
        assert stale == [] and ok == ["a"] and nobody == []
        assert srv.bad_frames >= 1
        raw.close(0)
        ctx.term()
    finally:
        srv.close()


def test_settings_and_keys() -> None:
    inner = {"kv_connector": "MooncakeConnector"}
    s = ConnectorSettings.from_extra_config({"inner": inner, "on_dead_peer": "fail"})
    assert s.on_dead_peer == "fail" and s.grant_timeout_s == 2.0
    for bad in ({}, {"inner": {"kv_connector": "ShmhbConnector"}},
                {"inner": inner, "on_dead_peer": "retry"}, {"inner": inner, "grant_timeout_s": -1},
                {"inner": inner, "act_on_suspect": "yes"}, {"inner": inner, "board": 3}):
        with pytest.raises(InvalidConfig):
            ConnectorSettings.from_extra_config(bad)
    k = rank_key("e" * 80, 0, 3, 1)
    assert len(k.encode()) < 64 and k.startswith(engine_prefix("e" * 80)) and k.endswith("/tp3/pp1")
    assert rank_key("abc", 0, 0, 0) == "vllm/abc/dp0/tp0/pp0"
    assert not rank_key("abcd", 0, 0, 0).startswith(engine_prefix("abc"))
    assert parse_extra({"inc": 5, "fence": EP}) == (5, EP)
    assert parse_extra({"inc": 5, "fence": "*:1"}) is None and parse_extra("x") is None


def test_a_veto_names_the_engine_it_vetoes() -> None:
    """The newest slot at a bootstrap address may be another engine's: only the
    requested engine's own slot, or a live other engine there, says anything."""
    from shmhb import Status
    from shmhb.status import SlotStatus
    from shmhb.vllm.verdict import may_hold_blocks, producer_verdict

    def slot(engine: str, status: Status) -> SlotStatus:
        return SlotStatus(rank_key(engine, 0, 0, 0), 1, 7, status, 0.0, (EP,))

    for st, want in [(Status.ALIVE, None), (Status.SUSPECT, None), (Status.DEAD, "dead"),
                     (Status.LEFT, "left"), (Status.UNKNOWN, None)]:
        assert producer_verdict(slot("e1", st), "e1", False) == want, st
    assert producer_verdict(slot("e1", Status.SUSPECT), "e1", True) == "suspect"
    # the requested engine restarted under a new id; the board still shows its dead
    # predecessor at that address: nothing is known about the new one, so no veto
    for st in (Status.DEAD, Status.LEFT, Status.SUSPECT, Status.UNKNOWN):
        assert producer_verdict(slot("old", st), "new", True) is None, st
    # a live other engine serves the address: the requested one is not there any more
    assert producer_verdict(slot("new", Status.ALIVE), "old", False) == "gone"
    # an engine id that is a prefix of another's names only itself
    assert producer_verdict(slot("e10", Status.DEAD), "e1", False) is None
    assert producer_verdict(None, "e1", False) is None
    long_id = "x" * 80  # keyed by a digest: the same rule
    assert producer_verdict(slot(long_id, Status.DEAD), long_id, False) == "dead"
    assert producer_verdict(slot(long_id, Status.ALIVE), "y" * 80, False) == "gone"
    assert may_hold_blocks("suspect") and not any(map(may_hold_blocks, ["dead", "left", "gone"]))
