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
import stat
import time

import numpy as np
import posix_ipc

from . import locks
from ..errors import (
    BoardCorrupt, BoardExists, BoardNotFound, BoardOpenError, BoardPermissionError, BoardSpaceError,
    BoardVersionMismatch, ShmhbError, StaleBoard,
)
from .layout import (
    HEADER_BYTES, HEADER_DTYPE, LAYOUT_VERSION, LOCK_REGISTRY, MAGIC, STATE_READY, TS_UNIT_NS, Sizes,
)
from ..procinfo import boot_id

log = logging.getLogger(__name__)

INIT_WAIT_S = 1.0
LOCK_WAIT_S = 5.0


SHM_DIR = "/dev/shm"


def _path(name: str) -> str:
    return "/" + name


def board_names() -> list[str]:
    """The boards in /dev/shm that this account can read (files that carry the board
    magic), sorted: what an error about a board that is not there names."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    magic = MAGIC.to_bytes(8, "little")
    out = []
    for entry in entries:
        try:
            with open(os.path.join(SHM_DIR, entry), "rb") as f:
                if f.read(8) == magic:
                    out.append(entry)
        except OSError:
            continue  # another account's file, or gone meanwhile
    return out


def not_found_hint(name: str) -> str:
    """What follows "no board NAME on this host" in an error: the boards there are."""
    others = [n for n in board_names() if n != name]
    if not others:
        return "there is no board on this host"
    return ("the boards on this host are " + ", ".join(repr(n) for n in others[:8])
            + (", ..." if len(others) > 8 else "") + " (a wrong --board or $SHMHB_BOARD?)")


def _not_a_board(name: str) -> BoardCorrupt | None:
    """A clear error if /dev/shm holds something other than a plain file under ``name``
    (a symlink, a directory: shm_open refuses them with ELOOP or EISDIR)."""
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
            "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
    return BoardCorrupt(f"{SHM_DIR}/{name} is {kind}, not a board: remove it, or use "
                        "another board name (--board / $SHMHB_BOARD)")


def _open_error(name: str, e: Exception) -> Exception:
    bad = _not_a_board(name)
    if bad is not None:
        return bad
    if isinstance(e, posix_ipc.ExistentialError):
        return BoardNotFound(
            f"no board {name!r} on this host ({not_found_hint(name)}): `shmhb pinger --board "
            f"{name}` creates it"
        )
    if isinstance(e, posix_ipc.PermissionsError):
        return BoardPermissionError(
            f"no permission to open board {name!r} (mode 0600 by default: its owner only): run "
            "as its owner, or let a group in where the board is created: `shmhb pinger "
            "--board-mode 0660 --board-group GROUP`, with this account in GROUP"
        )
    if isinstance(e, OSError) and e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENOTDIR):
        return BoardOpenError(e.errno, f"cannot open board {name!r}: {e.strerror or e} "
                                       "(too many open files? raise LimitNOFILE / ulimit -n)")
    if isinstance(e, OSError):
        return BoardCorrupt(f"cannot open board {name!r}: {e.strerror or e}; remove "
                            f"{SHM_DIR}/{name} or use another board name")
    return BoardCorrupt(f"cannot open board {name!r} ({e}): remove {SHM_DIR}/{name} "
                        "or use another board name")


def _shm_open(name: str, **kw: int) -> int:
    """shm_open through posix_ipc; its errors as shmhb errors (never a raw OSError or
    posix_ipc's ValueError for a directory)."""
    try:
        return int(posix_ipc.SharedMemory(_path(name), **kw).fd)
    except posix_ipc.ExistentialError:
        if kw.get("flags") == posix_ipc.O_CREX:
            bad = _not_a_board(name)
            raise bad or BoardExists(
                f"board {name!r} exists already; attach to it or unlink it first") from None
        raise _open_error(name, posix_ipc.ExistentialError()) from None
    except (posix_ipc.PermissionsError, OSError, ValueError) as e:
        raise _open_error(name, e) from None


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
        fd = _shm_open(name, flags=posix_ipc.O_CREX, mode=mode, size=0)
        try:
            locks.lock(fd, LOCK_REGISTRY, timeout_s=LOCK_WAIT_S, what=f"board {name!r} registry")
            if os.fstat(fd).st_nlink == 0:
                # Between our O_CREAT and the lock, a process recovering what looked like
                # a stale board (remove_stale) removed the name: ours is unreachable.
                os.close(fd)
                raise BoardExists(f"board {name!r} was removed while being created; retry")
            os.fchmod(fd, mode)  # shm_open's mode is masked by the umask
            try:
                # Unlike ftruncate, fallocate fails now with ENOSPC instead of SIGBUS later.
                os.posix_fallocate(fd, 0, sizes.total_bytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise BoardSpaceError(
                        e.errno,
                        f"/dev/shm has no room for board {name!r} ({sizes.total_bytes} bytes): "
                        "free space there or create the board with fewer slots (`shmhb pinger "
                        "--slots N`, Board.create(slots=N))",
                    ) from None
                raise
            mm = mmap.mmap(fd, sizes.total_bytes)
        except BoardExists:
            raise
        except BaseException:
            _unlink_if_same(name, fd)
            os.close(fd)
            raise
        return cls(name, fd, mm)

    def finish_create(self) -> None:
        locks.unlock(self.fd, LOCK_REGISTRY)

    def unlink_if_named(self) -> None:
        """Remove the board's name if it still names this segment (a failed create)."""
        _unlink_if_same(self.name, self.fd)

    # -- attaching ------------------------------------------------------------------------

    @classmethod
    def attach(cls, name: str) -> Segment:
        # Never pass size here: it would truncate a live segment (SIGBUS for its users).
        fd = _shm_open(name)
        try:
            seg = cls._attach_ready(name, fd)
            if seg is not None:
                return seg
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

    @classmethod
    def _attach_ready(cls, name: str, fd: int) -> Segment | None:
        """Attach without the registry lock, for a board whose creator has finished: the
        lock only orders an attach after a creation still under way, and waiting for it
        made every attach (``status``, a standby pinger, a restarted worker) fail while
        some process sat stopped holding it.  A finished board's header never
        changes, so a copy that reads ``STATE_READY`` and validates is the board; on a
        weakly ordered CPU a creation seen half-way could read READY before the fields,
        and then fails ``validate`` (sizes, magic, policy, boot id), which sends us to
        the locked path instead, where the creator's unlock orders everything.  None:
        take the locked path."""
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        size = st.st_size
        if size < HEADER_BYTES or st.st_nlink == 0:  # the locked path says why
            return None
        mm = mmap.mmap(fd, size)
        head = np.ndarray((), HEADER_DTYPE, buffer=mm)
        ready = int(head["state"]) == STATE_READY and int(head["magic"]) == MAGIC
        del head
        if ready:
            seg = cls(name, fd, mm)
            try:
                seg.validate()
            except ShmhbError:
                seg.mm.close()
                return None
            return seg
        mm.close()
        return None

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
        if min(pol) < TS_UNIT_NS or pol[1] < pol[0] or pol[4] < pol[3]:
            # under the time unit a threshold reads 0 units: every slot would be DEAD
            raise BoardCorrupt(f"board {self.name!r} holds an invalid policy (a time under "
                               "its ~1 ms unit, or dead before suspect): remove it with "
                               "`shmhb gc` and create it again")
        if bytes(head["boot_id"]).ljust(16, b"\0") != boot_id():
            raise StaleBoard(
                f"board {self.name!r} was created in an earlier boot of this host: "
                "Board.open recovers it, or remove it with `shmhb gc`"
            )

    # -- descriptors and teardown ---------------------------------------------------------

    def new_fd(self) -> int:
        """A new open file description of this very segment, for a lock of its own.

        Opened through /proc/self/fd, not by name: the name may meanwhile point to
        another segment (a board removed and created anew), and a lock taken there
        would exclude nobody here.  The inode is checked either way."""
        want = os.fstat(self.fd)
        try:
            fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            fd = _shm_open(self.name)  # no /proc: by name, and checked below
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
            os.close(fd)
            raise BoardNotFound(f"board {self.name!r} was removed and created anew while "
                                "this process had it open: open it again")
        return fd

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # numpy views still exported: the mapping stays until they are collected.
            log.debug("board %s: mapping still referenced at close", self.name)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def remove_stale(name: str) -> bool:
    """Remove the board ``name`` if, checked again under its registry lock held
    exclusively, it is still the same unfinished or earlier-boot segment; True if this
    call removed it.

    Many processes may find one stale board at once.  Unlinking by name is not atomic
    with the check, so the check and the unlink happen while holding the stale
    segment's own registry lock, and only if the name still points to that segment:
    a process that recovers second finds the name gone, or naming the board the first
    one created, and removes nothing (a plain unlink there split the host between two
    boards).  A creator takes that lock before writing anything and checks afterwards
    that its segment is still linked, so it never finishes a board nobody can find."""
    try:
        fd = _shm_open(name)
    except BoardNotFound:
        return False
    try:
        locks.lock(fd, LOCK_REGISTRY, timeout_s=LOCK_WAIT_S, what=f"board {name!r} registry")
        mine = os.fstat(fd)
        if mine.st_nlink == 0 or not _is_stale(fd, mine.st_size):
            return False
        try:
            now = _shm_open(name)
        except BoardNotFound:
            return False
        try:
            same = (os.fstat(now).st_ino, os.fstat(now).st_dev) == (mine.st_ino, mine.st_dev)
        finally:
            os.close(now)
        if same:
            _unlink_quietly(name)  # the name is ours while we hold the lock (see above)
        return same
    finally:
        os.close(fd)  # drops the lock


def _is_stale(fd: int, size: int) -> bool:
    """Unfinished (no READY mark: its creator died, since we hold the lock it creates
    under) or made in an earlier boot.  Anything else (a board that is merely corrupt,
    or some other file) is left for `shmhb gc` or a person."""
    if size < HEADER_BYTES:
        return size == 0
    mm = mmap.mmap(fd, HEADER_BYTES, prot=mmap.PROT_READ)
    try:
        head = np.ndarray((), HEADER_DTYPE, buffer=mm)
        magic, state = int(head["magic"]), int(head["state"])
        boot = bytes(head["boot_id"]).ljust(16, b"\0")
        del head
    finally:
        mm.close()
    if magic not in (0, MAGIC):
        return False
    return state != STATE_READY or boot != boot_id()


def _unlink_if_same(name: str, fd: int) -> None:
    """Remove ``name`` only if it still names the segment open on ``fd``."""
    try:
        now = _shm_open(name)
    except BoardNotFound:
        return
    except BoardCorrupt:
        return
    try:
        a, b = os.fstat(now), os.fstat(fd)
        if (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev):
            _unlink_quietly(name)
    finally:
        os.close(now)


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
