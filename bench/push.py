"""Remote kill -> DEAD with pushes and with pings only: ``python -m bench.push [--quick]``.

The pushes' benchmark, also run by ``python -m bench.cluster``.  Two pairs of simulated
hosts on loopback run side by side, every pinger at a 1 s ping interval:

* **pushes** (the default): watcher A1 (127.0.0.2) follows B1 (127.0.0.3) directly.
* **pings only**: watcher A2 (127.0.0.4) follows B2 (127.0.0.5) through a small ZMQ
  relay that listens at B2's address and the cluster port (what A2 follows) while B2's
  pinger listens on another port.  It forwards pings unchanged, drops every PUSH
  frame, and forwards acks with their address rewritten to its own (no secret here: an
  ack naming another address than the one pinged is refused as relayed, by design).
  B2 does push, as every pinger does, but nothing it pushes arrives, so A2 learns of a
  death only from the digest in the ack to its next ping: no switch in shmhb is needed
  to measure this.  The relay's drop count and A2's ``pushes_received`` (0) show it.

B1 and B2 each run 16 beating ranks (so acks carry a realistic digest) and a pool of
victim workers (small forked processes, ``agent=False``, beating every 0.05 s).  Kills
alternate between the pairs (pushes, pings only, pings only, pushes, ...) so machine
noise hits both alike.  Before each kill the watcher must see the victim's incarnation
ALIVE; before a pings-only kill the benchmark also waits a random 0..1 s, so kills land
at a uniformly random phase of the watcher's ping cycle (otherwise the pace of the loop
would lock onto it).  A kill is also the only change on its host for
``harness.QUIET_S`` before it: the pinger sends at most one push per 50 ms gap, so a
death right after another change there (the registration of the previous victim's
replacement) would wait for the gap; that batching is by design and is not what this
measures.  Each kill is timed from just before ``SIGKILL`` to the first poll
(every ~0.2 ms) at which the watcher's ``board.remote(endpoint)`` reads DEAD for that
incarnation; the same loop also records when the victim's own board says DEAD (the
local pidfd verdict).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from shmhb.net.protocol import PUSH, Ack, decode, encode_ack_raw, encode_entries
from shmhb.testing.loopback import free_port, loopback_addrs

from . import stats
from .harness import (
    Dist,
    HostServer,
    Victim,
    attach_when_ready,
    board_name,
    kill_and_time,
    start_pinger,
    wait_quiet,
    wait_remote_alive,
)

INTERVAL_S = 1.0
ORDER = ["push", "pings", "pings", "push"]
TARGET_PUSH_MEDIAN_MS = 10.0


class PushDroppingRelay:
    """Forwards one watcher's pings to a pinger and the answers back; drops PUSH frames."""

    def __init__(self, listen: str, upstream: str) -> None:
        self.listen = listen
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.back = self.ctx.socket(zmq.DEALER)
        for s in (self.front, self.back):
            s.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://{listen}")
        self.back.connect(f"tcp://{upstream}")
        self.dropped = self.forwarded = 0
        self._stop = threading.Event()
        self._rid: bytes | None = None
        self._t = threading.Thread(target=self._run, name="push-dropping-relay", daemon=True)
        self._t.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                if sock is self.front:
                    parts = self.front.recv_multipart()
                    if len(parts) == 2:
                        self._rid = parts[0]
                        self.back.send(parts[1])
                else:
                    frame = self.back.recv()
                    if len(frame) > 5 and frame[5] == PUSH:
                        self.dropped += 1
                        continue
                    a = decode(frame)
                    if isinstance(a, Ack):  # as if B2 listened here
                        frame = encode_ack_raw(a.nonce, a.identity, self.listen, a.gen,
                                               encode_entries(a.entries) if a.full else None)
                    if self._rid is not None:
                        with contextlib.suppress(zmq.ZMQError):
                            self.front.send_multipart([self._rid, frame])
                            self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.front.close(0)
        self.back.close(0)
        self.ctx.term()


@dataclass
class PushResult:
    push: Dist
    pings: Dist
    push_local: Dist
    pings_local: Dist
    relay_dropped: int
    pings_watcher_pushes_received: int
    push_watcher_pushes_received: int
    kills: int


def run(stack: contextlib.ExitStack, kills: int, log=print) -> PushResult:  # type: ignore[no-untyped-def]
    rng = random.Random()
    a1, b1, a2, b2 = loopback_addrs(4)
    port = free_port([a1, b1, a2, b2], span=2, rng=rng)
    port_b2 = port + 1  # B2's own; the relay takes b2:port, the port A2 follows it at
    names = {h: board_name(f"push-{h}") for h in ("a1", "b1", "a2", "b2")}
    addr = {"a1": a1, "b1": b1, "a2": a2, "b2": b2}
    procs = [start_pinger(stack, n, f"{addr[h]}:{port_b2 if h == 'b2' else port}", INTERVAL_S)
             for h, n in names.items()]
    boards = dict(zip(names, attach_when_ready(stack, list(names.values()), procs=procs)))
    relay = PushDroppingRelay(f"{b2}:{port}", f"{b2}:{port_b2}")
    stack.callback(relay.close)
    hs = HostServer(stack)
    for h in ("b1", "b2"):
        hs.start_ranks(names[h], 16, addr[h], 0.1, [])
    hs.wait_ranks(2)
    boards["a1"].watch(f"{b1}:30000")
    boards["a2"].watch(f"{b2}:30000")  # at the cluster port: the relay
    pool = 4
    keys = {h: [f"victim-{j}" for j in range(pool)] for h in ("b1", "b2")}
    eps = {h: [f"{addr[h]}:{31000 + j}" for j in range(pool)] for h in ("b1", "b2")}
    for h in ("b1", "b2"):
        for k, e in zip(keys[h], eps[h]):
            hs.request_victim(names[h], k, e)
    victims: dict[str, list[Victim]] = {
        h: [hs.wait_victim(names[h], k, e) for k, e in zip(keys[h], eps[h])] for h in ("b1", "b2")}
    res = PushResult(Dist(), Dist(), Dist(), Dist(), 0, 0, 0, 0)
    last_change = {h: time.monotonic() for h in ("b1", "b2")}
    order = ORDER
    idx = {"push": 0, "pings": 0}
    for k in range(2 * kills):
        mode = order[k % 4]
        src, dst = ("b1", "a1") if mode == "push" else ("b2", "a2")
        j = idx[mode] % pool
        idx[mode] += 1
        v = victims[src][j]
        if not wait_remote_alive(boards[dst], v, 10.0):
            log(f"  push bench: {v.key} on {src} never seen ALIVE by {dst}; skipped")
            (res.push if mode == "push" else res.pings).add(None)
        else:
            time.sleep(rng.uniform(0, INTERVAL_S) if mode == "pings" else rng.uniform(0, 0.02))
            wait_quiet(last_change[src])
            r = kill_and_time(boards[src], boards[dst], v, timeout_s=5 * INTERVAL_S + 12)
            (res.push if mode == "push" else res.pings).add(r.remote_ms)
            (res.push_local if mode == "push" else res.pings_local).add(r.local_ms)
            res.kills += 1
        hs.request_victim(names[src], v.key, v.endpoint)
        victims[src][j] = hs.wait_victim(names[src], v.key, v.endpoint)
        last_change[src] = time.monotonic()
    res.relay_dropped = relay.dropped
    res.pings_watcher_pushes_received = boards["a2"].stats()["pushes_received"]
    res.push_watcher_pushes_received = boards["a1"].stats()["pushes_received"]
    return res


def rows(res: PushResult) -> list[list[str]]:
    out = []
    for label, d, loc in (("pushes (default)", res.push, res.push_local),
                          ("pings only (pushes dropped)", res.pings, res.pings_local)):
        v = d.values
        if not v:
            out.append([label, "-", "-", "-", "-", "-", f"0 (+{d.missed} missed)"])
            continue
        out.append([label, stats.fmt(stats.median(v), "ms"), stats.fmt(stats.p99(v), "ms"),
                    stats.fmt(min(v), "ms"), stats.fmt(max(v), "ms"),
                    stats.fmt(stats.median(loc.values), "ms") if loc.values else "-",
                    f"{len(v)}" + (f" (+{d.missed} missed)" if d.missed else "")])
    return out


HEADERS = ["remote kill -> DEAD on watcher, ping interval 1 s", "median", "p99", "min", "max",
           "local verdict (median)", "kills"]


def verdict(res: PushResult) -> tuple[bool, str]:
    if not res.push.values:
        return False, "no push measurement"
    m = stats.median(res.push.values)
    ok = m <= TARGET_PUSH_MEDIAN_MS and not res.push.missed
    pm = stats.median(res.pings.values) if res.pings.values else float("nan")
    return ok, (f"median {m:.2f} ms with pushes (target <= {TARGET_PUSH_MEDIAN_MS:g} ms); pings "
                f"only: median {pm:.0f} ms, {pm / m:.0f}x slower")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.push", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 kills per mode instead of 30")
    p.add_argument("--kills", type=int, default=None)
    a = p.parse_args(argv)
    kills = a.kills or (10 if a.quick else 30)
    with contextlib.ExitStack() as stack:
        res = run(stack, kills)
    print(stats.table(HEADERS, rows(res)))
    ok, why = verdict(res)
    print(f"target: {'met' if ok else 'MISSED'}: {why}")
    print(f"relay dropped {res.relay_dropped} pushes; pings-only watcher received "
          f"{res.pings_watcher_pushes_received} pushes, push watcher {res.push_watcher_pushes_received}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
