"""The fence's pure parts and its wire: the load table's one rule, the grant server (in
C and in Python), the producer's asks (pipelined, early), over real loopback sockets."""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shmhb.testing.loopback import child_env
from tests.conftest import wait_until


from shmhb.kv import fence, grants  # noqa: E402
from shmhb.kv.fence import LAST_LOOK_S, FenceServer, GrantAsker  # noqa: E402
from shmhb.kv.fencewire import MAX_FRAME, next_frame, pack  # noqa: E402
from shmhb.kv.grants import Tokens, decode_ask, encode_ask, encode_reply  # noqa: E402
from shmhb.kv.loads import Load, LoadState, LoadTable  # noqa: E402
from ..children import child

EP = "127.0.0.2:4000"
DRIVERS = [pytest.param(True, id="c"), pytest.param(False, id="python")]


@pytest.fixture(params=DRIVERS)
def native(request: pytest.FixtureRequest) -> bool:
    if request.param and not grants.native:
        pytest.skip("shmhb._fence is not built (python setup.py build_ext --inplace)")
    return bool(request.param)


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _blocked(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("SigBlk:")).split()[1], 16)


def _blocks_host_signals(tid: int) -> bool:
    mask = _blocked(tid)
    return all(mask >> (sig - 1) & 1 for sig in (signal.SIGINT, signal.SIGTERM,
                                                 signal.SIGHUP, signal.SIGCHLD)) \
        and not mask >> (signal.SIGSEGV - 1) & 1


def _load(r: str, ep: str = EP, engine: str = "e1") -> Load:
    return Load(r, ep, engine, frozenset({1, 2}), token=object())


def _table(native: bool) -> LoadTable:
    return LoadTable(grants.new_states(native))


class Gated:
    """States whose answers wait for ``gate``: a consumer that stalls (the Python
    server: the C one cannot be held).  Everything else goes to the real table."""

    def __init__(self, inner: grants.States) -> None:
        self.inner, self.gate = inner, threading.Event()
        self.gate.set()

    def answer(self, incarnation: int, body: bytes) -> bytes | None:
        self.gate.wait(5.0)
        return self.inner.answer(incarnation, body)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


def test_the_grant_server_thread_leaves_the_host_signals_to_its_main_thread(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """The server's thread (C or Python) lives in the engine's process: a SIGINT or SIGTERM
    the kernel handed to it would leave the engine's main thread, which alone runs Python's
    handlers, asleep with the signal pending (as the README worker was, tests/test_readme)."""
    before = _tasks()
    server_of(_table(native), 1)
    new = wait_until(lambda: _tasks() - before, what="the server's thread")
    wait_until(lambda: all(_blocks_host_signals(t) for t in new), timeout_s=5,
               what=f"threads {sorted(new)} blocking the host's signals")
    assert not _blocks_host_signals(threading.get_native_id())


@pytest.fixture
def server_of() -> Iterator[Callable[..., FenceServer]]:
    made: list[FenceServer] = []

    def make(t: LoadTable, inc: int, host: str = "127.0.0.1") -> FenceServer:
        made.append(FenceServer(host, inc, t.states, t.tokens))
        return made[-1]
    yield make
    for s in made:
        s.close()


def _run(asker: GrantAsker, coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    finally:
        asker.close()


# -- the load table ------------------------------------------------------------------------------


def test_grant_and_abandon_exclude_each_other_under_threads(native: bool) -> None:
    for _ in range(200):
        t = _table(native)
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


def test_a_grant_over_the_wire_and_an_abandon_exclude_each_other(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """The server's thread (in C: no GIL, no Python lock) against the worker's abandon:
    of the two, exactly one takes each load, whatever the order they meet in."""
    t = _table(native)
    srv = server_of(t, 3)
    tok = bytes.fromhex(srv.token_for(EP))
    with _connect(srv.endpoint) as s:
        for i in range(300):
            r = f"r{i}"
            t.start([_load(r)])
            s.sendall(pack(encode_ask(i, 3, tok, [r.encode()])))
            abandoned = [ld.req_id for ld in t.abandon(req_ids={r})]
            reply = _read_frame(s)
            granted = reply[-1] == 1
            assert granted != (abandoned == [r]), (i, granted, abandoned)
            assert t.end([r], EP)[0].state is (LoadState.GRANTED if granted else LoadState.ABANDONED)
    assert len(t) == 0 and len(t.states) == 0


def test_grant_only_to_the_producer_asked_and_only_once(native: bool) -> None:
    t = _table(native)
    t.start([_load("a"), _load("b", ep="127.0.0.2:4001")])
    assert t.grant("127.0.0.9:1", ["a", "b"]) == []
    assert t.grant(EP, ["a", "b", "zz"]) == ["a"]
    assert t.grant(EP, ["a"]) == []  # granted already: a write may be under way
    assert t.abandon(endpoint=EP) == []  # a granted load is never given up early
    ab = t.abandon(engine_id="e1")
    assert [ld.req_id for ld in ab] == ["b"] and ab[0].state is LoadState.ABANDONED
    assert t.end(["b"], "127.0.0.2:4001")[0].state is LoadState.ABANDONED
    assert len(t) == 1 and len(t.states) == 1


def test_request_ids_beyond_the_wire_limit_are_still_keyed() -> None:
    long_id, empty = "x" * 300, ""
    assert grants.wire_id("abc") == b"abc" and grants.wire_id("\ud800") == b"\xed\xa0\x80"
    for r in (long_id, empty):
        w = grants.wire_id(r)
        assert w.startswith(b"#") and 0 < len(w) <= grants.MAX_ID_BYTES
    assert grants.wire_id(long_id) != grants.wire_id(long_id + "y")


# -- the wire ------------------------------------------------------------------------------------

TOKEN = bytes(range(16))
ASK = encode_ask(1, 1, TOKEN, [b"r"])


def _with(at: int, raw: bytes, body: bytes = ASK) -> bytes:
    return body[:at] + raw + body[at + len(raw):]


@pytest.mark.parametrize("frame", [
    b"", b"\x04", ASK[:35], ASK[:-1], ASK + b"x",
    _with(0, b"\x02"), _with(1, b"\x02"),  # another version, a reply
    _with(2, b"\x00\x00"), _with(2, struct.pack(">H", 1025)),  # 0 or too many ids
    _with(2, b"\x00\x02"),  # two ids announced, one there
    _with(36, b"\x00\x00"), _with(36, b"\x01\x01"),  # an empty id, one past the frame
    encode_ask(1, 1, TOKEN, [b"r"])[:36] + b"\x01\x01" + b"x" * 257,  # an id over 256
    b'{"v": 3, "n": 1, "inc": 1, "from": "127.0.0.2:4000", "tok": "' + b"0" * 32 + b'"}',
    b"\xff" * 64,
])
def test_malformed_asks_are_refused_by_both_decoders(frame: bytes) -> None:
    assert decode_ask(frame) is None
    assert grants.PyStates().answer(1, frame) is None
    if grants.native:
        assert grants.new_states(True).answer(1, frame) is None


def test_a_well_formed_ask_decodes_and_its_reply_reads_back() -> None:
    ids = [b"a", "é".encode(), b"x" * 256]
    body = encode_ask(2**64 - 1, 7, TOKEN, ids)
    assert decode_ask(body) == (2**64 - 1, 7, TOKEN, ids)
    reply = encode_reply(5, [True, False, True], 1500)
    assert grants.reply_nonce(reply) == 5
    assert grants.decode_reply(reply, 5, 3) == grants.Reply([True, False, True], 1500)
    for bad in (grants.decode_reply(reply, 6, 3), grants.decode_reply(reply, 5, 2),
                grants.decode_reply(reply[:-1] + b"\x02", 5, 3)):
        assert bad is None
    with pytest.raises(ValueError):
        encode_ask(1, 1, TOKEN, [])


def test_the_c_decoder_answers_what_the_python_one_does() -> None:
    """Both servers answer the same wire: for each mutated ask (a byte changed, cut,
    grown, a count or length field set at random), both refuse it or both give the
    same reply, and grant the same loads."""
    if not grants.native:
        pytest.skip("shmhb._fence is not built")
    rng = random.Random(21)
    py, c = grants.PyStates(), grants.new_states(True)
    ids = [f"req-{i}".encode() for i in range(40)]
    for s in (py, c):
        for i in ids:
            s.start(TOKEN + i)
    seen = {"none": 0, "reply": 0}
    for n in range(6000):
        body = bytearray(encode_ask(n, 1, TOKEN, rng.sample(ids, rng.randint(1, 6))))
        how = rng.randrange(5)
        if how == 0:
            body[rng.randrange(len(body))] = rng.randrange(256)
        elif how == 1:
            del body[rng.randrange(len(body)):]
        elif how == 2:
            body += os.urandom(rng.randint(1, 4))
        elif how == 3:
            struct.pack_into(">H", body, 2, rng.choice([0, 1, 2, 7, 1024, 1025, 65535]))
        else:
            struct.pack_into(">H", body, 36, rng.choice([0, 1, 5, 6, 7, 256, 257]))
        a, b = py.answer(1, bytes(body)), c.answer(1, bytes(body))
        assert a == b, (bytes(body), a, b)
        seen["none" if a is None else "reply"] += 1
    assert min(seen.values()) > 500, seen  # both kinds were met often
    assert [py.state(TOKEN + i) for i in ids] == [c.state(TOKEN + i) for i in ids]


def _read_frame(s: socket.socket) -> bytes:
    buf = bytearray()
    s.settimeout(5.0)
    while (got := next_frame(buf)) is None:
        data = s.recv(4096)
        assert data, "the server closed the connection"
        buf += data
    return got


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


def test_the_server_grants_only_its_incarnation_and_survives_garbage(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """Nothing a peer sends or does ends the server's thread or keeps others from their
    grants: a bad length (garbage, oversize, zero, a ZMTP greeting) or a malformed ask
    (JSON, say) closes that connection and is counted; a partial frame, a close
    and a reset cost only their connection."""
    t = _table(native)
    t.start([_load("a"), _load("b")])
    srv = server_of(t, 0)
    socks: list[socket.socket] = []
    try:
        srv.set_incarnation(77)
        tok = bytes.fromhex(srv.token_for(EP))
        zmtp = b"\xff" + b"\x00" * 8 + b"\x7f"
        json = pack(b'{"v": 1, "n": 1, "inc": 77, "reqs": ["b"]}')
        for raw in (b"garbage", struct.pack(">I", MAX_FRAME + 1) + b"x", b"\x00" * 4, zmtp, json):
            s = _connect(srv.endpoint)
            socks.append(s)
            s.sendall(raw)
            wait_until(lambda: _closed_by_peer(s), timeout_s=5,  # noqa: B023 - used at once
                       what=f"the server to close the connection that sent {raw!r}")
        wait_until(lambda: srv.counters()["bad_frames"] == 5, timeout_s=5,
                   what="5 bad frames counted")
        half = _connect(srv.endpoint)  # half a frame, then gone
        half.sendall(struct.pack(">I", 100) + b"{" * 10)
        half.close()
        reset = _connect(srv.endpoint)  # half a frame, then a reset
        reset.sendall(struct.pack(">I", 100) + b"{" * 10)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
        s = _connect(srv.endpoint)
        socks.append(s)
        s.sendall(pack(encode_ask(1, 76, tok, [b"a"])))  # a restarted consumer's
        assert grants.decode_reply(_read_frame(s), 1, 1).granted == [False]
        s.sendall(pack(encode_ask(2, 77, tok, [b"a", b"nope"])))
        assert grants.decode_reply(_read_frame(s), 2, 2).granted == [True, False]
        c = srv.counters()
        assert (c["asks"], c["stale_asks"], c["granted"]) == (2, 1, 1), c
        assert srv.report() == 1 and srv.report() == 0
    finally:
        for s in socks:
            s.close()


def test_idle_connections_past_the_limit_do_not_crowd_out_a_producer(
        native: bool, server_of: Callable[..., FenceServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that opens connection after connection and holds each with half a frame
    (a slow loris) costs the server at most MAX_CONNECTIONS of them: the least recently
    active go, and a producer that asks is served."""
    monkeypatch.setattr(fence, "MAX_CONNECTIONS", 8)
    t = _table(native)
    t.start([_load("a")])
    srv = server_of(t, 5)
    idle: list[socket.socket] = []
    try:
        for _ in range(20):
            s = _connect(srv.endpoint)
            idle.append(s)
            s.sendall(struct.pack(">I", 100) + b"{")  # a frame begun, never finished
        asker = GrantAsker(native)
        assert _run(asker, asker.ask(srv.endpoint, 5, srv.token_for(EP), ["a"], 5.0)) == ["a"]
        # 21 connections were taken, 8 kept: the asker's (the newest) and 7 idle ones
        wait_until(lambda: sum(map(_closed_by_peer, idle)) == 13, timeout_s=5,
                   what="the 13 oldest idle connections closed")
        assert sum(map(_closed_by_peer, idle)) == 13
        assert srv.counters()["dropped"] == 13
    finally:
        for s in idle:
            s.close()


NO_FDS = child("no_fds")


@pytest.mark.system
def test_a_server_with_no_descriptor_left_rests_and_recovers(native: bool) -> None:
    """A consumer process out of descriptors cannot accept a producer's connection,
    and has none to close to make room: its grant server rests (it does not spin on a
    listener that stays readable), and once descriptors are free, serves the producer
    that waited."""
    p = subprocess.Popen([sys.executable, NO_FDS, "1" if native else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=child_env())
    assert p.stdin is not None and p.stdout is not None
    conns: list[socket.socket] = []
    try:
        ep, tok = p.stdout.readline().split()
        assert p.stdout.readline().strip() == "full"
        conns = [_connect(ep) for _ in range(3)]  # taken by the kernel, not accepted

        def cpu_s() -> float:
            p.stdin.write("cpu\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            return float(p.stdout.readline())  # type: ignore[union-attr]

        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(1.5)  # a window to measure the server's CPU over, not a wait
        used, wall = cpu_s() - c0, time.monotonic() - t0
        assert used < 0.2 * wall, f"{used:.2f} s of CPU in {wall:.2f} s: accept() spins"
        p.stdin.write("free\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "freed"
        conns[0].sendall(pack(encode_ask(1, 5, bytes.fromhex(tok), [b"a"])))
        assert grants.decode_reply(_read_frame(conns[0]), 1, 1).granted == [True]
    finally:
        for s in conns:
            s.close()
        p.kill()
        p.wait()


def test_asks_over_ipv6(native: bool, server_of: Callable[..., FenceServer]) -> None:
    t = _table(native)
    t.start([_load("r")])
    try:
        srv = server_of(t, 4, "::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    assert srv.endpoint.startswith("[::1]:")
    asker = GrantAsker(native)
    assert _run(asker, asker.ask(srv.endpoint, 4, srv.token_for(EP), ["r"], 5.0)) == ["r"]


def test_a_grant_needs_the_token_given_to_that_producer(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """Case 9: a third party that knows the request id, with a guessed token or another
    producer's, finds no load, and the load stays WAITING: the consumer can still give
    it up at once, and the real producer is still granted it."""
    other = "127.0.0.3:4000"
    t = _table(native)
    t.start([_load("a"), _load("b"), _load("c", ep=other)])
    srv = server_of(t, 9)
    asker = GrantAsker(native)

    async def run() -> list[list[str]]:
        return [await asker.ask(srv.endpoint, 9, "f" * 32, ["a"], 5.0),             # guessed
                await asker.ask(srv.endpoint, 9, srv.token_for(other), ["a"], 5.0),  # other's
                await asker.ask(srv.endpoint, 9, srv.token_for(EP), ["a"], 5.0)]
    assert _run(asker, run()) == [[], [], ["a"]]
    assert [ld.req_id for ld in t.abandon(endpoint=EP)] == ["b"]
    assert [ld.req_id for ld in t.abandon(endpoint=other)] == ["c"]
    assert Tokens().of(EP) != Tokens().of(EP)  # tokens are per consumer process


# -- the producer's asks -------------------------------------------------------------------------


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
                ask = decode_ask(frame)
                assert ask is not None
                out, close = replies(ask[0])
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


def _reply(nonce: int, granted: list[bool]) -> bytes:
    return pack(encode_reply(nonce, granted, grants.LEASE_MS))


TOK = TOKEN.hex()


def test_a_late_reply_to_an_ask_given_up_is_skipped_and_any_other_stray_frame_is_no_grant(
        native: bool) -> None:
    """A reply to an ask given up (it came late) is skipped, and the ask's own is read
    after it.  A consumer answers each ask once, so a frame that answers no ask (a
    nonce never asked, junk) closes the channel and grants nothing, as a length of 0
    does."""
    mode, held = ["ok"], []

    def replies(nonce: int) -> tuple[bytes, bool]:
        how = mode[0]
        if how == "hold":  # answered later, before the next ask's reply
            held.append(nonce)
            return b"", False
        if how == "late":
            return b"".join(_reply(n, [True]) for n in held) + _reply(nonce, [False, True]), False
        stray = {"stranger": _reply(nonce + 1, [True]), "junk": pack(b"junk"),
                 "zero": b"\x00" * 4}.get(how, b"")
        return stray + _reply(nonce, [True] * (2 if how == "late" else 1)), False
    ep, _, shut = _fake_consumer(replies)
    asker = GrantAsker(native)

    async def run() -> list[object]:
        out: list[object] = [await asker.ask(ep, 1, TOK, ["x"], 2.0)]
        mode[0] = "hold"
        early = asker.ask_now(ep, 1, TOK, ["z"])
        assert early is not None
        await asyncio.to_thread(wait_until, lambda: held, timeout_s=5, what="the ask read")
        asker.forget(early)  # given up; its reply comes with the next one's
        mode[0] = "late"
        out += [await asker.ask(ep, 1, TOK, ["a", "b"], 2.0), asker.open_channels]
        for how in ("stranger", "junk", "zero"):
            mode[0] = how
            out += [await asker.ask(ep, 1, TOK, ["c"], 2.0), asker.open_channels]
        return out
    try:
        assert _run(asker, run()) == [["x"], ["b"], 1, [], 0, [], 0, [], 0]
    finally:
        shut()


def test_a_kept_connection_the_consumer_closed_is_made_anew(native: bool) -> None:
    """A consumer may close a connection that sits idle (past its limit on connections):
    the next ask opens a new one instead of failing on the old, and an early ask finds
    no connection (so the write asks)."""
    ep, closed, shut = _fake_consumer(lambda nonce: (_reply(nonce, [True]), True))
    asker = GrantAsker(native)

    async def run() -> tuple[list[str], bool, object, list[str]]:
        first = await asker.ask(ep, 1, TOK, ["a"], 2.0)
        was_closed = await asyncio.to_thread(closed.wait, 5.0)
        early = asker.ask_now(ep, 1, TOK, ["a"])
        return first, was_closed, early, await asker.ask(ep, 1, TOK, ["a"], 2.0)
    try:
        assert _run(asker, run()) == (["a"], True, None, ["a"])
    finally:
        shut()


def test_unreachable_consumer_and_missing_token_are_no_grant(native: bool) -> None:
    asker = GrantAsker(native)

    async def run() -> tuple[list[str], list[str], object]:
        return (await asker.ask("127.0.0.1:1", 5, TOK, ["b"], 0.2),
                await asker.ask("127.0.0.1:1", 5, None, ["b"], 0.2),
                asker.ask_now("127.0.0.1:1", 5, TOK, ["b"]))
    assert _run(asker, run()) == ([], [], None)


def test_asks_share_one_connection_and_a_late_reply_is_not_taken_for_another(
        server_of: Callable[..., FenceServer]) -> None:
    """One connection per consumer (the cost of the happy path); a consumer that
    stalled past an ask's timeout answers it later, and that reply (its own nonce) is
    skipped: the next ask reads its own."""
    states = Gated(grants.new_states(False))
    t = LoadTable(states)  # type: ignore[arg-type]
    t.start([_load(r) for r in "abcd"])
    srv = server_of(t, 3)
    tok = srv.token_for(EP)
    asker = GrantAsker()

    async def run() -> list[list[str]]:
        out = [await asker.ask(srv.endpoint, 3, tok, ["a"], 2.0),
               await asker.ask(srv.endpoint, 3, tok, ["b"], 2.0)]
        assert asker.open_channels == 1  # made once, kept
        states.gate.clear()  # the consumer stalls: this ask times out
        out.append(await asker.ask(srv.endpoint, 3, tok, ["c"], 0.3))
        threading.Timer(0.2, states.gate.set).start()  # resumes; its late reply grants "c"
        out.append(await asker.ask(srv.endpoint, 3, tok, ["d"], 5.0))
        out.append([str(asker.open_channels)])
        return out
    assert _run(asker, run()) == [["a"], ["b"], [], ["d"], ["1"]]
    assert srv.counters()["asks"] == 4
    # the stalled ask's reply came after it was given up: "c" granted, never written
    assert t.grant(EP, ["c"]) == []


def test_concurrent_asks_to_one_consumer_share_one_connection(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """Asks to one consumer from one loop go out together on its one connection and
    each reads its own grant."""
    reqs = [f"r{i}" for i in range(20)]
    t = _table(native)
    t.start([_load(r) for r in reqs])
    srv = server_of(t, 3)
    tok = srv.token_for(EP)
    asker = GrantAsker(native)

    async def run() -> tuple[list[list[str]], int]:
        got = await asyncio.gather(*(asker.ask(srv.endpoint, 3, tok, [r], 5.0) for r in reqs))
        return list(got), asker.open_channels
    assert _run(asker, run()) == ([[r] for r in reqs], 1)


def test_an_early_ask_is_read_at_the_write_without_a_wait(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """The producer asks as it reads the request and reads the answer at the write:
    when the answer is in by then, ``result`` returns without yielding to the loop
    (stepped by hand: it never suspends); ids outside the early ask are not granted by
    it, and an early ask given up (stock refused the request) leaves the channel as it
    was."""
    t = _table(native)
    t.start([_load(r) for r in "abcd"])
    srv = server_of(t, 3)
    tok = srv.token_for(EP)
    asker = GrantAsker(native)

    async def run() -> tuple[list[str], list[str], list[str], str]:
        await asker.ask(srv.endpoint, 3, tok, ["a"], 5.0)  # the connection is made
        early = asker.ask_now(srv.endpoint, 3, tok, ["b", "c"])
        assert early is not None and early.channel.sock is not None
        wait_until(lambda: srv.counters()["asks"] == 2, timeout_s=5, what="the ask answered")
        r, _, _ = select.select([early.channel.sock], [], [], 5.0)
        assert r, "the reply is in the producer's socket"
        coro = asker.result(early, ["b", "d"], 5.0)
        try:
            coro.send(None)
        except StopIteration as done:
            got = done.value
        else:
            coro.close()
            raise AssertionError("result() waited for an answer that was in")
        dropped = asker.ask_now(srv.endpoint, 3, tok, ["d"])
        assert dropped is not None
        asker.forget(dropped)  # its reply comes, and is skipped
        after = await asker.ask(srv.endpoint, 3, tok, ["a", "c"], 5.0)
        return got, after, [str(asker.open_channels)], "granted" if any(dropped.granted or ()) else "none"
    got, after, channels, dropped = _run(asker, run())
    assert got == ["b"] and after == [] and channels == ["1"] and dropped == "none"
    # "c" was granted with the early ask though never read for a write: the consumer
    # holds it as granted, which is what stock's refusal of the request then ends
    assert t.grant(EP, ["c", "d"]) == []


def test_a_grant_read_past_the_deadline_is_taken(server_of: Callable[..., FenceServer]) -> None:
    """A producer stopped between its ask and its read finds its deadline passed on
    resume, the consumer's grant unread.  A grant is a promise the consumer keeps for
    its lease (a GRANTED load is not given up before it ran out), so the ask returns it
    while the lease runs: failing it would fail a load the consumer is holding for this
    write.  Here the reply lands just past the deadline,
    as it does for a producer resumed after the deadline (found in CI: a SIGSTOP between
    the ask and the read failed a granted load, and no byte was written)."""
    states = Gated(grants.new_states(False))
    t = LoadTable(states)  # type: ignore[arg-type]
    t.start([_load("a"), _load("b")])
    srv = server_of(t, 3)
    tok = srv.token_for(EP)
    asker = GrantAsker()
    timeout_s = 0.3
    states.gate.clear()

    async def run() -> tuple[list[str], float, list[str]]:
        t0 = time.monotonic()
        threading.Timer(timeout_s + 0.05, states.gate.set).start()  # just past the deadline
        late = await asker.ask(srv.endpoint, 3, tok, ["a"], timeout_s)
        took = time.monotonic() - t0
        states.gate.clear()  # no answer at all: the last look is bounded
        t1 = time.monotonic()
        none = await asker.ask(srv.endpoint, 3, tok, ["b"], timeout_s)
        return late, took, none + [f"{time.monotonic() - t1:.3f}"]
    try:
        late, took, none = _run(asker, run())
    finally:
        states.gate.set()
    assert late == ["a"], (late, took)
    assert t.grant(EP, ["a"]) == []  # granted once, at the consumer too
    assert none[:-1] == [] and float(none[-1]) < timeout_s + LAST_LOOK_S + 1.0, none


def test_a_grant_waiting_when_a_stopped_producer_resumes_is_taken(
        server_of: Callable[..., FenceServer]) -> None:
    """The producer's loop is stopped (here: blocked) from before the reply comes until
    past its deadline: on resume the reply and the deadline are due in the same turn of
    the loop.  The reply is taken (it is read before the deadline is looked at)."""
    states = Gated(grants.new_states(False))
    t = LoadTable(states)  # type: ignore[arg-type]
    t.start([_load("a")])
    srv = server_of(t, 3)
    asker = GrantAsker()
    timeout_s = 0.3
    states.gate.clear()

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()

        def stopped() -> None:  # the stop itself, not a wait for something: a sleep
            states.gate.set()
            wait_until(lambda: srv.counters()["asks"] == 1, timeout_s=5, what="the ask read")
            time.sleep(timeout_s)
        loop.call_later(0.05, stopped)
        return await asker.ask(srv.endpoint, 3, srv.token_for(EP), ["a"], timeout_s)
    try:
        assert _run(asker, run()) == ["a"]
    finally:
        states.gate.set()


# -- the lease ---------------------------------------------------------------------------------


def test_a_grant_read_after_its_lease_ran_out_is_not_taken(
        server_of: Callable[..., FenceServer]) -> None:
    """A producer stopped between its ask and its write may resume after its consumer's
    inner connector gave the load up and vLLM reused the blocks.  A grant is promised for
    its lease only, counted by the producer from its own send: a reply read after that
    grants nothing (the producer tells the consumer, which recomputes), however the
    consumer's table reads."""
    states = Gated(grants.PyStates(lease_ms=300))
    t = LoadTable(states)  # type: ignore[arg-type]
    t.start([_load("a"), _load("b")])
    srv = server_of(t, 3)
    tok = srv.token_for(EP)
    asker = GrantAsker()
    states.gate.clear()

    async def run() -> tuple[list[str], list[str]]:
        threading.Timer(0.5, states.gate.set).start()  # answered past the 0.3 s lease
        late = await asker.ask(srv.endpoint, 3, tok, ["a"], 5.0)
        return late, await asker.ask(srv.endpoint, 3, tok, ["b"], 5.0)  # in time
    try:
        late, in_time = _run(asker, run())
    finally:
        states.gate.set()
    assert (late, in_time) == ([], ["b"])
    assert asker.counts["expired"] == 1
    assert [ld.state for ld in t.end(["a"], EP)] == [LoadState.GRANTED]  # granted, not used


def test_a_grant_over_the_wire_holds_the_load_for_its_lease(
        native: bool, server_of: Callable[..., FenceServer]) -> None:
    """The consumer learns, as the load ends, when the lease of its grant ends: the
    moment the ask was read plus the lease (both drivers), which the reply carries; a
    local go-ahead (a pull) and a load never granted hold nothing."""
    t = LoadTable(grants.new_states(native, lease_ms=1500))
    t.start([_load(r) for r in "abc"])
    srv = server_of(t, 3)
    tok = bytes.fromhex(srv.token_for(EP))
    with _connect(srv.endpoint) as s:
        t0 = time.monotonic_ns()
        s.sendall(pack(encode_ask(1, 3, tok, [b"a"])))
        reply = grants.decode_reply(_read_frame(s), 1, 1)
        t1 = time.monotonic_ns()
    assert reply == grants.Reply([True], 1500)
    assert t.grant(EP, ["b"]) == ["b"]
    a, b, c = t.end(["a", "b", "c"], EP)
    assert (a.state, b.state, c.state) == (LoadState.GRANTED, LoadState.GRANTED, LoadState.WAITING)
    assert t0 + 1_500_000_000 <= a.lease_until_ns <= t1 + 1_500_000_000
    assert (b.lease_until_ns, c.lease_until_ns) == (0, 0)
    # the producer's count ends first: from its send, shortened for clock rates
    assert reply.until_ns(t0) < t0 + 1_500_000_000 <= a.lease_until_ns


def test_a_consumer_streaming_replies_never_asked_neither_stalls_nor_delays_the_producer(
        native: bool) -> None:
    """The endpoint a producer asks comes from the transfer request.  One that streams
    well-framed replies to nonces never asked (as fast as the producer reads) is no
    consumer: a consumer answers each ask once.  Its connection is dropped at the first
    such reply, the ask is granted nothing within its deadline, and the producer's loop
    never stalls (it read while the socket stayed readable: a 1.0 s ask returned after
    1.8 to 4.4 s, and the loop stalled up to 1.8 s)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    junk = b"".join(_reply(n, [True]) for n in range(1000, 1256))

    def flood() -> None:
        with lsock:
            lsock.settimeout(5.0)
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(0.5)
                try:
                    while not stop.is_set():
                        conn.sendall(junk)
                except OSError:
                    return  # the producer closed it
    th = threading.Thread(target=flood, daemon=True)
    th.start()
    ep = f"127.0.0.1:{lsock.getsockname()[1]}"
    asker = GrantAsker(native)

    async def run() -> tuple[list[str], float, float]:
        lag = 0.0

        async def ticker() -> None:
            nonlocal lag
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(0.01)
                lag = max(lag, loop.time() - t - 0.01)
        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        got = await asker.ask(ep, 1, TOK, ["a"], 1.0)
        took = time.monotonic() - t0
        tick.cancel()
        return got, took, lag
    try:
        got, took, lag = _run(asker, run())
    finally:
        stop.set()
        th.join(5.0)
    assert got == []
    assert took < 1.0 + LAST_LOOK_S, took
    assert lag < 0.2, f"the loop stalled {lag:.2f} s"
