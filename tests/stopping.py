"""Stopping and ending the tests' child processes, in one place: a process stopped
(SIGSTOP) is continued before it is killed and reaped, so that nothing a test stopped
outlives it, and a stop a test makes always ends, whatever the test did meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def resume(pid: int) -> None:
    """Continue ``pid`` (SIGCONT) if it still exists."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped (SIGSTOP) for the block, continued after it, however it ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        resume(pid)


def kill(p: subprocess.Popen[Any]) -> None:
    """SIGKILL ``p`` if it still runs, continued first (it may be stopped)."""
    if p.poll() is None:
        resume(p.pid)
        p.kill()


def end(p: subprocess.Popen[Any], timeout_s: float = 10.0) -> int:
    """Kill ``p`` if it still runs (see ``kill``), reap it, close its pipes; its exit
    status."""
    kill(p)
    rc = p.wait(timeout_s)
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            f.close()
    return rc
