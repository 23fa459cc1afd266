"""Kernel-released locks on byte ranges of the board segment, and fork safety.

Open-file-description (OFD) locks: like ``flock`` they belong to an open file
description, so the kernel drops them when the holder dies (unlike posix_ipc
semaphores), and unlike fcntl record locks they do not vanish when some other fd of the
file is closed.  Unlike ``flock`` they cover byte ranges, so one segment carries many
locks: the registry, the agent role, and one per slot held by its live registrant.

A forked child shares its parent's open file descriptions and would keep the parent's
locks alive after the parent dies; ``after_fork_in_child`` closes every lock fd this
module knows about in the child.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import weakref
from typing import Protocol

from ..errors import LockTimeout

log = logging.getLogger(__name__)

# struct flock on 64-bit Linux (x86-64 and aarch64): short l_type, short l_whence,
# off_t l_start, off_t l_len, pid_t l_pid, padding.  l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("@hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)


def try_lock(fd: int, byte: int, *, exclusive: bool = True) -> bool:
    """Take the lock on ``byte`` without waiting; False if another description holds it."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    except OSError as e:
        if e.errno in _BUSY:
            return False
        raise
    return True


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def is_held(fd: int, byte: int) -> bool:
    """Whether some other open file description holds ``byte`` (a live holder)."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


def any_lock_held(fd: int) -> bool:
    """Whether another open file description holds any lock on any byte of the file."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


def lock(fd: int, byte: int, *, timeout_s: float, what: str, exclusive: bool = True) -> None:
    """Take the lock, retrying with a short backoff until ``timeout_s``.

    Polling rather than F_OFD_SETLKW: a blocked fcntl cannot be given a deadline, and a
    holder stopped with SIGSTOP would hang us forever.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    while not try_lock(fd, byte, exclusive=exclusive):
        if time.monotonic() >= deadline:
            who = describe_holders(fd, byte)
            raise LockTimeout(
                f"{what} stayed locked for {timeout_s:g} s by {who}: resume it (kill -CONT) "
                "or end it; the kernel frees the lock when its holder exits"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "blocked in the kernel",
           "Z": "a zombie"}


def holders(fd: int, byte: int) -> list[tuple[int, str]]:
    """(pid, state) of the processes whose open descriptions of ``fd``'s file hold an
    OFD lock starting at ``byte``.  OFD locks name no pid (F_OFD_GETLK and /proc/locks say
    -1), so each process's fds of that file are looked up and their ``fdinfo`` read, which
    lists the locks of that description.  For error messages only: it reads /proc for
    every process (processes of other users are not visible unless we are root)."""
    want = os.fstat(fd)
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue
        for f in fds:
            try:
                st = os.stat(f"/proc/{d}/fd/{f}")
                if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
                    continue
                with open(f"/proc/{d}/fdinfo/{f}") as fi:
                    lines = [ln.split() for ln in fi if ln.startswith("lock:")]
            except OSError:
                continue
            # lock:	1: OFDLCK ADVISORY  WRITE -1 00:1b:3834 0 0
            if any(len(p) >= 9 and p[2] == "OFDLCK" and p[-2] == str(byte) for p in lines):
                out.append((int(d), _state(int(d))))
                break
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            code = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "unknown"
    return _STATES.get(code, "running")


def describe_holders(fd: int, byte: int) -> str:
    """Who holds the lock, for an error message: 'pid 123 (stopped)', or a hint."""
    try:
        found = holders(fd, byte)
    except OSError:
        found = []
    if not found:
        return "a process this account cannot see (another user's? `fuser -v /dev/shm/<board>` as root)"
    return ", ".join(f"pid {pid} ({state})" for pid, state in found)


class ForkAware(Protocol):
    def after_fork_in_child(self) -> None: ...


_fork_aware: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_fork_lock = threading.Lock()


def on_fork(obj: ForkAware) -> None:
    """Call ``obj.after_fork_in_child()`` in every child forked while ``obj`` lives."""
    with _fork_lock:
        _fork_aware.add(obj)


def _after_fork_in_child() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()  # the parent may have held it in another thread
    for obj in list(_fork_aware):
        try:
            obj.after_fork_in_child()
        except OSError:
            log.exception("cleaning up %r after fork", obj)
    _fork_aware.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
