"""Stock vLLM MooncakeConnector versus ShmhbConnector around it: ``python -m bench.vllm``.

One run, real vLLM and the real Mooncake transfer engine (TCP) on CPU, a prefill host
(127.0.0.2) and a decode host (127.0.0.3) each with its own board and pinger (the stack
of ``tests/vllm``; needs the vLLM venv, see tests/vllm/conftest.py).  Two parts:

* **What a client sees** (``--only client``).  The decode engine runs vLLM's real
  Scheduler (tests/vllm/scheduled.py) with the deterministic stand-in model, for three
  set-ups: stock at vLLM's default ``kv_load_failure_policy`` ("fail"), stock with
  "recompute", and wrapped (which sets "recompute" itself).  Per fault (kill -9 or
  SIGSTOP of the prefill with the request's load in flight, restart under the same
  engine id, restart under a new one): the request's outcome (completed with the right
  tokens, or failed) and how much later than an undisturbed request it finished.
  Stock waits ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60`` s for a reply that cannot
  come: 540 s at the default; this bench lowers the timeout (``--abort-timeout-s``,
  default 10: 70 s per case) so the run takes minutes.
* **What the happy path costs** (``--only transfer``).  Two stock pairs and a wrapped
  pair side by side in one stack, samples interleaved in every order: the time from a
  load's start to its blocks landing (the decode side's ``loading`` to ``loaded``), for
  1 MiB and 16 MiB of KV per request, p50 and p99, with the second stock pair against
  the first as the bench's own resolution; each thread's CPU per transfer, wrapped
  against stock (``--samples``, default 300: the timed rounds are seconds of a run
  whose minutes go to starting engines); and the wrapper's own cost per call, timed
  against the inner connector alone in the same process.

Writes ``bench/results_vllm.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.vllm import model
from tests.vllm.stack import POLICY, PREFILL_IP, EngineProc, Stack, new_ids, open_stack, submit

OUT = Path(__file__).resolve().parent / "results_vllm.md"
VARIANTS = ("stock", "stock + recompute", "wrapped")
SCENARIOS = (
    ("kill", "kill -9 the prefill, load in flight"),
    ("stop", "SIGSTOP the prefill, load in flight"),
    ("flap", "request sent while the prefill is SUSPECT (stopped 0.5 s past suspect-after, then resumed)"),
    ("restart_same", "prefill restarted, same engine id: the next request"),
    ("restart_new", "prefill restarted, new engine id: the next request, at once"),
)
TOKENS = 4
SIZES = ((64, "1 MiB"), (1024, "16 MiB"))  # prompt blocks of 16 KiB


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


def _stack(tmp: str, wrapped: bool, env: dict[str, str]) -> contextlib.AbstractContextManager[Stack]:
    os.makedirs(tmp, exist_ok=True)
    return open_stack(tmp, lambda cluster, d: Stack(cluster, d, wrapped=wrapped, env=env))


# -- what a client sees -------------------------------------------------------------------

def _submit(p: EngineProc, d: EngineProc, seed: int, finish: bool = True,
            before_serve: Any = None) -> tuple[str, list[int]]:
    rid, _, prompt = submit(p, d, seed, TOKENS, finish=finish, before_serve=before_serve)
    return rid, prompt


def _served(d: EngineProc, rid: str, prompt: list[int], limit_s: float) -> dict[str, Any]:
    try:
        ev = d.expect("served", rid=rid, timeout_s=limit_s)
    except AssertionError:
        return {"outcome": f"still waiting after {limit_s:.0f} s", "s": limit_s}
    ok = ev["tokens"] == model.generate(prompt, TOKENS)
    done = ev["finish_reason"] == "length"
    outcome = ("completed" if ok else "completed, WRONG tokens") if done else \
        f"failed ({ev['finish_reason']})"
    return {"outcome": outcome, "s": ev["t"] - ev["added_t"]}


def client_view(variant: str, abort_s: int, tmp: str) -> dict[str, Any]:
    limit = abort_s + 60 + 30
    env = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(abort_s)}
    res: dict[str, Any] = {}
    with _stack(tmp, variant == "wrapped", env) as stack:
        d = stack.start("decode", scheduler=True,
                        failure_policy="recompute" if variant == "stock + recompute" else None)
        p = stack.start("prefill", "bench-prefill")
        _wait_known(stack, p)
        base = []
        for seed in range(3):  # undisturbed: the first one also makes the handshake
            rid, prompt = _submit(p, d, seed)
            base.append(_served(d, rid, prompt, limit))
        res["undisturbed"] = base[-1]
        rid, prompt = _submit(p, d, 10, finish=False)
        p.expect("asked", timeout_s=30)
        p.kill()
        res["kill"] = _served(d, rid, prompt, limit)
        p2 = stack.start("prefill", p.engine_id)
        _wait_known(stack, p2)
        rid, prompt = _submit(p2, d, 11)
        res["restart_same"] = _served(d, rid, prompt, limit)
        p2.kill()
        p3 = stack.start("prefill")
        _wait_known(stack, p3)
        rid, prompt = _submit(p3, d, 12)
        _served(d, rid, prompt, limit)  # a good one first: the handshake is made
        rid, prompt = _submit(p3, d, 13, finish=False)
        p3.expect("asked", timeout_s=30)
        p3.stop()
        res["stop"] = _served(d, rid, prompt, limit)
        p3.cont()
        _wait_known(stack, p3)

        def stop_until_suspect() -> None:
            from shmhb import Status
            p3.stop()
            ep = p3.bootstrap.split("://", 1)[1]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s = stack.decode_host.board.remote(ep)
                if s is not None and s.status is Status.SUSPECT:
                    return
                time.sleep(0.005)
        rid, prompt = _submit(p3, d, 15, before_serve=stop_until_suspect)
        time.sleep(0.5)
        p3.cont()
        res["flap"] = _served(d, rid, prompt, limit)
        p3.kill()
        p4 = stack.start("prefill")  # at once: the decode host may not know it yet
        rid, prompt = _submit(p4, d, 14)
        res["restart_new"] = _served(d, rid, prompt, limit)
        b = d.request("blocks", "blocks")
        res["leaked_blocks"] = b["at_start"] - b["free"]
        res["policy"] = b["policy"]
    return res


# -- what the happy path costs --------------------------------------------------------------

STAGES = (("request", "the load's start to its request read at the producer"),
          ("to_write", "request read to the write's start (wrapped: the go-ahead)"),
          ("write", "the write itself"),
          ("to_loaded", "the write's end to the decode step that reports it loaded"))


def _wrote(p: EngineProc) -> list[dict[str, Any]]:
    """The producer's "wrote" stamps of the transfer just done (one at least)."""
    out = [p.expect("wrote", timeout_s=30)]
    more = [ev for ev in p.seen if ev["ev"] == "wrote"]
    for ev in more:
        p.seen.remove(ev)
    while True:
        try:
            ev = p.events.get_nowait()
        except queue.Empty:
            return out + more
        (more if ev["ev"] == "wrote" else p.seen).append(ev)


def _sample(p: EngineProc, d: EngineProc, seed: int) -> tuple[float, bool, dict[str, float]]:
    """One transfer: the prefill computes and finishes, the decode loads.  The decode's
    ``loading`` to ``loaded`` stamps, whether the right bytes landed, and the stages
    between (both processes stamp the one monotonic clock of this machine)."""
    rid, xid = new_ids()
    a = p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=seed, timeout_s=120)
    p.send("finish", rid=rid)
    p.expect("finished", rid=rid)
    d.send("load", rid=rid, transfer_id=xid, engine_id=p.engine_id, bootstrap=p.bootstrap)
    t0 = d.expect("loading", rid=rid, timeout_s=60)["t"]
    b = d.expect("loaded", "load_failed", rid=rid, timeout_s=120)
    asked = p.expect_asked(xid)["t"]
    w = _wrote(p)
    w0, w1 = min(ev["t0"] for ev in w), max(ev["t"] for ev in w)
    stages = {"request": asked - t0, "to_write": w0 - asked, "write": w1 - w0,
              "to_loaded": b["t"] - w1}
    return b["t"] - t0, b["ev"] != "loaded" or b["digest"] != a["digest"], stages


#: the happy path's pairs of engines: two stock pairs (their difference is what the
#: bench reads where there is none: its resolution on this machine) and a wrapped one;
#: with ``--no-goahead-pair`` also a wrapped pair whose consumer sends no shmhb field
#: (no go-ahead: unsafe, to tell the go-ahead's share of the cost from the rest's)
PAIRS = ("stock", "stock2", "wrapped")
NO_GOAHEAD = "wrapped, no go-ahead"
#: how often the happy path's engines step while a transfer is under way
STEP_S = 0.0002


def happy_path(blocks: int, samples: int, tmp: str, step_s: float = STEP_S,
               no_goahead: bool = False) -> dict[str, dict[str, Any]]:
    """Two stock pairs and a wrapped pair side by side in one stack (one board and
    pinger per host, each pair of engines on its own bootstrap port), each round timing
    one transfer of each pair in the next of their orders: each pair is timed first,
    second, third (...) equally often, so a drift in the machine's load or a cost of
    coming first falls on all."""
    names = PAIRS + ((NO_GOAHEAD,) if no_goahead else ())
    orders = list(itertools.permutations(range(len(names))))
    # Engines step every ``step_s`` (0.2 ms) while a transfer is under way and every
    # 5 ms otherwise: six or eight engines spinning on two cores would time the OS
    # scheduler, not the wrapper.
    env = {"SHMHB_VLLM_PROMPT_BLOCKS": str(blocks), "SHMHB_VLLM_STEP_S": str(step_s),
           "SHMHB_VLLM_IDLE_STEP_S": "0.005", "SHMHB_VLLM_TRACE": "1"}
    with _stack(tmp, True, env) as stack:
        pairs = {}
        for k, name in enumerate(names):
            wrapped = name.startswith("wrapped")
            port = stack.new_port([PREFILL_IP])
            off = {"SHMHB_VLLM_NO_GOAHEAD": "1"} if name == NO_GOAHEAD else {}
            p = stack.start("prefill", f"happy-{blocks}-{k}", wrapped=wrapped,
                            bootstrap_port=port)
            pairs[name] = (p, stack.start("decode", wrapped=wrapped, bootstrap_port=port,
                                          env=off))
        _wait_known(stack, pairs["wrapped"][0])
        times: dict[str, list[float]] = {n: [] for n in names}
        bad = dict.fromkeys(names, 0)
        stages: dict[str, dict[str, list[float]]] = {n: {} for n in names}
        cpu0: dict[str, list[dict[str, Any]]] = {}
        for i in range(samples + 2):
            if i == 2:  # the first two make the handshake
                cpu0 = _cpu(pairs)
            for k in orders[i % len(orders)]:
                name = names[k]
                dt, wrong, st = _sample(*pairs[name], seed=i)
                bad[name] += wrong
                if i >= 2:
                    times[name].append(dt)
                    for stage, v in st.items():
                        stages[name].setdefault(stage, []).append(v)
        cpu1 = _cpu(pairs)
        out: dict[str, dict[str, Any]] = {}
        for name, ts in times.items():
            out[name] = {**_per_transfer(cpu0[name], cpu1[name], samples),
                         "p50": float(np.percentile(ts, 50)),
                         "p99": float(np.percentile(ts, 99)), "bad": bad[name],
                         "stages": {k: float(np.percentile(v, 50))
                                    for k, v in stages[name].items()}}
        stock = times["stock"] + times["stock2"]
        out["both"] = {"p50": float(np.percentile(stock, 50)),
                       "p99": float(np.percentile(stock, 99))}
        # per round: a wrapped transfer against the two stock ones of that round
        for name in names[2:]:
            out[name]["paired"] = float(np.percentile(
                [w - (a + b) / 2 for a, b, w in zip(times["stock"], times["stock2"],
                                                     times[name])], 50))
        out["stock2"]["paired"] = float(np.percentile(
            [b - a for a, b in zip(times["stock"], times["stock2"])], 50))
        p = pairs["wrapped"][0]
        out["wrapped"]["asks"] = p.request("asks", "asks")["counts"]
        if blocks == SIZES[0][0]:
            for name in ("stock", "wrapped"):
                p, d = pairs[name]
                out[name]["cost"] = d.request("cost", "cost", engine_id=p.engine_id,
                                              bootstrap=p.bootstrap, n=2000, timeout_s=180)
        return out


def _cpu(pairs: dict[str, tuple[EngineProc, EngineProc]]) -> dict[str, list[dict[str, Any]]]:
    """Per pair, each engine's CPU so far (its whole process's, its main thread's, each
    thread's by name, ns) and its steps."""
    return {name: [e.request("cpu", "cpu") for e in engines] for name, engines in pairs.items()}


#: the threads an engine's CPU is told by: the inner's event loop (the wrapper's hooks run
#: on it), the main thread (the steps), the threads of no Python name (Mooncake's transfer
#: engine; a wrapped consumer's C go-ahead thread), shmhb's own (beat, embedded agent)
THREAD_GROUPS = (("loop", "the inner's event loop (the wrapper's hooks)"),
                 ("main", "the main thread (the steps)"),
                 ("native", "threads of no Python name (Mooncake's; the C go-ahead thread)"),
                 ("shmhb", "shmhb's own threads (beat, embedded agent)"),
                 ("all", "all threads"))


def _group(thread: str) -> str:
    if thread == "MainThread":
        return "main"
    if thread.endswith("(_async_loop)"):
        return "loop"
    if thread.startswith("shmhb-"):
        return "shmhb"
    return "native" if thread == "python" else "other"


def _per_transfer(c0: list[dict[str, Any]], c1: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """What a pair's engines spent per transfer between two ``_cpu`` looks (µs of CPU, by
    role and thread group; over whole rounds, so what a thread spends between transfers
    counts too), and their steps."""
    cpu: dict[str, dict[str, float]] = {}
    for role, a, b in zip(("prefill", "decode"), c0, c1):
        groups = cpu[role] = dict.fromkeys([g for g, _ in THREAD_GROUPS] + ["other"], 0.0)
        for k, v in b["threads"].items():
            us = (v - a["threads"].get(k, 0)) / n / 1e3
            groups[_group(k)] += us
            groups["all"] += us
    return {"cpu": cpu, "steps": [(b["steps"] - a["steps"]) / n for a, b in zip(c0, c1)],
            "step_us": [(b["step_ns"] - a["step_ns"]) / max(1, b["steps"] - a["steps"]) / 1e3
                        for a, b in zip(c0, c1)],
            "judges": [(b["judges"] - a["judges"]) / n for a, b in zip(c0, c1)]}


# -- the report -------------------------------------------------------------------------------

def _cell(r: dict[str, Any], base: float) -> str:
    if r["outcome"].startswith("completed"):
        return f"{r['outcome']}, +{max(0.0, r['s'] - base):.2f} s"
    return f"**{r['outcome']}** after {r['s']:.2f} s"


def _vllm_version() -> str:
    import vllm
    return str(vllm.__version__)


def client_lines(rows: dict[str, dict[str, Any]], abort_s: int) -> list[str]:
    lines = [
        "## What a client sees", "",
        f"`python -m bench.vllm --only client --abort-timeout-s {abort_s}` (vLLM "
        f"{_vllm_version()}): the decode engine "
        "runs vLLM's real Scheduler and KVCacheManager with the stand-in model; a request "
        "completes only with the tokens of an undisturbed run.  Per cell: the outcome, "
        "and how much later than an undisturbed request it finished (undisturbed: "
        + ", ".join(f"{v} {rows[v]['undisturbed']['s'] * 1e3:.0f} ms" for v in VARIANTS)
        + f").  Stock waits {abort_s + 60} s here, **540 s at the default**.", "",
        "| fault | " + " | ".join(VARIANTS) + " |",
        "| --- |" + " --- |" * len(VARIANTS),
    ]
    for key, label in SCENARIOS:
        lines.append(f"| {label} | " + " | ".join(
            _cell(rows[v][key], rows[v]["undisturbed"]["s"]) for v in VARIANTS) + " |")
    lines += ["", "Blocks left allocated on the decode side at the end: " + ", ".join(
        f"{v} {rows[v]['leaked_blocks']}" for v in VARIANTS)
        + f"; wrapped, vLLM's policy read `{rows['wrapped']['policy']}`.", ""]
    return lines


def transfer_lines(rows: dict[tuple[str, int], dict[str, Any]], samples: int,
                   step_s: float) -> list[str]:
    step = f" --step-s {step_s:g}" if step_s != STEP_S else ""
    if (NO_GOAHEAD, SIZES[0][0]) in rows:
        step += " --no-goahead-pair"
    lines = [
        "## What the happy path costs", "",
        f"`python -m bench.vllm --only transfer --samples {samples}{step}` "
        f"(vLLM {_vllm_version()}, engines stepping every {step_s * 1e3:g} ms while a "
        "transfer is under way): "
        "a load's start to its blocks landing, for two stock pairs of engines and a wrapped "
        "pair side by side in one stack (and one more below, where named), one transfer "
        "of each per round, the rounds taking every order of the pairs in turn (the "
        "wrapped producer asks its consumer's "
        "go-ahead before every write: one round trip, asked as it reads a request whose "
        "blocks are computed, answered in C by the consumer).  *Stock* pools both stock "
        "pairs; *added* is the wrapped p50 less the stock p50; *paired* is the p50, over "
        "rounds, of the wrapped transfer less the mean of that round's stock two.  "
        "*Resolution*: the same two figures for the second stock pair against the first, "
        "what this bench reads as a difference where there is none.  Target: at most 5 % "
        "or 200 µs added to the p50, whichever is larger.", "",
        "| KV per request | stock p50 / p99 | wrapped p50 / p99 | added to p50 | paired | "
        "target | resolution: stock B - A, p50s / paired | bad transfers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for blocks, label in SIZES:
        s, w = rows[("both", blocks)], rows[("wrapped", blocks)]
        a, b = rows[("stock", blocks)], rows[("stock2", blocks)]
        added = w["p50"] - s["p50"]
        bound = max(0.05 * s["p50"], 200e-6)
        lines.append(f"| {label} | {s['p50'] * 1e3:.2f} / {s['p99'] * 1e3:.2f} ms | "
                     f"{w['p50'] * 1e3:.2f} / {w['p99'] * 1e3:.2f} ms | {added * 1e6:+.0f} µs | "
                     f"{w['paired'] * 1e6:+.0f} µs | "
                     f"{'met' if added <= bound else 'missed'} (≤ {bound * 1e6:.0f} µs) | "
                     f"{(b['p50'] - a['p50']) * 1e6:+.0f} / {b['paired'] * 1e6:+.0f} µs | "
                     f"{a['bad'] + b['bad']} / {w['bad']} |")
    names = PAIRS + ((NO_GOAHEAD,) if (NO_GOAHEAD, SIZES[0][0]) in rows else ())
    if len(names) > len(PAIRS):
        lines += ["", "The wrapper with its go-ahead switched off (the consumer sends no "
                  "shmhb field, so the producer writes on the board's word alone: unsafe, "
                  "a measurement only), against the same stock pairs:", "",
                  "| KV per request | p50 / p99 | added to p50 | paired |", "| --- | --- | --- | --- |"]
        for blocks, label in SIZES:
            s, n = rows[("both", blocks)], rows[(NO_GOAHEAD, blocks)]
            lines.append(f"| {label} | {n['p50'] * 1e3:.2f} / {n['p99'] * 1e3:.2f} ms | "
                         f"{(n['p50'] - s['p50']) * 1e6:+.0f} µs | {n['paired'] * 1e6:+.0f} µs |")
    lines += ["", "Where the time goes, p50 of each stage, ms (" + " / ".join(
              ["stock A", "stock B", *names[2:]]) + "; the stages need not add up to the "
              "total's p50):", "",
              "| stage | " + " | ".join(label for _, label in SIZES) + " |",
              "| --- |" + " --- |" * len(SIZES)]
    for k, label in STAGES:
        lines.append(f"| {label} | " + " | ".join(
            " / ".join(f"{rows[(n, b)]['stages'][k] * 1e3:.2f}" for n in names)
            for b, _ in SIZES) + " |")
    lines += _cpu_lines(rows, names)
    lines += ["", "How the wrapped producer read its go-ahead answers (asks made as the request "
              "was read; answers in at the write, within the 1 ms hold, or awaited on its "
              "loop):", "", "| KV per request | asked early | in at once | held | awaited |",
              "| --- | --- | --- | --- | --- |"]
    for blocks, label in SIZES:
        ask = rows[("wrapped", blocks)].get("asks", {})
        lines.append(f"| {label} | {ask.get('early', 0)} | {ask.get('in_time', 0)} | "
                     f"{ask.get('held', 0)} | {ask.get('awaited', 0)} |")
    c, sc = rows[("wrapped", SIZES[0][0])]["cost"], rows[("stock", SIZES[0][0])]["cost"]
    lines += [
        "", "Per call, ns (2,000 calls; wrapped calls interleaved with the inner connector's "
        "own in the same process, so *added* is the wrapper's share of a step).  Target: "
        "at most 10 µs per step.", "",
        "| call | stock p50 / p99 | wrapped p50 / p99 | inner alone, same process | added p50 / p99 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k in ("get_transfer_results", "get_finished"):
        lines.append(f"| `{k}` (per step) | {sc[k]:.0f} / {sc[k + '_p99']:.0f} | "
                     f"{c[k]:.0f} / {c[k + '_p99']:.0f} | {c[k + '_inner']:.0f} | "
                     f"{c[k + '_added']:.0f} / {c[k + '_added_p99']:.0f} |")
    k = "get_num_new_matched_tokens"
    lines.append(f"| `{k}` (per request) | {sc[k]:.0f} / {sc[k + '_p99']:.0f} | "
                 f"{c[k]:.0f} / {c[k + '_p99']:.0f} | - | - |")
    lines.append(f"| the wrapper's `poll()` (in each step call) | - | {c['wrapper_poll']:.0f} / "
                 f"{c['wrapper_poll_p99']:.0f} | - | - |")
    lines.append(f"| the wrapper's board read (in the scheduler call) | - | "
                 f"{c['wrapper_veto_read']:.0f} / {c['wrapper_veto_read_p99']:.0f} | - | - |")
    return lines + [""]


def _cpu_lines(rows: dict[tuple[str, int], dict[str, Any]], names: tuple[str, ...]) -> list[str]:
    blk, label = SIZES[0]
    stock = (rows[("stock", blk)]["cpu"], rows[("stock2", blk)]["cpu"])
    cols = [f"{n}: prefill / decode" for n in names[2:]] + ["stock B - A: prefill / decode"]
    lines = ["", f"CPU per transfer at {label}, µs, over the stock pairs' mean: what the "
             "wrapper adds on each thread of the producer's and the consumer's engine, from "
             "each thread's CPU clock over the timed rounds (so a thread's cost between "
             "transfers counts too); the last column is the same for the second stock pair "
             "against the first (the figure's resolution).  Stock spent "
             + " / ".join(f"{(stock[0][r]['all'] + stock[1][r]['all']) / 2 / 1e3:.1f}"
                          for r in ("prefill", "decode"))
             + " ms per transfer in all (prefill / decode), much of it between "
             "transfers:", "",
             "| thread | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for g, what in THREAD_GROUPS:
        cells = []
        for n in names[2:]:
            c = rows[(n, blk)]["cpu"]
            cells.append(" / ".join(
                f"{c[r][g] - (stock[0][r][g] + stock[1][r][g]) / 2:+.0f}" for r in ("prefill", "decode")))
        cells.append(" / ".join(f"{stock[1][r][g] - stock[0][r][g]:+.0f}" for r in ("prefill", "decode")))
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    per = [rows[(n, blk)]["step_us"] for n in names]  # [prefill, decode] per pair
    cells = [" / ".join(f"{p[r] - (per[0][r] + per[1][r]) / 2:+.1f}" for r in (0, 1)) for p in per[2:]]
    cells.append(" / ".join(f"{per[1][r] - per[0][r]:+.1f}" for r in (0, 1)))
    lines.append("| one step of the main thread (each; stock: " + " / ".join(
        f"{(per[0][r] + per[1][r]) / 2:.0f}" for r in (0, 1)) + ") | " + " | ".join(cells) + " |")
    cells = [" / ".join(f"{rows[(n, blk)]['judges'][r]:.2f}" for r in (0, 1)) for n in names[2:]]
    lines.append("| the wrapper's reaper: full looks at the board per transfer (absolute) | "
                 + " | ".join(cells) + " | - |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--abort-timeout-s", type=int, default=10)
    ap.add_argument("--samples", type=int, default=300,
                    help="happy path: transfers timed per pair and size")
    ap.add_argument("--only", choices=("client", "transfer"))
    ap.add_argument("--step-s", type=float, default=STEP_S,
                    help="happy path: how often an engine steps while a transfer is under "
                         "way (a GPU engine: every 10 ms or more)")
    ap.add_argument("--no-goahead-pair", action="store_true",
                    help="happy path: also a wrapped pair with the go-ahead switched off "
                         "(unsafe: a measurement of the go-ahead's share only)")
    a = ap.parse_args()
    import vllm
    sections: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if a.only in (None, "client"):
            rows = {}
            for v in VARIANTS:
                print(f"client view: {v} ...", flush=True)
                rows[v] = client_view(v, a.abort_timeout_s, os.path.join(tmp, v.replace(" ", "")))
                print(rows[v], flush=True)
            sections["client"] = client_lines(rows, a.abort_timeout_s)
        if a.only in (None, "transfer"):
            trows = {}
            for blocks, label in SIZES:
                print(f"happy path {label}, two stock pairs and a wrapped one ...", flush=True)
                rows = happy_path(blocks, a.samples, os.path.join(tmp, f"t{blocks}"), a.step_s,
                                  a.no_goahead_pair)
                for name, row in rows.items():
                    trows[(name, blocks)] = row
                print(rows, flush=True)
            sections["transfer"] = transfer_lines(trows, a.samples, a.step_s)
    old = _old_sections()
    old.update(sections)
    head = ["# vLLM: stock MooncakeConnector vs ShmhbConnector around it", "",
            "Mooncake TCP, CPU (the vLLM release each section ran on is named in it); shmhb policy suspect-after "
            f"{POLICY.suspect_after_s} s, dead-after {POLICY.dead_after_s} s; a shared 2-core "
            "machine.  Each section is rewritten by the run named in it.", ""]
    text = "\n".join(head + old.get("client", []) + old.get("transfer", [])) + "\n"
    OUT.write_text(text)
    print(text)


def _old_sections() -> dict[str, list[str]]:
    """The sections of the results file a partial run (``--only``) keeps."""
    out: dict[str, list[str]] = {}
    if not OUT.exists():
        return out
    cur: list[str] | None = None
    for line in OUT.read_text().splitlines():
        if line.startswith("## What a client sees"):
            cur = out.setdefault("client", [])
        elif line.startswith("## What the happy path costs"):
            cur = out.setdefault("transfer", [])
        if cur is not None:
            cur.append(line)
    return out


if __name__ == "__main__":
    main()
