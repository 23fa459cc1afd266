"""The Prometheus exporter, scraped over real HTTP on 127.0.0.1 and parsed with
prometheus_client's own parser."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

import shmhb
from shmhb import Status
from shmhb.agent.role import Agent
from shmhb.cli.exporter import Exporter
from shmhb.board.layout import HEADER_DTYPE, STAT_NAMES
from shmhb.testing.loopback import child_env

from ..conftest import ROOT, Procs, unlink_quietly, wait_until
from ..fakes import FakePinger

A, D = Status.ALIVE, Status.DEAD

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, sorted labels), and every family's type."""
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples: Samples = {}
    types = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


#: conftest's board with slow suspicion (5 s): these tests are not about hangs
pytestmark = pytest.mark.slow_suspicion


@pytest.fixture
def exporter(board: shmhb.Board) -> Iterator[Exporter]:
    with Exporter(board.name, addr="127.0.0.1", port=0) as e:
        yield e


def _poke_stat(board: shmhb.Board, name: str, value: int) -> None:
    """Test-only: set one of the agent's counters as if the pinger had counted."""
    i = HEADER_DTYPE.fields["stats"][1] // 8 + STAT_NAMES.index(name)
    board._q[i] = value


def test_one_scrape_has_every_metric(board: shmhb.Board, procs: Procs, local_agent: Agent,
                                     exporter: Exporter) -> None:
    for k in range(3):
        procs.worker(board.name, f"rank-{k}")
    FakePinger(board).host(0, "10.9.0.2:45645", A, 0.25,
                           [("decode-0", 77, 5, A, ["10.9.0.2:31000"]),
                            ("decode-1", 78, 6, D, ["10.9.0.2:31001"])])
    _poke_stat(board, "bad_auth", 3)
    _poke_stat(board, "bad_replay", 2)
    assert exporter.port > 0 and exporter.url.startswith("http://127.0.0.1:")
    s, types = scrape(exporter.url)
    assert get(s, "shmhb_board_up") == 1
    assert get(s, "shmhb_board_capacity_slots") == 64
    for k in range(3):
        key = f"rank-{k}"
        assert get(s, "shmhb_slot_status", key=key, status="alive") == 1
        for other in ("suspect", "dead", "left", "unknown"):
            assert get(s, "shmhb_slot_status", key=key, status=other) == 0
        assert 0 <= get(s, "shmhb_slot_age_seconds", key=key) < 2
        assert get(s, "shmhb_slot_incarnation", key=key) == board.slot(key).incarnation  # type: ignore[union-attr]
    assert get(s, "shmhb_agent_up") == 1 and get(s, "shmhb_agent_role_held") == 1
    assert get(s, "shmhb_agent_term") >= 1
    assert 0 <= get(s, "shmhb_agent_loop_lateness_seconds") < 5
    assert get(s, "shmhb_peer_status", peer="10.9.0.2:45645", status="alive") == 1
    assert get(s, "shmhb_peer_rtt_seconds", peer="10.9.0.2:45645") == pytest.approx(0.00025)
    assert get(s, "shmhb_peer_last_ack_age_seconds", peer="10.9.0.2:45645") >= 0
    assert get(s, "shmhb_remote_slot_status", peer="10.9.0.2:45645", key="decode-1", status="dead") == 1
    assert get(s, "shmhb_remote_slot_incarnation", peer="10.9.0.2:45645", key="decode-0") == 5
    assert get(s, "shmhb_bad_frames_total", reason="auth") == 3
    assert get(s, "shmhb_bad_frames_total", reason="replay") == 2
    assert get(s, "shmhb_bad_frames_total", reason="magic") == 0
    assert get(s, "shmhb_deaths_total") == 0 and get(s, "shmhb_restarts_total") == 0
    assert get(s, "shmhb_remote_restarts_total", peer="10.9.0.2:45645") == 0
    for c in ("shmhb_deaths", "shmhb_restarts", "shmhb_bad_frames", "shmhb_agent_late_loops",
              "shmhb_pings_sent", "shmhb_acks_received"):
        assert types[c] == "counter", c
    assert types["shmhb_slot_status"] == "gauge"


def test_probes_beside_metrics(board: shmhb.Board, exporter: Exporter) -> None:
    base = exporter.url.rsplit("/", 1)[0]

    def get_path(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(base + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert get_path("/healthz") == (200, "ok\n")
    code, body = get_path("/readyz")  # no agent has run on this board
    assert code == 503 and "no agent has run" in body, body
    assert get_path("/")[0] == 404 and get_path("/metricsx")[0] == 404
    code, body = get_path("/nope")
    for served in ("/metrics", "/healthz", "/readyz", "/instances"):  # every path it serves
        assert served in body, body
    assert get_path("/instances")[0] == 200
    a = Agent(board.name, config=shmhb.AgentConfig(tick_s=0.02), network=False).start()
    try:
        assert a.holding.wait(5)
        code, body = get_path("/readyz")
        assert code == 200 and "alive" in body, body
    finally:
        a.stop()
    code, body = get_path("/readyz")
    assert code == 503 and "left" in body, body
    samples, _ = scrape(exporter.url)
    info = [k for k in samples if k[0] == "shmhb_build_info"]
    assert len(info) == 1 and samples[info[0]] == 1
    labels = dict(info[0][1])
    assert labels["version"] == shmhb.__version__ and labels["native"] in ("true", "false")


@pytest.mark.system
def test_status_agent_only_probe(board: shmhb.Board) -> None:
    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shmhb", "status", "--agent-only",
                               "--board", board.name], capture_output=True, text=True,
                              timeout=60, env=child_env())
    assert probe().returncode == 3
    with board.register("w", agent=False):  # a worker does not make the agent healthy
        assert probe().returncode == 3
        a = Agent(board.name, config=shmhb.AgentConfig(tick_s=0.02), network=False).start()
        try:
            assert a.holding.wait(5)
            out = probe()
            assert out.returncode == 0 and "alive" in out.stdout
        finally:
            a.stop()
    assert probe().returncode == 3  # it left: this probe wants a running agent


def test_every_metric_is_documented(board: shmhb.Board, local_agent: Agent, exporter: Exporter) -> None:
    FakePinger(board).host(0, "h:1", A, 0.1, [("x", 1, 1, A, ["h:2"])])
    with board.register("w", agent=False):
        _, types = scrape(exporter.url)
    with open(os.path.join(ROOT, "docs", "METRICS.md")) as f:
        doc = f.read()
    documented = set(re.findall(r"^\| `(shmhb_[a-z_]+)`", doc, re.MULTILINE))
    exposed = {n + ("_total" if t == "counter" else "") for n, t in types.items()
               if n.startswith("shmhb_")}
    assert exposed == documented, (exposed ^ documented)


def test_deaths_and_restarts_are_counted(board: shmhb.Board, procs: Procs, local_agent: Agent,
                                         exporter: Exporter) -> None:
    w = procs.worker(board.name, "r")
    s, _ = scrape(exporter.url)
    inc0 = get(s, "shmhb_slot_incarnation", key="r")
    w.kill()
    wait_until(lambda: (x := board.slot("r")) and x.status is D)
    s, _ = scrape(exporter.url)
    assert get(s, "shmhb_deaths_total") == 1
    assert get(s, "shmhb_slot_status", key="r", status="dead") == 1
    assert get(s, "shmhb_restarts_total") == 0
    procs.worker(board.name, "r")
    s, _ = scrape(exporter.url)
    assert get(s, "shmhb_slot_incarnation", key="r") > inc0
    assert get(s, "shmhb_restarts_total") == 1
    s, _ = scrape(exporter.url)
    assert get(s, "shmhb_restarts_total") == 1  # counted once, not once per scrape
    fp = FakePinger(board)
    fp.host(0, "h:1", A, 0.1, [("x", 1, 1, A, ["h:2"])])
    scrape(exporter.url)
    fp.host(0, "h:1", A, 0.1, [("x", 2, 9, A, ["h:2"])])
    s, _ = scrape(exporter.url)
    assert get(s, "shmhb_remote_restarts_total", peer="h:1") == 1


def test_a_scrape_reads_the_board_once(board: shmhb.Board, exporter: Exporter,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import shmhb.cli.exporter as ex

    calls = []
    real = ex.read_view

    def counting(b: shmhb.Board, **kw: object) -> object:
        calls.append(1)
        return real(b)

    monkeypatch.setattr(ex, "read_view", counting)
    scrape(exporter.url)
    assert len(calls) == 1
    scrape(exporter.url)
    assert len(calls) == 2


def test_missing_then_recreated_board() -> None:
    name = f"shmhb-test-{uuid.uuid4().hex[:12]}"
    try:
        with Exporter(name, port=0) as e:
            s, _ = scrape(e.url)
            assert get(s, "shmhb_board_up") == 0
            assert not any(k[0] == "shmhb_slot_status" for k in s)
            b = shmhb.Board.create(name, slots=8)
            with b.register("first", agent=False):
                s, _ = scrape(e.url)
                assert get(s, "shmhb_board_up") == 1 and get(s, "shmhb_board_capacity_slots") == 8
            b.unlink()
            b.close()
            s, _ = scrape(e.url)
            assert get(s, "shmhb_board_up") == 0  # removed: no stale numbers
            b2 = shmhb.Board.create(name, slots=16)
            with b2.register("second", agent=False):
                s, _ = scrape(e.url)
                assert get(s, "shmhb_board_capacity_slots") == 16
                assert get(s, "shmhb_slot_status", key="second", status="alive") == 1
                assert ("shmhb_slot_status", (("key", "first"), ("status", "left"))) not in s
            b2.close()
    finally:
        unlink_quietly(name)


def test_exporter_command_serves_and_stops_on_sigterm(board: shmhb.Board, procs: Procs) -> None:
    procs.worker(board.name, "w")
    p = subprocess.Popen([sys.executable, "-m", "shmhb", "exporter", "--board", board.name,
                          "--port", "0", "--addr", "127.0.0.1"], stdout=subprocess.PIPE,
                         text=True, env=child_env())
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+/metrics)", line)
        assert url, line
        s, _ = scrape(url.group(1))
        assert get(s, "shmhb_slot_status", key="w", status="alive") == 1
        p.terminate()
        assert p.wait(30) == 0
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url.group(1), timeout=5)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()


@pytest.mark.system
def test_exporter_command_reports_a_busy_port(board: shmhb.Board, exporter: Exporter) -> None:
    out = subprocess.run([sys.executable, "-m", "shmhb", "exporter", "--board", board.name,
                          "--port", str(exporter.port)], capture_output=True, text=True,
                         timeout=60, env=child_env())
    assert out.returncode == 2 and "cannot listen" in out.stderr


def test_restart_memory_holds_only_what_the_board_shows(board: shmhb.Board, local_agent: Agent,
                                                       exporter: Exporter) -> None:
    """The incarnations remembered to count restarts are those the last scrape saw:
    keys that churn (vLLM rank keys carry a per-process engine id; a followed host brings
    up to 4,096 keys per ack) are forgotten once gone, instead of piling up (12,000
    entries on a 64-slot board).  A restart is still counted, and past the limit keys
    are not followed, counted by a metric."""
    import shmhb.cli.exporter as ex
    from shmhb.cli.view import read_view

    fp = FakePinger(board)
    for round_ in range(30):
        fp.host(0, "h:1", A, 0.1, [(f"e{round_}-{i}", 1, 1, A, ["h:2"]) for i in range(10)])
        s, _ = scrape(exporter.url)
        assert get(s, "shmhb_restart_keys") == 10
    fp.host(0, "h:1", A, 0.1, [("e29-0", 2, 9, A, ["h:2"])])
    s, _ = scrape(exporter.url)
    assert get(s, "shmhb_restart_keys") == 1
    assert get(s, "shmhb_remote_restarts_total", peer="h:1") == 1
    counter = ex.RestartCounter(limit=4)
    fp.host(0, "h:1", A, 0.1, [(f"k{i}", 1, 1, A, ["h:2"]) for i in range(6)])
    counter.observe(read_view(board))
    assert (counter.remembered, counter.over_limit) == (4, 2)
