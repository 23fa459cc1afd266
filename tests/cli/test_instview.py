"""/instances and /instances/changes beside /metrics (shmhb.cli.instview): the change log
alone, then the exporter over real HTTP with a real engine killed and restarted."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import urllib.error
import urllib.request
from typing import Any

import shmhb
from shmhb import Status
from shmhb.cli.exporter import Exporter
from shmhb.cli.instview import SCHEMA, InstanceLog

from ..conftest import ENGINE, Procs, inst


def test_the_change_log_resumes_from_a_revision_and_resets_when_it_cannot() -> None:
    log = InstanceLog(keep=3)
    assert log.update([inst("e1", Status.ALIVE)]) == 1
    assert log.update([inst("e1", Status.ALIVE)]) == 1  # nothing changed
    snap = log.snapshot()
    assert snap["schema"] == SCHEMA and snap["revision"] == 1 and len(snap["instances"]) == 1
    log.update([inst("e1", Status.DEAD), inst("e2", Status.ALIVE, inc=2)])
    got = log.since(1, log.epoch)
    assert [(c["op"], c["instance"]["engine_id"], c["instance"]["status"]) for c in got["changes"]] \
        == [("changed", "e1", "dead"), ("added", "e2", "alive")]
    assert got["revision"] == 3 and "reset" not in got
    assert log.since(3, log.epoch)["changes"] == []
    log.update([inst("e2", Status.ALIVE, inc=2)])
    assert log.since(3, log.epoch)["changes"][0]["op"] == "removed"
    for rev, epoch in ((0, log.epoch), (1, "another-run"), (99, log.epoch)):
        r = log.since(rev, epoch)  # too old (kept 3), another exporter's run, from the future
        assert r["reset"] is True and r["revision"] == 4 and len(r["instances"]) == 1, (rev, epoch)
    assert log.snapshot(live_only=True)["instances"][0]["engine_id"] == "e2"


def test_a_drain_is_a_change_and_a_draining_instance_is_not_live() -> None:
    log = InstanceLog()
    log.update([inst("e1", Status.ALIVE)])
    log.update([dataclasses.replace(inst("e1", Status.ALIVE), draining=True)])
    got = log.since(1, log.epoch)["changes"]
    assert [(c["op"], c["instance"]["draining"]) for c in got] == [("changed", True)]
    assert log.snapshot(live_only=True)["instances"] == []


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_exporter_serves_instances_and_their_changes(board: shmhb.Board, agent: object,
                                                     procs: Procs) -> None:
    with Exporter(board.name, port=0) as ex:
        base = f"http://127.0.0.1:{ex.port}"
        code, doc = get(base + "/instances?live=1")
        assert code == 503 and doc["instances"] == []  # nothing alive: not ready
        p = procs.program(ENGINE, board.name, "eng-a", "prefill", "1")
        code, doc = get(base + "/instances?live=1")
        assert code == 200 and doc["schema"] == SCHEMA
        (i,) = doc["instances"]
        assert (i["engine_id"], i["role"], i["status"], i["url"], i["bootstrap"]) == \
            ("eng-a", "prefill", "alive", "http://127.0.0.5:8000", "127.0.0.5:8998")
        rev, epoch = doc["revision"], doc["epoch"]
        # a long poll, answered when the engine dies
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(
            r=get(f"{base}/instances/changes?since={rev}&epoch={epoch}&wait_s=10")))
        t.start()
        p.send_signal(signal.SIGKILL)
        p.wait(5)
        t.join(15)
        code, ch = out["r"]
        assert code == 200 and [c["instance"]["status"] for c in ch["changes"]] == ["dead"]
        code, again = get(f"{base}/instances/changes?since=0&epoch=other")
        assert again["reset"] is True and again["instances"][0]["status"] == "dead"
        for bad in ("since=-1", "since=x", "wait_s=99", "epoch=" + "e" * 65):
            assert get(f"{base}/instances/changes?{bad}")[0] == 400, bad
        assert urllib.request.urlopen(base + "/metrics", timeout=10).status == 200


def _cpu_s(pid: int) -> float:
    import os
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_long_polls_neither_shut_probes_out_nor_spin(board: shmhb.Board, agent: object,
                                                     procs: Procs) -> None:
    """As many waiting long polls as the exporter has slots (the documented router
    usage, ``wait_s=30``): probes, a scrape and a plain read still get through (the
    long poll waiting the longest answers early, with no changes, and is asked again),
    and the waiting polls cost next to no CPU (they look at the board's change counter,
    not read the board every 10 ms: 16 of them took 62 % of a core)."""
    import re
    import subprocess
    import sys
    import time

    from shmhb.cli.httpserve import MAX_CONNECTIONS
    from shmhb.testing.loopback import child_env

    procs.program(ENGINE, board.name, "eng-a", "prefill", "1")
    p = subprocess.Popen([sys.executable, "-m", "shmhb", "exporter", "--board", board.name,
                          "--port", "0", "--addr", "127.0.0.1"], stdout=subprocess.PIPE,
                         text=True, env=child_env())
    try:
        assert p.stdout is not None
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", p.stdout.readline())
        assert m
        threads0 = _threads(p.pid)  # before any request: no handler thread yet
        base = f"http://127.0.0.1:{m.group(1)}"
        code, doc = get(base + "/instances?live=1")
        assert code == 200
        polls: list[dict[str, Any]] = [{} for _ in range(MAX_CONNECTIONS)]
        url = f"{base}/instances/changes?since={doc['revision']}&epoch={doc['epoch']}&wait_s=30"

        def poll(out: dict[str, Any]) -> None:
            try:
                out["r"] = get(url)
            except OSError as e:  # refused: what must not happen
                out["error"] = repr(e)
        for out in polls:
            threading.Thread(target=poll, args=(out,), daemon=True).start()
        deadline = time.monotonic() + 30
        while _threads(p.pid) < threads0 + MAX_CONNECTIONS:
            assert not any("error" in o for o in polls), polls
            assert time.monotonic() < deadline, "the long polls never all waited"
            time.sleep(0.05)
        c0, t0 = _cpu_s(p.pid), time.monotonic()
        time.sleep(2.0)  # a window to measure the waiting polls' CPU over, not a wait
        used, wall = _cpu_s(p.pid) - c0, time.monotonic() - t0
        assert used < 0.1 * wall, f"{used:.2f} s of CPU in {wall:.2f} s: waiting polls spin"
        for path in ("/readyz", "/healthz", "/metrics", "/instances?live=1"):
            with urllib.request.urlopen(base + path, timeout=10) as r:
                assert r.status == 200, path
        answered = [o["r"] for o in polls if "r" in o]
        assert not any("error" in o for o in polls), polls
        assert answered and all(code == 200 and ch["changes"] == [] for code, ch in answered)
    finally:
        p.kill()
        p.wait(10)
        if p.stdout:
            p.stdout.close()
