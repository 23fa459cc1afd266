"""A process stopped while it holds the registry lock.

Attaching needs no lock once the board is finished: ``status``, a standby pinger and a
new worker's attach must not wait for it.  Nor does a registration: a restarted worker
registers past the stopped holder (``shmhb.board.registration``), the agent watches it and
announces it, and registrations after the holder resumed read newer still."""

from __future__ import annotations

import subprocess
import sys
import time


import shmhb
from shmhb import Status
from shmhb.testing.loopback import child_env

from ..conftest import Procs, Stall, wait_until


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
        # a restarted worker registers at once, past the stopped holder (before: it
        # failed after 5 s with LockTimeout), and the agent watches it
        ch = board.changes()
        t0 = time.monotonic()
        during = procs.worker(board.name, "during")
        took = time.monotonic() - t0
        assert took < 4.0, f"the registration waited {took:.2f} s"
        wait_until(lambda: board.status("during") is Status.ALIVE, timeout_s=5)
        wait_until(lambda: board.changes() != ch, timeout_s=5, what="the agent announcing it")
        inc_during = board.slot("during").incarnation  # type: ignore[union-attr]
        during.kill()
        wait_until(lambda: board.status("during") is Status.DEAD, timeout_s=5,
                   what="the agent judging the worker registered past the holder")
        assert standby.poll() is None, "the standby pinger died on the stopped holder"
    finally:
        stall.release()
    with board.register("after", agent=False) as hb:
        assert board.status("after") is Status.ALIVE
        assert hb.incarnation > inc_during  # newer, as the reaper needs
    again = procs.worker(board.name, "during")  # the same key again, with the lock
    wait_until(lambda: board.status("during") is Status.ALIVE, timeout_s=5)
    assert board.slot("during").incarnation > inc_during  # type: ignore[union-attr]
    again.kill()
