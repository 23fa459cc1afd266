"""A prefill host (127.0.0.2) and a decode host (127.0.0.3), each with its own board and
pinger, running SGLang disaggregation ranks (``tests/sglang/engine.py``), stock or with
shmhb's wrapper switched on (``SHMHB_SGLANG=1``, picked up through SGLang's own plugin
loading).  Used by the tests in this folder and by ``python -m bench.sglang``.  Every
wait has a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from shmhb.testing.loopback import child_env, free_port
from tests.conftest import ROOT, wait_until
from tests.hosts import Cluster

import shmhb
from shmhb import Status
from ..stopping import resume

PREFILL_IP, DECODE_IP = "127.0.0.2", "127.0.0.3"
STUB = os.path.join(ROOT, "tests", "sglang", "torchvision_stub")
#: short policy so hangs are judged within seconds; kills are seen through pidfds
POLICY = shmhb.Policy(suspect_after_s=0.5, dead_after_s=2.0,
                      peer_suspect_after_s=0.5, peer_dead_after_s=2.0)
#: what every rank process runs with: the import-time torchvision stand-in, Mooncake's
#: TCP transport, and nothing that may look up a model hub (child_env adds the switches)
ENV = {
    "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1", "PYTHONUNBUFFERED": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "5", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}


class Rank:
    """One rank process: commands in on stdin, JSON events out on stdout."""

    def __init__(self, role: str, ip: str, board: str, *, wrapped: bool, bootstrap_port: int,
                 log_dir: str, pages: int = 64, env: dict[str, str] | None = None,
                 http_port: int | None = None) -> None:
        """``http_port``: its HTTP front's (``tests/sglang/front.py``), also its serving
        URL for the wrapper (``SHMHB_SGLANG_SERVING_URL``: the instance slot routers are
        fed from)."""
        self.role, self.ip, self.wrapped = role, ip, wrapped
        self.bootstrap_port = bootstrap_port
        self.bootstrap = f"{ip}:{bootstrap_port}"
        self.http_port = http_port
        e = child_env(**ENV)
        e["PYTHONPATH"] = os.pathsep.join([e["PYTHONPATH"], STUB])
        e["SHMHB_BOARD"] = board
        e["SHMHB_SGLANG"] = "1" if wrapped else "0"
        if http_port is not None:
            e["SHMHB_SGLANG_SERVING_URL"] = self.url
        e.update(env or {})
        self.log_path = os.path.join(log_dir, f"{role}-{'w' if wrapped else 's'}-"
                                              f"{uuid.uuid4().hex[:6]}.log")
        cmd = [sys.executable, "-m", "tests.sglang.engine", "--role", role, "--ip", ip,
               "--bootstrap-port", str(bootstrap_port), "--dist-port",
               str(free_port([ip])), "--model-dir", os.path.join(log_dir, "model"),
               "--pages", str(pages)] + ([] if http_port is None else
                                         ["--http-port", str(http_port)])
        with open(self.log_path, "wb") as log:
            self.p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, env=e)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.p.pid
        self.ready = self.expect("ready", timeout_s=240)

    @property
    def url(self) -> str:
        """Its HTTP front's address (with ``http_port``)."""
        return f"http://{self.ip}:{self.http_port}"

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue

    def send(self, op: str, **kw: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.p.stdin.flush()

    def expect(self, *names: str, room: int | None = None, timeout_s: float = 30.0
               ) -> dict[str, Any]:
        """The next event named one of ``names`` (for ``room``, if given); others wait in
        ``seen``."""
        for ev in self.seen:
            if ev["ev"] in names and (room is None or ev.get("room") == room):
                self.seen.remove(ev)
                return ev
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.role}: no {names} for room {room} within "
                                     f"{timeout_s} s\n{self.log_tail()}")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.p.poll() is not None:
                    raise AssertionError(f"{self.role} exited with {self.p.returncode}\n"
                                         + self.log_tail()) from None
                continue
            if ev["ev"] in names and (room is None or ev.get("room") == room):
                return ev
            self.seen.append(ev)

    def send_at(self, op: str, **kw: Any) -> float:
        """``send``, returning ``time.monotonic()`` from before it (the ranks' clock)."""
        t = time.monotonic()
        self.send(op, **kw)
        return t

    def request(self, op: str, reply: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.expect(reply)

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def kill(self) -> float:
        t = time.monotonic()
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)
        return t

    def stop(self) -> float:
        t = time.monotonic()
        os.kill(self.p.pid, signal.SIGSTOP)
        return t

    def cont(self) -> None:
        resume(self.p.pid)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                resume(self.p.pid)
                self.send("quit")
            except OSError:  # it exited meanwhile
                pass
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        for s in (self.p.stdin, self.p.stdout):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


class Stack:
    """The two hosts, their pingers, and the ranks started on them."""

    def __init__(self, cluster: Cluster, log_dir: str, *, wrapped: bool) -> None:
        self.cluster, self.log_dir, self.wrapped = cluster, log_dir, wrapped
        self.prefill_host = cluster.host(policy=POLICY, ip=PREFILL_IP, interval_s=0.1)
        self.decode_host = cluster.host(policy=POLICY, ip=DECODE_IP, interval_s=0.1)
        self.bootstrap_port = free_port([PREFILL_IP])
        self.ranks: list[Rank] = []

    def start(self, role: str, **kw: Any) -> Rank:
        host = self.prefill_host if role == "prefill" else self.decode_host
        kw.setdefault("wrapped", self.wrapped)
        kw.setdefault("bootstrap_port", self.bootstrap_port)
        r = Rank(role, host.ip, host.name, log_dir=self.log_dir, **kw)
        self.ranks.append(r)
        return r

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def new_room() -> int:
    return random.getrandbits(62)


def alive_on_decode_host(stack: Stack, p: Rank, timeout_s: float = 20.0) -> None:
    """Until the decode host's board reads prefill ``p``'s rank ALIVE at its rank port."""
    ep = f"{p.ip}:{p.ready['rank_port']}"
    stack.decode_host.board.watch(ep)
    wait_until(lambda: (s := stack.decode_host.board.remote(ep)) is not None
               and s.status is Status.ALIVE and s.pid == p.pid,
               timeout_s=timeout_s, what=f"prefill {ep} alive on the decode host")
