"""The board's watch table: which remote hosts local processes ask the pinger to follow.

An object that ``Board`` constructs and owns (``Board.watch``, ``unwatch``,
``watched_hosts``... delegate to it), given the watch rows' view, the header (for the
change counter) and the board's registry lock.  Rows are written under the registry lock, counted per owning process (pid, start time, pid namespace) and
dropped when the owner is gone; the pinger's configured peers are rows of owner 0.
Readers (``watched_hosts``) take no lock and skip rows caught mid-write.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from . import locks
from .config import check_endpoint, parse_address
from ..errors import WatchTableFull
from .layout import HEADER_DTYPE, LOCK_WATCH_BASE, WATCH_ROW_DTYPE, watch_checksum
from ..procinfo import own_pid_namespace, start_time
from .records import stored_address
from .registrylock import RegistryLock, bump_reg_gen

log = logging.getLogger(__name__)


class WatchTable:
    """The watch rows of one board handle."""

    def __init__(self, name: str, rows: np.ndarray, header: np.ndarray,
                 lock: RegistryLock) -> None:
        """``name``: the board's, for messages; ``rows``: its watch table
        (``layout.WATCH_ROW_DTYPE``); ``header``: its header, whose change counter a
        change moves; ``lock``: its registry lock, which every change holds."""
        self.name = name
        self._watches = rows
        self._head = header
        self._lock = lock

    def close(self) -> None:
        """Drop the views of the mapping (the board is being closed): from here on the
        table reads empty."""
        self._watches = np.empty(0, WATCH_ROW_DTYPE)
        self._head = np.zeros((), HEADER_DTYPE)

    def watch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        """Ask this host's pinger to follow the host behind ``endpoint`` ("host:port").
        Watches are counted per process and dropped when the process dies.
        ``timeout_s``: how long to wait for the registry lock (see ``registry``)."""
        self.change_watch(endpoint, +1, timeout_s=timeout_s)

    def unwatch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        self.change_watch(endpoint, -1, timeout_s=timeout_s)

    def change_watch(self, endpoint: str, delta: int, owner_pid: int | None = None,
                     keep_port: bool = False, timeout_s: float | None = None) -> None:
        """Add ``delta`` to the watch count of ``endpoint`` for ``owner_pid`` (default:
        this process; 0: the pinger's configured peers, kept until the settings change,
        whose address may name a port when ``keep_port``).  Under the registry lock."""
        # A watch names a host (its pinger listens on the cluster's pinger port); the
        # pinger's --peer list (owner 0) names a host with its own port, or none.
        if keep_port or owner_pid == 0:
            ab = str(parse_address(endpoint, what="peer address")).encode()
        else:
            ab = str(parse_address(check_endpoint(endpoint)).with_port(None)).encode()
        pid = os.getpid() if owner_pid is None else owner_pid
        pstart = (start_time() or 0) if pid else 0
        with self._lock.hold(timeout_s):
            w = self._watches
            ns = own_pid_namespace() if pid else 0
            mine = np.flatnonzero((w["checksum"] != 0) & (w["owner_pid"] == pid)
                                  & (w["owner_ns"] == ns) & (w["address"] == ab))
            own_fd = self._lock.fd()
            if len(mine):
                i = int(mine[0])
                row = w[i]
                refs = int(row["refs"]) + delta if int(row["owner_start"]) == pstart else delta
                if refs <= 0:
                    row["checksum"] = 0
                    if pid:
                        locks.unlock(own_fd, LOCK_WATCH_BASE + i)
                else:
                    row["checksum"] = 0
                    row["owner_start"] = pstart
                    row["refs"] = refs
                    row["checksum"] = watch_checksum(row)
                    if pid:
                        locks.try_lock(own_fd, LOCK_WATCH_BASE + i, exclusive=False)
            elif delta > 0:
                free = np.flatnonzero(w["checksum"] == 0)
                if not len(free):
                    free = self._reclaim_watches()
                if not len(free):
                    raise WatchTableFull(
                        f"board {self.name!r}: all {len(w)} watch rows are in use")
                i = int(free[0])
                if pid:  # held while this process lives (see _reclaim_watches)
                    locks.try_lock(own_fd, LOCK_WATCH_BASE + i, exclusive=False)
                row = w[i]
                row["owner_pid"] = pid
                row["owner_start"] = pstart
                row["refs"] = delta
                row["address"] = ab
                row["owner_ns"] = ns
                row["checksum"] = watch_checksum(row)
            bump_reg_gen(self._head)

    def _reclaim_watches(self) -> np.ndarray:
        """Free watch rows of processes that are gone (caller holds the registry lock);
        returns the free rows.  Owners in our pid namespace are judged by pid and start
        time; those of another namespace (whose pids mean nothing here) by the row's
        lock, which a live owner holds: without that, their rows stayed forever and the
        table filled for good (WatchTableFull)."""
        w = self._watches
        ns = own_pid_namespace()
        probe = self._lock.fd()
        for i in np.flatnonzero(w["checksum"] != 0):
            row = w[int(i)]
            pid = int(row["owner_pid"])
            if not pid:
                continue  # the pinger's --peer list: kept until the settings change
            if int(row["owner_ns"]) == ns:
                gone = start_time(pid) != int(row["owner_start"])
            else:
                gone = not locks.is_held(probe, LOCK_WATCH_BASE + int(i))
            if gone:
                row["checksum"] = 0
        return np.flatnonzero(w["checksum"] == 0)

    def reclaim_watches(self, timeout_s: float | None = None) -> int:
        """Drop the watches of processes that died without unwatching; the agent calls
        this periodically.  Returns how many rows were freed.  ``timeout_s``: how long
        to wait for the registry lock, if there is anything to drop."""
        w = self._watches
        owners = {(int(w[int(i)]["owner_pid"]), int(w[int(i)]["owner_start"]))
                  for i in np.flatnonzero((w["checksum"] != 0) & (w["owner_pid"] != 0)
                                          & (w["owner_ns"] == own_pid_namespace()))}
        if all(start_time(pid) == start for pid, start in owners):
            return 0  # the common case, without the lock
        with self._lock.hold(timeout_s):
            before = int(np.count_nonzero(w["checksum"] == 0))
            freed = len(self._reclaim_watches()) - before
            if freed:
                bump_reg_gen(self._head)
        if freed:
            log.info("board %s: dropped %d watch(es) of processes that are gone", self.name, freed)
        return freed

    def watched_hosts(self) -> dict[str, int]:
        """Hosts that live local processes (or the pinger's --peer list) watch, with the
        number of watching processes.  Read lock-free; rows caught mid-write are skipped."""
        out: dict[str, int] = {}
        for i, raw in self._watch_rows():
            host = stored_address(raw, "watch row", i)
            if host is not None:
                out[host] = out.get(host, 0) + 1
        return out

    def configured_peers(self) -> list[str]:
        """The pinger's configured peers (rows of owner 0, ``shmhb pinger --peer``) as
        stored, sorted; lock-free, rows caught mid-write or refused by the door skipped."""
        w = self._watches.copy()
        out = []
        for i, raw in self._watch_rows():
            if int(w[i]["owner_pid"]) == 0:
                host = stored_address(raw, "watch row", i)
                if host is not None:
                    out.append(host)
        return sorted(out)

    def refused_watches(self) -> list[str]:
        """The stored watch addresses that today's address door refuses (an older version
        let them in), as printable text: ``watched_hosts()`` leaves them out; the agent
        reports them so that the operator learns a host is not being followed."""
        return [raw.rstrip(b"\0").decode("utf-8", "backslashreplace")
                for i, raw in self._watch_rows()
                if stored_address(raw, "watch row", i) is None]

    def _watch_rows(self) -> list[tuple[int, bytes]]:
        """(index, raw address) of every watch row whose checksum holds; lock-free, rows
        caught mid-write are skipped."""
        w = self._watches.copy()
        rows = []
        for i in np.flatnonzero(w["checksum"] != 0):
            row = w[int(i)]
            if int(row["checksum"]) == watch_checksum(row):
                rows.append((int(i), bytes(row["address"])))
        return rows
