"""Stock vLLM NixlConnector versus ShmhbConnector around it: ``python -m bench.vllm_nixl``.

One run, real vLLM and the real NIXL (UCX over TCP on loopback, DRAM) on CPU, in the
stack of ``tests/vllm`` (a prefill host 127.0.0.2 and a decode host 127.0.0.3, each
with its own board and pinger); needs the vLLM venv with NIXL (tests/vllm/conftest.py).
A stock pair and a wrapped pair of engines run side by side, each on its own side-channel
port, and each fault is done to both:

* **Faults.**  Per fault, what the request whose prefill was hit ends as (loaded,
  failed, computed locally, or still waiting), and how long after the fault:
  the prefill stopped with the request's READ posted; stopped before its first
  handshake; killed, then the next request; restarted under the same engine id, then
  the next request; restarted under a new one.
* **The happy path.**  The time from a load's start to its blocks landing (the decode's
  ``loading`` to ``loaded``), stock and wrapped interleaved ABBA, p50 and p99.

Writes ``bench/results_vllm_nixl.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.vllm.stack import (
    POLICY, EngineProc, Stack, expected_digest, open_stack, prefilled, start_pair,
    wait_alive_on_decode_host,
)

OUT = Path(__file__).resolve().parent / "results_vllm_nixl.md"
#: how long a request is watched before it is called "still waiting"
WATCH_S = 15.0


def _alive(stack: Stack, p: EngineProc) -> None:
    """Until the decode host's board shows ``p`` alive (wrapped engines are judged by it;
    a stock one is not on the board: nothing to wait for)."""
    if p.wrapped:
        wait_alive_on_decode_host(stack, p)


def _end(d: EngineProc, rid: str, t0: float, seed: int, limit_s: float = WATCH_S) -> dict[str, Any]:
    """How the request ended, ``s`` after ``t0``."""
    try:
        ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=limit_s)
    except AssertionError:
        return {"outcome": f"still waiting after {limit_s:.0f} s", "s": None}
    if ev["ev"] == "loaded":
        ok = ev["digest"] == expected_digest(seed)
        return {"outcome": "loaded" if ok else "loaded, WRONG bytes", "s": ev["t"] - t0}
    return {"outcome": "load failed", "s": ev["t"] - t0}


def _send(d: EngineProc, p: EngineProc, rid: str, params: dict[str, Any]) -> dict[str, Any]:
    """Start loading ``rid`` on ``d``: its "loading" or "vetoed" event (stamped)."""
    d.send("load", rid=rid, transfer_id="-", engine_id=p.engine_id, bootstrap=p.bootstrap,
           params=params)
    return d.expect("loading", "vetoed", rid=rid)


def _request(d: EngineProc, p: EngineProc, params: dict[str, Any], rid: str, t0: float,
             seed: int) -> dict[str, Any]:
    ev = _send(d, p, rid, params)
    if ev["ev"] == "vetoed":
        return {"outcome": "computed locally (vetoed)", "s": ev["t"] - t0}
    return _end(d, rid, t0, seed)


def _healthy(stack: Stack, p: EngineProc, d: EngineProc, seed: int) -> None:
    """One good transfer (the engine is known to the decode side after it)."""
    _alive(stack, p)
    rid, _, params = prefilled(p, seed=seed)
    r = _request(d, p, params, rid, time.monotonic(), seed)
    if r["outcome"] != "loaded":
        raise RuntimeError(f"a healthy transfer ended {r}")


def faults(stack: Stack, wrapped: bool, tag: str) -> dict[str, dict[str, Any]]:
    """Each fault to this variant's pair, in turn (see the module docstring)."""
    rows: dict[str, dict[str, Any]] = {}
    # stopped before the first handshake: a prefill the decode has not met
    p, d = start_pair(stack, wrapped, f"{tag}-a")
    _alive(stack, p)
    rid, _, params = prefilled(p, seed=31)
    t0 = p.stop()
    rows["stop_handshake"] = _request(d, p, params, rid, t0, 31)
    p.cont()
    _healthy(stack, p, d, 30)
    # stopped with the READ posted (the engine is known), then a new request to it
    rid, _, params = prefilled(p, seed=32)
    t0 = p.stop()
    rows["stop_posted"] = _request(d, p, params, rid, t0, 32)
    rows["stop_next"] = _request(d, p, params, rid + "-next", time.monotonic(), 32)
    t1 = time.monotonic()
    p.cont()
    rows["stop_resumed"] = _end(d, rid, t1, 32, 60) if rows["stop_posted"]["s"] is None \
        else {"outcome": "(ended before)", "s": None}
    _healthy(stack, p, d, 36)
    # killed, then the next request once the board could know (dead-after)
    rid, _, params = prefilled(p, seed=33)
    t0 = p.kill()
    time.sleep(POLICY.dead_after_s)
    rows["kill_next"] = _request(d, p, params, rid, t0, 33)
    port = int(p.bootstrap.rsplit(":", 1)[1])
    # restarted under the same id: the next request
    p2 = stack.start("prefill", p.engine_id, wrapped=wrapped, bootstrap_port=port)
    _alive(stack, p2)
    rid, _, params = prefilled(p2, seed=34)
    rows["restart_same"] = _request(d, p2, params, rid, time.monotonic(), 34)
    p2.kill()
    # restarted under a new id at the same address: the next request, at once
    p3 = stack.start("prefill", f"{tag}-new", wrapped=wrapped, bootstrap_port=port)
    rid, _, params = prefilled(p3, seed=35)
    rows["restart_new"] = _request(d, p3, params, rid, time.monotonic(), 35)
    agents = d.request("inner", "inner")["remote_agents"]
    rows["cached"] = {"outcome": ", ".join(agents) or "none", "s": None}
    return rows


def happy_path(stack: Stack, samples: int) -> dict[bool, dict[str, float]]:
    """Stock and wrapped interleaved ABBA: ``loading`` to ``loaded`` of one request."""
    # Engines step every 0.2 ms while a load is under way and every 5 ms otherwise (as
    # bench.vllm's happy path): at 5 ms a step, a load's end is seen a step late or not.
    env = {"SHMHB_VLLM_STEP_S": "0.0002", "SHMHB_VLLM_IDLE_STEP_S": "0.005"}
    pairs = {w: start_pair(stack, w, f"happy-{'w' if w else 's'}", env)
             for w in (False, True)}
    _alive(stack, pairs[True][0])
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(samples + 2):
        for wrapped in ((False, True) if i % 2 == 0 else (True, False)):
            p, d = pairs[wrapped]
            rid, _, params = prefilled(p, seed=i)
            t0 = _send(d, p, rid, params)["t"]
            ev = d.expect("loaded", "load_failed", rid=rid, timeout_s=60)
            if ev["ev"] != "loaded" or ev["digest"] != expected_digest(i):
                raise RuntimeError(f"a bad transfer on the happy path: {ev}")
            if i >= 2:  # the first two make the handshake
                times[wrapped].append(ev["t"] - t0)
    out = {w: {"p50": float(np.percentile(ts, 50)), "p99": float(np.percentile(ts, 99))}
           for w, ts in times.items()}
    added = [w - s for s, w in zip(times[False], times[True])]
    out[True]["added_p50"] = float(np.percentile(added, 50))
    return out


FAULTS = (
    ("stop_handshake", "SIGSTOP the prefill before the decode's first request to it (handshake pending)"),
    ("stop_posted", "SIGSTOP the prefill, then a request to it (READ posted while the board says ALIVE)"),
    ("stop_next", "... and a second request once the first has waited 15 s (the board says DEAD)"),
    ("stop_resumed", "... the first request, once the prefill resumes (time after the resume)"),
    ("kill_next", "kill -9 the prefill (known to the decode); a request dead-after later (time from the kill)"),
    ("restart_same", "prefill restarted, same engine id: the next request"),
    ("restart_new", "prefill restarted, new engine id, same address: the next request, at once"),
    ("cached", "engines the decode's NIXL worker still caches at the end"),
)


def _cell(r: dict[str, Any]) -> str:
    return r["outcome"] if r["s"] is None else f"{r['outcome']} after {r['s']:.2f} s"


def _kept() -> dict[str, list[str]]:
    """The sections of the results file as they are (a partial run keeps the other)."""
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in OUT.read_text().splitlines() if OUT.exists() else ():
        if line.startswith("## "):
            cur = out.setdefault(line, [])
        if cur is not None:
            cur.append(line)
    return out


def report(rows: dict[bool, dict[str, dict[str, Any]]], happy: dict[bool, dict[str, float]],
           samples: int, kept: dict[str, list[str]]) -> str:
    import vllm
    lines = [
        "# vLLM: stock NixlConnector vs ShmhbConnector around it", "",
        f"vLLM {vllm.__version__}, NIXL (UCX over TCP on loopback, DRAM), CPU; shmhb policy "
        f"suspect-after {POLICY.suspect_after_s} s, dead-after {POLICY.dead_after_s} s; a "
        "shared 2-core machine.  A stock pair and a wrapped pair side by side in one stack. "
        "Each section is rewritten by the run named in it.", "",
    ]
    if rows:
        lines += ["## Faults", "", "`python -m bench.vllm_nixl --only faults`: the request's "
                  "end, and how long after the fault (or after its own start)", "",
                  "| fault | stock | wrapped |", "| --- | --- | --- |"]
        for key, what in FAULTS:
            lines.append(f"| {what} | {_cell(rows[False][key])} | {_cell(rows[True][key])} |")
        lines.append("")
    else:
        lines += kept.get("## Faults", [])
    if happy:
        s, w = happy[False], happy[True]
        lines += [
            "## The happy path", "",
            f"`python -m bench.vllm_nixl --only transfer --samples {samples}`: a load's start "
            f"to its blocks landing (`loading` to `loaded`), {samples} samples each, "
            "interleaved ABBA, 3 blocks of 16 KiB per request; engines step every 0.2 ms "
            "while a load is under way:", "",
            "| | p50 | p99 |", "| --- | --- | --- |",
            f"| stock | {s['p50'] * 1e3:.2f} ms | {s['p99'] * 1e3:.2f} ms |",
            f"| wrapped | {w['p50'] * 1e3:.2f} ms | {w['p99'] * 1e3:.2f} ms |",
            f"| added (p50 of paired differences) | {w['added_p50'] * 1e3:+.2f} ms | |",
        ]
    else:
        lines += kept.get("## The happy path", [])
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--only", choices=("faults", "transfer"),
                    help="one part; the other's section of the results file is kept")
    a = ap.parse_args()
    rows: dict[bool, dict[str, dict[str, Any]]] = {}
    happy: dict[bool, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with open_stack(tmp, lambda cluster, d: Stack(cluster, d, wrapped=True, inner="nixl")) as stack:
            for wrapped in (False, True) if a.only != "transfer" else ():
                print(f"faults, {'wrapped' if wrapped else 'stock'} ...", flush=True)
                rows[wrapped] = faults(stack, wrapped, "w" if wrapped else "s")
                print(rows[wrapped], flush=True)
            if a.only != "faults":
                print("happy path ...", flush=True)
                happy = happy_path(stack, a.samples)
    text = report(rows, happy, a.samples, _kept())
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
