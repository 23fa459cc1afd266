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

from .errors import LockTimeout

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


def lock(fd: int, byte: int, *, timeout_s: float, what: str, exclusive: bool = True) -> None:
    """Take the lock, retrying with a short backoff until ``timeout_s``.

    Polling rather than F_OFD_SETLKW: a blocked fcntl cannot be given a deadline, and a
    holder stopped with SIGSTOP would hang us forever.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    while not try_lock(fd, byte, exclusive=exclusive):
        if time.monotonic() >= deadline:
            raise LockTimeout(
                f"{what} stayed locked for {timeout_s:g} s: a process holding it may be "
                "stopped (SIGSTOP) or hung; find it with `fuser -v /dev/shm/<board>`"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


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
