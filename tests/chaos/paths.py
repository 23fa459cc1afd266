"""The actors of two fault kinds on throwaway hosts next to the cluster:
``python -m tests.chaos.paths KIND IP_A IP_B IP_C``.

``two_addresses``: host B's pinger listens on every address (``0.0.0.0``, a host with
several interfaces); host A follows it as IP_B and as IP_C (a ``--peer`` on one network,
the watch of a worker's endpoint on another).  Both addresses must read ALIVE for a
peer dead-after window and more, B's worker ALIVE at its endpoint on each; then the
worker is SIGKILLed and must read DEAD at both within ``BOUND_S``.

``secret_rotation``: hosts A and B follow each other with a secret, and rotate it host by
host in the documented three steps (OLD+NEW, NEW+OLD, NEW), each file rewritten in
place while the pingers run: neither may read the other anything but ALIVE at any
moment.  Then A's file gets a secret B does not hold: B must read A UNKNOWN with its
authentication failing, never DEAD, for a dead-after window and more.

Prints one JSON line ``{"ok": ..., "why": ..., "kill_ms": ...}``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..children import child

BOUND_S = 5.0
BULK = child("bulk")
OLD = b"chaos-old-secret-0123456789abcdef"
NEW = b"chaos-new-secret-0123456789abcdef"
ROGUE = b"chaos-rogue-secret-0123456789abcd"


def _until(pred: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def _hold(pred: Callable[[], Any], seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not pred():
            raise AssertionError(what)
        time.sleep(0.02)


def _wildcard_port() -> int:
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


def _secret(path: str, *secrets: bytes) -> None:
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"\n".join(secrets) + b"\n")
    os.replace(tmp, path)


class _Run:
    def __init__(self) -> None:
        import shmhb

        self.shmhb = shmhb
        self.policy = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5,
                                   peer_suspect_after_s=0.5, peer_dead_after_s=1.5)
        self.boards: list[Any] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.tmp = tempfile.mkdtemp(prefix="shmhb-chaos-paths-")

    def board(self) -> Any:
        b = self.shmhb.Board.create(f"shmhb-chaos-paths-{uuid.uuid4().hex[:8]}", slots=8,
                                    policy=self.policy)
        self.boards.append(b)
        return b

    def spawn(self, *args: str, ready: bool = True, log: str | None = None) -> subprocess.Popen[str]:
        out = open(os.path.join(self.tmp, log), "w") if log else None
        p = subprocess.Popen([sys.executable, *args],
                             stdout=out if out else subprocess.PIPE,
                             stderr=out if out else subprocess.DEVNULL, text=True)
        if out:
            out.close()
        self.procs.append(p)
        if ready:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"{args[:3]} did not start: {line!r}")
        return p

    def pinger(self, board: Any, listen: str, *flags: str) -> None:
        self.spawn("-m", "shmhb", "pinger", "--board", board.name, "--tick-s", "0.02",
                   "--listen", listen, "--interval-s", "0.2", *flags, ready=False,
                   log=f"{board.name}.log")

    def reloads(self, board: Any) -> int:
        with open(os.path.join(self.tmp, f"{board.name}.log")) as f:
            return f.read().count("secret file reloaded")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout:
                p.stdout.close()
        for b in self.boards:
            b.close()
            b.unlink()
        for n in os.listdir(self.tmp):
            os.unlink(os.path.join(self.tmp, n))
        os.rmdir(self.tmp)


def two_addresses(run: _Run, ip_a: str, ip_b: str, ip_c: str) -> dict[str, Any]:
    Status = run.shmhb.Status
    port = _wildcard_port()
    a, b = run.board(), run.board()
    run.pinger(b, f"0.0.0.0:{port}")
    run.pinger(a, f"{ip_a}:{_wildcard_port()}", "--peer", f"{ip_b}:{port}", "--peer",
               f"{ip_c}:{port}")
    w = run.spawn(BULK, b.name, "rank-", "1", ip_b, "30001")
    eps = [f"{ip_b}:30001"]
    _until(lambda: all((r := a.remote(ep)) is not None and r.status is Status.ALIVE
                       for ep in eps), 30, "b's worker alive on a")
    both = lambda: all((p := a.peer(ip)) is not None and p.status is Status.ALIVE  # noqa: E731
                       for ip in (ip_b, ip_c))
    _until(both, 30, "b alive under both addresses")
    _hold(both, 2.5 * run.policy.peer_dead_after_s,
          "b read other than alive under one of its addresses")
    t0 = time.monotonic()
    w.send_signal(signal.SIGKILL)
    _until(lambda: all((r := a.remote(ep)) is not None and r.status is Status.DEAD
                       for ep in eps), 30, "the worker's kill seen")
    kill_s = time.monotonic() - t0
    spoofed = a.stats()["bad_spoofed"]
    ok = kill_s < BOUND_S and spoofed == 0
    return {"ok": ok, "why": "" if ok else f"kill DEAD after {kill_s:.3f} s, {spoofed} acks "
            "dropped as spoofed", "kill_ms": round(kill_s * 1e3, 1)}


def secret_rotation(run: _Run, ip_a: str, ip_b: str, _ip_c: str) -> dict[str, Any]:
    Status = run.shmhb.Status
    port = _wildcard_port()
    fa, fb = os.path.join(run.tmp, "a.secret"), os.path.join(run.tmp, "b.secret")
    _secret(fa, OLD)
    _secret(fb, OLD)
    a, b = run.board(), run.board()
    run.pinger(a, f"{ip_a}:{port}", "--peer", ip_b, "--secret-file", fa)
    run.pinger(b, f"{ip_b}:{port}", "--peer", ip_a, "--secret-file", fb)
    pairs = ((a, ip_b), (b, ip_a))

    def alive() -> bool:
        return all((p := h.peer(o)) is not None and p.status is Status.ALIVE
                   and not p.auth_failing for h, o in pairs)
    _until(alive, 30, "both alive")
    for n, secrets in enumerate(((OLD, NEW), (NEW, OLD), (NEW,)), 1):
        for h, f in ((a, fa), (b, fb)):
            _secret(f, *secrets)
            _until(lambda h=h: run.reloads(h) >= n, 20, f"step {n} taken up")
            _hold(alive, 1.0, f"a host read its peer other than alive at rotation step {n}")
    _secret(fa, ROGUE)  # a mismatch: named, never a death
    seen: set[Any] = set()

    def mismatch(want: Any) -> bool:
        p = b.peer(ip_a)
        seen.add(None if p is None else p.status)
        return p is not None and p.auth_failing and p.status is want
    _until(lambda: mismatch(Status.UNKNOWN), 20, "the mismatch named, a read unknown")
    _hold(lambda: mismatch(Status.UNKNOWN), 2.5 * run.policy.peer_dead_after_s,
          "a mismatched host read other than unknown")
    if Status.DEAD in seen:
        raise AssertionError("a mismatched host read dead")
    return {"ok": True, "why": ""}


KINDS = {"two_addresses": two_addresses, "secret_rotation": secret_rotation}


def main(argv: list[str]) -> int:
    run = _Run()
    try:
        out = KINDS[argv[0]](run, *argv[1:4])
    except Exception as e:  # noqa: BLE001 - reported to the harness, which breaches
        out = {"ok": False, "why": f"{type(e).__name__}: {e}"}
    finally:
        run.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
