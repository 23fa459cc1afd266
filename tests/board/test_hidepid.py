"""/proc mounted with ``hidepid=2`` (systemd's ``ProtectProc=invisible``)
and a board shared with another account.  The agent cannot see a worker of another uid
in /proc; that is not "gone" (its pidfd says it lives), so the worker must not read DEAD,
and its death must still be seen at once.

Run as root only: the agent is started as ``nobody`` in a mount namespace of its own
whose /proc is mounted with hidepid=2, the worker runs as root.  Elsewhere it skips."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

import shmhb
from shmhb import Status

from ..conftest import ROOT, Procs, wait_until

NOBODY = 65534
# /root is often 0700: the interpreter under it is bind-mounted back for nobody to reach
SETUP = """
set -e
py=$(readlink -f "$1"); shift
case "$py" in /root/*)
  d=$(mktemp -d); mount --bind /root "$d"; mount -t tmpfs -o mode=755 tmpfs /root
  top=$(echo "$py" | cut -d/ -f3); mkdir -p "/root/$top"; mount --bind "$d/$top" "/root/$top"
  umount -l "$d";;
esac
mount -t proc -o hidepid=2 proc /proc
exec setpriv --reuid {uid} --regid {uid} --clear-groups "$@"
"""


def _as_nobody(*argv: str) -> list[str]:
    """``python ARGV`` as nobody, in a mount namespace whose /proc hides other uids."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", SETUP.format(uid=NOBODY),
            "sh", sys.executable, sys.executable, *argv]


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a mount namespace, and a second account)"
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return "needs unshare and setpriv (util-linux)"
    # the interpreter and this checkout must be reachable by nobody (a venv in a 0700
    # directory such as mktemp -d's is not)
    r = subprocess.run(_as_nobody("-c", "import shmhb"), cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        return f"nobody cannot run this interpreter with shmhb: {r.stderr.strip()[-200:]}"
    return None


_WHY_NOT = _usable()


@pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))
def test_a_worker_hidden_by_hidepid_is_not_dead_and_its_death_is_seen(
        board_name: str, procs: Procs) -> None:
    board = shmhb.Board.create(board_name, slots=16, mode=0o666, suspect_after_s=0.5,
                               dead_after_s=1.5)
    try:
        w = procs.worker(board_name, "hidden")  # root's: invisible to nobody
        cmd = _as_nobody("-m", "shmhb", "pinger", "--board", board_name, "--tick-s", "0.02")
        agent = procs.spawn(cmd, ready=False)
        wait_until(lambda: agent.poll() is not None or board.agent().status is Status.ALIVE,
                   timeout_s=30, what="the hidepid agent holds the role")
        assert agent.poll() is None, "the agent did not start"
        assert board.agent().pid != os.getpid()
        # the agent has examined the slot (several ticks): still alive
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            assert board.status("hidden") is Status.ALIVE, board.slot("hidden")
            time.sleep(0.02)  # pacing of the check only
        w.kill()
        wait_until(lambda: board.status("hidden") is Status.DEAD, timeout_s=1.0, poll_s=0.001,
                   what="the hidden worker DEAD within 1 s of its kill")
    finally:
        board.close()
