"""Fork server of victim workers for the kill benchmark: ``python -m bench.worker BOARD``.

A fresh Python worker that imports shmhb (numpy) costs about 0.2 s of CPU to start; a
fork of a process that has imported it already costs a few milliseconds, so a hundred
kills take seconds instead of a minute on a 2-core machine.  Each forked child is a small
worker like any other: it attaches to the board, registers its key (``agent=False``),
beats from a thread every 0.05 s and waits to be killed.

Protocol, one line each: stdin ``KEY`` -> stdout ``ready KEY PID`` (or ``error KEY
MESSAGE``), written by the child once it beats.  EOF on stdin ends the server, and its
children die with it (``PR_SET_PDEATHSIG``): nothing outlives an interrupted benchmark.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

import shmhb

PR_SET_PDEATHSIG = 1


def _child(board_name: str, key: str, server_pid: int) -> NoReturn:
    """Body of one victim: register, beat, wait for the SIGKILL."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server_pid:  # the server died before prctl took effect
            os._exit(1)
        board = shmhb.Board.attach(board_name)
        board.register(key, agent=False).start(0.05)
        os.write(1, f"ready {key} {os.getpid()}\n".encode())
        while True:
            signal.pause()
    except BaseException as e:  # noqa: BLE001 - report anything, never run the server's code
        os.write(1, f"error {key} {e!r}\n".encode())
    os._exit(1)


def main() -> None:
    board_name = sys.argv[1]
    server_pid = os.getpid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the killed children
    for line in sys.stdin:
        key = line.strip()
        if key and os.fork() == 0:
            _child(board_name, key, server_pid)


if __name__ == "__main__":
    main()
