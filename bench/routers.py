"""``python -m bench.routers``: the real routers in front of P/D, side by side in one run.

For vllm-router (PD mode, ``--kv-connector mooncake``), sglang-router and smg (PD mode),
each in four setups: at its defaults, with its health check as tight as it takes
(``--health-check-interval-secs 1 --health-failure-threshold 1
--health-check-timeout-secs 1``), at its defaults fed by ``shmhb feed`` (its defaults:
a suspect instance is taken out where the router can take it back, sglang and smg, not
for vllm-router), and fed with the other choice (``shmhb-flip``: ``--act-on-suspect``
for vllm-router, ``--no-act-on-suspect`` for the others).  Each setup
gets a fresh stack (tests/routers/stack.py): prefills p1, p2, p3 and decode d1 on four
simulated hosts (boards, agents), stand-ins that register as ShmhbConnector does, the
router on 127.0.0.1, and a client sending ``--rate-hz`` requests per second (timeout
4 s).  Then, in order, each followed by a window of ``--window-s``:

1. **kill**: p1 SIGKILLed;
2. **restart**: p1 started again under a new engine id (its registration is the origin);
3. **stop**: p3 SIGSTOPped (p2 stays healthy throughout, so there is always somewhere
   to send).

Then, per router, a **drain** run in a fresh stack of prefills p1, p2 and decodes d1, d2,
in three setups: *stock* (an engine stops at once on SIGTERM, as vLLM does by default,
nothing tells the router), *tuned* (the same, tight health check) and *shmhb* (the
engine drains on SIGTERM as ShmhbConnector does, ``shmhb.board.drain``, and ``shmhb
feed`` feeds the router): p2 SIGTERMed, then d2, each at a random phase of the
client's schedule and followed by a window.

Per phase: requests failed (sent in the window, or in flight at the fault), how long
after the fault the router still sent to the faulty instance (the send time of the
last request that failed, sent after the fault: a request fails only through the faulty
instance here; "> window" when failures went on to the window's end), and for a
restart whether and when the restarted instance served again.  With shmhb the time of
the feeder's call to the router (kill -> remove) is reported too.  ``--repeats N``
runs each setup N times; cells give the median and the worst.  Writes its section of
bench/RESULTS.md (between the ``routers`` markers; nothing else in the file changes).

Run as root, the bench first moves itself into a network namespace with nothing but
loopback (``tests.routers.stack.private_network``), so no router it starts can reach
past the host; every process it starts runs with the model hubs' offline switches, and
fails if any router's log shows an attempt to reach one.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import shmhb
from tests.routers.stack import TUNED, Client, PdStack, Result, bench_refusal, wait_for

OUT = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- routers:begin -->", "<!-- routers:end -->"
MODES = ("defaults", "tuned", "shmhb", "shmhb-flip")
DRAIN_MODES = ("stock", "tuned", "shmhb")
KINDS = ("vllm", "sglang", "smg")
#: the feeder's flag that flips its default choice on suspect instances, per kind
FLIP = {"vllm": "--act-on-suspect", "sglang": "--no-act-on-suspect", "smg": "--no-act-on-suspect"}
POLICY = shmhb.Policy(suspect_after_s=1.0, dead_after_s=2.0)


def phase(results: list[Result], t0: int, t_end: int, last: bool = False) -> dict[str, Any]:
    """The failures of one phase: those in flight at the fault (sent before ``t0``, within
    the client's timeout, answered after it) and those sent in [t0, t_end); and the send
    time of the last failure after the fault (None: failures went on into the last
    second before ``t_end``)."""
    inflight = [r for r in results if r.status != 200 and t0 - 4_500_000_000 <= r.t_send < t0
                <= r.t_done]
    # a request still open at the next fault is that fault's (it counts there, in flight)
    after = [r for r in results if r.status != 200 and t0 <= r.t_send < t_end
             and (last or r.t_done < t_end)]
    latest = max((r.t_send - t0 for r in after), default=0)
    return {"inflight": len(inflight), "after": len(after),
            "stop_ms": None if latest > t_end - t0 - 1_000_000_000 else latest / 1e6,
            "first": [(round((r.t_send - t0) / 1e6), r.status) for r in after[:4]]}


def run_setup(kind: str, mode: str, window_s: float, rate_hz: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="shmhb-bench-routers-") as tmp:
        s = PdStack(tmp, hosts=4, policy=POLICY)
        try:
            p1 = s.add_instance("p1", "prefill", 0)
            p2 = s.add_instance("p2", "prefill", 1)
            p3 = s.add_instance("p3", "prefill", 2)
            s.add_instance("d1", "decode", 3)
            s.start_router(kind, TUNED if mode == "tuned" else [])
            if mode.startswith("shmhb"):
                s.start_feeder(kind, *([FLIP[kind]] if mode == "shmhb-flip" else []))
            c = Client(s.router_port, rate_hz=rate_hz).start()
            wait_for(lambda: all(len(p.served_since(0)) >= 3 for p in (p1, p2, p3)),
                     30, "the prefills serving")
            w = int(window_s * 1e9)
            t_kill = s.kill("p1")
            time.sleep(window_s)  # the bench's observation window (a measured span, not a wait)
            s.start("p1")
            t_reg = time.monotonic_ns()  # the stand-in printed "ready" after registering
            time.sleep(window_s)
            t_stop = s.kill("p3", signal.SIGSTOP)
            time.sleep(window_s)
            res = c.stop()
            os.kill(p3.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            t_end = t_stop + w
            out = {"kill": phase(res, t_kill, t_reg), "restart": phase(res, t_reg, t_stop),
                   "stop": phase(res, t_stop, t_end, last=True), "requests": len(res)}
            served = p1.served_since(t_reg, "/kv")
            out["restart"]["serve_ms"] = (served[0] - t_reg) / 1e6 if served else None
            acts = s.feed_actions()
            out["kill"]["feed_ms"] = removal_ms(acts, p1.url, t_kill)
            out["stop"]["feed_ms"] = removal_ms(acts, p3.url, t_stop)
        finally:
            close(s)
        return out


def removal_ms(actions: list[dict[str, Any]], url: str, t_ns: int) -> float | None:
    """From ``t_ns`` to the feeder's first removal of ``url`` after it (None: none)."""
    rm = [a["t_ns"] for a in actions if a.get("event") == "remove" and a["url"] == url
          and a["t_ns"] > t_ns]
    return (rm[0] - t_ns) / 1e6 if rm else None


def close(s: PdStack) -> None:
    """End the stack; a router that tried to reach a model hub fails the bench."""
    s.close()
    tried = s.hub_lookups()
    if tried:
        raise SystemExit(f"a router tried to reach a model hub: {tried}")


def run_drain(kind: str, mode: str, window_s: float, rate_hz: float) -> dict[str, Any]:
    """The drain run: p2, then d2, SIGTERMed under load (see the module's docstring)."""
    drain_s = 10.0 if mode == "shmhb" else 0.0
    with tempfile.TemporaryDirectory(prefix="shmhb-bench-drain-") as tmp:
        s = PdStack(tmp, hosts=4, policy=POLICY)
        try:
            insts = [s.add_instance("p1", "prefill", 0, drain_timeout_s=drain_s),
                     s.add_instance("p2", "prefill", 1, drain_timeout_s=drain_s),
                     s.add_instance("d1", "decode", 2, drain_timeout_s=drain_s),
                     s.add_instance("d2", "decode", 3, drain_timeout_s=drain_s)]
            s.start_router(kind, TUNED if mode == "tuned" else [])
            if mode == "shmhb":
                s.start_feeder(kind)
            c = Client(s.router_port, rate_hz=rate_hz).start()
            wait_for(lambda: all(len(i.served_since(0)) >= 3 for i in insts), 30,
                     "every instance serving")
            out: dict[str, Any] = {}
            marks = []
            for name in ("p2", "d2"):
                time.sleep(random.uniform(0, 1 / rate_hz))  # a random phase of the schedule
                t = s.kill(name, signal.SIGTERM)
                marks.append((name, t))
                time.sleep(window_s)  # the bench's observation window (a measured span)
            res = c.stop()
            acts = s.feed_actions()
            for k, (name, t) in enumerate(marks):
                end = marks[k + 1][1] if k + 1 < len(marks) else t + int(window_s * 1e9)
                ph = phase(res, t, end, last=k + 1 == len(marks))
                ph["feed_ms"] = removal_ms(acts, s.instances[name].url, t)
                out["drain " + name] = ph
            out["requests"] = len(res)
        finally:
            close(s)
        return out


def drain_table(runs: dict[tuple[str, str], list[dict[str, Any]]], window_s: float) -> list[str]:
    never = f"> {window_s - 1:g} s"
    rows = ["| router | setup | prefill SIGTERM: failed, in flight + after | still sent to it "
            "for ms | feeder call ms | decode SIGTERM: failed, in flight + after | still sent "
            "to it for ms | feeder call ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (kind, mode), rs in runs.items():
        def g(ph: str, k: str) -> list[Any]:
            return [r[ph].get(k) for r in rs]
        cells = []
        for ph in ("drain p2", "drain d2"):
            cells += [f"{cell(g(ph, 'inflight'))} + {cell(g(ph, 'after'))}",
                      cell(g(ph, "stop_ms"), none=never), cell(g(ph, "feed_ms"))]
        rows.append(f"| {kind if kind == 'smg' else kind + '-router'} | {mode} | "
                    + " | ".join(cells) + " |")
    return rows


def feeder_cpu(seconds: float = 10.0) -> float:
    """Percent of one core ``shmhb feed`` spends following 3 boards of 4 engines x 4
    ranks (beating every 0.1 s) with nothing changing and its router unreachable."""
    from shmhb.board.instances import register_instance
    from shmhb.testing.loopback import child_env
    tag = os.urandom(3).hex()
    boards = [shmhb.Board.create(f"shmhb-bench-feed-{tag}-{i}", slots=64) for i in range(3)]
    hbs: list[Any] = []
    p = None
    try:
        for i, b in enumerate(boards):
            for e in range(4):
                rk = [b.register(f"vllm/e{i}{e}/dp0/tp{t}/pp0", agent=False,
                                 endpoints=(f"127.0.0.{2 + i}:{31000 + 10 * e + t}",)).start(0.1)
                      for t in range(4)]
                hbs += rk
                hbs.append(register_instance(b, rk[0], "prefill", f"e{i}{e}",
                                             serving=f"127.0.0.{2 + i}:{8000 + e}",
                                             bootstrap=f"127.0.0.{2 + i}:{9000 + e}"))
        cmd = [sys.executable, "-m", "shmhb", "feed", "--router", "sglang=http://127.0.0.1:1"]
        for b in boards:
            cmd += ["--board", b.name]
        p = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(2)  # past its start-up

        def cpu_s() -> float:
            with open(f"/proc/{p.pid}/stat") as f:  # type: ignore[union-attr]
                st = f.read().rsplit(")", 1)[1].split()
            return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(seconds)
        return 100 * (cpu_s() - c0) / (time.monotonic() - t0)
    finally:
        if p is not None:
            p.kill()
            p.wait()
        for h in hbs:
            h.close()
        for b in boards:
            b.unlink()
            b.close()


def cell(vals: list[Any], fmt: str = "{:.0f}", none: str = "-") -> str:
    got = [v for v in vals if v is not None]
    if not got:
        return none
    med = statistics.median(got)
    txt = fmt.format(med)
    if len(vals) > 1:
        worst = max(got)
        txt += f" (max {fmt.format(worst)})"
    if len(got) < len(vals):
        txt += f", {len(vals) - len(got)}/{len(vals)} {none}"
    return txt


def table(runs: dict[tuple[str, str], list[dict[str, Any]]], window_s: float) -> list[str]:
    never = f"> {window_s - 1:g} s"
    rows = ["| router | setup | kill: failed, in flight + after | kill: still sent to it for "
            "ms | kill: feeder call ms | stop: failed, in flight + after | stop: still sent "
            "for ms | stop: feeder call ms | restart: failed | restart: serves again after ms |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (kind, mode), rs in runs.items():
        label = f"shmhb {FLIP[kind]}" if mode == "shmhb-flip" else mode
        def g(ph: str, k: str) -> list[Any]:
            return [r[ph].get(k) for r in rs]

        def fails(ph: str) -> str:
            return f"{cell(g(ph, 'inflight'))} + {cell(g(ph, 'after'))}"
        rows.append(
            f"| {kind if kind == 'smg' else kind + '-router'} | {label} | {fails('kill')} | "
            f"{cell(g('kill', 'stop_ms'), none=never)} | {cell(g('kill', 'feed_ms'))} | "
            f"{fails('stop')} | {cell(g('stop', 'stop_ms'), none=never)} | "
            f"{cell(g('stop', 'feed_ms'))} | {cell(g('restart', 'after'))} | "
            f"{cell(g('restart', 'serve_ms'), none='never')} |")
    return rows


def section(runs: dict[tuple[str, str], list[dict[str, Any]]],
            drains: dict[tuple[str, str], list[dict[str, Any]]], a: argparse.Namespace,
            wall_s: float) -> str:
    vers = []
    for pkg in ("vllm-router", "sglang-router", "smg"):
        try:
            from importlib.metadata import version
            vers.append(f"{pkg} {version(pkg)}")
        except Exception:  # noqa: BLE001  (a version string only)
            vers.append(f"{pkg} ?")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [BEGIN, "## Routers in front of P/D: defaults, tuned health check, fed by shmhb", "",
             f"`python -m bench.routers --repeats {a.repeats} --window-s {a.window_s:g} "
             f"--rate-hz {a.rate_hz:g}`, run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{wall_s:.0f} s wall; {', '.join(vers)}; python {platform.python_version()}; "
             f"load average at the end {load}.", "",
             "Each setup: a fresh stack, prefills p1, p2, p3 and decode d1 (stand-ins that "
             "register as ShmhbConnector does, tests/routers/standin.py, 20 ms per prefill "
             "and per KV fetch), round robin, a client at the rate above (timeout 4 s). "
             f"Faults in order, each followed by {a.window_s:g} s: p1 SIGKILLed, p1 restarted "
             "under a new engine id, p3 SIGSTOPped (p2 healthy throughout). Board policy suspect 1 s, "
             "dead 2 s; *shmhb*: `shmhb feed` at its defaults (a suspect instance is taken out "
             "where the router takes it back: sglang-router, smg), and with the other choice. "
             "*failed*: requests that got no 200, in flight at the fault (sent before it, "
             "answered after) + sent after it within the phase; *still sent to it*: the send "
             "time, after the fault, of the last request that failed (only the faulty "
             "instance fails requests here; 0: none failed after the fault; "
             f"\"> {a.window_s - 1:g} s\": failures went on into the phase's last second); "
             "*feeder call*: fault to `shmhb feed`'s DELETE to the router; *serves again*: "
             "registration of the restarted p1 to the first KV fetch a decode completed from "
             "it (a request it really served). Cells: median (max) of "
             f"{a.repeats} run(s).", ""]
    lines += table(runs, a.window_s)
    lines += ["", "Read with: vllm-router in PD mode takes no worker over HTTP, so fed by "
              "shmhb a restarted prefill stays out until the router restarts (`shmhb feed` "
              "says so: `cannot_add`); at its defaults and tuned it keeps the restarted URL "
              "with the dead engine's id, so requests sent there fail at the decode side "
              "(*restart: failed*). sglang-router and smg retry a failed request on another "
              "worker, so a kill costs them no request even at their defaults; the restarted "
              "instance is what its own health check did not give back within the window. "
              "A stopped instance accepts connections and never answers: every request sent "
              "to it before it is taken out waits for the client's timeout, so a stop costs "
              "what arrives until the feeder acts: at the board's dead-after (2 s here) "
              "where it acts on dead only, at suspect-after (1 s) where it acts on suspect "
              "(its default for sglang-router and smg, which take the instance back when it "
              "beats again). smg stops sending to a stopped worker by itself sooner than "
              "the others: see its rows.", "",
              "Targets, fed by shmhb: kill to the router's call within 50 ms; "
              "stop to the call within about a second where the router takes the instance "
              "back; failed requests at most those inside the dead instance; a restarted "
              "instance serving within 1 s of its registration (sglang-router, smg; "
              "vllm-router's PD mode cannot take it back).", ""]
    if drains:
        lines += ["### A drain under steady load", "",
                  "Per router, a fresh stack of prefills p1, p2 and decodes d1, d2; p2 "
                  f"SIGTERMed, then d2, each at a random phase of the client's schedule and "
                  f"followed by {a.window_s:g} s. *stock*: the engine stops at once on SIGTERM "
                  "(vLLM's default, `--shutdown-timeout 0`), nothing tells the router; "
                  "*tuned*: the same with the tight health check; *shmhb*: the engine drains "
                  "as ShmhbConnector does (reads draining, serves its requests in flight and "
                  "the KV its decodes have not fetched, then stops; `shmhb.board.drain`) and "
                  "`shmhb feed` feeds the router. Columns as above.", ""]
        lines += drain_table(drains, a.window_s)
        lines += ["", "Target: a drain loses no request, on every router."]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(text: str, path: Path = OUT) -> None:
    """Put ``text`` (with its markers) into ``path`` in place of the old section, or at
    the end; nothing else in the file changes."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        new = head + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def keep_section(old: str, new: str) -> str:
    """``new`` (a whole report being rewritten) with the routers section of ``old``
    carried over: for bench/report.py, which rewrites RESULTS.md whole."""
    if BEGIN not in old or END not in old or BEGIN in new:
        return new
    sec = BEGIN + old.split(BEGIN, 1)[1].split(END, 1)[0] + END
    return new.rstrip("\n") + "\n\n" + sec + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--rate-hz", type=float, default=50.0)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--no-drain", action="store_true", help="skip the drain runs")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--feeder-cpu-only", action="store_true",
                    help="only measure shmhb feed's own CPU while idle (no routers needed)")
    a = ap.parse_args(argv)
    if a.feeder_cpu_only:
        print(f"shmhb feed, 3 boards x 4 engines x 4 ranks, idle, router unreachable: "
              f"{feeder_cpu():.1f} % of one core")
        return 0
    why = bench_refusal(a.kinds)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    t0 = time.monotonic()
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in a.kinds:
        for m in MODES:
            for i in range(a.repeats):
                print(f"{k} {m} run {i + 1}/{a.repeats} ...", file=sys.stderr, flush=True)
                runs.setdefault((k, m), []).append(run_setup(k, m, a.window_s, a.rate_hz))
                print(f"  {runs[(k, m)][-1]}", file=sys.stderr, flush=True)
    drains: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in [] if a.no_drain else a.kinds:
        for m in DRAIN_MODES:
            for i in range(a.repeats):
                print(f"{k} drain {m} run {i + 1}/{a.repeats} ...", file=sys.stderr, flush=True)
                drains.setdefault((k, m), []).append(run_drain(k, m, a.window_s, a.rate_hz))
                print(f"  {drains[(k, m)][-1]}", file=sys.stderr, flush=True)
    text = section(runs, drains, a, time.monotonic() - t0)
    write_section(text, Path(a.out))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
