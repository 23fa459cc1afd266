"""Issue 23 case 14: a process stopped while it holds the registry lock.

Attaching needs no lock once the board is finished: ``status``, a standby pinger and a
new worker's attach must not wait for it.  What does need it (a registration) fails
after its timeout naming the stopped holder, so an operator knows whom to resume."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import shmhb
from shmhb import Status
from shmhb.loopback import child_env

from .conftest import Procs, wait_until
from .test_registry_stall import Stall


def test_attach_status_and_a_standby_do_not_wait_for_a_stopped_holder(
        board: shmhb.Board, procs: Procs, agent: object) -> None:
    w = procs.worker(board.name, "before")
    stall = Stall(board.name)
    try:
        t0 = time.monotonic()
        b2 = shmhb.Board.attach(board.name)
        took = time.monotonic() - t0
        assert took < 1.0, f"attach waited {took:.2f} s for the registry lock"
        assert b2.status("before") is Status.ALIVE
        b2.close()
        out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", board.name],
                             capture_output=True, text=True, timeout=60, env=child_env())
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert "before" in out.stdout
        standby = procs.spawn([sys.executable, "-m", "shmhb", "pinger", "--board", board.name,
                               "--tick-s", "0.02"], ready=False)
        w.kill()  # the running agent still records deaths
        wait_until(lambda: board.status("before") is Status.DEAD, timeout_s=5)
        with pytest.raises(shmhb.LockTimeout, match=rf"pid {stall.p.pid} \(stopped\)"):
            board.register("during", agent=False)
        assert standby.poll() is None, "the standby pinger died on the stopped holder"
    finally:
        stall.release()
    with board.register("after", agent=False):
        assert board.status("after") is Status.ALIVE
