"""shmhb feed without a real router: the plan (pure), and the feeder against a fake
router on 127.0.0.1 that speaks sglang-router's worker API and can be made to fail,
with real engine processes on a real board.  The real routers: tests/routers."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import shmhb
from shmhb import Status
from shmhb.errors import InvalidConfig
from shmhb.cli.feeder import Feeder, FeederConfig, Memory, Pending, plan
from shmhb.cli.feed import parse_router, reader
from shmhb.cli.routerapi import RouterWorker, SglangRouter, smg_conflict, client_for
from shmhb.testing.loopback import free_port

from ..conftest import ENGINE, Procs, inst, wait_until
from ..hosts import Cluster

A, S, D, L, U = Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT, Status.UNKNOWN


def rw(url: str = "http://127.0.0.5:8000", role: str = "prefill", bport: int | None = 8998,
       ident: str = "id-1") -> RouterWorker:
    return RouterWorker(url, role, bport, ident)


def ops(actions: list[Any]) -> list[tuple[str, str]]:
    return [(a.op, a.url) for a in actions]


def test_plan_removes_the_dead_and_leaves_unknown_and_strangers_alone() -> None:
    mem = Memory()
    stranger = rw("http://127.0.0.9:1", ident="s")
    listed = [rw(), stranger]
    assert ops(plan([inst("e", D)], listed, mem, lambda r: True)) == \
        [("remove", "http://127.0.0.5:8000")]
    assert plan([inst("e", L)], listed, Memory(), lambda r: True)[0].op == "remove"
    assert plan([inst("e", U)], listed, Memory(), lambda r: True) == []
    assert plan([inst("e", S)], listed, Memory(), lambda r: True) == []
    assert ops(plan([inst("e", S)], listed, Memory(), lambda r: True, act_on_suspect=True)) == \
        [("remove", "http://127.0.0.5:8000")]
    # the old incarnation dead, the new one alive at the same url: it stays
    assert plan([inst("e", D), inst("e2", A, inc=2)], listed, Memory(), lambda r: True) == []


def test_plan_replaces_a_worker_the_router_lists_unhealthy_while_its_instance_is_alive(
        ) -> None:
    """The router's own check failed it (a restart it missed while no feeder ran, a busy
    instance): alive on the board, it is removed and added, where the router takes adds;
    an add of it not yet confirmed is left to its retries; a dead one is only removed."""
    sick = RouterWorker("http://127.0.0.5:8000", "prefill", 8998, "id-1", healthy=False)
    url = sick.url
    assert ops(plan([inst("e", A)], [sick], Memory(), lambda r: True)) == \
        [("remove", url), ("add", url)]
    assert plan([inst("e", A)], [sick], Memory(), lambda r: False) == []
    assert plan([inst("e", U)], [sick], Memory(), lambda r: True) == []
    assert ops(plan([inst("e", D)], [sick], Memory(), lambda r: True)) == [("remove", url)]
    pending = Memory()
    pending.pending[url] = Pending(sick, retry_at_ns=0, tries=0)
    assert plan([inst("e", A)], [sick], pending, lambda r: True) == []
    assert plan([inst("e", A)], [rw()], Memory(), lambda r: True) == []  # healthy: as it is


def test_plan_adds_back_where_it_can_and_replaces_a_restarted_entry() -> None:
    mem = Memory()
    assert plan([inst("e", A)], [rw()], mem, lambda r: True) == []  # seen: remembered
    # removed earlier (not listed now), alive again: added with the role and bootstrap port
    acts = plan([inst("e2", A, inc=2)], [], mem, lambda r: True)
    assert [(a.op, a.role, a.bootstrap_port) for a in acts] == [("add", "prefill", 8998)]
    mem_no = Memory(seen=dict(mem.seen))
    said = plan([inst("e2", A, inc=2)], [], mem_no, lambda r: False)  # the router cannot
    assert [a.op for a in said] == ["cannot_add"]  # said once per incarnation
    assert plan([inst("e2", A, inc=2)], [], mem_no, lambda r: False) == []
    # restarted while listed (a death missed): its entry is stale, removed and added anew
    mem2 = Memory()
    plan([inst("e", A, inc=1)], [rw()], mem2, lambda r: True)
    assert ops(plan([inst("e", A, inc=5)], [rw()], mem2, lambda r: True)) == \
        [("remove", "http://127.0.0.5:8000"), ("add", "http://127.0.0.5:8000")]
    mem3 = Memory()
    plan([inst("e", A, inc=1)], [rw()], mem3, lambda r: False)
    assert ops(plan([inst("e", A, inc=5)], [rw()], mem3, lambda r: False)) == \
        [("remove", "http://127.0.0.5:8000")]


def test_plan_takes_a_draining_instance_out_and_keeps_it_out_until_the_drain_ends() -> None:
    mem = Memory()
    draining = dataclasses.replace(inst("e", A), draining=True)
    acts = plan([draining], [rw()], mem, lambda r: True)
    assert ops(acts) == [("remove", "http://127.0.0.5:8000")] and "draining" in acts[0].why
    assert plan([draining], [], mem, lambda r: True) == []  # not added back while it drains
    assert ops(plan([inst("e", A)], [], mem, lambda r: True)) == [("add", "http://127.0.0.5:8000")]


def test_plan_matches_by_bootstrap_port_when_no_serving_address() -> None:
    listed = [rw("http://127.0.0.5:9000", bport=8998, ident="a"),
              rw("http://127.0.0.5:9001", bport=8999, ident="b")]
    acts = plan([inst("e", D, serving=None, bootstrap="127.0.0.5:8999")], listed, Memory(),
                lambda r: True)
    assert ops(acts) == [("remove", "http://127.0.0.5:9001")]
    # same port on another host: no match, nothing done
    assert plan([inst("e", D, serving=None, bootstrap="127.0.0.6:8999")], listed, Memory(),
                lambda r: True) == []


def test_router_arguments_are_checked() -> None:
    for bad in ("vllm", "nginx=http://127.0.0.1:1", "vllm=127.0.0.1:1", "vllm=http://a b:1",
                "sglang=https://127.0.0.1:1"):
        with pytest.raises(InvalidConfig):
            parse_router(bad)
    with pytest.raises(InvalidConfig):
        FeederConfig(poll_s=0)
    assert client_for("vllm", "http://127.0.0.1:30000").can_add("prefill") is False
    assert client_for("sglang", "http://127.0.0.1:30000").can_add("prefill") is True
    assert client_for("smg", "http://127.0.0.1:30000").replaces is True
    with pytest.raises(InvalidConfig):
        FeederConfig(act_on_suspect="yes")  # type: ignore[arg-type]
    # by default a suspect instance is taken out only where the router can add it back
    read = lambda: []  # noqa: E731
    assert Feeder(read, lambda: 0, client_for("smg", "http://127.0.0.1:1")).acts_on_suspect()
    assert not Feeder(read, lambda: 0, client_for("vllm", "http://127.0.0.1:1")).acts_on_suspect()
    assert Feeder(read, lambda: 0, client_for("vllm", "http://127.0.0.1:1"),
                  FeederConfig(act_on_suspect=True)).acts_on_suspect()


def test_smg_conflicts_are_read_for_their_code_and_worker_id() -> None:
    msg = (b'{"error": "Worker already exists at URL \'http://127.0.0.2:1\' with ID '
           b'01a24eb4-19b9-7299-9f72-4c19dbad3612. Use PUT /workers/01a24eb4-19b9-7299-9f72-'
           b'4c19dbad3612 to replace", "code": "WORKER_ALREADY_EXISTS"}')
    assert smg_conflict(msg) == ("WORKER_ALREADY_EXISTS", "01a24eb4-19b9-7299-9f72-4c19dbad3612")
    for bad in (b"not json", b"[1]", b'{"code": 5, "error": null}'):
        assert smg_conflict(bad) == (None, None)


class FakeRouter:
    """sglang-router's worker API in memory; ``mode``: "ok", "error" (HTTP 500 to
    everything) or "slow" (each answer after 3 s: past the client's 1 s timeout)."""

    def __init__(self, workers: list[dict[str, Any]]) -> None:
        self.workers = {w["id"]: w for w in workers}
        self.mode = "ok"
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def answer(self, code: int, doc: Any) -> None:
                out = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def handle_any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                with fake.lock:
                    fake.calls.append((self.command, self.path))
                    mode = fake.mode
                if mode == "slow":
                    fake.release.wait(3)
                if mode == "error":
                    return self.answer(500, {"error": "boom"})
                with fake.lock:
                    if self.command == "GET" and self.path == "/workers":
                        return self.answer(200, {"workers": list(fake.workers.values())})
                    if self.command == "DELETE" and self.path.startswith("/workers/"):
                        fake.workers.pop(self.path.split("/")[-1], None)
                        return self.answer(202, {"status": "accepted"})
                    if self.command == "POST" and self.path == "/workers":
                        ident = uuid.uuid4().hex
                        fake.workers[ident] = dict(body, id=ident)
                        return self.answer(202, {"status": "accepted", "worker_id": ident})
                self.answer(404, {})

            do_GET = do_POST = do_DELETE = handle_any

        self.port = free_port(["127.0.0.1"])
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def urls(self) -> set[str]:
        with self.lock:
            return {w["url"] for w in self.workers.values()}

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_router() -> Any:
    r = FakeRouter([{"id": "p0", "url": "http://127.0.0.5:8000", "worker_type": "prefill",
                     "bootstrap_port": 8998},
                    {"id": "x", "url": "http://127.0.0.9:1", "worker_type": "decode"}])
    yield r
    r.close()


def test_feeder_follows_kill_and_restart_and_survives_a_failing_router(
        board: shmhb.Board, agent: object, procs: Procs, fake_router: FakeRouter) -> None:
    read, changes = reader([board], remote=True)
    client = SglangRouter(f"http://127.0.0.1:{fake_router.port}")
    f = Feeder(read, changes, client, FeederConfig(resync_s=0.3, backoff_s=0.05,
                                                   max_backoff_s=0.2)).start()
    try:
        p = procs.program(ENGINE, board.name, "eng-a", "prefill", "1")
        wait_until(lambda: ("GET", "/workers") in fake_router.calls, 5, what="first list")
        p.send_signal(signal.SIGKILL)
        p.wait(5)
        url = "http://127.0.0.5:8000"
        wait_until(lambda: url not in fake_router.urls(), 5, what="dead engine removed")
        assert "http://127.0.0.9:1" in fake_router.urls()  # a worker no instance matches stays
        # the router fails while the engine comes back: the feeder retries with backoff
        with fake_router.lock:
            fake_router.mode = "error"
            n0 = len(fake_router.calls)
        procs.program(ENGINE, board.name, "eng-b", "prefill", "1")
        wait_until(lambda: len(fake_router.calls) >= n0 + 3, 5, what="retries")
        with fake_router.lock:
            fake_router.mode = "slow"
        wait_until(lambda: f.failures >= 4, 10, what="a timed-out call")
        # the board is still followed while the router fails: eng-b dies and it is seen
        q = procs.procs[-1]
        wait_until(lambda: any(i.engine == "eng-b" and i.status is A for i in f.latest() or ()),
                   5, what="eng-b seen alive while the router fails")
        q.send_signal(signal.SIGKILL)
        q.wait(5)
        wait_until(lambda: any(i.engine == "eng-b" and i.status is D for i in f.latest() or ()),
                   5, what="eng-b seen dead while the router is slow")
        procs.program(ENGINE, board.name, "eng-c", "prefill", "1")
        with fake_router.lock:
            fake_router.mode = "ok"
        fake_router.release.set()
        wait_until(lambda: url in fake_router.urls(), 10, what="the restarted engine added back")
        with fake_router.lock:
            added = [w for w in fake_router.workers.values() if w["url"] == url]
        assert added and added[0]["worker_type"] == "prefill" and added[0]["bootstrap_port"] == 8998
    finally:
        f.stop()


def test_feeder_on_one_host_follows_an_engine_on_another_through_the_pinger(
        cluster: Cluster) -> None:
    """The feeder reads only host A's board; the engine runs on host B, whose instance
    slot reaches A in B's digest, and whose kill reaches A as a push."""
    a, b = cluster.host(), cluster.host()
    a.watch(b)
    url = f"http://{b.ip}:8000"
    router = FakeRouter([{"id": "p", "url": url, "worker_type": "prefill", "bootstrap_port": 8998}])
    read, changes = reader([a.board], remote=True)
    f = Feeder(read, changes, SglangRouter(f"http://127.0.0.1:{router.port}"),
               FeederConfig(resync_s=0.3)).start()
    try:
        p = cluster.procs.program(ENGINE, b.name, "eng-r", "prefill", "1", b.ip)
        wait_until(lambda: any(i.engine == "eng-r" and i.status is A and i.host
                               for i in f.latest() or ()), 10, what="B's instance seen from A")
        p.send_signal(signal.SIGKILL)
        p.wait(5)
        wait_until(lambda: url not in router.urls(), 10, what="B's dead engine removed")
        cluster.procs.program(ENGINE, b.name, "eng-r2", "prefill", "1", b.ip)
        wait_until(lambda: url in router.urls(), 10, what="B's restarted engine added back")
    finally:
        f.stop()
        router.close()
