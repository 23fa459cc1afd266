"""Facts about processes that survive pid reuse: start time and pid namespace."""

from __future__ import annotations

import errno
import os

_SELF_NS: int | None = None


def pid_namespace(pid: int | str = "self") -> int:
    """Inode of the pid namespace of ``pid`` (0 if it cannot be read)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


def own_pid_namespace() -> int:
    global _SELF_NS
    if _SELF_NS is None:
        _SELF_NS = pid_namespace()
    return _SELF_NS


def start_time(pid: int | str = "self") -> int | None:
    """The process start time in clock ticks since boot (field 22 of /proc/PID/stat), or
    None if no such process or it is a zombie (dead, not yet reaped by its parent).
    Together with the pid it names one process for the whole boot, where the pid alone
    may be reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except ProcessLookupError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    rest = data[data.rindex(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def thread_switches(tid: int) -> int | None:
    """Context switches (voluntary + not) of thread ``tid`` of this process so far, or
    None if they cannot be read (no procfs, out of fds).  A thread blocked in one call
    makes none; one that runs, is preempted or waits for the GIL keeps making them."""
    try:
        with open(f"/proc/self/task/{tid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return None
    n = 0
    for line in data.splitlines():
        if line.startswith((b"voluntary_ctxt_switches:", b"nonvoluntary_ctxt_switches:")):
            n += int(line.split()[1])
    return n


def pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid``, or None if the process is gone; raises OSError(ENOSYS) where
    the kernel has no pidfd_open."""
    if not hasattr(os, "pidfd_open"):
        raise OSError(errno.ENOSYS, "os.pidfd_open is not available")
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def boot_id() -> bytes:
    """16 bytes that identify this boot of the host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))
    except (OSError, ValueError):
        # No procfs: fall back to the boot time, good enough to tell boots apart.
        import time
        t = int(time.time() - time.monotonic())
        return t.to_bytes(16, "little")
