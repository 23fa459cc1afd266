"""vllm-ascend's ``MooncakeConnectorV1``, stock against wrapped: each scenario's outcome and
its time, written to ``bench/results_vllm_ascend.md``.

    python -m bench.vllm_ascend [--out PATH]      # about 8 minutes on 2 busy cores

Run in the venv of ``.ci/vllm_ascend`` (vllm-ascend 0.23.0.post1, vLLM 0.23.0).  The
figures are the ones the scenarios of ``tests/vllm_ascend/test_scenarios.py`` measure and
print (``<mode>: <scenario>: <outcome>``), each scenario run once stock and once
wrapped, producer and consumer in their own processes on 127.0.0.2 and 127.0.0.3: this
runs those tests and tables what they printed, so every figure comes with the one
command that measured it, and a scenario whose test failed is reported as such.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results_vllm_ascend.md")
TESTS = "tests/vllm_ascend/test_scenarios.py"
#: what a scenario prints, after any of pytest's progress marks on the same line
LINE = re.compile(r"^[.FEsx]*(stock|wrapped): ([^:]+?)(?: \(([^)]*)\))?: (.+)$")
#: the scenarios in the table's order, by the names the tests print
ROWS = (
    ("dead before the first handshake", "the producer killed after computing the request, "
     "before the consumer ever asked it"),
    ("same engine id", "the producer restarted on its address under the same engine id: "
     "the next two requests"),
    ("new engine id", "restarted under a new engine id (vllm-ascend's default): the next "
     "request"),
    ("killed mid-pull", "the producer killed with half the request's bytes read"),
    ("stopped before the request", "SIGSTOP of the producer before the consumer's first "
     "request to it"),
    ("stopped during the pull", "SIGSTOP with half the request's bytes read (after the "
     "consumer's go-ahead), then SIGCONT"),
    ("consumer restarted before its pull", "the consumer killed after the producer "
     "finished a request for it, then restarted"),
)


@dataclass(frozen=True)
class Outcome:
    mode: str
    scenario: str
    detail: str
    text: str


def run(extra: list[str]) -> tuple[list[Outcome], list[str], int]:
    """Run the scenarios; what they printed, the tests that failed, pytest's status."""
    env = dict(os.environ, SHMHB_REQUIRE_VLLM_ASCEND="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", TESTS, "-p", "no:cacheprovider", *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, check=False)
    out, failed = [], []
    for line in p.stdout.splitlines():
        m = LINE.match(line)
        if m:
            out.append(Outcome(m[1], m[2], m[3] or "", m[4]))
        elif line.startswith("FAILED "):
            failed.append(line.split()[1])
    return out, failed, p.returncode


def table(outcomes: list[Outcome], failed: list[str]) -> str:
    by = {(o.mode, o.scenario): o for o in outcomes}
    lines = ["| scenario | what | stock | wrapped |", "| --- | --- | --- | --- |"]
    for name, what in ROWS:
        cells = []
        for mode in ("stock", "wrapped"):
            o = by.get((mode, name))
            cells.append(o.text + (f" ({o.detail})" if o.detail else "") if o else "not run")
        lines.append(f"| {name} | {what} | {cells[0]} | {cells[1]} |")
    if failed:
        lines += ["", "Failed in this run: " + ", ".join(f"`{f}`" for f in failed)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("-k", default=None, help="pytest's -k: some scenarios only")
    a = ap.parse_args()
    outcomes, failed, rc = run(["-k", a.k] if a.k else [])
    text = table(outcomes, failed)
    print(text)
    with open(a.out, "w") as f:
        f.write(HEADER + text + "\n" + FOOTER)
    sys.exit(rc)


HEADER = """# vllm-ascend: stock MooncakeConnectorV1 vs ShmhbConnector around it

vllm-ascend 0.23.0.post1 with vLLM 0.23.0 (`.ci/vllm_ascend`'s venv), Mooncake's TCP
transport, CPU KV tensors, the NPU device layer stubbed (docs/VLLM_ASCEND.md); a producer
on 127.0.0.2 and a consumer on 127.0.0.3, each host with its board and pinger; shmhb
policy suspect-after 0.5 s, dead-after 2.0 s; a shared 2-core machine.  Requests of 3
blocks (48 KiB); a fault "mid-pull" lands with half a read's bytes in (the test engine
cuts that read in two and holds the second half until the fault is placed).

`python -m bench.vllm_ascend` (it runs `tests/vllm_ascend/test_scenarios.py` and tables
what each scenario printed): what the consumer's connector reported for the request
(`loaded`, `load_failed`: vLLM recomputes it with the wrapper's default policy; `vetoed`:
computed locally at once) and when, from the fault:

"""
FOOTER = """
Stock's failed loads fail the client's request at vLLM's default `kv_load_failure_policy`
("fail"); wrapped, the policy is "recompute": each such request is served, right, by a
local prefill (`tests/vllm_ascend/test_recovery.py`, vLLM 0.23's real Scheduler).

What the table does not show (asserted by the same tests, not timed): after "new engine
id", stock's decode still holds the dead engine's metadata (its FIFO tables keep up to
16,000 engines), the wrapped one has evicted it; after "dead before the first handshake"
and "stopped before the request", the wrapped decode serves the next producer on that
address and exits when asked.
"""


if __name__ == "__main__":
    main()
