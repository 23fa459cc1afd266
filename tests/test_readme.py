"""The README's worker example does what its comments say: a worker ended by `kill PID`
or by Ctrl-C reads LEFT, not DEAD."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import pytest

import shmhb
from shmhb import Status

from .conftest import ROOT, Procs, wait_until


def _worker_part() -> str:
    """The README's first Python example, up to where a reader takes over."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"```python\n(.*?)```", f.read(), re.S)
    assert block is not None
    code = block.group(1)
    return code[:code.index("\nreader = ")] + "\nprint('ready', flush=True)\nsignal.pause()\n"


@pytest.mark.parametrize("sig, rc", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_the_readme_worker_reads_left_when_stopped(board: shmhb.Board, procs: Procs,
                                                    sig: signal.Signals, rc: int) -> None:
    p = procs.spawn([sys.executable, "-c", _worker_part()], env={"SHMHB_BOARD": board.name})
    wait_until(lambda: board.status("decode-rank-3") is Status.ALIVE, what="the worker beats")
    p.send_signal(sig)
    assert p.wait(30) == rc
    assert board.status("decode-rank-3") is Status.LEFT


def _blocked(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        return int(next(ln for ln in f if ln.startswith("SigBlk:")).split()[1], 16)


def test_our_threads_leave_the_host_signals_to_its_main_thread(board: shmhb.Board) -> None:
    """A signal sent to a worker goes to one of its threads that does not block it; Python
    runs the handler in the main thread only, so one taken by a beat thread left the
    example above asleep in ``signal.pause()`` with its Ctrl-C pending (seen once, in CI).
    Every thread shmhb starts in a host's process blocks the host's signals."""
    hb = board.register("decode-rank-3").start(interval_s=0.05)
    try:
        ours = wait_until(lambda: [t for t in threading.enumerate()
                                   if t.name.startswith("shmhb-") and t.native_id],
                          what="the beat thread running")
        for t in ours:
            assert t.native_id is not None
            mask = _blocked(t.native_id)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
                assert mask >> (sig - 1) & 1, (t.name, sig)
            assert not mask >> (signal.SIGSEGV - 1) & 1, t.name
        assert not _blocked(threading.get_native_id()) >> (signal.SIGINT - 1) & 1
    finally:
        hb.close()
