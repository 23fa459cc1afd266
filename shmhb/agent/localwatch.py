"""The local half of the agent role: every registered worker watched, its death recorded
at once.  Never depends on the network half, and survives what the host throws at it
(EMFILE, slot records it cannot decode): such a slot is looked at again next tick, and
a worker whose pidfd cannot be had is watched through its slot lock.
"""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import zmq

from ..board import locks
from .writer import AgentWriter
from ..board.handle import Board
from ..board.core import board_words
from ..board.forgetting import ExpiredSlots
from ..errors import FD_ERRNOS, BoardOpenError, ShmhbError
from ..board.layout import LOCK_SLOT_BASE, hb_left, hb_marks_array, pack_verdict, ts_units, word_tag
from ..procinfo import own_pid_namespace, pidfd_open, start_time
from ..ratelog import RateLimitedLog

log = logging.getLogger(__name__)

#: The longest wait between two scans of the slot words while the board's change
#: counter stands still (see ``LocalWatch.tick``).
SCAN_FALLBACK_NS = 250_000_000
#: how long after a forget refused for want of fds it is tried again
FORGET_RETRY_NS = 1_000_000_000


#: what ``_visible_start_time`` returns for a process /proc does not show us
_INVISIBLE = -1


def _visible_start_time(pid: int, pidfd: int) -> int | None:
    """``start_time(pid)`` for a process we hold a pidfd of: None if it is gone (or a
    zombie), ``_INVISIBLE`` if it lives but /proc hides it from us: with hidepid=2 (or
    systemd's ProtectProc=invisible) another user's /proc/PID does not exist for us, with
    hidepid=1 it cannot be read.  The pidfd tells which, about that very process (no pid
    reuse in between): ``pidfd_send_signal`` with signal 0 fails with ESRCH once it is
    gone, with EPERM while it lives and is not ours to signal."""
    try:
        st = start_time(pid)
    except PermissionError:
        st = None
    else:
        if st is not None:
            return st
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return _INVISIBLE
    # alive (or a zombie), and signalable: same user or root; /proc shows such a
    # process unless it is a zombie, so read it once more to tell
    try:
        return start_time(pid) if os.path.exists(f"/proc/{pid}") else _INVISIBLE
    except PermissionError:
        return _INVISIBLE


class _Watched:
    __slots__ = ("tag", "pid", "pidfd", "done")

    def __init__(self, tag: int, pid: int, pidfd: int | None, done: bool) -> None:
        self.tag, self.pid, self.pidfd, self.done = tag, pid, pidfd, done


class LocalWatch:
    """Watches every registered local worker and records its death at once.

    Workers in our pid namespace are watched through a pidfd: the kernel wakes us when
    the process exits.  The pid is verified against the start time the worker recorded
    at registration, so a reused pid is never mistaken for the worker.  Workers in
    another namespace, or where pidfd_open is missing, are checked every tick through
    their slot lock, which the kernel releases when they die.
    """

    def __init__(self, board: Board, writer: AgentWriter) -> None:
        self.board = board
        self.bw = board_words(board)
        self.w = writer
        self._watched: dict[int, _Watched] = {}
        self._by_fd: dict[int, int] = {}
        self._lockfd = self.bw.new_fd()
        self._expired = ExpiredSlots(self.bw)
        self._ns = own_pid_namespace()
        self._pidfd_ok = hasattr(os, "pidfd_open")
        self._marks = np.zeros(board.sizes.nslots, np.uint64)  # (incarnation, left) per slot
        self._retry: set[int] = set()
        self._by_lock: set[int] = set()  # slots watched through their lock, not a pidfd
        self._ratelog = RateLimitedLog(log, now_ns=self.bw.now_ns)  # the agent's clock
        self._seen_changes: int | None = None
        self._next_scan_ns = 0
        self._forget_retry_ns = 0
        self.pollables_gen = 0

    def pollables(self) -> list[zmq.Socket | int]:
        return list(self._by_fd)

    def on_ready(self, what: zmq.Socket | int, now_ns: int) -> None:
        i = self._by_fd.pop(what, None)  # type: ignore[arg-type]
        if i is None:
            return
        self.pollables_gen += 1
        wt = self._watched[i]
        os.close(wt.pidfd)  # type: ignore[arg-type]
        wt.pidfd = None
        self._convict(i, wt, now_ns, "exited")

    def _convict(self, i: int, wt: _Watched, now_ns: int, why: str) -> None:
        wt.done = True
        self._by_lock.discard(i)
        hb = self.bw.words[self.bw.hb_index(i)]
        if word_tag(hb) != wt.tag or hb_left(hb):
            return  # it left gracefully, or the slot was registered again meanwhile
        self.bw.words[self.bw.verdict_index(i)] = pack_verdict(wt.tag, ts_units(now_ns))
        self.w.changed()
        self.w.count("deaths_seen")
        info = self.bw.read_slot(i)
        log.info("board %s: worker %r (pid %d) %s: DEAD", self.board.name,
                 info.key if info else f"slot {i}", wt.pid, why)

    def tick(self, now_ns: int, late_ns: int) -> None:
        """Start watching new registrations, stop watching leaves, and check the slot
        locks of workers that have no pidfd.  Only slots whose (incarnation, left) bits
        changed since the last scan are examined one by one.

        The scan of the slot words runs when the board's change counter moved, when a
        slot waits to be looked at again, or ``SCAN_FALLBACK_NS`` after the last scan;
        an idle tick costs one read of the counter.  A registration moves ``reg_gen``
        after it wrote the slot's words, and so does a leave that could take the
        registry lock; on aarch64 the counter may be seen moving before the words, and
        a leaver kept from the lock does not move it at all.  The fallback scan catches
        both, so the counter only makes a change seen sooner and no order between words
        is relied on.  A worker is then watched through its pidfd at most that much
        later than it registered; a death meanwhile is still seen (the pidfd is checked
        against the start time the worker recorded, see ``_examine``)."""
        b = self.board
        ch = b.changes()
        if ch != self._seen_changes or self._retry or now_ns >= self._next_scan_ns:
            self._seen_changes = ch
            self._next_scan_ns = now_ns + SCAN_FALLBACK_NS
            self._scan(now_ns)
        for i in list(self._by_lock):
            if not locks.is_held(self._lockfd, LOCK_SLOT_BASE + i):
                self._convict(i, self._watched[i], now_ns, "released its slot lock")
        if now_ns >= self._forget_retry_ns:
            self._forget_expired(now_ns)

    def _forget_expired(self, now_ns: int) -> None:
        """The policy's ``forget_after_s`` (one comparison when it is off).  Clearing a
        slot takes an fd for its slot lock; out of fds (a connection flood at a low
        LimitNOFILE) that is refused with ``BoardOpenError``, which must not stop the
        agent: nothing was cleared (the fd comes first), so the same slots are tried
        again ``FORGET_RETRY_NS`` later, and the refusal is logged at a bounded rate."""
        try:
            self._expired.forget_expired()
        except (BoardOpenError, OSError) as e:
            if not isinstance(e, BoardOpenError) and e.errno not in FD_ERRNOS:
                raise
            self._forget_retry_ns = now_ns + FORGET_RETRY_NS
            self._ratelog.warn("forget", "board %s: could not forget expired slots (%s); "
                               "retrying every %g s", self.board.name, e, FORGET_RETRY_NS / 1e9)

    def _scan(self, now_ns: int) -> None:
        b = self.bw
        hbs = b.hb_words.copy()
        marks = hb_marks_array(hbs)
        todo = {int(i) for i in np.flatnonzero(marks != self._marks)} | self._retry
        self._marks = marks
        self._retry = set()
        if todo:
            verdicts = b.verdict_words.copy()
            for i in sorted(todo):
                if hbs[i]:
                    try:
                        self._examine(i, int(hbs[i]), int(verdicts[i]), now_ns)
                    except (OSError, ShmhbError, ValueError, UnicodeError) as e:
                        # /proc unreadable (EMFILE), or a slot record an older version
                        # stored that does not decode: look again next tick, never stop
                        # watching the others over it.
                        self._forget(i)
                        self._retry.add(i)
                        self._ratelog.warn("examine", "board %s: slot %d not watched yet: %s",
                                           self.board.name, i, e)

    def _examine(self, i: int, hb: int, verdict: int, now_ns: int) -> None:
        tag = word_tag(hb)
        wt = self._watched.get(i)
        if wt is not None and wt.tag == tag:
            if hb_left(hb) and not wt.done:  # it left gracefully: stop watching
                self._forget(i)
                self._watched[i] = _Watched(tag, wt.pid, None, True)
                # Readers learn of changes from the change counter; the leaver moves the
                # registry's half of it, unless the registry lock was out of its reach
                # (held by a stopped process): ours is always within reach.
                self.w.changed()
            return
        self._forget(i)
        if hb_left(hb) or word_tag(verdict) == tag:
            self._watched[i] = _Watched(tag, 0, None, True)
            return
        info = self.bw.read_slot(i)
        if info is None:
            self._retry.add(i)  # caught mid-registration: look again next tick
            return
        pid = info.pid
        rec = self.bw.record_table[i]
        wt = _Watched(tag, pid, None, False)
        self._watched[i] = wt
        self.w.changed()  # as for a leave: the registrant may not have (shmhb.board.registration)
        if (self._pidfd_ok and int(rec["pid_ns"]) == self._ns
                and self._watch_by_pidfd(i, wt, int(rec["pid_start"]), now_ns)):
            return
        # another pid namespace, or no pidfd: the slot lock tells, checked every tick
        self._by_lock.add(i)
        if not locks.is_held(self._lockfd, LOCK_SLOT_BASE + i):
            self._convict(i, wt, now_ns, "released its slot lock")

    def _watch_by_pidfd(self, i: int, wt: _Watched, pid_start: int, now_ns: int) -> bool:
        """Watch slot ``i``'s registrant through a pidfd (or convict it at once if its pid
        is gone or names another process); False when no pidfd could be had: the caller
        watches the slot lock instead."""
        pid = wt.pid
        pidfd = None
        try:
            pidfd = pidfd_open(pid)
            started = _visible_start_time(pid, pidfd) if pidfd is not None else None
        except OSError as e:
            if e.errno in FD_ERRNOS:
                # Out of file descriptors (a connection flood, a low LimitNOFILE):
                # this worker is watched through its slot lock instead, which needs
                # no fd of its own and is checked every tick.
                self._ratelog.warn("fds", "board %s: no fd for a pidfd (%s): worker %d "
                                   "watched through its slot lock", self.board.name, e, pid)
            else:
                log.warning("pidfd_open unavailable (%s): falling back to slot locks", e)
                self._pidfd_ok = False
            if pidfd is not None:
                os.close(pidfd)
        else:
            if pidfd is None:
                self._convict(i, wt, now_ns, "was gone before the agent saw it")
            elif started is _INVISIBLE:
                # /proc hides it (hidepid=2, ProtectProc=invisible: another user's
                # process), which is not "gone": the pidfd was had, so the pid names
                # a live process.  Whether it is still our registrant its start time
                # cannot tell; its slot lock can (the kernel frees it when the
                # registrant dies, and a pid is only reused after that).  So: the
                # pidfd for the exit notice, and the slot lock checked every tick.
                wt.pidfd = pidfd
                self._by_fd[pidfd] = i
                self.pollables_gen += 1
                self._ratelog.warn("hidden", "board %s: /proc hides pid %d (hidepid?): "
                                   "worker watched through its pidfd and slot lock",
                                   self.board.name, pid)
                self._by_lock.add(i)
                if not locks.is_held(self._lockfd, LOCK_SLOT_BASE + i):
                    self._convict(i, wt, now_ns, "released its slot lock")
            elif started != pid_start:
                os.close(pidfd)
                self._convict(i, wt, now_ns, "was gone (its pid now names another process)")
            else:
                wt.pidfd = pidfd
                self._by_fd[pidfd] = i
                self.pollables_gen += 1
            return True
        return False

    def flush(self, now_ns: int) -> None:
        """Nothing to do: verdicts are written as each pidfd fires."""

    def _forget(self, i: int) -> None:
        self._by_lock.discard(i)
        wt = self._watched.pop(i, None)
        if wt is not None and wt.pidfd is not None:
            self._by_fd.pop(wt.pidfd, None)
            os.close(wt.pidfd)
            self.pollables_gen += 1

    def close(self) -> None:
        for i in list(self._watched):
            self._forget(i)
        os.close(self._lockfd)
