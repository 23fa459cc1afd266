"""Every exception shmhb raises.

Each class derives from :class:`ShmhbError` and, where one fits, from the matching
built-in, so callers can catch either ``shmhb.BoardNotFound`` or ``FileNotFoundError``.
Messages say what went wrong and what to do about it.
"""

from __future__ import annotations

import errno

#: the errnos of a process (EMFILE) or a host (ENFILE) out of file descriptors
FD_ERRNOS = (errno.EMFILE, errno.ENFILE)


class ShmhbError(Exception):
    """Base class of all shmhb errors."""


class InvalidName(ShmhbError, ValueError):
    """A board name that POSIX shared memory cannot hold."""


class InvalidConfig(ShmhbError, ValueError):
    """A configuration value out of its valid range."""


class PolicyMismatch(InvalidConfig):
    """The board exists with another policy than the one asked for.  A board's policy is
    fixed when it is created (every reader judges by it), so it cannot change in place."""


class SettingsConflict(InvalidConfig):
    """A ``shmhb pinger`` asked for other network settings than the board's while another
    pinger runs on it, or for settings without the board's authentication: settings
    change under a holder only when the operator says so (``--replace-settings``)."""


class BoardNotFound(ShmhbError, FileNotFoundError):
    """No board of that name exists on this host."""


class BoardExists(ShmhbError, FileExistsError):
    """A board of that name exists already (``Board.create`` refuses to clobber it)."""


class BoardPermissionError(ShmhbError, PermissionError):
    """The board exists but this user may not open it."""


class BoardCorrupt(ShmhbError, ValueError):
    """The segment is not a valid board: wrong size, magic, layout or contents."""


class BoardVersionMismatch(BoardCorrupt):
    """The segment was written by an incompatible layout version of shmhb."""


class StaleBoard(BoardCorrupt):
    """The segment was left by an earlier boot of this host or by a creator that crashed."""


class BoardOpenError(ShmhbError, OSError):
    """The system refused to open the board (too many open files, no memory, ...)."""


class BoardSpaceError(ShmhbError, OSError):
    """/dev/shm has no room for a board of the requested size."""


class BoardFull(ShmhbError, RuntimeError):
    """Every slot of the board holds a live registration."""


class KeyInUse(ShmhbError, RuntimeError):
    """The key is registered by a process that is still alive."""


class KeyNotFound(ShmhbError, KeyError):
    """No slot of the board holds that key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidKey(ShmhbError, ValueError):
    """A key or endpoint that does not fit the board's fixed-size fields."""


class InvalidAddress(InvalidKey, InvalidConfig):
    """An endpoint, watch or pinger address that libzmq would refuse, that would not read
    back as written, or that is longer than the wire holds (see ``shmhb.board.address``)."""


class LockTimeout(ShmhbError, TimeoutError):
    """A board lock stayed held by another process for longer than allowed."""


class HeartbeatClosed(ShmhbError, RuntimeError):
    """The heartbeat was closed, or belongs to the parent of a forked process."""


class ProtocolError(ShmhbError, ValueError):
    """A frame from the network that is malformed, oversized or not authentic."""


class WatchTableFull(ShmhbError, RuntimeError):
    """The board's watch table has no free row."""
