"""The POSIX shared-memory segment behind a board: create, attach, validate, unlink.

Thin I/O around posix_ipc and mmap.  The creator initialises the header while holding
the registry lock exclusively and marks it READY last; an attacher takes the same lock
shared before it reads the header, so it never sees a half-written one (the lock's
syscalls order the memory accesses on every architecture).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time

import numpy as np
import posix_ipc

from . import locks
from .errors import (
    BoardCorrupt, BoardExists, BoardNotFound, BoardPermissionError, BoardSpaceError,
    BoardVersionMismatch, StaleBoard,
)
from .layout import HEADER_BYTES, HEADER_DTYPE, LAYOUT_VERSION, LOCK_REGISTRY, MAGIC, STATE_READY, Sizes
from .procinfo import boot_id

log = logging.getLogger(__name__)

INIT_WAIT_S = 1.0
LOCK_WAIT_S = 5.0


def _path(name: str) -> str:
    return "/" + name


def _open_error(name: str, e: Exception) -> Exception:
    if isinstance(e, posix_ipc.ExistentialError):
        return BoardNotFound(
            f"no board {name!r} on this host: start a worker or `shmhb pinger` to create it"
        )
    if isinstance(e, posix_ipc.PermissionsError):
        return BoardPermissionError(
            f"no permission to open board {name!r}: run as its owner, or create it with a wider mode"
        )
    return e


class Segment:
    """A mapped board segment.  ``buf`` is the whole mapping."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.fd = fd
        self.mm = mm
        self.size = len(mm)

    # -- creation -------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, sizes: Sizes, mode: int) -> Segment:
        """Create the segment, allocate its memory up front, and return it with the
        registry lock held exclusively on ``fd``: the caller writes the header, marks it
        READY, then calls ``finish_create``."""
        try:
            shm = posix_ipc.SharedMemory(_path(name), flags=posix_ipc.O_CREX, mode=mode, size=0)
        except posix_ipc.ExistentialError:
            raise BoardExists(f"board {name!r} exists already; attach to it or unlink it first") from None
        except posix_ipc.PermissionsError as e:
            raise _open_error(name, e) from None
        fd = shm.fd
        try:
            locks.lock(fd, LOCK_REGISTRY, timeout_s=LOCK_WAIT_S, what=f"board {name!r} registry")
            os.fchmod(fd, mode)  # shm_open's mode is masked by the umask
            try:
                # Unlike ftruncate, fallocate fails now with ENOSPC instead of SIGBUS later.
                os.posix_fallocate(fd, 0, sizes.total_bytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise BoardSpaceError(
                        e.errno,
                        f"/dev/shm has no room for board {name!r} ({sizes.total_bytes} bytes): "
                        "free space there or create the board with fewer slots",
                    ) from None
                raise
            mm = mmap.mmap(fd, sizes.total_bytes)
        except BaseException:
            _unlink_quietly(name)
            os.close(fd)
            raise
        return cls(name, fd, mm)

    def finish_create(self) -> None:
        locks.unlock(self.fd, LOCK_REGISTRY)

    # -- attaching ------------------------------------------------------------------------

    @classmethod
    def attach(cls, name: str) -> Segment:
        try:
            # Never pass size here: it would truncate a live segment (SIGBUS for its users).
            shm = posix_ipc.SharedMemory(_path(name))
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError) as e:
            raise _open_error(name, e) from None
        fd = shm.fd
        try:
            deadline = time.monotonic() + INIT_WAIT_S
            while True:
                locks.lock(fd, LOCK_REGISTRY, timeout_s=LOCK_WAIT_S,
                           what=f"board {name!r} registry", exclusive=False)
                try:
                    st = os.fstat(fd)
                    if st.st_nlink == 0:
                        # removed (by `shmhb gc` or unlink) between our open and the
                        # lock: this copy is gone for everyone else
                        raise BoardNotFound(f"board {name!r} was removed while being opened")
                    size = st.st_size
                    if 0 < size < HEADER_BYTES:
                        raise BoardCorrupt(
                            f"{name!r} is {size} bytes, too small for a board: it is not a "
                            "shmhb board or was truncated; remove it or use another name"
                        )
                    if size >= HEADER_BYTES:
                        mm = mmap.mmap(fd, size)
                        head = np.ndarray((), HEADER_DTYPE, buffer=mm)
                        magic = int(head["magic"])
                        # magic 0: the creator has not finished (or died before it did)
                        if int(head["state"]) == STATE_READY or magic not in (0, MAGIC):
                            seg = cls(name, fd, mm)
                            seg.validate()
                            return seg
                        del head
                        mm.close()
                finally:
                    locks.unlock(fd, LOCK_REGISTRY)
                if time.monotonic() >= deadline:
                    raise StaleBoard(
                        f"board {name!r} was never finished by its creator (it crashed?): "
                        f"`shmhb pinger --board {name}` (or any worker's Board.open) recovers "
                        f"it; if nothing uses it, rm /dev/shm/{name}"
                    )
                time.sleep(0.005)
        except BaseException:
            os.close(fd)
            raise

    def validate(self) -> None:
        """Check that the header describes this segment; raise a clear error if not."""
        head = np.ndarray((), HEADER_DTYPE, buffer=self.mm)
        if int(head["magic"]) != MAGIC:
            raise BoardCorrupt(f"{self.name!r} is not a shmhb board (bad magic): remove it or use another name")
        if int(head["version"]) != LAYOUT_VERSION:
            raise BoardVersionMismatch(
                f"board {self.name!r} has layout version {int(head['version'])}, this shmhb "
                f"speaks {LAYOUT_VERSION}: run the same shmhb version on the whole host"
            )
        try:
            sizes = Sizes(int(head["nslots"]), int(head["npeers"]), int(head["nremote"]),
                          int(head["nwatch"]))
        except (ValueError, OverflowError):
            raise BoardCorrupt(f"board {self.name!r} has an impossible header") from None
        stored = [int(head[f]) for f in ("header_bytes", "total_bytes", "slot_off", "record_off",
                                        "peer_off", "remote_off", "watch_off")]
        expect = [HEADER_BYTES, sizes.total_bytes, sizes.slot_off, sizes.record_off,
                  sizes.peer_off, sizes.remote_off, sizes.watch_off]
        if stored != expect or self.size != sizes.total_bytes or min(
            sizes.nslots, sizes.npeers, sizes.nremote, sizes.nwatch) < 1:
            raise BoardCorrupt(
                f"board {self.name!r} is {self.size} bytes but its header describes another "
                "layout: it was truncated or overwritten; remove it and restart its users"
            )
        pol = [int(head[f]) for f in ("suspect_after_ns", "dead_after_ns", "agent_stale_ns",
                                     "peer_suspect_after_ns", "peer_dead_after_ns")]
        if min(pol) <= 0 or pol[1] < pol[0] or pol[4] < pol[3]:
            raise BoardCorrupt(f"board {self.name!r} holds an invalid policy")
        if bytes(head["boot_id"]).ljust(16, b"\0") != boot_id():
            raise StaleBoard(
                f"board {self.name!r} was created in an earlier boot of this host: "
                "Board.open recovers it, or remove it with `shmhb gc`"
            )

    # -- descriptors and teardown ---------------------------------------------------------

    def new_fd(self) -> int:
        """A new open file description of this segment, for a lock of its own."""
        try:
            return posix_ipc.SharedMemory(_path(self.name)).fd
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError) as e:
            raise _open_error(self.name, e) from None

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # numpy views still exported: the mapping stays until they are collected.
            log.debug("board %s: mapping still referenced at close", self.name)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(_path(name))
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError) as e:
        raise _open_error(name, e) from None


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(_path(name))
    except posix_ipc.ExistentialError:
        pass  # already gone: that is the state we want
