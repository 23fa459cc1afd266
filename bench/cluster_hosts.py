"""Fork server of the shmhb side of ``bench.cluster``: ``python -m bench.cluster_hosts``.

One process that has imported shmhb forks, on request, the worker-side processes of the
simulated hosts (a fork costs milliseconds, a fresh interpreter about 0.2 s of CPU):

* ``ranks BOARD N ADDR BEAT_S WATCH[,WATCH...]``: the host's ranks process.  It
  registers ``N`` slots (keys ``rank-I``, endpoint ``ADDR:30000+I``, ``agent=False``:
  the host's ``shmhb pinger`` holds the agent role), beats all of them from one thread
  every ``BEAT_S`` seconds, and watches every endpoint in the comma-separated list (use
  ``-`` for none).  Answers ``ranks-ready BOARD PID``.
* ``victim BOARD KEY ENDPOINT``: a victim worker for the kill tests: registers ``KEY``
  with ``ENDPOINT`` (``agent=False``), beats every 0.05 s from a thread, answers
  ``ready BOARD KEY PID INCARNATION``.  Registering a key again (after its holder was killed)
  recycles its slot with a new incarnation.

Errors are answered ``error WHAT MESSAGE``.  Every answer is one ``os.write`` of one
line (atomic on a pipe).  EOF on stdin ends the server and every child it forked dies
with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import NoReturn

import shmhb

PR_SET_PDEATHSIG = 1


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _child_setup(server_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:
        os._exit(1)


def _ranks(server_pid: int, board_name: str, n: int, addr: str, beat_s: float,
           watches: list[str]) -> NoReturn:
    try:
        _child_setup(server_pid)
        board = shmhb.Board.attach(board_name)
        hbs = [board.register(f"rank-{i}", endpoints=(f"{addr}:{30000 + i}",), agent=False)
               for i in range(n)]
        for w in watches:
            board.watch(w)
        beats = [hb.beat for hb in hbs]

        def beat_all() -> None:
            while True:
                for b in beats:
                    b()
                time.sleep(beat_s)

        threading.Thread(target=beat_all, name="beats", daemon=True).start()
        _say(f"ranks-ready {board_name} {os.getpid()}")
        while True:
            signal.pause()
    except BaseException as e:  # noqa: BLE001
        _say(f"error ranks-{board_name} {e!r}")
    os._exit(1)


def _victim(server_pid: int, board_name: str, key: str, endpoint: str) -> NoReturn:
    try:
        _child_setup(server_pid)
        board = shmhb.Board.attach(board_name)
        hb = board.register(key, endpoints=(endpoint,), agent=False).start(0.05)
        _say(f"ready {board_name} {key} {os.getpid()} {hb.incarnation}")
        while True:
            signal.pause()
    except BaseException as e:  # noqa: BLE001
        _say(f"error {board_name}/{key} {e!r}")
    os._exit(1)


def main() -> None:
    server_pid = os.getpid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed children
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        try:
            if parts[0] == "ranks" and len(parts) == 6:
                _, board_name, n, addr, beat_s, watches = parts
                args = (board_name, int(n), addr, float(beat_s),
                        [] if watches == "-" else watches.split(","))
                if os.fork() == 0:
                    _ranks(server_pid, *args)
            elif parts[0] == "victim" and len(parts) == 4:
                if os.fork() == 0:
                    _victim(server_pid, parts[1], parts[2], parts[3])
            else:
                _say(f"error command {line.strip()!r}")
        except Exception as e:  # noqa: BLE001 - a bad request must not end the server
            _say(f"error command {e!r}")


if __name__ == "__main__":
    main()
