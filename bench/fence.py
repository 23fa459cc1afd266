"""``python -m bench.fence [--asks N]``: what one go-ahead ask costs a producer, a new
TCP connection per ask (as the first go-ahead version asked, there over ZMQ) against one
kept per consumer (``shmhb.vllm.fence.GrantAsker``), interleaved in one run against one
real ``FenceServer`` on loopback.  Needs the vLLM extra (``shmhb.vllm`` imports vLLM).

Reports per variant the median and p99 of one ask in ms, and the ratio of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

from shmhb.vllm import fencewire
from shmhb.vllm.fence import VERSION, FenceServer, GrantAsker, decode_reply

PRODUCER = "127.0.0.1:1"


async def _new_connection_ask(endpoint: str, inc: int, tok: str, req: str) -> list[str] | None:
    """An ask as the first version made it: a connection opened and closed around it."""
    sock = await fencewire.connect(endpoint)
    try:
        nonce = int.from_bytes(os.urandom(6), "little")
        await fencewire.send_frame(sock, json.dumps({
            "v": VERSION, "n": nonce, "inc": inc, "from": PRODUCER, "tok": tok,
            "reqs": [req]}).encode(), 5.0)
        buf = bytearray()
        while (frame := fencewire.next_frame(buf)) is None:
            had = len(buf)
            await fencewire.recv_into(sock, buf, 5.0)
            if len(buf) == had:
                return None  # nothing in 5 s
        return decode_reply(frame, nonce)
    finally:
        sock.close()


async def _run(srv: FenceServer, asks: int) -> dict[str, list[float]]:
    asker = GrantAsker()
    tok = srv.token_for(PRODUCER)
    out: dict[str, list[float]] = {"new connection per ask": [], "one connection per consumer": []}
    try:
        for i in range(asks):  # interleaved: machine noise lands on both alike
            t0 = time.perf_counter()
            got = await _new_connection_ask(srv.endpoint, srv.incarnation, tok, f"a{i}")
            out["new connection per ask"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kept = await asker.ask(srv.endpoint, srv.incarnation, tok, PRODUCER, [f"b{i}"], 5.0)
            out["one connection per consumer"].append(time.perf_counter() - t0)
            if got != [f"a{i}"] or kept != [f"b{i}"]:
                raise SystemExit(f"ask {i}: no grant ({got}, {kept}): the bench is broken")
    finally:
        asker.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fence", description=__doc__)
    ap.add_argument("--asks", type=int, default=500, help="asks per variant (default 500)")
    a = ap.parse_args(argv)
    srv = FenceServer("127.0.0.1", 7, lambda frm, reqs: reqs)
    try:
        rows = asyncio.run(_run(srv, a.asks))
    finally:
        srv.close()
    base = float(np.median(rows["new connection per ask"]))
    print(f"`python -m bench.fence --asks {a.asks}`: one go-ahead ask, ms")
    print("| variant | p50 | p99 | p50 ratio |\n| --- | --- | --- | --- |")
    for name, ts in rows.items():
        p50, p99 = float(np.median(ts)), float(np.percentile(ts, 99))
        print(f"| {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {p50 / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
