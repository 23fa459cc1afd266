"""The board's registry lock: a kernel-released OFD lock on the segment plus a thread lock.

It orders registrations, watches and settings between processes (``shmhb.board.registration``
says which registrations go on without it).  ``BoardCore`` owns one per handle and lends
it to the objects that write under it (the watch table, the registrar).  The registry's
change counter, which only holders of the lock move, is bumped here too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from . import locks
from ..errors import LockTimeout
from .layout import LOCK_REGISTRY

REGISTRY_TIMEOUT_S = 5.0



def bump_reg_gen(head: np.ndarray) -> None:
    """Move the registry's change counter (``reg_gen`` in ``head``, the board header) so
    that readers memoising on ``changes()`` look again.  The one place it is written;
    the caller holds the registry lock, which orders its writers."""
    head["reg_gen"] = int(head["reg_gen"]) + 1


_fork_guard = threading.Lock()


def _reset_fork_guard() -> None:
    global _fork_guard
    _fork_guard = threading.Lock()  # a parent's thread may have held it at the fork


os.register_at_fork(after_in_child=_reset_fork_guard)


class RegistryLock:
    """The registry lock of one board handle: ``hold()`` it; ``fd()`` is this process's
    descriptor of the segment that the lock is taken on (other locks of the caller's may
    go there too, released with it when the process dies)."""

    def __init__(self, name: str, fd: int, new_fd: Callable[[], int]) -> None:
        """``fd``: the handle's descriptor of the segment, used in the process that made
        the handle; ``new_fd``: opens another description of the same segment (for a
        forked child: see ``fd``)."""
        self._what = f"board {name!r} registry"
        self._first_fd = fd
        self._new_fd = new_fd
        self._thread_lock = threading.Lock()
        self._reg = (os.getpid(), fd)  # (pid, the lock's descriptor in that process)

    @contextlib.contextmanager
    def hold(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the lock: the OFD lock that orders registrations, watches and settings
        between processes, plus a thread lock, since threads sharing this handle share
        its open file description and an OFD lock does not exclude them from each other.
        ``LockTimeout`` after ``timeout_s`` (default ``REGISTRY_TIMEOUT_S``): a process
        stopped or hung while holding the lock keeps it (the kernel releases it only
        when its holder dies)."""
        wait_s = REGISTRY_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        fd, tlock = self._fd_and_lock()
        if not tlock.acquire(timeout=max(wait_s, 0.0)):
            raise LockTimeout(f"{self._what} stayed locked by another thread for {wait_s:g} s")
        try:
            locks.lock(fd, LOCK_REGISTRY, what=self._what,
                       timeout_s=max(0.0, deadline - time.monotonic()))
            try:
                yield
            finally:
                locks.unlock(fd, LOCK_REGISTRY)
        finally:
            tlock.release()

    def fd(self) -> int:
        """This process's descriptor for the registry lock (see ``_fd_and_lock``)."""
        return self._fd_and_lock()[0]

    def _fd_and_lock(self) -> tuple[int, threading.Lock]:
        """This process's descriptor for the registry lock, and its thread lock.

        An OFD lock belongs to an open file description, which a forked child shares
        with its parent: taken on the inherited one, parent and child would not exclude
        each other, and a child killed while holding it would leave it held for as long
        as the parent lives (the description stays open there).  So the first call in
        a new process opens a description of its own (of the same segment, not by
        name) and a new thread lock (the parent's may have been held at the fork by a
        thread that does not exist here)."""
        pid = os.getpid()
        if pid != self._reg[0]:
            with _fork_guard:
                if pid != self._reg[0]:
                    self._thread_lock = threading.Lock()
                    self._reg = (pid, self._new_fd())
        return self._reg[1], self._thread_lock

    def close(self) -> None:
        """Close the descriptor this process opened for the lock, if it opened one (the
        handle's own descriptor is the segment's to close)."""
        pid, fd = self._reg
        if fd != self._first_fd and pid == os.getpid():
            os.close(fd)
        self._reg = (pid, self._first_fd)
