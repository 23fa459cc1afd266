"""examples/pd_disagg.py runs, tells its story and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from shmhb.testing.loopback import child_env

from .conftest import ROOT, pids_with_cmdline, wait_until

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

EXAMPLE = os.path.join(ROOT, "examples", "pd_disagg.py")
ENV = child_env()


def _leftovers(pid: int) -> tuple[set[str], list[int]]:
    tag = f"pd-demo-{pid}-"
    return ({n for n in os.listdir("/dev/shm") if n.startswith(tag)}, pids_with_cmdline(tag))


def test_quick_run_drops_every_link_and_handshakes_afresh() -> None:
    p = subprocess.Popen([sys.executable, EXAMPLE, "--quick"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        out, _ = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out
    before, after = out.split("== kill the decode engine")
    kill, restart = after.split("== restart the decode engine")
    # 2 prefill ranks x 2 decode ranks: four links, each handshaken, dropped once, redone
    hs = re.findall(r"prefill r(\d)\s+handshake with decode r(\d) .*incarnation (\d+)", before)
    assert len(set(hs)) == 4, out
    drops = re.findall(r"prefill r(\d)\s+DROP \S+ \(decode r(\d), incarnation (\d+)\): dead;"
                       r" cache entry removed .* (\d+) ms after the kill", kill)
    assert sorted((a, b, c) for a, b, c, _ in drops) == sorted(hs), out
    assert "within the detection window" in kill, out
    assert "DROP" not in restart, "a fresh link was dropped"
    fresh = re.findall(r"prefill r(\d)\s+handshake with decode r(\d) .*incarnation (\d+)", restart)
    assert len(fresh) == 4, out
    old = {(a, b): int(c) for a, b, c in hs}
    assert all(int(c) > old[(a, b)] for a, b, c in fresh), out
    assert "4 fresh handshakes against the new incarnations" in restart, out
    assert re.search(r"cleaned up: \d+ processes ended, 2 boards removed", out), out
    segs, pids = _leftovers(p.pid)
    assert not segs and not pids


def test_interrupted_run_cleans_up() -> None:
    p = subprocess.Popen([sys.executable, EXAMPLE, "--quick"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        assert p.stdout is not None
        seen = []
        for line in p.stdout:  # Ctrl-C once the links are up
            seen.append(line)
            if "cached and tracked" in line:
                break
        else:
            raise AssertionError("".join(seen))
        p.send_signal(signal.SIGINT)
        rest = p.stdout.read()
        assert p.wait(60) == 130, "".join(seen) + rest
        assert "interrupted" in rest and "2 boards removed" in rest, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()
    wait_until(lambda: _leftovers(p.pid) == (set(), []), timeout_s=10, what="nothing left")
