"""A P/D stack on loopback for the real routers: simulated hosts (each its own board and
``shmhb pinger`` holding the agent role, on its own 127.0.0.x), stand-in prefill and
decode instances (``tests.routers.standin``), a real vllm-router, sglang-router or smg in PD
mode on 127.0.0.1, optionally ``shmhb feed`` in front of it, and a steady client.

Used by tests/routers and by ``python -m bench.routers``.  Everything it starts is
ended and every board removed by ``close()``.  Waits are conditions with deadlines.
Both move into a network namespace of their own first where they run as root
(:func:`private_network`), and check the routers' logs for hub lookups
(:func:`hub_lookups`).
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import Any

import shmhb
from shmhb.testing.loopback import child_env, free_port

#: the tightest health check the routers take (the issue's "tuned" column)
TUNED = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
         "--health-check-timeout-secs", "1"]


_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then ifr_flags in the union (40 bytes)


def only_loopback() -> bool:
    """Whether this thread's network namespace has no interface but ``lo``."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def private_network() -> bool:
    """Move this process into a network namespace of its own whose only interface is
    ``lo``, brought up, so that nothing it or its children start can send a packet off
    the host, whatever they try.  Only root may (``unshare(CLONE_NEWNET)``): returns
    False, changing nothing, for any other user; True once isolated (at once if already).

    Call it from the main thread before any other thread starts: a namespace belongs to
    the thread that made it and to what that thread starts later, so a thread started
    earlier stays outside.  Loopback traffic between the process's own hosts (127.0.0.x)
    and its children works as before; shared memory is not a network resource and is
    shared as before."""
    if only_loopback():
        return True
    if os.geteuid() != 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (a container "
                           f"without CAP_SYS_ADMIN? run the tests as an unprivileged user, or "
                           f"in `unshare -n` yourself)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    return only_loopback()


def bench_refusal(kinds: Collection[str]) -> str | None:
    """Why a bench of the ``kinds`` routers cannot run here, or None: then this process is
    in a loopback-only network namespace wherever it runs as root (:func:`private_network`)."""
    for k in kinds:
        if router_binary(k) is None:
            return f"{k} router not installed: pip install '.[routers]'"
    if not private_network() and os.geteuid() == 0:
        return "as root, yet not in a network namespace of loopback only"
    return None


#: What a router writes when it tries to reach a model hub: a download, a tokenizer load
#: or fetch (sglang-router: "Loading tokenizer 'M' from source: M", "Failed to download
#: tokenizer from HuggingFace ..."), the hub by name.  Its "No tokenizer_path or
#: model_path found" is the absence of an attempt and does not match.
HUB_LOOKUP = re.compile(r"download|hugging ?face|hf[_-]?hub|\bhub\b|(?:loading|fetching|fetch) tokenizer",
                        re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def hub_lookups(log: str) -> list[str]:
    """The lines of a router's log that show an attempt to reach a model hub."""
    return [ln for ln in _ANSI.sub("", log).splitlines() if HUB_LOOKUP.search(ln)]


def router_binary(kind: str) -> str | None:
    """The router's console command in this interpreter's environment, or None."""
    name = {"vllm": "vllm-router", "sglang": "sglang-router", "smg": "smg"}[kind]
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def wait_for(pred: Any, timeout_s: float, what: str, poll_s: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def http_json(host: str, port: int, method: str, path: str, body: Any = None,
              timeout_s: float = 2.0) -> tuple[int, Any]:
    assert host.startswith("127."), "loopback only"
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"content-type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")
    finally:
        conn.close()


@dataclass
class Instance:
    name: str
    role: str
    ip: str
    port: int
    bootstrap_port: int | None
    board: str
    engine_id: str
    log: str
    proc: subprocess.Popen[str] | None = None
    compute_ms: float = 20.0  # per prefill and per KV fetch
    serving_url: bool = True  # registered with its serving address (else bootstrap only)
    drain_timeout_s: float = 10.0  # its drain on SIGTERM (0: it stops at once, as stock)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def served_since(self, t_ns: int, what: str | None = None) -> list[int]:
        """Monotonic times of the requests it took at or after ``t_ns`` (from its log);
        ``what``: only lines for that path (``/kv``: KV fetches it served)."""
        try:
            with open(self.log) as f:
                rows = [line.split() for line in f if line.strip()]
        except FileNotFoundError:
            return []
        return [int(r[0]) for r in rows if len(r) == 2 and int(r[0]) >= t_ns
                and (what is None or r[1] == what) and (what is not None or r[1] != "/kv")]


@dataclass
class Result:
    t_send: int
    t_done: int
    status: int  # HTTP status; 0: no answer (refused, timeout)


@dataclass
class Client:
    """Sends POST /v1/completions at ``rate_hz`` (each on its own thread, ``timeout_s``)
    until stopped; ``results`` in send order."""

    port: int
    rate_hz: float = 50.0
    timeout_s: float = 4.0
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _one(self) -> None:
        t0 = time.monotonic_ns()
        try:
            st, _ = http_json("127.0.0.1", self.port, "POST", "/v1/completions",
                              {"model": "standin", "prompt": "hello", "max_tokens": 1},
                              timeout_s=self.timeout_s)
        except (OSError, http.client.HTTPException):
            st = 0
        with self._lock:
            self.results.append(Result(t0, time.monotonic_ns(), st))

    def _run(self) -> None:
        gap = 1.0 / self.rate_hz
        nxt = time.monotonic()
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self._threads.append(t)
            nxt += gap
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def start(self) -> Client:
        th = threading.Thread(target=self._run, daemon=True)
        th.start()
        self._threads.append(th)
        return self

    def stop(self) -> list[Result]:
        self._stop.set()
        for t in list(self._threads):
            t.join(self.timeout_s + 2)
        with self._lock:
            return sorted(self.results, key=lambda r: r.t_send)


class PdStack:
    def __init__(self, tmp: str, *, hosts: int = 3, policy: shmhb.Policy | None = None,
                 boards: dict[str, shmhb.Board] | None = None) -> None:
        """``hosts`` simulated hosts of its own (boards and pingers, removed by ``close``),
        or ``boards``: hosts someone else runs, by ip (their instances added with
        ``add_served``), for the router and the feeder alone."""
        self.tmp = tmp
        self.own_boards = boards is None
        self.ips = [f"127.0.0.{2 + i}" for i in range(hosts)] if boards is None else list(boards)
        self.policy = policy or shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.0)
        self.procs: list[subprocess.Popen[Any]] = []
        self.boards: dict[str, shmhb.Board] = dict(boards or {})
        self.instances: dict[str, Instance] = {}
        self.router: subprocess.Popen[bytes] | None = None
        self.router_port = 0
        self.feeder: subprocess.Popen[str] | None = None
        self.feed_lines: list[str] = []
        tag = uuid.uuid4().hex[:8]
        for i, ip in enumerate(self.ips if self.own_boards else ()):
            name = f"shmhb-rt-{tag}-{i}"
            self.boards[ip] = shmhb.Board.create(name, policy=self.policy, slots=16)
            self._spawn([sys.executable, "-m", "shmhb", "pinger", "--board", name,
                         "--tick-s", "0.02"], f"pinger-{i}")
        for ip, b in self.boards.items():
            wait_for(lambda b=b: b.agent().status is shmhb.Status.ALIVE, 20, f"agent of {ip}")

    # -- processes ------------------------------------------------------------------------

    def _spawn(self, cmd: list[str], label: str, text: bool = False) -> subprocess.Popen[Any]:
        out = open(os.path.join(self.tmp, label + ".log"), "ab")
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if text else out,
                                 stderr=out, env=child_env(), text=text)
        finally:
            out.close()
        self.procs.append(p)
        return p

    def log_tail(self, label: str, n: int = 30) -> str:
        try:
            with open(os.path.join(self.tmp, label + ".log"), "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return ""

    def add_instance(self, name: str, role: str, host: int, *, serving_url: bool = True,
                     compute_ms: float = 20.0, drain_timeout_s: float = 10.0) -> Instance:
        ip = self.ips[host]
        port = free_port([ip], span=2)
        inst = Instance(name, role, ip, port, port + 1 if role == "prefill" else None,
                        self.boards[ip].name, "", os.path.join(self.tmp, name + ".served"),
                        compute_ms=compute_ms, serving_url=serving_url,
                        drain_timeout_s=drain_timeout_s)
        self.instances[name] = inst
        self.start(name)
        return inst

    def add_served(self, name: str, role: str, ip: str, port: int,
                   bootstrap_port: int | None) -> Instance:
        """An instance another process serves at ``ip:port`` (on the host of board
        ``self.boards[ip]``), for ``start_router``; it is not started or ended here."""
        inst = Instance(name, role, ip, port, bootstrap_port, self.boards[ip].name, name,
                        os.path.join(self.tmp, name + ".served"))
        self.instances[name] = inst
        return inst

    def start(self, name: str, serve_after_s: float = 0.0) -> Instance:
        """(Re)start instance ``name`` under a new engine id (vLLM's default on a restart);
        ``serve_after_s``: its HTTP servers answer only that long after it registered."""
        inst = self.instances[name]
        inst.engine_id = f"{name}-{uuid.uuid4().hex[:12]}"
        cmd = [sys.executable, "-m", "tests.routers.standin", "--role", inst.role, "--host",
               inst.ip, "--port", str(inst.port), "--board", inst.board, "--engine-id",
               inst.engine_id, "--log", inst.log,
               "--compute-ms", str(inst.compute_ms), "--serve-after-s", str(serve_after_s),
               "--drain-timeout-s", str(inst.drain_timeout_s)]
        if inst.bootstrap_port is not None:
            cmd += ["--bootstrap-port", str(inst.bootstrap_port)]
        if not inst.serving_url:
            cmd += ["--no-serving-url"]
        p = self._spawn(cmd, name, text=True)
        line = p.stdout.readline() if p.stdout else ""
        if not line.startswith("ready"):
            raise AssertionError(f"stand-in {name} did not start:\n" + self.log_tail(name))
        inst.proc = p
        return inst

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to instance ``name``; returns the monotonic time just before."""
        p = self.instances[name].proc
        assert p is not None
        t = time.monotonic_ns()
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait(10)
        return t

    def start_router(self, kind: str, extra: list[str] = ()) -> int:  # type: ignore[assignment]
        exe = router_binary(kind)
        assert exe is not None, f"{kind} router not installed"
        ports = free_port(["127.0.0.1"], span=2)
        self.router_port = ports
        pre = [i for i in self.instances.values() if i.role == "prefill"]
        dec = [i for i in self.instances.values() if i.role == "decode"]
        cmd = [exe] + (["launch"] if kind in ("sglang", "smg") else [])
        cmd += ["--host", "127.0.0.1", "--port", str(ports), "--prometheus-port", str(ports + 1),
                "--prometheus-host", "127.0.0.1", "--policy", "round_robin"]
        cmd += ["--pd-disaggregation"] if kind in ("sglang", "smg") else \
            ["--vllm-pd-disaggregation", "--kv-connector", "mooncake"]
        for i in pre:
            cmd += ["--prefill", i.url, str(i.bootstrap_port)]
        for i in dec:
            cmd += ["--decode", i.url]
        cmd += list(extra)
        self.router = self._spawn(cmd, f"router-{kind}")
        want = len(pre) + len(dec)
        wait_for(lambda: self.router_healthy() >= want or self._router_exited(), 60,
                 f"{kind} router with {want} healthy workers", poll_s=0.1)
        if self._router_exited():
            raise AssertionError(f"{kind} router exited:\n" + self.log_tail(f"router-{kind}"))
        return ports

    def _router_exited(self) -> bool:
        return self.router is not None and self.router.poll() is not None

    def router_workers(self) -> list[dict[str, Any]]:
        try:
            st, doc = http_json("127.0.0.1", self.router_port, "GET", "/workers", timeout_s=1)
        except (OSError, http.client.HTTPException):
            return []
        return doc.get("workers", []) if st == 200 and isinstance(doc, dict) else []

    def router_healthy(self) -> int:
        return sum(1 for w in self.router_workers() if w.get("is_healthy"))

    def listed(self, url: str, healthy_only: bool = True) -> bool:
        return any(w.get("url") == url and (w.get("is_healthy") or not healthy_only)
                   for w in self.router_workers())

    def start_feeder(self, kind: str, *extra: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "shmhb", "feed", "--router",
               f"{kind}=http://127.0.0.1:{self.router_port}", "--json"]
        for b in self.boards.values():
            cmd += ["--board", b.name]
        p = self._spawn(cmd + list(extra), "feeder", text=True)
        self.feeder = p
        line = p.stdout.readline() if p.stdout else ""
        if '"ready"' not in line:
            raise AssertionError("shmhb feed did not start:\n" + self.log_tail("feeder"))

        def pump() -> None:
            assert p.stdout is not None
            for ln in p.stdout:
                self.feed_lines.append(ln)
        threading.Thread(target=pump, daemon=True).start()
        return p

    def feed_actions(self) -> list[dict[str, Any]]:
        out = []
        for ln in list(self.feed_lines):
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
        return out

    def hub_lookups(self) -> dict[str, list[str]]:
        """Each router log's lines that show an attempt to reach a model hub (none may)."""
        out = {}
        for path in sorted(glob.glob(os.path.join(self.tmp, "router-*.log"))):
            with open(path, errors="replace") as f:
                lines = hub_lookups(f.read())
            if lines:
                out[os.path.basename(path)] = lines
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
        for b in self.boards.values() if self.own_boards else ():
            b.unlink()
            b.close()
