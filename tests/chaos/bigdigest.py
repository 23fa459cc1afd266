"""The ``big_digest`` fault kind's actor (a host of more than 256 workers):
``python -m tests.chaos.bigdigest IP_A IP_B``.

Two throwaway hosts next to the cluster, each with its own board and pinger: A's board
holds 260 dead slots (their registrant SIGKILLed), 39 live ones and then the 300th
worker, past 256 digest entries; B follows that worker.  B
must see it ALIVE, then DEAD within ``BOUND_S`` of its SIGKILL.  Prints one JSON line
``{"ok": ..., "why": ..., "kill_ms": ...}``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from typing import Any
from ..children import child

BOUND_S = 5.0
BULK = child("bulk")


def _until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def big_digest(ip_a: str, ip_b: str) -> dict[str, Any]:
    import shmhb
    from shmhb.testing.loopback import free_port

    policy = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5, peer_suspect_after_s=0.5,
                          peer_dead_after_s=1.5)
    port = free_port([ip_a, ip_b])
    names = [f"shmhb-chaos-big-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    a = shmhb.Board.create(names[0], slots=400, policy=policy)
    b = shmhb.Board.create(names[1], slots=8, policy=policy)
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: str, ready: bool = True) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        procs.append(p)
        if ready:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"{args[:3]} did not start: {line!r}")
        return p

    try:
        for board, ip in ((a, ip_a), (b, ip_b)):
            spawn("-m", "shmhb", "pinger", "--board", board.name, "--tick-s", "0.02",
                  "--listen", f"{ip}:{port}", "--interval-s", "0.2", ready=False)
        gone = spawn(BULK, a.name, "gone-", "260", ip_a, "32000")
        gone.kill()
        gone.wait(10)
        _until(lambda: sum(s.status is shmhb.Status.DEAD for s in a.slots()) == 260, 30,
               "260 dead slots")
        spawn(BULK, a.name, "live-", "39", ip_a, "33000")
        w = spawn(BULK, a.name, "rank-", "1", ip_a, "30001")
        ep = f"{ip_a}:30001"
        b.watch(ep)
        _until(lambda: (r := b.remote(ep)) is not None and r.status is shmhb.Status.ALIVE, 30,
               "the 300th worker alive on the other host")
        t0 = time.monotonic()
        w.send_signal(signal.SIGKILL)
        _until(lambda: (r := b.remote(ep)) is not None and r.status is shmhb.Status.DEAD, 30,
               "the 300th worker's kill seen on the other host")
        kill_s = time.monotonic() - t0
        ok = kill_s < BOUND_S and a.stats()["digest_cut"] == 0
        return {"ok": ok, "why": "" if ok else f"kill DEAD after {kill_s:.3f} s, "
                f"digest_cut {a.stats()['digest_cut']}", "kill_ms": round(kill_s * 1e3, 1)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout:
                p.stdout.close()
        for board in (a, b):
            board.close()
            board.unlink()


def main(argv: list[str]) -> int:
    try:
        out = big_digest(argv[0], argv[1])
    except Exception as e:  # noqa: BLE001 - reported to the harness, which breaches
        out = {"ok": False, "why": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
