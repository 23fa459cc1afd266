"""A signal ends a long-running command even when it lands while the main thread waits
on the very event it sets (shmhb pinger once hung on SIGTERM that way)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ..children import child
from ..conftest import ROOT

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

def flood(deadline_s: float) -> tuple[int | None, str]:
    """Run ``signal_flood`` under a flood of SIGUSR1: its exit status (None if it
    stopped answering by the deadline) and what it printed."""
    p = subprocess.Popen([sys.executable, child("signal_flood")], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        end = time.monotonic() + deadline_s
        while p.poll() is None and time.monotonic() < end:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                break
        rc = p.poll()
        if rc is None:
            return None, ""
        return rc, p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_a_flood_of_signals_never_deadlocks_a_main_thread_waiting_on_the_event() -> None:
    rc, out = flood(deadline_s=60)
    assert rc == 0, "the child stopped answering signals: a handler deadlocked"
    assert out.split() == ["done", "True"]  # the callback ran, from the helper's thread


def test_other_signals_keep_their_handlers() -> None:
    # SIGINT left out of the set still raises KeyboardInterrupt in the main thread
    out = subprocess.run([sys.executable, child("other_signals")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interrupted", "False", "stopped", "True"]
