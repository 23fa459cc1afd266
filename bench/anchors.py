"""What serving stacks run today to notice a dead peer, measured where it can be run here
and modelled where it cannot: part of the design study, so not rerun by every
``python -m bench``.  ``python -m bench.anchors [--quick]`` measures, prints a table and
writes bench/results_anchors.json (the figures and the run that made them); the suite
reads that file and puts the same rows into Q3 of bench/RESULTS.md.

- **SGLang's heartbeat checker** (measured): the decode side's thread sleeps
  ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` (5 s), then sends ``GET /health`` to every
  prefill bootstrap server in turn over a keep-alive session with ``timeout=(2, 3)``
  (connect, read); a 200 resets the server's failure count, anything else or an
  exception adds one, and at ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` (2) the
  server is dropped and its connection info removed (``_handle_node_failure``): the
  drop is the link cleanup.  Reproduced here against small HTTP servers on loopback,
  one process each, SIGKILLed at random phases.
- **Dynamo's etcd lease** (measured where Debian's ``etcd`` binary exists, else
  modelled): each worker grants a lease of TTL 10 s, puts its key under it and keeps
  the lease alive every TTL/2; a watcher sees the key deleted when the lease expires.
  Run against a private etcd on 127.0.0.1 (own data dir, stopped at the end) through
  its JSON gateway (``/v3/lease/grant``, ``/v3/kv/put``, ``/v3/lease/keepalive``,
  ``/v3/kv/range``); the observer polls every 20 ms.
- **vLLM NIXL's KV lease** (modelled): a lease of 30 s renewed by heartbeats every ~5 s.
- **Mooncake store's client TTL** (modelled): the client pings the master every 1 s, the
  master drops a client after 10 s without one.
- **Stock vLLM MooncakeConnector** (measured with vLLM 0.32.0, not by this module): the
  next request's load fails after ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60`` = 540 s.

Models are exact mixtures over the death's phase in the renewal period (evenly spaced
phases), like ``bench.seed_baseline.purge_model``: a death at phase u of a period P,
lease L, is seen L - u after the death (u in [0, P)).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shmhb.testing.loopback import child_env, free_port

from . import stats
from .harness import stop_process

SGLANG_INTERVAL_S = 5.0
SGLANG_MAX_FAILURES = 2
SGLANG_TIMEOUT_S = (2.0, 3.0)  # requests' (connect, read)
ETCD_TTL_S = 10
NIXL_LEASE_S, NIXL_RENEW_S = 30.0, 5.0
MOONCAKE_TTL_S, MOONCAKE_PING_S = 10.0, 1.0
VLLM_MOONCAKE_S = 540.0

NOTE = ("SGLang's decode-side heartbeat checker is reproduced faithfully (sleep 5 s, then "
        "`GET /health` to each prefill in turn on a keep-alive connection, timeouts 2 s connect / "
        "3 s read, dropped at the 2nd consecutive failure) against small HTTP servers on loopback, "
        "SIGKILLed at random phases; a SIGKILLed server refuses at once, a hung one costs the 3 s "
        "read timeout per check (modelled row). Dynamo's lease: holders grant a 10 s etcd lease, "
        "put a key under it and keep it alive every 5 s, against a private etcd on 127.0.0.1; the "
        "observer polls the keys every 20 ms. vLLM NIXL (30 s lease, ~5 s heartbeats) and Mooncake "
        "store (10 s TTL, 1 s pings) are modelled over the death's phase. Stock vLLM "
        "MooncakeConnector's 540 s was measured with vLLM 0.32.0 itself (both roles on CPU), not "
        "by this suite.")


def lease_model(lease_s: float, renew_s: float, phases: int = 200) -> list[float]:
    """Death -> expiry for a lease of ``lease_s`` renewed every ``renew_s``, the death at
    a uniformly spread phase of the renewal period."""
    return [lease_s - renew_s * (k + 0.5) / phases for k in range(phases)]


def sglang_model(interval_s: float = SGLANG_INTERVAL_S, failures: int = SGLANG_MAX_FAILURES,
                 per_check_s: float = 0.0, phases: int = 200) -> list[float]:
    """SGLang's checker after a death at a uniform phase of its sleep: the next check
    fails, then ``failures - 1`` more, one per sleep + check (``per_check_s``: 0 for a
    refused connection, the read timeout for a hung server)."""
    return [interval_s * (k + 0.5) / phases + per_check_s
            + (failures - 1) * (interval_s + per_check_s) for k in range(phases)]


# -- SGLang: the heartbeat checker against HTTP servers on loopback ----------------------

_HEALTH_SERVER = """
import ctypes, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # die with the bench
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"               # keep-alive, as SGLang's session uses
    def do_GET(self):
        body = b"ok" if self.path == "/health" else b"no"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer((sys.argv[1], 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


class SGLangChecker:
    """SGLang's ``heartbeat_checker`` loop, line for line in behaviour: sleep, then
    ``GET /health`` to each address in turn on its own keep-alive connection, count
    consecutive failures, drop an address at ``max_failures``."""

    def __init__(self, addresses: list[str], interval_s: float, max_failures: int,
                 timeout_s: tuple[float, float] = SGLANG_TIMEOUT_S) -> None:
        self.addresses = list(addresses)
        self.interval_s = interval_s
        self.max_failures = max_failures
        self.timeout_s = timeout_s
        self.failures: dict[str, int] = {}
        self.ok: dict[str, int] = {}
        self.dropped: dict[str, float] = {}  # address -> perf_counter at the drop
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sglang-heartbeat", daemon=True)

    def start(self) -> SGLangChecker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + sum(self.timeout_s) + 1)
        for c in self._conns.values():
            c.close()

    def _health(self, addr: str) -> bool:
        c = self._conns.get(addr)
        if c is None:
            host, port = addr.rsplit(":", 1)
            c = self._conns[addr] = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s[0])
        try:
            if c.sock is None:
                c.connect()
                assert c.sock is not None
                c.sock.settimeout(self.timeout_s[1])
            c.request("GET", "/health", headers={"Connection": "keep-alive"})
            r = c.getresponse()
            r.read()
            return r.status == 200
        except (OSError, http.client.HTTPException):
            c.close()  # requests' pool discards a broken connection the same way
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for addr in list(self.addresses):
                if self._health(addr):
                    self.failures[addr] = 0
                    self.ok[addr] = self.ok.get(addr, 0) + 1
                    continue
                self.failures[addr] = self.failures.get(addr, 0) + 1
                if self.failures[addr] >= self.max_failures:
                    self.dropped[addr] = time.perf_counter()
                    self.addresses.remove(addr)  # _handle_node_failure: the links go


@dataclass
class Measured:
    name: str
    values_s: list[float] = field(default_factory=list)
    missed: int = 0
    note: str = ""


def run_sglang(stack: contextlib.ExitStack, n: int, interval_s: float = SGLANG_INTERVAL_S,
               max_failures: int = SGLANG_MAX_FAILURES, host: str = "127.0.0.1",
               rng: random.Random | None = None) -> Measured:
    """``n`` health servers, one checker; every server is SIGKILLed once, at random
    times spread over one interval after the checker has seen each answer twice."""
    rng = rng or random.Random()
    procs = []
    addrs = []
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-c", _HEALTH_SERVER, host], stdout=subprocess.PIPE,
                             text=True, env=child_env())
        stack.callback(stop_process, p)
        assert p.stdout is not None
        addrs.append(f"{host}:{int(p.stdout.readline())}")
        procs.append(p)
    chk = SGLangChecker(addrs, interval_s, max_failures).start()
    stack.callback(chk.stop)
    deadline = time.monotonic() + 4 * interval_s + 10
    while min(chk.ok.get(a, 0) for a in addrs) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    res = Measured(f"SGLang heartbeat checker (GET /health every {interval_s:g} s, "
                   f"drop after {max_failures} failures)")
    if chk.dropped:
        res.note = "a server was dropped before it was killed"
    killed: dict[str, float] = {}
    for a, p in sorted(zip(addrs, procs), key=lambda _: rng.random()):
        time.sleep(rng.uniform(0, interval_s / n))
        killed[a] = time.perf_counter()
        p.send_signal(signal.SIGKILL)
    budget = max_failures * (interval_s + sum(SGLANG_TIMEOUT_S)) + interval_s + 5
    deadline = time.monotonic() + budget
    while len(chk.dropped) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    for a, t0 in killed.items():
        if a in chk.dropped:
            res.values_s.append(chk.dropped[a] - t0)
        else:
            res.missed += 1
    return res


# -- Dynamo: an etcd lease ------------------------------------------------------------------

def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _post(base: str, path: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read() or b"{}")
        assert isinstance(out, dict)
        return out


_LEASE_WORKER = """
import base64, ctypes, json, signal, sys, time, urllib.request
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
base, key, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3])
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read() or b"{}")
lease = post("/v3/lease/grant", {"TTL": ttl})["ID"]
post("/v3/kv/put", {"key": base64.b64encode(key.encode()).decode(), "value": "YWxpdmU=", "lease": lease})
print("ready", flush=True)
while True:                      # keep-alive every TTL/2, as Dynamo's runtime does
    time.sleep(ttl / 2)
    post("/v3/lease/keepalive", {"ID": lease})
"""


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def start_etcd(stack: contextlib.ExitStack, host: str = "127.0.0.1") -> str:
    """A private etcd on loopback with its own data dir; stopped and removed at the end.
    Returns the client URL."""
    exe = etcd_binary()
    if exe is None:
        raise RuntimeError("no etcd binary")
    port = free_port([host], span=2)
    data = stack.enter_context(tempfile.TemporaryDirectory(prefix="shmhb-bench-etcd-"))
    client, peer = f"http://{host}:{port}", f"http://{host}:{port + 1}"
    p = subprocess.Popen([exe, "--name", "bench", "--data-dir", data,
                          "--listen-client-urls", client, "--advertise-client-urls", client,
                          "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                          "--initial-cluster", f"bench={peer}", "--log-level", "error"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(stop_process, p)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                if json.loads(r.read()).get("health") in ("true", True):
                    return client
        except OSError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("etcd did not start")
        time.sleep(0.05)


def run_etcd(stack: contextlib.ExitStack, n: int, ttl_s: int = ETCD_TTL_S,
             rng: random.Random | None = None) -> Measured:
    """``n`` lease holders (one process each) on a private etcd, SIGKILLed at random
    times over one keep-alive period; time until each key is gone."""
    rng = rng or random.Random()
    base = start_etcd(stack)
    keys = [f"/bench/instances/w{i}" for i in range(n)]
    procs = {}
    for k in keys:
        p = subprocess.Popen([sys.executable, "-c", _LEASE_WORKER, base, k, str(ttl_s)],
                             stdout=subprocess.PIPE, text=True, env=child_env())
        stack.callback(stop_process, p)
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("an etcd lease holder did not start")
        procs[k] = p
        time.sleep(rng.uniform(0, ttl_s / 2 / n))  # spread the keep-alive phases
    time.sleep(ttl_s / 2)  # every holder has renewed at least once
    res = Measured(f"Dynamo etcd lease (TTL {ttl_s} s, keep-alive every {ttl_s / 2:g} s)")
    killed: dict[str, float] = {}
    for k in sorted(keys, key=lambda _: rng.random()):
        time.sleep(rng.uniform(0, ttl_s / 2 / n))
        killed[k] = time.perf_counter()
        procs[k].send_signal(signal.SIGKILL)
    gone: dict[str, float] = {}
    deadline = time.monotonic() + ttl_s + 10
    while len(gone) < n and time.monotonic() < deadline:
        got = _post(base, "/v3/kv/range", {"key": _b64("/bench/instances/"),
                                           "range_end": _b64("/bench/instances0"), "keys_only": True})
        live = {base64.b64decode(kv["key"]).decode() for kv in got.get("kvs", [])}
        t = time.perf_counter()
        for k in keys:
            if k not in live and k not in gone:
                gone[k] = t
        time.sleep(0.02)
    for k, t0 in killed.items():
        if k in gone:
            res.values_s.append(gone[k] - t0)
        else:
            res.missed += 1
    return res


# -- the rows -----------------------------------------------------------------------------

#: the committed figures of the last ``python -m bench.anchors``, which the suite reads
RESULTS = Path(__file__).resolve().parent / "results_anchors.json"


@dataclass
class Anchors:
    sglang: Measured | None = None
    etcd: Measured | None = None
    etcd_why_not: str = ""
    models: dict[str, list[float]] = field(default_factory=dict)
    made_by: str = ""  # the command, date and machine of the run that measured them


def models() -> dict[str, list[float]]:
    return {
        f"SGLang heartbeat checker, hung prefill (read timeout {SGLANG_TIMEOUT_S[1]:g} s per check)":
            sglang_model(per_check_s=SGLANG_TIMEOUT_S[1]),
        f"vLLM NIXL KV lease ({NIXL_LEASE_S:g} s, renewed every {NIXL_RENEW_S:g} s)":
            lease_model(NIXL_LEASE_S, NIXL_RENEW_S),
        f"Mooncake store client TTL ({MOONCAKE_TTL_S:g} s, ping every {MOONCAKE_PING_S:g} s)":
            lease_model(MOONCAKE_TTL_S, MOONCAKE_PING_S),
    }


def run(n_sglang: int, n_etcd: int, *, sglang_interval_s: float = SGLANG_INTERVAL_S,
        log: Any = print) -> Anchors:
    """The measured anchors (both at once: they are seconds-scale and wait most of the
    time) and the models.  ``n_etcd`` 0 skips etcd."""
    out = Anchors(models=models())
    with contextlib.ExitStack() as st:
        errs: list[BaseException] = []

        def etcd_part() -> None:
            try:
                out.etcd = run_etcd(st, n_etcd)
            except (RuntimeError, OSError) as e:
                out.etcd_why_not = f"etcd run failed: {e}"
                errs.append(e)

        th = None
        if n_etcd and etcd_binary() is not None:
            log(f"anchors: Dynamo etcd lease, {n_etcd} holders on a private etcd")
            th = threading.Thread(target=etcd_part, daemon=True)
            th.start()
        elif n_etcd:
            out.etcd_why_not = "no etcd binary here (Debian: apt-get install etcd-server): modelled"
        if n_sglang:
            log(f"anchors: SGLang heartbeat checker, {n_sglang} prefill servers")
            out.sglang = run_sglang(st, n_sglang, interval_s=sglang_interval_s)
        if th is not None:
            th.join()
    if out.etcd is None:
        out.models.update(etcd_model())
    return out


def etcd_model() -> dict[str, list[float]]:
    return {f"Dynamo etcd lease (TTL {ETCD_TTL_S} s, keep-alive every {ETCD_TTL_S / 2:g} s)":
            lease_model(ETCD_TTL_S, ETCD_TTL_S / 2)}


def save(a: Anchors, path: Path = RESULTS) -> None:
    """The measured figures and who made them, as JSON (the models are recomputed)."""
    doc = {"made_by": a.made_by, "etcd_why_not": a.etcd_why_not,
           "sglang": asdict(a.sglang) if a.sglang else None,
           "etcd": asdict(a.etcd) if a.etcd else None}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load(path: Path = RESULTS) -> Anchors:
    """The figures ``save`` wrote, with the models; a clear error where the file is
    missing or not such a document."""
    try:
        doc = json.loads(path.read_text())
        out = Anchors(sglang=Measured(**doc["sglang"]) if doc["sglang"] else None,
                      etcd=Measured(**doc["etcd"]) if doc["etcd"] else None,
                      etcd_why_not=str(doc["etcd_why_not"]), models=models(),
                      made_by=str(doc["made_by"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path}: no figures of today's stacks ({e!r}): run "
                           "`python -m bench.anchors` to measure them") from e
    if out.etcd is None:
        out.models.update(etcd_model())
    return out


def rows(a: Anchors) -> list[list[str]]:
    """Q3 rows, columns: event, verdict, median, p99, how, note."""
    out = []
    for m, verdict in ((a.sglang, "dropped, links removed"), (a.etcd, "key deleted, lease expired")):
        if m is None:
            continue
        how = f"measured, {len(m.values_s)} kills" + (f" (+{m.missed} missed)" if m.missed else "")
        out.append(["" if out else "prefill/peer kill (today's stacks)", f"{m.name}: {verdict}",
                    *_dist_s(m.values_s), how, m.note or "-"])
    for name, v in a.models.items():
        note = a.etcd_why_not if name.startswith("Dynamo") and a.etcd_why_not else "-"
        out.append(["", name + ": expired", *_dist_s(v), "modelled: death at a uniform phase", note])
    out.append(["", "stock vLLM 0.32.0 MooncakeConnector: next load fails",
                stats.fmt(VLLM_MOONCAKE_S, "s"), "-",
                "measured with vLLM (ABORT_REQUEST_TIMEOUT + 60 s), not by this suite", "-"])
    return out


def _dist_s(v: list[float]) -> list[str]:
    if not v:
        return ["-", "-"]
    return [stats.fmt(stats.median(v), "s"), stats.fmt(stats.p99(v), "s")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.anchors", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer kills")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write the figures (default: bench/results_anchors.json; "
                         "with --quick nowhere)")
    a = ap.parse_args(argv)
    n = 3 if a.quick else 8
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    res = run(n, n)
    res.made_by = (f"`python -m bench.anchors{' --quick' if a.quick else ''}`, run {started}; "
                   f"{stats.machine_info()[0][1]}")
    print(stats.table(["event", "verdict", "median", "p99", "how", "note"], rows(res)))
    out = a.out or (None if a.quick else RESULTS)
    if out is not None:
        save(res, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(10)
    sys.exit(main())
