"""Stock vLLM MooncakeConnector versus ShmhbConnector around it: ``python -m bench.vllm``.

One run, real vLLM 0.32 and the real Mooncake transfer engine (TCP) on CPU, a prefill
host (127.0.0.2) and a decode host (127.0.0.3) each with its own board and pinger (the
stack of ``tests/vllm``; needs the vLLM venv, see tests/vllm/conftest.py).  For each of
kill -9 of the prefill worker, SIGSTOP of it, and a restart under the same engine id,
after a first good transfer: what the decode side's load ends as, and how long after
the fault.  Then the wrapper's cost per scheduler and worker call.

Stock waits ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60`` s for a reply that cannot come;
at the default (480) that is 540 s per case.  This bench lowers the timeout
(``--abort-timeout-s``, default 10: 70 s per case) so the run takes minutes; the figure
at the default is the formula's.  Writes ``bench/results_vllm.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import Procs
from tests.hosts import Cluster
from tests.vllm.stack import POLICY, EngineProc, Stack, new_ids, transfer

OUT = Path(__file__).resolve().parent / "results_vllm.md"


def _in_flight(p: EngineProc, d: EngineProc) -> str:
    """A load in flight: the decode side asked, the prefill side holds the request."""
    rid, xid = new_ids()
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid)
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    d.expect("loading", "vetoed", rid=rid)
    p.expect_asked(xid)
    return rid


def _outcome(d: EngineProc, rid: str, t0: float, limit_s: float) -> tuple[str, float]:
    try:
        ev = d.expect("loaded", "load_failed", "vetoed", rid=rid, timeout_s=limit_s)
    except AssertionError:
        return f"still waiting after {limit_s:.0f} s", limit_s
    return ev["ev"].replace("_", " "), ev["t"] - t0


def _wait_known(stack: Stack, p: EngineProc) -> None:
    from shmhb import Status
    ep = p.bootstrap.split("://", 1)[1]
    stack.decode_host.board.watch(ep)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = stack.decode_host.board.remote(ep)
        if s is not None and s.status is Status.ALIVE and p.engine_id in s.key:
            return
        time.sleep(0.01)


def run_variant(wrapped: bool, abort_s: int, tmp: str, cost_only: bool = False) -> dict[str, Any]:
    limit = abort_s + 60 + 30
    procs = Procs()
    cluster = Cluster(tmp, procs)
    stack = Stack(cluster, tmp, wrapped=wrapped,
                  env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(abort_s)})
    res: dict[str, Any] = {}
    try:
        p, d = stack.start("prefill", "bench-prefill"), stack.start("decode")
        _wait_known(stack, p)
        transfer(p, d, seed=1)
        res["cost"] = d.request("cost", "cost", engine_id=p.engine_id, bootstrap=p.bootstrap,
                                timeout_s=120)
        if cost_only:
            return res
        # kill -9 with a load in flight
        rid = _in_flight(p, d)
        t = p.kill()
        res["kill"] = _outcome(d, rid, t, limit)
        # restart under the same engine id: the next request
        p2 = stack.start("prefill", p.engine_id)
        _wait_known(stack, p2)
        rid, xid = new_ids()
        p2.request("prefill", "prefilled", rid=rid, transfer_id=xid)
        p2.send("finish", rid=rid)
        t = time.monotonic()
        d.send("load", rid=rid, transfer_id=xid, engine_id=p2.engine_id, bootstrap=p2.bootstrap)
        res["restart"] = _outcome(d, rid, t, limit)
        # SIGSTOP with a load in flight, on a fresh engine (new id: stock cannot reach
        # the restarted one above)
        p2.kill()
        p3 = stack.start("prefill")
        _wait_known(stack, p3)
        transfer(p3, d, seed=2, timeout_s=limit)
        rid = _in_flight(p3, d)
        t = p3.stop()
        res["hang"] = _outcome(d, rid, t, limit)
        p3.cont()
        res["inner_engines"] = d.request("inner", "inner")["remote_agents"]
    finally:
        stack.close()
        procs.cleanup()
        cluster.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--abort-timeout-s", type=int, default=10)
    ap.add_argument("--cost-only", action="store_true",
                    help="only the per-call costs (no faults): a minute instead of ten")
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for wrapped in (False, True):
            name = "ShmhbConnector(MooncakeConnector)" if wrapped else "stock MooncakeConnector"
            print(f"running {name} ...", flush=True)
            rows[wrapped] = run_variant(wrapped, a.abort_timeout_s, tmp, a.cost_only)
            print(rows[wrapped], flush=True)
    s, w = rows[False], rows[True]
    if a.cost_only:
        for k in ("get_num_new_matched_tokens", "get_finished"):
            print(f"{k}: stock {s['cost'][k]:.0f} ns, wrapped {w['cost'][k]:.0f} ns")
        print(f"wrapper's board read {w['cost']['wrapper_veto_read']:.0f} ns, "
              f"poll {w['cost']['wrapper_poll']:.0f} ns")
        return
    lines = [
        "# vLLM: stock MooncakeConnector vs ShmhbConnector around it",
        "",
        f"`python -m bench.vllm --abort-timeout-s {a.abort_timeout_s}` (vLLM 0.32.0, Mooncake TCP, "
        f"CPU; shmhb policy dead-after {POLICY.dead_after_s} s; one run).  Stock waits "
        f"`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60` s: {a.abort_timeout_s + 60} s here, "
        "**540 s at the default 480**.",
        "",
        "| after a first good transfer | stock | wrapped |",
        "| --- | --- | --- |",
    ]
    for key, label in (("kill", "kill -9 the prefill worker, load in flight"),
                       ("hang", "SIGSTOP the prefill worker, load in flight"),
                       ("restart", "restart the prefill worker (same engine id), next request")):
        (so, st), (wo, wt) = s[key], w[key]
        lines.append(f"| {label} | {so} after {st:.2f} s | {wo} after {wt:.3f} s |")
    lines += ["", f"Dead engines left in the decode side's `_remote_agents`: stock "
              f"{s['inner_engines']}, wrapped {w['inner_engines']}.", "",
              "| per call (median ns) | stock | wrapped |", "| --- | --- | --- |"]
    for k in ("get_num_new_matched_tokens", "get_finished"):
        lines.append(f"| `{k}` | {s['cost'][k]:.0f} | {w['cost'][k]:.0f} |")
    lines.append(f"| the wrapper's own board read (scheduler) | - | {w['cost']['wrapper_veto_read']:.0f} |")
    lines.append(f"| the wrapper's own `poll()` (worker) | - | {w['cost']['wrapper_poll']:.0f} |")
    text = "\n".join(lines) + "\n"
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
