"""``shmhb gc``: find the boards on this host and remove those no live process uses.

A board is a file in /dev/shm that starts with the board magic.  It is *in use* when

- the kernel says another open file description of it exists: a write lease
  (``F_SETLEASE``) is granted only when nobody else has the file open or mapped, in any
  process, namespace or user; this is the decisive check, or
- some process maps it or holds it open (found by scanning ``/proc/*/maps`` and
  ``/proc/*/fd``, matching the file's device and inode): names the pids, and decides
  where a lease cannot be taken (a board of another user, without CAP_LEASE), or
- any lock on it is held (every live worker holds its slot lock, the agent holds the
  role lock), or
- no lease could be taken and a process of the board owner's uid could not be
  inspected: then we cannot tell, and an undecidable board is kept.

Each board that attaches has its rows checked too (``shmhb.cli.check``, the checker the
chaos harness uses): one that stays invalid is listed, state ``invalid-rows``.

Removing a board another process still uses would split the host: old workers would beat
into the unlinked segment while new ones create a fresh board under the same name.  So
``remove`` checks again just before unlinking, holding the board's registry lock
exclusively (attachers and registrations wait on it), and refuses if anything changed.
A lease holder is told of a competing open() by a signal (SIGIO unless set otherwise,
which would kill us); the probe points it at SIGURG, whose default action is to ignore.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..board import locks, segment
from ..board.handle import Board
from .check import Finding, check_rows
from ..errors import (
    BoardNotFound,
    BoardPermissionError,
    BoardVersionMismatch,
    LockTimeout,
    ShmhbError,
    StaleBoard,
)
from ..board.layout import HEADER_BYTES, LOCK_REGISTRY, MAGIC
from ..board.locks import any_lock_held
from ..board.segment import SHM_DIR

log = logging.getLogger(__name__)

_MAGIC_BYTES = MAGIC.to_bytes(8, "little")
REMOVE_LOCK_TIMEOUT_S = 1.0


def shm_path(name: str) -> str:
    """Where the POSIX shared-memory object ``name`` lives on Linux."""
    return os.path.join(SHM_DIR, name)


FileId = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class BoardFile:
    """One board file and what the scan found about it."""

    name: str
    size: int
    uid: int
    file_id: FileId
    state: str  # ok | invalid-rows | stale | other-version | corrupt | busy | no-permission | unfinished | not-a-board
    detail: str = ""
    users: list[int] = field(default_factory=list)
    locked: bool = False
    opened_elsewhere: bool | None = None  # the lease probe; None: it could not tell
    unverified: list[int] = field(default_factory=list)

    @property
    def in_use(self) -> bool:
        if self.users or self.locked or self.opened_elsewhere:
            return True
        return self.opened_elsewhere is None and bool(self.unverified)

    @property
    def removable(self) -> bool:
        return not self.in_use and self.state not in ("not-a-board", "unfinished")

    def why_kept(self) -> str:
        if self.state == "not-a-board":
            return "not a board"
        if self.state == "unfinished":
            # What `shmhb status` says of the same segment (segment.Segment.attach).
            return (f"unfinished board or not a board: `shmhb pinger --board {self.name}` (or any "
                    f"worker's Board.open) recovers a board; if nothing uses it, rm {shm_path(self.name)}")
        bits = []
        if self.users:
            bits.append("used by pid " + ",".join(map(str, self.users)))
        if self.locked:
            bits.append("a lock on it is held")
        if self.opened_elsewhere and not self.users:
            bits.append("open in a process this scan cannot see")
        if self.opened_elsewhere is None and self.unverified:
            n = len(self.unverified)
            bits.append(f"{n} process{'es' if n > 1 else ''} of its owner could not be inspected")
        return "; ".join(bits)


# -- finding boards ------------------------------------------------------------------------


def _has_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == _MAGIC_BYTES
    except OSError as e:
        log.debug("cannot read %s: %s", path, e)
        return False


def _empty_header(path: str) -> bool:
    """An all-zero header (or an empty file): what a board's creator leaves when it dies
    before writing the magic, and also what any freshly made foreign segment looks like;
    gc cannot tell the two apart, so it never removes such a file."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        log.debug("cannot read %s: %s", path, e)
        return False
    return head.count(0) == len(head)


def _describe(name: str) -> tuple[str, str]:
    """(state, detail) of the board ``name``, from attaching to it."""
    try:
        board = Board.attach(name)
    except StaleBoard as e:
        return "stale", str(e).split(":")[0]
    except BoardVersionMismatch:
        return "other-version", "written by another layout version"
    except BoardPermissionError:
        return "no-permission", "cannot open it"
    except BoardNotFound:
        return "gone", "removed meanwhile"
    except LockTimeout:
        return "busy", "its registry lock stays held (a stopped registrant?)"
    except ShmhbError as e:
        state = "not-a-board" if "not a shmhb board" in str(e) else "corrupt"
        return state, str(e).split(":")[0]
    try:
        slots = board.slots()
        n_live = sum(1 for s in slots if s.status.value in ("alive", "suspect"))
        detail = f"{board.capacity.slots} slots, {len(slots)} registered, {n_live} live"
        return _rows_checked(check_rows(board), detail)
    finally:
        board.close()


def _rows_checked(bad: list[Finding], detail: str) -> tuple[str, str]:
    """("ok", detail), or ("invalid-rows", what is wrong) when rows stay invalid
    (``shmhb.cli.check``): the board works, its readers skip those rows."""
    if not bad:
        return "ok", detail
    shown = "; ".join(map(str, bad[:3])) + ("; ..." if len(bad) > 3 else "")
    return "invalid-rows", f"{detail}; {len(bad)} invalid row(s), skipped by readers: {shown}"


def unreadable_owners() -> dict[int, int]:
    """Files in /dev/shm this account may not read, by owner uid: boards of another
    account (mode 0600) look like this, and only their owner (or root) can judge or
    remove them."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return {}
    out: dict[int, int] = {}
    for name in entries:
        try:
            st = os.stat(shm_path(name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and not os.access(shm_path(name), os.R_OK):
            out[st.st_uid] = out.get(st.st_uid, 0) + 1
    return out


def list_boards(names: Sequence[str] | None = None) -> list[BoardFile]:
    """Boards in /dev/shm (or only ``names``), each with who uses it.

    Only files that carry the board magic are boards.  Without ``names`` other files
    are skipped; a name given explicitly that holds something else (or a board whose
    creator died before finishing it, which ``Board.open`` recovers by itself) is
    reported as ``not-a-board`` and never removed."""
    if names:
        candidates = [n for n in names if os.path.exists(shm_path(n))]
    else:
        try:
            entries = sorted(os.listdir(SHM_DIR))
        except FileNotFoundError:
            return []
        candidates = [n for n in entries if _has_magic(shm_path(n))]
    out = []
    for name in candidates:
        try:
            st = os.stat(shm_path(name))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if _has_magic(shm_path(name)):
            state, detail = _describe(name)
        elif _empty_header(shm_path(name)):
            state, detail = "unfinished", "empty header: a board its creator never finished?"
        else:
            state, detail = "not-a-board", "no board magic"
        if state == "gone":
            continue
        out.append(BoardFile(name, st.st_size, st.st_uid, (st.st_dev, st.st_ino), state, detail))
    if out:
        _fill_usage(out)
    return out


# -- who uses them -------------------------------------------------------------------------


def _maps_ids(pid: str) -> set[FileId]:
    """(dev, inode) of every file mapped by ``pid``."""
    ids = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5 or parts[4] == "0":
                continue
            major, minor = parts[3].split(":")
            ids.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
    return ids


def _fd_ids(pid: str, skip_fd: int | None) -> set[FileId]:
    """(dev, inode) of every file ``pid`` holds open (sockets, pipes and such skipped)."""
    ids = set()
    d = f"/proc/{pid}/fd"
    for fd in os.listdir(d):
        if skip_fd is not None and int(fd) == skip_fd:
            continue
        try:
            if not os.readlink(f"{d}/{fd}").startswith("/"):
                continue
            st = os.stat(f"{d}/{fd}")
        except (FileNotFoundError, ProcessLookupError):
            continue  # closed meanwhile
        ids.add((st.st_dev, st.st_ino))
    return ids


def scan_users(targets: Iterable[FileId], *, skip_own_fd: int | None = None
               ) -> tuple[dict[FileId, list[int]], dict[int, int]]:
    """Which processes map or hold open each target file.

    Returns ({file id: [pids]}, {uninspectable pid: its uid}).  ``skip_own_fd``: an fd
    of this process to ignore (``remove``'s own handle)."""
    want = set(targets)
    users: dict[FileId, list[int]] = {t: [] for t in want}
    hidden: dict[int, int] = {}
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            found = _maps_ids(pid) | _fd_ids(pid, skip_own_fd if int(pid) == me else None)
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited during the scan
        except PermissionError:
            try:
                hidden[int(pid)] = os.stat(f"/proc/{pid}").st_uid
            except FileNotFoundError:
                pass
            continue
        for t in want & found:
            users[t].append(int(pid))
    return users, hidden


_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)  # Linux


def opened_elsewhere(fd: int) -> bool | None:
    """Whether any other open file description of ``fd``'s file exists (an open fd or a
    mapping, in any process), by trying for a write lease; None if the kernel will not
    give us one (not the owner and no CAP_LEASE, leases disabled, unsupported)."""
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)  # a lease break must not kill us
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EBUSY):
            return True
        log.debug("no lease probe (%s): falling back to the /proc scan", e)
        return None
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def _probe(name: str) -> tuple[bool, bool | None]:
    """(a lock on it is held, opened elsewhere) for the board file ``name``."""
    try:
        fd = os.open(shm_path(name), os.O_RDWR)
    except FileNotFoundError:
        return False, False
    except PermissionError:
        return True, None  # cannot tell: keep it
    try:
        return any_lock_held(fd), opened_elsewhere(fd)
    finally:
        os.close(fd)


def _fill_usage(boards: list[BoardFile]) -> None:
    users, hidden = scan_users(b.file_id for b in boards)
    for b in boards:
        b.users = sorted(users[b.file_id])
        b.locked, b.opened_elsewhere = _probe(b.name)
        b.unverified = sorted(p for p, uid in hidden.items() if uid == b.uid)


# -- removing ------------------------------------------------------------------------------


def remove(board: BoardFile) -> bool:
    """Unlink ``board`` if, checked again under its registry lock, nobody uses it.

    Returns True if removed, False if it turned out to be in use, replaced or gone."""
    path = shm_path(board.name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != board.file_id:
            log.warning("board %s was replaced since the scan; keeping it", board.name)
            return False
        try:
            locks.lock(fd, LOCK_REGISTRY, timeout_s=REMOVE_LOCK_TIMEOUT_S,
                       what=f"board {board.name!r} registry")
        except LockTimeout:
            log.warning("board %s: its registry lock is held; keeping it", board.name)
            return False
        try:
            if any_lock_held(fd):
                log.warning("board %s: a lock on it is held; keeping it", board.name)
                return False
            elsewhere = opened_elsewhere(fd)
            if elsewhere:
                log.warning("board %s is open in another process; keeping it", board.name)
                return False
            users, hidden = scan_users([board.file_id], skip_own_fd=fd)
            blockers = users[board.file_id]
            if elsewhere is None:
                blockers += [p for p, uid in hidden.items() if uid == st.st_uid]
            if blockers:
                log.warning("board %s is in use (pid %s); keeping it", board.name,
                            ",".join(map(str, blockers)))
                return False
            try:
                segment.unlink(board.name)
            except BoardNotFound:
                return False
            log.info("removed board %s", board.name)
            return True
        finally:
            try:
                locks.unlock(fd, LOCK_REGISTRY)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise
    finally:
        os.close(fd)
