"""The pure parts of shmhb.vllm: the load table's one rule, the go-ahead wire, settings."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest

from .conftest import require_vllm
from tests.conftest import wait_until

require_vllm()

from shmhb.errors import InvalidConfig  # noqa: E402
from shmhb.vllm import fence  # noqa: E402
from shmhb.vllm.fence import (  # noqa: E402
    LAST_LOOK_S, MAX_FRAME, VERSION, FenceServer, GrantAsker, decode_ask, decode_reply,
    parse_extra)
from shmhb.vllm.fencewire import next_frame, pack  # noqa: E402
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


TOK = "0" * 32


def _ask(**kw: object) -> bytes:
    m: dict[str, object] = {"v": VERSION, "n": 1, "inc": 1, "from": EP, "tok": TOK, "reqs": ["r"]}
    m.update(kw)
    return json.dumps({k: v for k, v in m.items() if v is not None}).encode()


@pytest.mark.parametrize("frame", [
    b"", b"not json", b"[]", _ask(v=1), _ask(n="x"), _ask(**{"from": "a b:1"}),
    _ask(reqs=["x" * 300]), _ask(reqs=[1]), _ask(reqs=["r"] * 2000), b"{" * 70000,
    _ask(tok=None), _ask(tok="g" * 32), _ask(tok="0" * 31),
    b"[" * 20000 + b"]" * 20000,  # nested deeper than the parser goes: RecursionError
    _ask(reqs=["\ud800"]),  # a lone surrogate: UnicodeEncodeError on .encode()
    b'{"v": %d, "n": 1, "inc": 1, "from": "127.0.0.2:4000", "tok": "' % VERSION + b"0" * 32
    + b'", "reqs": ["\\ud800"]}',
    b"\xff\xfe",
])
def test_malformed_asks_are_refused(frame: bytes) -> None:
    assert decode_ask(frame) is None
    assert decode_reply(frame, 1) is None


def test_a_well_formed_ask_decodes() -> None:
    assert decode_ask(_ask()) == (1, 1, EP, TOK, ["r"])


def _run_asks(srv: FenceServer, asks: list[tuple[int, str | None, str, list[str]]],
              timeout_s: float = 2.0) -> list[list[str]]:
    """Asks in turn from one GrantAsker (one loop), ``(inc, token, from, reqs)`` each."""
    asker = GrantAsker()

    async def run() -> list[list[str]]:
        return [await asker.ask(srv.endpoint, inc, tok, frm, reqs, timeout_s)
                for inc, tok, frm, reqs in asks]
    try:
        return asyncio.run(run())
    finally:
        asker.close()


def _connect(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end closed ``s`` (EOF or a reset), polled without blocking."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_fence_server_grants_only_its_incarnation_and_survives_garbage() -> None:
    """Nothing a peer sends or does ends the server's thread or keeps others from their
    grants: a bad length (garbage, oversize, zero, a version 2 producer's ZMTP greeting)
    closes that connection; a frame that decodes to no ask is counted and dropped (the
    frames of case 8, which ended the server's thread); a partial frame, a close and a
    reset cost only their connection."""
    t = LoadTable()
    t.start([_load("a", ep=EP), _load("b", ep=EP)])
    srv = FenceServer("127.0.0.1", 0, t.grant)
    socks: list[socket.socket] = []
    try:
        srv.incarnation = 77
        tok = srv.token_for(EP)
        zmtp = b"\xff" + b"\x00" * 8 + b"\x7f"
        for raw in (b"garbage", struct.pack(">I", MAX_FRAME + 1) + b"x", b"\x00" * 4, zmtp):
            s = _connect(srv.endpoint)
            socks.append(s)
            s.sendall(raw)
            wait_until(lambda: _closed_by_peer(s), timeout_s=5,  # noqa: B023 - used at once
                       what=f"the server to close the connection that sent {raw!r}")
        s = _connect(srv.endpoint)  # the frames of case 8: counted, the connection kept
        socks.append(s)
        s.sendall(pack(b"[" * 20000 + b"]" * 20000) + pack(_ask(reqs=["\ud800"])))
        wait_until(lambda: srv.bad_frames == 6, timeout_s=5, what="6 bad frames counted")
        s.sendall(pack(_ask(inc=77, tok=tok, reqs=["b"])))  # and it still serves asks
        s.settimeout(5.0)
        got, buf = None, bytearray()
        while got is None:
            buf += s.recv(4096)
            got = next_frame(buf)
        assert decode_reply(got, 1) == ["b"]
        half = _connect(srv.endpoint)  # half a frame, then gone
        half.sendall(struct.pack(">I", 100) + b"{" * 10)
        half.close()
        reset = _connect(srv.endpoint)  # half a frame, then a reset
        reset.sendall(struct.pack(">I", 100) + b"{" * 10)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
        stale, ok = _run_asks(srv, [(76, tok, EP, ["a"]),  # a restarted consumer
                                    (77, tok, EP, ["a", "nope"])])
        assert stale == [] and ok == ["a"]
        assert srv.bad_frames == 6 and srv.asks == 3
        assert srv._thread.is_alive()  # noqa: SLF001 - the thread the bad frames used to end
    finally:
        srv.close()
        for s in socks:
            s.close()


def test_idle_connections_past_the_limit_do_not_crowd_out_a_producer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that opens connection after connection and holds each with half a frame
    (a slow loris) costs the server at most MAX_CONNECTIONS of them: the least recently
    active go, and a producer that asks is served."""
    monkeypatch.setattr(fence, "MAX_CONNECTIONS", 8)
    t = LoadTable()
    t.start([_load("a")])
    srv = FenceServer("127.0.0.1", 5, t.grant)
    idle: list[socket.socket] = []
    try:
        for _ in range(20):
            s = _connect(srv.endpoint)
            idle.append(s)
            s.sendall(struct.pack(">I", 100) + b"{")  # a frame begun, never finished
        assert _run_asks(srv, [(5, srv.token_for(EP), EP, ["a"])]) == [["a"]]
        # 21 connections were taken, 8 kept: the asker's (the newest) and 7 idle ones
        wait_until(lambda: sum(map(_closed_by_peer, idle)) == 13, timeout_s=5,
                   what="the 13 oldest idle connections closed")
        assert sum(map(_closed_by_peer, idle)) == 13
        assert srv._thread.is_alive()  # noqa: SLF001
    finally:
        srv.close()
        for s in idle:
            s.close()


def _fake_consumer(replies: Callable[[int], tuple[bytes, bool]]
                   ) -> tuple[str, threading.Event, Callable[[], None]]:
    """A consumer that answers each ask with ``replies(nonce)``: raw bytes, and whether
    it then closes the connection (and sets ``closed``).  Its endpoint, ``closed``, and
    what stops it (its thread ends and its sockets close)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.05)  # the thread looks at ``stop`` this often
    closed, stop = threading.Event(), threading.Event()

    def serve_one(conn: socket.socket) -> None:
        conn.settimeout(0.05)
        buf = bytearray()
        while not stop.is_set():
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return
            buf += data
            while (frame := next_frame(buf)) is not None:
                out, close = replies(json.loads(frame)["n"])
                conn.sendall(out)
                if close:
                    conn.close()
                    closed.set()
                    return

    def serve() -> None:
        with lsock:
            while not stop.is_set():
                try:
                    conn, _ = lsock.accept()
                except TimeoutError:
                    continue
                with conn:
                    serve_one(conn)
    th = threading.Thread(target=serve, daemon=True)
    th.start()

    def shut() -> None:
        stop.set()
        th.join(5.0)
    return f"127.0.0.1:{lsock.getsockname()[1]}", closed, shut


def _reply(nonce: int, ok: list[str]) -> bytes:
    return pack(json.dumps({"v": VERSION, "n": nonce, "ok": ok}).encode())


def test_a_reply_to_another_nonce_is_skipped_and_a_bad_length_is_no_grant() -> None:
    """A reply that is not this ask's (another nonce, or junk) is skipped, and the ask's
    own is read after it; a reply with a length of 0 closes the channel and grants
    nothing."""
    bad_next = threading.Event()

    def replies(nonce: int) -> tuple[bytes, bool]:
        if bad_next.is_set():
            return b"\x00" * 4 + _reply(nonce, ["a"]), False
        return _reply(nonce + 1, ["a", "b"]) + pack(b"junk") + _reply(nonce, ["b", "x"]), False
    ep, _, shut = _fake_consumer(replies)
    asker = GrantAsker()

    async def run() -> tuple[list[str], int, list[str], int]:
        first = await asker.ask(ep, 1, TOK, EP, ["a", "b"], 2.0)
        kept = asker.open_channels
        bad_next.set()
        second = await asker.ask(ep, 1, TOK, EP, ["a"], 2.0)
        return first, kept, second, asker.open_channels
    try:
        assert asyncio.run(run()) == (["b"], 1, [], 0)
    finally:
        asker.close()
        shut()


def test_a_kept_connection_the_consumer_closed_is_made_anew() -> None:
    """A consumer may close a connection that sits idle (past its limit on connections):
    the next ask opens a new one instead of failing on the old."""
    ep, closed, shut = _fake_consumer(lambda nonce: (_reply(nonce, ["a"]), True))
    asker = GrantAsker()

    async def run() -> tuple[list[str], bool, list[str]]:
        first = await asker.ask(ep, 1, TOK, EP, ["a"], 2.0)
        was_closed = await asyncio.to_thread(closed.wait, 5.0)
        return first, was_closed, await asker.ask(ep, 1, TOK, EP, ["a"], 2.0)
    try:
        assert asyncio.run(run()) == (["a"], True, ["a"])
    finally:
        asker.close()
        shut()


def test_asks_over_ipv6() -> None:
    try:
        srv = FenceServer("::1", 4, lambda frm, reqs: reqs)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert srv.endpoint.startswith("[::1]:")
        assert _run_asks(srv, [(4, srv.token_for(EP), EP, ["r"])]) == [["r"]]
    finally:
        srv.close()


def test_unreachable_consumer_and_missing_token_are_no_grant() -> None:
    asker = GrantAsker()

    async def run() -> tuple[list[str], list[str]]:
        return (await asker.ask("127.0.0.1:1", 5, TOK, EP, ["b"], 0.2),
                await asker.ask("127.0.0.1:1", 5, None, EP, ["b"], 0.2))
    try:
        assert asyncio.run(run()) == ([], [])
    finally:
        asker.close()


def test_a_grant_needs_the_token_given_to_that_producer() -> None:
    """Case 9: a third party that knows the request id, claiming the producer's ``from``
    or its own, is refused, and the load stays WAITING: the consumer can still give it
    up at once, and the real producer is still granted it."""
    other = "127.0.0.3:4000"
    t = LoadTable()
    t.start([_load("a", ep=EP), _load("c", ep=other)])
    srv = FenceServer("127.0.0.1", 9, t.grant)
    try:
        forged = _run_asks(srv, [(9, "f" * 32, EP, ["a"]),           # a guessed token
                                 (9, srv.token_for(other), EP, ["a"]),  # another producer's
                                 (9, srv.token_for(other), other, ["a"])])  # not its load
        assert forged == [[], [], []] and srv.refused_tokens == 2
        assert _run_asks(srv, [(9, srv.token_for(EP), EP, ["a"])]) == [["a"]]
        assert [ld.req_id for ld in t.abandon(endpoint=other)] == ["c"]
        other_srv = FenceServer("127.0.0.1", 9, t.grant)  # tokens are per consumer process
        try:
            assert other_srv.token_for(EP) != srv.token_for(EP)
        finally:
            other_srv.close()
    finally:
        srv.close()


def test_asks_reuse_one_connection_and_a_timed_out_one_is_made_anew() -> None:
    """One connection per consumer (the cost of the happy path), and after a consumer
    stalled past the timeout, a late reply is never taken for the next ask's."""
    t = LoadTable()
    t.start([_load(r) for r in "abcd"])
    peers: list[bytes] = []
    gate = threading.Event()
    gate.set()

    def grant(frm: str, reqs: list[str]) -> list[str]:
        gate.wait()
        return t.grant(frm, reqs)
    srv = FenceServer("127.0.0.1", 3, grant)
    orig = srv.answer

    def answer(frame: bytes) -> bytes | None:
        peers.append(frame)
        return orig(frame)
    srv.answer = answer  # type: ignore[method-assign]
    tok = srv.token_for(EP)
    asker = GrantAsker()

    async def run() -> list[list[str]]:
        out = [await asker.ask(srv.endpoint, 3, tok, EP, ["a"], 2.0),
               await asker.ask(srv.endpoint, 3, tok, EP, ["b"], 2.0)]
        assert asker.open_channels == 1  # made once, kept
        gate.clear()  # the consumer stalls: this ask times out
        out.append(await asker.ask(srv.endpoint, 3, tok, EP, ["c"], 0.3))
        threading.Timer(0.2, gate.set).start()  # resumes; its late reply grants "c"
        out.append(await asker.ask(srv.endpoint, 3, tok, EP, ["d"], 5.0))
        return out
    try:
        got = asyncio.run(run())
    finally:
        asker.close()
        srv.close()
    assert got == [["a"], ["b"], [], ["d"]], got
    assert len(peers) == 4
    # the stalled ask's reply came to a closed channel: "c" was granted, never written
    assert t.grant(EP, ["c"]) == []


def test_concurrent_asks_to_one_consumer_take_turns_on_one_connection() -> None:
    """Asks to one consumer from one loop share its channel, one at a time: an ask that
    finds it free takes it at once, the others wait their turn, and each reads its own
    grant."""
    reqs = [f"r{i}" for i in range(20)]
    t = LoadTable()
    t.start([_load(r) for r in reqs])
    srv = FenceServer("127.0.0.1", 3, t.grant)
    tok = srv.token_for(EP)
    asker = GrantAsker()

    async def run() -> tuple[list[list[str]], int]:
        got = await asyncio.gather(*(asker.ask(srv.endpoint, 3, tok, EP, [r], 5.0)
                                     for r in reqs))
        return list(got), asker.open_channels
    try:
        assert asyncio.run(run()) == ([[r] for r in reqs], 1)
    finally:
        asker.close()
        srv.close()


def test_a_grant_read_past_the_deadline_is_taken() -> None:
    """A producer stopped between its ask and its read finds its deadline passed on
    resume, the consumer's grant unread.  A grant is a promise the consumer keeps (a
    GRANTED load is never given up), so the ask returns it: failing it would fail a load
    the consumer is holding for this write.  Here the reply lands just past the deadline,
    as it does for a producer resumed after the deadline (found in CI: a SIGSTOP between
    the ask and the read failed a granted load, and no byte was written)."""
    t = LoadTable()
    t.start([_load("a"), _load("b")])
    gate = threading.Event()

    def grant(frm: str, reqs: list[str]) -> list[str]:
        gate.wait(5.0)
        return t.grant(frm, reqs)
    srv = FenceServer("127.0.0.1", 3, grant)
    tok = srv.token_for(EP)
    asker = GrantAsker()
    timeout_s = 0.3

    async def run() -> tuple[list[str], float, list[str]]:
        t0 = time.monotonic()
        threading.Timer(timeout_s + 0.05, gate.set).start()  # answers just past the deadline
        late = await asker.ask(srv.endpoint, 3, tok, EP, ["a"], timeout_s)
        took = time.monotonic() - t0
        gate.clear()  # no answer at all: the last look is bounded
        t1 = time.monotonic()
        none = await asker.ask(srv.endpoint, 3, tok, EP, ["b"], timeout_s)
        return late, took, none + [f"{time.monotonic() - t1:.3f}"]
    try:
        late, took, none = asyncio.run(run())
    finally:
        gate.set()
        asker.close()
        srv.close()
    assert late == ["a"], (late, took)
    assert t.grant(EP, ["a"]) == []  # granted once, at the consumer too
    assert none[:-1] == [] and float(none[-1]) < timeout_s + LAST_LOOK_S + 1.0, none


def test_a_grant_waiting_when_a_stopped_producer_resumes_is_taken() -> None:
    """The producer's loop is stopped (here: blocked) from before the reply comes until
    past its deadline: on resume the reply and the deadline are due in the same turn of
    the loop.  The reply is taken (a read cancelled by the deadline would have lost the
    bytes it took off the socket, and with them the grant)."""
    t = LoadTable()
    t.start([_load("a")])
    gate = threading.Event()

    def grant(frm: str, reqs: list[str]) -> list[str]:
        gate.wait(5.0)
        return t.grant(frm, reqs)
    srv = FenceServer("127.0.0.1", 3, grant)
    asker = GrantAsker()
    timeout_s = 0.3

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()

        def stopped() -> None:  # the stop itself, not a wait for something: a sleep
            gate.set()
            wait_until(lambda: srv.asks == 1, timeout_s=5, what="the ask read")
            time.sleep(timeout_s)
        loop.call_later(0.05, stopped)
        return await asker.ask(srv.endpoint, 3, srv.token_for(EP), EP, ["a"], timeout_s)
    try:
        assert asyncio.run(run()) == ["a"]
    finally:
        gate.set()
        asker.close()
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
    assert parse_extra({"inc": 5, "fence": EP}) == (5, EP, None)
    assert parse_extra({"inc": 5, "fence": EP, "tok": TOK}) == (5, EP, TOK)
    assert parse_extra({"inc": 5, "fence": EP, "tok": "x"}) == (5, EP, None)
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

# -- vLLM 0.33's hooks, forwarded; the adapter's version gate ---------------------------------

def _outer_ktc(protocol: str) -> object:
    from vllm.config import KVTransferConfig
    return KVTransferConfig(
        kv_connector="ShmhbConnector", kv_connector_module_path="shmhb.vllm",
        kv_role="kv_consumer", kv_connector_extra_config={"inner": {
            "kv_connector": "MooncakeConnector",
            "kv_connector_extra_config": {"mooncake_protocol": protocol}}})


def test_sleep_mode_hooks_reach_the_inner_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector,
    )

    from shmhb.vllm.connector import ShmhbConnector
    calls: list[str] = []

    class Inner:
        def unregister_kv_caches(self) -> None:
            calls.append("unregister")

        def restore_kv_caches(self) -> None:
            calls.append("restore")
    c = ShmhbConnector.__new__(ShmhbConnector)  # only the forwarding is under test
    c.inner = Inner()  # type: ignore[assignment]
    c.unregister_kv_caches()
    c.restore_kv_caches()
    assert calls == ["unregister", "restore"]  # (0.33's base class would answer None)
    # Mooncake 0.33 supports sleep mode over RDMA only; the base class says yes to all.
    if hasattr(MooncakeConnector, "supports_sleep_mode"):
        assert ShmhbConnector.supports_sleep_mode(_outer_ktc("tcp")) is False
        assert ShmhbConnector.supports_sleep_mode(_outer_ktc("rdma")) is True
    else:  # 0.32: no such hook; the wrapper answers what the base class would
        assert ShmhbConnector.supports_sleep_mode(_outer_ktc("tcp")) is True


def test_prom_metrics_are_the_inner_connectors_fed_its_stats() -> None:
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
        MooncakeKVConnectorStats,
    )

    from shmhb.vllm.connector import ShmhbConnector
    from shmhb.vllm.stats import ShmhbKVConnectorStats
    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Counter, Gauge, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=_outer_ktc("tcp"))
    prom = ShmhbConnector.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    if "build_prom_metrics" not in vars(MooncakeConnector):  # 0.32: Mooncake has none
        assert prom is None
        return
    assert prom is not None
    inner = MooncakeKVConnectorStats()
    inner.record_failed_recv()
    inner.record_failed_recv()
    prom.observe(ShmhbKVConnectorStats(data={"shmhb": {"failed_loads": 2}, "inner": inner}).to_dict())
    prom.observe(ShmhbKVConnectorStats(data={"shmhb": {"failed_loads": 1}, "inner": None}).to_dict())
    got = {s.name: s.value for m in reg.collect() for s in m.samples
           if "failed_recv" in s.name and s.name.endswith("_total")}
    assert list(got.values()) == [2.0], got


def test_adapter_refuses_a_vllm_it_was_not_written_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from shmhb.vllm.mooncake_adapter import MooncakeAdapter
    from shmhb.vllm.inner import vllm_release
    assert vllm_release("0.33.0") == (0, 33) and vllm_release("0.32.1.dev3+gabc") == (0, 32)
    assert vllm_release("dev") is None
    worker = type("W", (), {"is_kv_producer": False, "is_kv_consumer": True})()
    a = MooncakeAdapter(type("C", (), {"connector_worker": worker})())
    with pytest.raises(TypeError, match="lacks"):  # this vLLM, but not its Mooncake worker
        a.check()
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(TypeError, match="0.34.0"):
        a.check()


def test_adapters_read_the_producer_address_from_untrusted_params() -> None:
    """The scheduler's veto looks the producer up by the address its transfer params
    name: each adapter reads its own fields, and anything that is not an address is
    None (no veto, no crash)."""
    from shmhb.vllm.adapters import adapter_class
    from shmhb.vllm.mooncake_adapter import MooncakeAdapter
    from shmhb.vllm.nixl_adapter import NixlAdapter
    assert adapter_class("MooncakeConnector") is MooncakeAdapter
    assert adapter_class("NixlConnector") is NixlAdapter
    with pytest.raises(TypeError, match="no adapter"):
        adapter_class("LMCacheConnectorV1")
    m, n = MooncakeAdapter.producer_address, NixlAdapter.producer_address
    assert MooncakeAdapter.address_fields == ("remote_bootstrap_addr",)
    assert m("http://127.0.0.2:8998") == m("127.0.0.2:8998/x") == "127.0.0.2:8998"
    for bad in (None, 8998, "http://", "http://a b:1", "http://127.0.0.2:99999", ["x"]):
        assert m(bad) is None, bad
    assert NixlAdapter.address_fields == ("remote_host", "remote_port")
    assert n("127.0.0.2", 5600) == "127.0.0.2:5600" and n("::1", 5600) == "[::1]:5600"
    for bad in ((None, 5600), ("127.0.0.2", "5600"), ("127.0.0.2", True), ("127.0.0.2", -1),
                ("127.0.0.2", 1 << 20), ("a b", 1), ("127.0.0.2",), ()):
        assert n(*bad) is None, bad
    assert not NixlAdapter.asks_go_ahead and MooncakeAdapter.asks_go_ahead


def test_ledger_settles_each_workers_share_once_and_reports_after_the_last() -> None:
    """vLLM 0.32's fields, 0.33's rule (the backport): a request pulled from two
    producer workers is reported once, after both settled, its blocks invalid once."""
    import queue
    from types import SimpleNamespace

    from shmhb.vllm.mooncake_pulls import Ledger, settles_per_peer

    class Worker32:
        def __init__(self) -> None:
            self.finished_recving_reqs: set[str] = set()
            self._invalid_block_ids: queue.Queue[set[int]] = queue.Queue()
            self._failed_recv_reqs: queue.Queue[str] = queue.Queue()
            self._is_hma_required = False
            self.xfer_stats = SimpleNamespace(record_failed_recv=lambda: None)

        def _handle_failed_recv(self, *a: object) -> None:
            raise AssertionError("0.32's own settlement must not run")

        def process_pulling_result(self, *a: object) -> None:
            raise AssertionError("0.32's own settlement must not run")
    w = Worker32()
    assert not settles_per_peer(w)
    ended: list[tuple[str, list[str]]] = []
    ledger = Ledger(w, lambda ep, reqs: ended.append((ep, reqs)))
    ledger.install()
    pm = SimpleNamespace(pull_tasks_count=2, failed=False, local_block_ids=[[4, 5]], d_req_id="r")

    async def worker(ep: str, ok: bool) -> list[str]:
        task = asyncio.current_task()
        mine = {"r": pm}
        ledger.begin(task, ep)
        if ok:  # this worker's write landed and it said so
            w.process_pulling_result(SimpleNamespace(ok_reqs=["r"], err_reqs=None, err_msg=None), mine)
            w.process_pulling_result(SimpleNamespace(ok_reqs=["r"], err_reqs=None, err_msg=None), mine)
        left = ledger.finish(task, {"r": pm})  # then fenced: settle what it left
        ledger.fail_now({"r": pm}, left, "fenced")
        return left

    async def run() -> tuple[list[str], set[str], list[str]]:
        a = await worker("A", ok=True)
        after_a = set(w.finished_recving_reqs)
        b = await worker("B", ok=False)
        return a, after_a, b
    a, after_a, b = asyncio.run(run())
    assert a == [] and b == ["r"]  # A settled by its result (once), B by the fence
    assert after_a == set()  # not reported while B could still write
    assert w.finished_recving_reqs == {"r"} and pm.pull_tasks_count == 0 and pm.failed
    assert w._invalid_block_ids.get_nowait() == {4, 5} and w._invalid_block_ids.empty()
    assert ended == [("A", ["r"])]
