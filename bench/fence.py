"""``python -m bench.fence [--asks N]``: what one go-ahead ask costs a producer when the
consumer's engine is busy, its grants answered in C (``shmhb._fence``: no GIL) against
in Python (a thread that must take the engine's GIL first).

Each consumer is a process of its own whose main thread runs Python without pause (an
engine stepping on a CPU; on a GPU host it would wait on the device with the GIL
released), with its fence server on loopback.  This process asks both, interleaved,
over one kept connection each (``GrantAsker``).  Needs the vLLM extra (``shmhb.vllm``
imports vLLM) and the built extension (``python setup.py build_ext --inplace``).

Reports per variant the median and p99 of one ask in ms, and the ratio of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import numpy as np

PRODUCER = "127.0.0.1:1"


def _consumer(native: bool, asks: int, conn: Connection) -> None:
    """A consumer with ``asks`` loads waiting, busy in Python until told to stop."""
    from shmhb.kv import grants
    from shmhb.kv.fence import FenceServer
    from shmhb.kv.loads import Load, LoadTable
    t = LoadTable(grants.new_states(native))
    t.start(Load(f"r{i}", PRODUCER, "e", frozenset(), None) for i in range(asks))
    srv = FenceServer("127.0.0.1", 7, t.states, t.tokens)
    conn.send((srv.endpoint, srv.token_for(PRODUCER)))
    x, look = 0, time.monotonic() + 0.5
    while True:  # the engine's main thread: Python, no syscall that drops the GIL
        for i in range(2000):
            x += i * i
        if time.monotonic() >= look:  # (a vDSO read: keeps the GIL)
            if conn.poll():
                break
            look = time.monotonic() + 0.5
    srv.close()


async def _run(eps: dict[str, tuple[str, str]], asks: int) -> dict[str, list[float]]:
    from shmhb.kv.fence import GrantAsker
    asker = GrantAsker()
    out: dict[str, list[float]] = {k: [] for k in eps}
    try:
        for name, (ep, tok) in eps.items():  # connect first: not what is measured
            await asker.ask(ep, 7, tok, ["warm"], 5.0)
        for i in range(asks):  # interleaved: machine noise lands on both alike
            for name, (ep, tok) in eps.items():
                t0 = time.perf_counter()
                got = await asker.ask(ep, 7, tok, [f"r{i}"], 5.0)
                out[name].append(time.perf_counter() - t0)
                if got != [f"r{i}"]:
                    raise SystemExit(f"{name}, ask {i}: no grant ({got}): the bench is broken")
    finally:
        asker.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fence", description=__doc__)
    ap.add_argument("--asks", type=int, default=300, help="asks per variant (default 300)")
    a = ap.parse_args(argv)
    from shmhb.kv import grants
    if not grants.native:
        raise SystemExit("shmhb._fence is not built: python setup.py build_ext --inplace")
    ctx = mp.get_context("spawn")
    procs, pipes, eps = [], [], {}
    try:
        for name, native in (("answered in Python", False), ("answered in C", True)):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_consumer, args=(native, a.asks, theirs), daemon=True)
            p.start()
            procs.append(p)
            pipes.append(mine)
            if not mine.poll(120):
                raise SystemExit(f"the consumer ({name}) did not start")
            eps[name] = mine.recv()
        rows = asyncio.run(_run(eps, a.asks))
    finally:
        for c in pipes:
            c.send("stop")
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    base = float(np.median(rows["answered in Python"]))
    print(f"`python -m bench.fence --asks {a.asks}`: one go-ahead ask to a busy consumer, ms")
    print("| consumer's grants | p50 | p99 | p50 ratio |\n| --- | --- | --- | --- |")
    for name, ts in rows.items():
        p50, p99 = float(np.median(ts)), float(np.percentile(ts, 99))
        print(f"| {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {p50 / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
