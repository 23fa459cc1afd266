"""SGLang 0.5.23's own P/D on Mooncake, stock against shmhb's wrapper: each scenario's
outcome and its time, written to ``bench/results_sglang.md``.

    python -m bench.sglang [--out PATH] [--cap-s 40]     # about 14 minutes on 2 busy cores

Run in the venv of ``.ci/sglang``.  The stack is ``tests/sglang/stack.py``'s: a prefill
rank on 127.0.0.2 and a decode rank on 127.0.0.3, each its own process with SGLang's real
disaggregation classes, each host with its board and pinger; stock is the same processes
with ``SHMHB_SGLANG=0`` (the plugin loads and installs nothing).  SGLang's health check
is at its defaults (5 s x 2 failures) in both modes.  A room that has not concluded
``--cap-s`` after the fault is reported as such (stock's waiting timeout is 300 s).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tests.conftest import Procs
from tests.hosts import Cluster
from tests.sglang.engine import expected_digest, zeros_digest
from tests.sglang.stack import Rank, Stack, alive_on_decode_host, new_room

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results_sglang.md")

BIG = 2048  # pages of 64 KiB in the mid-transfer scenario: 128 MiB


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    run: Callable[[Stack, float], str]


def _ranks(stack: Stack, pages: int = 64) -> tuple[Rank, Rank]:
    """A fresh prefill and decode (the previous ones closed), one room served."""
    for r in stack.ranks:
        r.close()
    stack.ranks.clear()
    p, d = stack.start("prefill", pages=pages), stack.start("decode", pages=pages)
    room = new_room()
    p.send("prefill", room=room, seed=1)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    ev = d.expect("received", "recv_failed", room=room, timeout_s=60)
    assert ev["ev"] == "received" and ev["digest"] == expected_digest(1, pages), ev
    if stack.wrapped:
        alive_on_decode_host(stack, p)
    return p, d


class HeldRoom(NamedTuple):
    p: Rank  # the prefill holding the room
    d: Rank  # its decode
    room: int


def _held_room(stack: Stack, seed: int, pages: int = 64) -> HeldRoom:
    """Fresh ranks (``_ranks``) and a room the prefill holds: bootstrapped, the decode's
    transfer request read, its KV not computed yet (it writes on ``go``)."""
    p, d = _ranks(stack, pages)
    room = new_room()
    p.send("prefill", room=room, seed=seed, hold=True)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    return HeldRoom(p, d, room)


def _outcome(d: Rank, room: int, t0: float, cap_s: float) -> str:
    try:
        ev = d.expect("received", "recv_failed", room=room, timeout_s=cap_s)
    except AssertionError:
        return f"**not concluded {cap_s:.0f} s after the fault**"
    verb = "served" if ev["ev"] == "received" else "failed"
    return f"{verb} {ev['t'] - t0:.2f} s after the fault"


def killed_while_waiting(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 2)
    return _outcome(d, room, p.kill(), cap_s)


def killed_before_the_room(stack: Stack, cap_s: float) -> str:
    p, d = _ranks(stack)
    t0 = p.kill()
    room = new_room()
    d.send("recv", room=room, bootstrap=p.bootstrap)
    out = _outcome(d, room, t0, cap_s)
    try:  # the receiver sent its transfer request (to the rank its tables held)
        d.expect("metadata_sent", room=room, timeout_s=0.01)
        sent = True
    except AssertionError:
        sent = False
    return out + ("; the room was sent to the dead rank's port" if sent
                  else "; nothing sent to the dead rank's port")


def stopped_while_waiting(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 3)
    t0 = p.stop()
    p.send("go", room=room)  # what it does first when resumed
    out = _outcome(d, room, t0, cap_s)
    p.cont()
    sent = p.expect("sent", "send_failed", room=room, timeout_s=60)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and d.request("landed", "landed")["pages"] == 0 \
            and sent["ev"] == "sent":
        pass  # a "sent" write has landed by the time the prefill reports it
    landed = d.request("digest", "digest")["digest"] != zeros_digest(64)
    return out + ("; resumed, the prefill **wrote into the given-up pages**" if landed
                  else "; resumed, the prefill wrote nothing (refused the go-ahead)")


def killed_mid_transfer(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 4, BIG)
    p.send("go", room=room)
    deadline = time.monotonic() + 30
    while d.request("landed", "landed")["pages"] == 0 and time.monotonic() < deadline:
        pass
    t0 = p.kill()
    n = d.request("landed", "landed")["pages"]
    return _outcome(d, room, t0, cap_s) + f" ({n} of {BIG} pages landed)"


def decode_killed(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 5)
    t0 = d.kill()
    try:
        ev = p.expect("send_failed", room=room, timeout_s=cap_s)
    except AssertionError:
        return f"**the prefill still holds the room {cap_s:.0f} s after the fault**"
    return f"the prefill freed the room {ev['t'] - t0:.2f} s after the fault"


def _left(t0: float, cap_s: float) -> float:
    return max(0.5, cap_s - (time.monotonic() - t0))


def _next_room(p: Rank, d: Rank, seed: int, cap_s: float) -> str:
    """A room issued to ``p`` now: what the decode reported, from the issue."""
    room = new_room()
    p.send("prefill", room=room, seed=seed)
    t = d.send_at("recv", room=room, bootstrap=p.bootstrap)
    try:
        ev = d.expect("received", "recv_failed", room=room, timeout_s=cap_s)
    except AssertionError:
        return f"**not concluded {cap_s:.0f} s after it was issued**"
    ok = ev["ev"] == "received" and ev["digest"] == expected_digest(seed, 64)
    return f"{'served' if ok else 'failed'} {ev['t'] - t:.2f} s after it was issued"


def _pending(d: Rank, room: int, t0: float, cap_s: float) -> str:
    try:  # an event already in is taken from what was read meanwhile
        ev = d.expect("received", "recv_failed", room=room, timeout_s=_left(t0, cap_s))
    except AssertionError:
        return f"**not concluded {cap_s:.0f} s after the fault**"
    return f"{'served' if ev['ev'] == 'received' else 'failed'} {ev['t'] - t0:.2f} s after the fault"


def restarted_after_detection(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 6)
    t0 = p.kill()
    pending = _pending(d, room, t0, cap_s)
    p2 = stack.start("prefill")
    up = time.monotonic() - t0
    return (f"pending room {pending}; restarted then (up {up:.1f} s after the fault), the "
            f"next room {_next_room(p2, d, 7, cap_s)}")


def restarted_before_detection(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 8)
    t0 = p.kill()
    p2 = stack.start("prefill")  # at once, on the same address
    up = time.monotonic() - t0
    pending = _pending(d, room, t0, cap_s)
    return (f"restarted at once (up {up:.1f} s after the fault); pending room {pending}; "
            f"the next room {_next_room(p2, d, 9, cap_s)}")


def decode_restarted(stack: Stack, cap_s: float) -> str:
    p, d, room = _held_room(stack, 10)
    t0 = d.kill()
    d2 = stack.start("decode")
    up = time.monotonic() - t0
    p.send("go", room=room)  # the write the prefill was about to do, to the old decode
    try:
        ev = p.expect("sent", "send_failed", room=room, timeout_s=_left(t0, cap_s))
        held = (f"the prefill's room {'written' if ev['ev'] == 'sent' else 'failed'} "
                f"{ev['t'] - t0:.2f} s after the fault")
    except AssertionError:
        held = f"**the prefill still holds the room {cap_s:.0f} s after the fault**"
    return (f"{held}; restarted (up {up:.1f} s after the fault, then the write released), "
            f"the new decode's next room {_next_room(p, d2, 11, cap_s)}")


ROWS = (
    Row("killed while the decode waits", "the prefill killed after the decode's transfer "
        "request reached it, before its KV was computed: the decode's room", killed_while_waiting),
    Row("killed before the room", "the prefill killed, then the decode issues a room to "
        "its address (it served one before)", killed_before_the_room),
    Row("stopped while the decode waits", "SIGSTOP of the prefill holding the room; SIGCONT "
        "once the decode's room has concluded (or at the cap), the write next in line",
        stopped_while_waiting),
    Row("killed mid-transfer", "the prefill killed with the first pages of a 128 MiB room "
        "landed (a granted write: the wrapped decode holds the room for its go-ahead's lease)", killed_mid_transfer),
    Row("decode killed", "the decode killed while the prefill holds its room (bootstrapped, "
        "not computed yet): the prefill's room", decode_killed),
    Row("prefill restarted after detection", "the prefill killed while the decode waits, "
        "restarted on the same address once the decode's room has concluded (or at the "
        "cap); then a new room", restarted_after_detection),
    Row("prefill restarted before detection", "the prefill killed while the decode waits "
        "and restarted at once on the same address (before SGLang's health check can "
        "miss two polls); the pending room, then a new room", restarted_before_detection),
    Row("decode restarted", "the decode killed while the prefill holds its room and "
        "restarted at once; then the prefill's write is released; then a room from the "
        "new decode", decode_restarted),
)


def measure(wrapped: bool, cap_s: float, only: str | None) -> dict[str, str]:
    tmp = tempfile.mkdtemp(prefix=f"bench-sglang-{'w' if wrapped else 's'}-")
    procs = Procs()
    cluster = Cluster(tmp, procs)
    stack = Stack(cluster, tmp, wrapped=wrapped)
    out = {}
    try:
        for row in ROWS:
            if only and only not in row.name:
                continue
            try:
                out[row.name] = row.run(stack, cap_s)
            except AssertionError as e:
                out[row.name] = f"error: {str(e).splitlines()[0]}"
            print(f"{'wrapped' if wrapped else 'stock'}: {row.name}: {out[row.name]}", flush=True)
    finally:
        try:
            stack.close()
        finally:
            procs.cleanup()
            cluster.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--cap-s", type=float, default=40.0)
    ap.add_argument("-k", default=None, help="only the scenarios whose name has this")
    a = ap.parse_args()
    from tests.routers.stack import private_network
    private_network()  # as root: nothing but loopback for this process and its children
    stock = measure(False, a.cap_s, a.k)
    wrapped = measure(True, a.cap_s, a.k)
    lines = ["| scenario | what | stock SGLang 0.5.23 | wrapped (`SHMHB_SGLANG=1`) |",
             "| --- | --- | --- | --- |"]
    for row in ROWS:
        if row.name in stock or row.name in wrapped:
            lines.append(f"| {row.name} | {row.what} | {stock.get(row.name, 'not run')} | "
                         f"{wrapped.get(row.name, 'not run')} |")
    text = "\n".join(lines)
    print(text)
    with open(a.out, "w") as f:
        f.write(HEADER + text + "\n" + FOOTER)


HEADER = """# SGLang: stock P/D on Mooncake vs shmhb's wrapper

SGLang 0.5.23 (`.ci/sglang`'s venv), Mooncake's TCP transport, CPU KV tensors of 64 KiB
pages (rooms of 64 pages, 4 MiB, but for the mid-transfer row); a prefill rank on
127.0.0.2 and a decode rank on 127.0.0.3, each its own process running SGLang's real
manager, sender, receiver and bootstrap server (`tests/sglang/engine.py`), each host
with its board and pinger; shmhb policy suspect-after 0.5 s, dead-after 2.0 s; SGLang's
health check at its defaults (every 5 s, 2 failures); a shared 2-core machine.

`python -m bench.sglang` (every figure below; one run, both modes): what the decode's
receiver reported for the room (the decode scheduler turns a failure into the request's
`KVTransferError`) and when, from the fault:

"""
FOOTER = """
"Killed before the room", stock: the room is sent through the cached `connection_pool`
entry to the dead process's rank port (SGLang's ZMQ PUSH socket queues it) and waits for
the health check; wrapped: the board has dropped the rank, its entries are gone, and
the room fails asking the bootstrap server (a real decode scheduler keeps such a request
queued until its bootstrap timeout, and a restarted prefill on that address serves it).
"Killed mid-transfer": the wrapper fails no granted room before its go-ahead's lease
ran out (a stopped prefill could resume and finish the write): the wrapped decode holds
the room for the lease (`SHMHB_SGLANG_GRANT_LEASE_S`, 30 s here, its default), then fails
it; it evicts the dead rank's entries at once all the same (docs/SGLANG.md, "The
lease").  Stock fails it at its health check, about 10 s, with nothing to stop a
resumed prefill from writing into the pages it freed.
"""


if __name__ == "__main__":
    main()
