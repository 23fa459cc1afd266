"""The board: one host's liveness table in POSIX shared memory.

Readers (``slot``, ``status``, ``slots``, ``peer``, ``remote``) take no lock and make no
syscall but the clock: they load single aligned 64-bit words and judge them with
``shmhb.judge``.  Registration and watches take the kernel-released registry lock.
See ``shmhb.layout`` for the byte map and the one-writer-per-word rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from . import locks, native, segment
from .clock import MONOTONIC, Clock
from .config import (
    Capacity, Policy, board_name, check_endpoint, parse_address,
)
from .errors import (
    BoardCorrupt, BoardFull, BoardNotFound, InvalidConfig, KeyInUse, KeyNotFound, LockTimeout,
    StaleBoard, WatchTableFull,
)
from .judge import Thresholds, agent_fresh, combine_remote, judge_agent, judge_local, judge_row
from .layout import (
    FEATURE_TIMENS, HEADER_DTYPE, INC_SHIFT, LAYOUT_VERSION,
    LOCK_AGENT, LOCK_REGISTRY, LOCK_SLOT_BASE, LOCK_WATCH_BASE, MAGIC, PEER_ROW_DTYPE,
    REMOTE_ROW_DTYPE, SLOT_RECORD_DTYPE, SLOT_WORDS_DTYPE, STAT_NAMES, STATE_READY,
    TS39_MASK, TS_SHIFT, TS_UNIT_NS, WATCH_ROW_DTYPE, Sizes,
    inc_tag, pack_hb, peer_checksum, record_checksum, remote_checksum, watch_checksum,
)
from .procinfo import boot_id, own_pid_namespace, start_time
from .records import check_key, check_registration, stored_address, stored_endpoints, stored_key
from .status import AgentStatus, NetworkStatus, PeerStatus, SlotStatus, Status
from .timens import monotonic_offset_ns

log = logging.getLogger(__name__)

UNIT_S = TS_UNIT_NS / 1e9
REGISTRY_TIMEOUT_S = 5.0
_RETRIES = 8  # re-reads of a record caught mid-write before giving up on it for now


_fork_guard = threading.Lock()


def _reset_fork_guard() -> None:
    global _fork_guard
    _fork_guard = threading.Lock()  # a parent's thread may have held it at the fork


os.register_at_fork(after_in_child=_reset_fork_guard)


def _word_index(byte_offset: int) -> int:
    assert byte_offset % 8 == 0, "board words must be 8-byte aligned"
    return byte_offset // 8


class Board:
    """A handle on one host's board.  Create, attach or open it with the classmethods."""

    # -- construction ---------------------------------------------------------------------

    def __init__(self, seg: segment.Segment, clock: Clock = MONOTONIC) -> None:
        self._seg = seg
        self.name = seg.name
        self._clock = clock
        self._now_ns = clock.monotonic_ns
        mm = seg.mm
        base = np.frombuffer(mm, dtype=np.uint8, count=1)
        # Alignment is what makes single-word loads and stores atomic: assert it.
        assert base.ctypes.data % 64 == 0, "board mapping is not cache-line aligned"
        self._head = np.ndarray((), HEADER_DTYPE, buffer=mm)
        h = self._head
        self.sizes = Sizes(int(h["nslots"]), int(h["npeers"]), int(h["nremote"]), int(h["nwatch"]))
        sz = self.sizes
        self._words = np.ndarray(sz.nslots, SLOT_WORDS_DTYPE, buffer=mm, offset=sz.slot_off)
        self._records = np.ndarray(sz.nslots, SLOT_RECORD_DTYPE, buffer=mm, offset=sz.record_off)
        self._peers = np.ndarray(sz.npeers, PEER_ROW_DTYPE, buffer=mm, offset=sz.peer_off)
        self._remotes = np.ndarray(sz.nremote, REMOTE_ROW_DTYPE, buffer=mm, offset=sz.remote_off)
        self._watches = np.ndarray(sz.nwatch, WATCH_ROW_DTYPE, buffer=mm, offset=sz.watch_off)
        self._hb = self._words["hb"]  # strided views, one word per 64-byte line
        self._verdict = self._words["verdict"]
        # Whole-segment array of words for the hot path: q[i] is one aligned 8-byte load.
        self._q = memoryview(mm).cast("B").cast("Q")
        self._hb0 = _word_index(sz.slot_off)
        off = HEADER_DTYPE.fields
        assert off is not None
        self._agent_hb_i = _word_index(off["agent_hb"][1])
        self._agent_id_i = _word_index(off["agent_id"][1])
        self._reg_gen_i = _word_index(off["reg_gen"][1])
        self._agent_gen_i = _word_index(off["agent_gen"][1])
        forget_ns = int(h["forget_after_ns"])  # 0: off (and in boards of earlier versions)
        try:
            self.policy = Policy(
                suspect_after_s=int(h["suspect_after_ns"]) / 1e9,
                dead_after_s=int(h["dead_after_ns"]) / 1e9,
                agent_stale_s=int(h["agent_stale_ns"]) / 1e9,
                peer_suspect_after_s=int(h["peer_suspect_after_ns"]) / 1e9,
                peer_dead_after_s=int(h["peer_dead_after_ns"]) / 1e9,
                forget_after_s=forget_ns / 1e9 if forget_ns else None,
            )
        except InvalidConfig as e:
            raise BoardCorrupt(f"board {self.name!r} holds a policy this shmhb refuses ({e}): "
                               "remove it (`shmhb gc`) and let its users create it again") from None
        # (forget_after in units, 0: off; (slot, hb word) pairs not to try again)
        self._forget: tuple[int, set[tuple[int, int]]] = (forget_ns >> TS_SHIFT, set())
        self.thresholds = Thresholds(*(int(h[f]) >> TS_SHIFT for f in (
            "suspect_after_ns", "dead_after_ns", "agent_stale_ns",
            "peer_suspect_after_ns", "peer_dead_after_ns")))
        self.board_inc = int(h["board_inc"])
        # key -> (hb word index, incarnation tag, SlotStatus fields) for the hot path
        self._by_key: dict[str, list[Any]] = {}
        self._rec_cache: dict[int, tuple[int, tuple[str, int, int, tuple[str, ...]]]] = {}
        # endpoint -> (remote row, its generation, its peer row, changes() when it was
        # chosen, memo of the words judged)
        self._remote_cache: dict[str, tuple[int, int, int, int, Any]] = {}
        self._closed = False
        self._thread_lock = threading.Lock()
        # (pid, the registry lock's descriptor in that process): see _registry_fd.
        # Instance attributes stay at most 30 here: beyond, CPython 3.11 stops sharing
        # the instance dict's keys and every attribute load of the hot path gets slower.
        self._reg = (os.getpid(), seg.fd)
        self._bind_hot_paths(native.extension())

    def _bind_hot_paths(self, ext: Any) -> None:
        """The one switch between the C and the pure-Python hot paths (``shmhb.native``):
        with the extension, ``slot``, ``status``, ``changes`` and ``oldest_beat_age`` are its
        acquire loads and ``remote`` memoises through its ``WordMemo``; without it,
        the methods below run as written.  Both judge the same words alike."""
        self._ext = ext  # the one attribute added on the pure path: keep the instance small
        if ext is None:
            return
        clk = native.clock_arg(self._now_ns)
        words = ext.Words(self._seg.mm, self._reg_gen_i, self._agent_gen_i, self._hb0,
                          self.sizes.nslots, clk)
        reader = ext.SlotReader(self._seg.mm, self._by_key, self._slot_slow,
                                self.thresholds.suspect, self.thresholds.dead,
                                (None, *(Status.from_code(c) for c in range(1, 6))),
                                SlotStatus, UNIT_S, clk)
        self.slot = reader.slot  # type: ignore[method-assign]
        self.status = reader.status  # type: ignore[method-assign]
        self.changes = words.changes  # type: ignore[method-assign]
        self.oldest_beat_age = words.oldest_age  # type: ignore[method-assign]
        self._word_memo = words.memo  # type: ignore[method-assign]

    @property
    def native(self) -> bool:
        """Whether this handle's hot paths are the C extension's (``shmhb.native``)."""
        return self._ext is not None

    @property
    def capacity(self) -> Capacity:
        sz = self.sizes
        return Capacity(sz.nslots, sz.npeers, sz.nremote, sz.nwatch)

    @property
    def boot_id(self) -> bytes:
        """The boot this board was created in (16 bytes)."""
        return bytes(self._head["boot_id"]).ljust(16, b"\0")

    @property
    def timens_offset_ns(self) -> int | None:
        """The creator's CLOCK_MONOTONIC offset (time namespace); None in boards of
        earlier versions, which did not record it."""
        h = self._head
        return int(h["timens_offset_ns"]) if int(h["features"]) & FEATURE_TIMENS else None

    @classmethod
    def create(
        cls,
        name: str | None = None,
        *,
        slots: int = 64,
        suspect_after_s: float | None = None,
        dead_after_s: float | None = None,
        mode: int = 0o600,
        forget_after_s: float | None = None,
        peers: int | None = None,
        remote_slots: int | None = None,
        watches: int | None = None,
        policy: Policy | None = None,
        clock: Clock = MONOTONIC,
    ) -> Board:
        """Create a new board; ``BoardExists`` if the name is taken."""
        name = board_name(name)
        pol = policy or Policy()
        if not isinstance(pol, Policy):
            raise InvalidConfig(f"policy must be a shmhb.Policy, got {pol!r}")
        if suspect_after_s is not None or dead_after_s is not None or forget_after_s is not None:
            pol = dataclasses.replace(
                pol,
                suspect_after_s=pol.suspect_after_s if suspect_after_s is None else suspect_after_s,
                dead_after_s=pol.dead_after_s if dead_after_s is None else dead_after_s,
                forget_after_s=pol.forget_after_s if forget_after_s is None else forget_after_s,
            )
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777 \
                or mode & 0o600 != 0o600:
            raise InvalidConfig(
                f"mode must be file permission bits in 0o600..0o777 that let the owner read "
                f"and write (e.g. 0o600, or 0o660 to share with a group), got {mode!r}")
        d = Capacity()
        cap = Capacity(slots, d.peers if peers is None else peers,
                       d.remote_slots if remote_slots is None else remote_slots,
                       d.watches if watches is None else watches)
        sizes = Sizes(cap.slots, cap.peers, cap.remote_slots, cap.watches)
        seg = segment.Segment.create(name, sizes, mode)
        try:
            h = np.ndarray((), HEADER_DTYPE, buffer=seg.mm)
            h["version"] = LAYOUT_VERSION
            h["header_bytes"] = segment.HEADER_BYTES
            h["total_bytes"] = sizes.total_bytes
            h["nslots"], h["npeers"], h["nremote"], h["nwatch"] = (
                sizes.nslots, sizes.npeers, sizes.nremote, sizes.nwatch)
            for f in ("slot_off", "record_off", "peer_off", "remote_off", "watch_off"):
                h[f] = getattr(sizes, f)
            h["boot_id"] = boot_id()
            h["board_inc"] = secrets.randbits(63) | 1
            h["created_ns"] = clock.monotonic_ns()
            # Incarnations count up from the wall-clock time of creation (in µs), not
            # from 1: a board removed and created anew (a restarted host) must never
            # hand a worker an incarnation that links to its predecessor were made with.
            h["inc_counter"] = time.time_ns() // 1000
            h["creator_pid"] = os.getpid()
            h["suspect_after_ns"] = int(pol.suspect_after_s * 1e9)
            h["dead_after_ns"] = int(pol.dead_after_s * 1e9)
            h["agent_stale_ns"] = int(pol.agent_stale_s * 1e9)
            h["peer_suspect_after_ns"] = int(pol.peer_suspect_after_s * 1e9)
            h["peer_dead_after_ns"] = int(pol.peer_dead_after_s * 1e9)
            h["forget_after_ns"] = int((pol.forget_after_s or 0) * 1e9)
            h["timens_offset_ns"] = monotonic_offset_ns()
            h["features"] = FEATURE_TIMENS
            h["magic"] = MAGIC
            h["state"] = STATE_READY
            del h
            seg.finish_create()
            log.info("created board %s: %d slots, %d bytes", name, cap.slots, sizes.total_bytes)
            return cls(seg, clock)
        except BaseException:
            seg.unlink_if_named()
            seg.close()
            raise

    @classmethod
    def attach(cls, name: str | None = None, *, clock: Clock = MONOTONIC) -> Board:
        """Attach to an existing board; ``BoardNotFound`` if there is none."""
        return cls(segment.Segment.attach(board_name(name)), clock)

    @classmethod
    def open(cls, name: str | None = None, **create_kwargs: Any) -> Board:
        """Attach to the board, creating it if absent.  A board left by an earlier boot or
        by a creator that crashed before finishing it is removed and created anew."""
        name = board_name(name)
        clock = create_kwargs.get("clock", MONOTONIC)
        for _ in range(5):
            try:
                return cls.attach(name, clock=clock)
            except BoardNotFound:
                pass
            except StaleBoard as e:
                # Several processes may find it stale at once: remove_stale removes it
                # only if it is still that stale segment, so all end up on one board.
                if segment.remove_stale(name):
                    log.warning("board %s: %s; recreating it", name, e)
            try:
                return cls.create(name, **create_kwargs)
            except segment.BoardExists:
                continue  # another process created it first: attach to theirs
        raise BoardNotFound(f"board {name!r} kept appearing and vanishing; is something removing it?")

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this handle (the board stays for other processes)."""
        if self._closed:
            return
        self._closed = True
        pid, fd = self._reg
        if fd != self._seg.fd and pid == os.getpid():
            os.close(fd)
        self._by_key.clear()
        self._remote_cache.clear()
        if self._ext is not None:  # give back the C objects' exports of the mapping
            self.slot.__self__.release()  # type: ignore[attr-defined]
            self.changes.__self__.release()  # type: ignore[attr-defined]
        for attr in ("_head", "_words", "_records", "_peers", "_remotes", "_watches",
                     "_hb", "_verdict"):
            setattr(self, attr, None)
        self._q.release()
        self._seg.close()

    def unlink(self) -> None:
        """Remove the board's name from the host; processes that have it mapped keep it."""
        try:
            segment.unlink(self.name)
        except BoardNotFound:
            pass

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<shmhb.Board {self.name!r} slots={self.sizes.nslots}>"

    def _new_fd(self) -> int:
        return self._seg.new_fd()

    @contextlib.contextmanager
    def registry(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the board's registry lock: the kernel-released OFD lock that orders
        registrations, watches and settings between processes, plus a thread lock,
        since threads sharing this handle share its open file description and an OFD
        lock does not exclude them from each other.  ``LockTimeout`` after
        ``timeout_s`` (default ``REGISTRY_TIMEOUT_S``): a process stopped or hung while
        holding the lock keeps it (the kernel releases it only when its holder dies)."""
        wait_s = REGISTRY_TIMEOUT_S if timeout_s is None else timeout_s
        what = f"board {self.name!r} registry"
        deadline = time.monotonic() + wait_s
        fd, tlock = self._registry_fd()
        if not tlock.acquire(timeout=max(wait_s, 0.0)):
            raise LockTimeout(f"{what} stayed locked by another thread for {wait_s:g} s")
        try:
            locks.lock(fd, LOCK_REGISTRY, what=what,
                       timeout_s=max(0.0, deadline - time.monotonic()))
            try:
                yield
            finally:
                locks.unlock(fd, LOCK_REGISTRY)
        finally:
            tlock.release()

    def _registry_fd(self) -> tuple[int, threading.Lock]:
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
                    self._reg = (pid, self._seg.new_fd())
        return self._reg[1], self._thread_lock

    # -- registration ---------------------------------------------------------------------

    def register(self, key: str, endpoints: Iterable[str] = (), *, agent: bool = True) -> Any:
        """Claim a slot for ``key`` in this process and return its ``Heartbeat``.

        The slot of a key whose previous holder died or left is reused with a new
        incarnation.  ``KeyInUse`` if a live process holds the key, ``BoardFull`` if no
        slot is free.  ``agent``: also join the election for the host's agent role, so
        deaths are detected with no separate daemon.
        """
        from .heartbeat import Heartbeat

        kb, eb, eps = check_registration(key, endpoints)
        self.check_clock()
        fd = self._new_fd()
        try:
            index, inc = self._claim(key, kb, eb, fd)
        except BaseException:
            os.close(fd)
            raise
        hb = Heartbeat(self, index, key, inc, eps, fd, self._hb0 + index * 8)
        if agent:
            from .agent import embedded_join
            embedded_join(self.name, hb)
        return hb

    def check_clock(self) -> None:
        """``InvalidConfig`` if this process's CLOCK_MONOTONIC is not the board's (another
        time namespace): its beats would read ALIVE forever or DEAD at once.  Called by
        ``register``; an agent should call it before taking the role.  A board of an
        earlier version, which did not record its creator's offset, counts as 0."""
        mine = monotonic_offset_ns()
        board = self.timens_offset_ns if self.timens_offset_ns is not None else 0
        if mine != board:
            raise InvalidConfig(
                f"this process's monotonic clock is offset by {mine / 1e9:+.3f} s (a time "
                f"namespace) from board {self.name!r}'s ({board / 1e9:+.3f} s): its beats "
                "would be misjudged; run it in the board's time namespace")

    def _claim(self, key: str, kb: bytes, eb: bytes, fd: int) -> tuple[int, int]:
        with self.registry():
            recs = self._records
            valid = np.flatnonzero(recs["checksum"] != 0)
            same = [int(i) for i in valid[recs["key"][valid] == kb]]
            index = -1
            for i in same:
                if locks.try_lock(fd, LOCK_SLOT_BASE + i):
                    index = i
                    break
                raise KeyInUse(
                    f"key {key!r} is registered by live process {int(recs[i]['pid'])}: "
                    "close its heartbeat or choose another key"
                )
            if index < 0:
                index = self._free_slot(fd, valid)
            h = self._head
            inc = int(h["inc_counter"]) + 1
            if inc_tag(inc) == 0:
                inc += 1  # tag 0 would read as "never registered"
            h["inc_counter"] = inc
            now = self._now_ns()
            rec = recs[index]
            rec["checksum"] = 0
            rec["incarnation"] = inc
            rec["pid"] = os.getpid()
            rec["pid_start"] = start_time() or 0
            rec["pid_ns"] = own_pid_namespace()
            rec["registered_ns"] = now
            rec["key"] = kb
            rec["endpoints"] = eb
            rec["checksum"] = record_checksum(rec)
            # The record first, then the word that names it: a reader that sees the new
            # word but an old record notices the incarnation mismatch and retries.
            self._q[self._hb0 + index * 8] = pack_hb(inc, now >> TS_SHIFT)
            h["reg_gen"] = int(h["reg_gen"]) + 1
            log.info("board %s: %r registered in slot %d, incarnation %d", self.name, key, index, inc)
            return index, inc

    def _free_slot(self, fd: int, valid: np.ndarray) -> int:
        """A slot nobody holds: never used first, then left, then the longest dead."""
        recs = self._records
        unused = np.flatnonzero(recs["checksum"] == 0)
        if len(unused):
            i = int(unused[0])
            if locks.try_lock(fd, LOCK_SLOT_BASE + i):
                return i
        hb = self._hb
        order = sorted((int(i) for i in valid), key=lambda i: (not int(hb[i]) >> 39 & 1,
                                                              int(recs[i]["registered_ns"])))
        for i in order:
            if locks.try_lock(fd, LOCK_SLOT_BASE + i):
                return i
        raise BoardFull(
            f"board {self.name!r} is full: all {self.sizes.nslots} slots are held by live "
            "processes; create it with more slots (Board.create(slots=...))"
        )

    # -- forgetting dead slots ----------------------------------------------------------

    def forget(self, key: str, *, timeout_s: float | None = None) -> SlotStatus:
        """Clear the slot of ``key``, DEAD or LEFT, so it no longer shows (a probe such
        as ``shmhb status`` and its alert recover after a crash without rebuilding the
        board).  Returns what the slot held.  ``KeyInUse`` if a live process holds it
        (ALIVE or SUSPECT, or DEAD by silence while its process lives: kill it first);
        ``KeyNotFound`` (a ``KeyError``) if no slot holds ``key``."""
        check_key(key)
        with self.registry(timeout_s):
            for i in np.flatnonzero(self._records["key"] == key.encode()):
                got = self._slot_at(int(i))
                if got is None or got.key != key:
                    continue
                if got.status not in (Status.DEAD, Status.LEFT):
                    raise KeyInUse(f"{key!r} is {got.status.value} (pid {got.pid}): only a "
                                   "dead or left slot can be forgotten")
                if not self._clear_slot(int(i), got.incarnation):
                    raise KeyInUse(f"{key!r} reads dead but its process (pid {got.pid}) "
                                   "still holds the slot (hung or stopped?): kill it first")
                log.info("board %s: forgot %r (slot %d, incarnation %d, %s)", self.name, key,
                         int(i), got.incarnation, got.status.value)
                return got
        raise KeyNotFound(f"no slot of board {self.name!r} holds {key!r}: see `shmhb status`")

    def forget_expired(self, timeout_s: float = 0.01) -> list[str]:
        """Clear the slots that read DEAD or LEFT for the policy's ``forget_after_s``
        (counted from their last beat); the agent calls this from its local watch.  A
        no-op (one comparison) when the policy has it off, and one vectorised pass over
        the heartbeat words otherwise; never raises for a busy registry (retried at the
        next call).  Returns the keys forgotten."""
        units, refused = self._forget
        if not units:
            return []
        hb = self._hb.copy()
        now = self._now_ns() >> TS_SHIFT
        old = np.flatnonzero((hb != 0) & (now - (hb & np.uint64(TS39_MASK)).astype(np.int64)
                                          >= units))
        todo = [int(i) for i in old if (int(i), int(hb[i])) not in refused]
        if not todo:
            return []
        out = []
        try:
            with self.registry(timeout_s):
                for i in todo:
                    got = self._slot_at(i)
                    if got is None or got.status not in (Status.DEAD, Status.LEFT):
                        refused.add((i, int(hb[i])))
                        continue
                    if self._clear_slot(i, got.incarnation):
                        out.append(got.key)
                    else:  # its process lives on (hung): not until it is gone
                        refused.add((i, int(hb[i])))
        except LockTimeout:
            return out
        if out:
            log.info("board %s: forgot %d slot(s) dead or left for %g s: %s", self.name,
                     len(out), self.policy.forget_after_s, ", ".join(map(repr, out)))
        if len(refused) > 4 * self.sizes.nslots:
            refused.clear()
        return out

    def _slot_at(self, i: int) -> SlotStatus | None:
        info = self._read_slot(i)
        if info is None:
            return None
        key, pid, inc, eps = info
        hb = self._q[self._hb0 + i * 8]
        if hb >> INC_SHIFT != inc_tag(inc):
            return None
        st, age = judge_local(hb, self._q[self._hb0 + i * 8 + 1], self._now_ns() >> TS_SHIFT,
                              self.thresholds)
        return SlotStatus(key, pid, inc, st, age * UNIT_S, eps)

    def _clear_slot(self, i: int, incarnation: int) -> bool:
        """Empty slot ``i`` if no live process holds it (caller holds the registry lock);
        False if one does.  Holding the slot's lock while clearing makes this process the
        slot's one writer, as a registrant is: its worker is gone, and a new registrant
        must wait for both locks."""
        fd = self._new_fd()
        try:
            if not locks.try_lock(fd, LOCK_SLOT_BASE + i):
                return False
            wi = self._hb0 + i * 8
            if self._q[wi] >> INC_SHIFT != inc_tag(incarnation):
                return False  # not the incarnation judged (cannot happen under the registry lock)
            self._q[wi] = 0  # readers see an empty slot from here on
            self._records[i]["checksum"] = 0  # free: a registrant may take it
            self._rec_cache.pop(i, None)
            self._head["reg_gen"] = int(self._head["reg_gen"]) + 1
            return True
        finally:
            os.close(fd)  # drops the slot lock

    def _bump_reg_gen(self, timeout_s: float | None = None) -> None:
        with self.registry(timeout_s):
            self._head["reg_gen"] = int(self._head["reg_gen"]) + 1

    # -- local reads: the hot path ----------------------------------------------------------

    def slot(self, key: str) -> SlotStatus | None:
        """The worker registered under ``key`` on this host, judged now; None if absent.

        Hot path: two single-word loads and a clock read.  Judging is a pure function
        of (heartbeat word, verdict word, now in units), so when all three are what the
        previous call saw, the previous answer is returned as it is.
        """
        c = self._by_key.get(key)
        if c is not None:
            q = self._q
            i = c[0]
            hb = q[i]
            v = q[i + 1]
            now = self._now_ns() >> TS_SHIFT
            m = c[5]  # (hb, verdict, now, answer), replaced whole: threads may share c
            if hb == m[0] and v == m[1] and now == m[2]:
                return m[3]  # type: ignore[no-any-return]
            if hb >> INC_SHIFT == c[1]:
                st, age = judge_local(hb, v, now, self.thresholds)
                r = SlotStatus(key, c[2], c[3], st, age * UNIT_S, c[4])
                c[5] = (hb, v, now, r)
                return r
        return self._slot_slow(key)

    def status(self, key: str) -> Status | None:
        """Just the status of ``key``: the cheapest read."""
        s = self.slot(key)
        return None if s is None else s.status

    def _slot_slow(self, key: str) -> SlotStatus | None:
        kb = key.encode()
        recs = self._records
        for i in np.flatnonzero(recs["key"] == kb):
            got = self._read_slot(int(i))
            if got is not None and got[0] == key:
                _, pid, inc, eps = got
                wi = self._hb0 + int(i) * 8
                # [word index, tag, pid, incarnation, endpoints, memo (hb, verdict, now, answer)]
                self._by_key[key] = [wi, inc_tag(inc), pid, inc, eps, (-1, -1, -1, None)]
                hb = self._q[wi]
                if hb >> INC_SHIFT == inc_tag(inc):
                    st, age = judge_local(hb, self._q[wi + 1], self._now_ns() >> TS_SHIFT,
                                          self.thresholds)
                    return SlotStatus(key, pid, inc, st, age * UNIT_S, eps)
        self._by_key.pop(key, None)
        return None

    def _read_slot(self, i: int) -> tuple[str, int, int, tuple[str, ...]] | None:
        """The validated record of slot ``i`` that matches its heartbeat word, or None if
        the slot is empty or being rewritten."""
        for _ in range(_RETRIES):
            tag = self._q[self._hb0 + i * 8] >> INC_SHIFT
            if tag == 0:
                return None
            cached = self._rec_cache.get(i)
            if cached is not None and cached[0] == tag:
                return cached[1]
            rec = self._records[i].copy()  # one pass over the bytes, then validate the copy
            ck = int(rec["checksum"])
            if ck and ck == record_checksum(rec) and inc_tag(int(rec["incarnation"])) == tag:
                key = stored_key(bytes(rec["key"]), "slot", i)
                if key is None:
                    return None
                info = (key, int(rec["pid"]), int(rec["incarnation"]),
                        stored_endpoints(bytes(rec["endpoints"]), "slot", i))
                self._rec_cache[i] = (tag, info)
                return info
        return None

    def slots(self) -> list[SlotStatus]:
        """Every registered local slot, judged now."""
        hbs = self._hb.copy()
        verdicts = self._verdict.copy()
        now = self._now_ns() >> TS_SHIFT
        out = []
        for i0 in np.flatnonzero(hbs):
            i = int(i0)
            info = self._read_slot(i)
            if info is None:
                continue
            key, pid, inc, eps = info
            hb = int(hbs[i])
            if hb >> INC_SHIFT != inc_tag(inc):
                hb = self._q[self._hb0 + i * 8]
            st, age = judge_local(hb, int(verdicts[i]), now, self.thresholds)
            out.append(SlotStatus(key, pid, inc, st, age * UNIT_S, eps))
        return out

    def cached_index(self, key: str) -> int | None:
        """The slot index of ``key`` as this handle's last ``slot(key)`` found it, or None
        if it has not looked it up (or found nothing)."""
        c = self._by_key.get(key)
        return None if c is None else (c[0] - self._hb0) // 8

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.uint64]:
        """Vectorised view of every slot: (hb words, verdict words, now) for
        ``judge.judge_local_array``; the cheap way to scan a large board."""
        return self._hb.copy(), self._verdict.copy(), np.uint64(self._now_ns() >> TS_SHIFT)

    # -- the agent, as readers see it -------------------------------------------------------

    def agent(self) -> AgentStatus:
        """The holder of the host agent role: its pid and whether it is running."""
        q = self._q
        ahb, aid = q[self._agent_hb_i], q[self._agent_id_i]
        now = self._now_ns() >> TS_SHIFT
        st, age = judge_agent(ahb, now, self.thresholds)
        term = ahb >> INC_SHIFT
        pid = aid & ((1 << 40) - 1) if aid >> INC_SHIFT == term else 0
        return AgentStatus(pid, st, None if age is None else age * UNIT_S, term)

    def agent_fresh(self) -> bool:
        """Whether this host's agent is observing now (its heartbeat is fresh): when it
        is not, every remote status reads UNKNOWN.  One word and the clock."""
        return self._agent_ok(self._now_ns() >> TS_SHIFT)

    def network(self) -> NetworkStatus:
        """The agent's network half (the pinger): listening or not, on which address,
        degraded and why, as the holder of the agent role recorded it."""
        from .netstate import decode_network
        a = self.agent()
        return decode_network(self._head.copy(), a.term, a.status is Status.ALIVE)

    def agent_held(self) -> bool:
        """Whether a live process holds the agent role (a syscall: not for hot paths)."""
        return locks.is_held(self._seg.fd, LOCK_AGENT)

    def changes(self) -> int:
        """A counter that moves whenever a registration, a leave, a watch or any verdict
        the agent writes changes: equal values mean nothing changed but time."""
        q = self._q
        return q[self._reg_gen_i] + q[self._agent_gen_i]

    def oldest_beat_age(self, slots: np.ndarray) -> int | None:
        """Board time units since the oldest last beat among the local slots ``slots``
        (an intp array of slot indices; negative if every beat came after the clock
        read), or None for no slots.  One pass, no Python loop: the LinkReaper's check
        whether a tracked slot may have gone stale."""
        if not len(slots):
            return None
        ts = self._hb[slots] & np.uint64(TS39_MASK)
        return (self._now_ns() >> TS_SHIFT) - int(ts.min())

    def _word_memo(self, i: int, j: int, k: int) -> Any:
        """A memo of an answer judged from words ``i``, ``j``, ``k`` (see native.WordMemo)."""
        return native.WordMemo(self._q, i, j, k)

    def stats(self) -> dict[str, int]:
        """The agent's counters (pings, acks, bad frames by reason, deaths seen)."""
        vals = self._head["stats"].copy()
        return {n: int(vals[k]) for k, n in enumerate(STAT_NAMES)}

    def lateness_ms(self) -> float:
        return int(self._head["agent_lateness_us"]) / 1000.0

    # -- watches ----------------------------------------------------------------------------

    def watch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        """Ask this host's pinger to follow the host behind ``endpoint`` ("host:port").
        Watches are counted per process and dropped when the process dies.
        ``timeout_s``: how long to wait for the registry lock (see ``registry``)."""
        self._watch_change(endpoint, +1, timeout_s=timeout_s)

    def unwatch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        self._watch_change(endpoint, -1, timeout_s=timeout_s)

    def _watch_change(self, endpoint: str, delta: int, owner_pid: int | None = None,
                      keep_port: bool = False, timeout_s: float | None = None) -> None:
        # A watch names a host (its pinger listens on the cluster's pinger port); the
        # pinger's --peer list (owner 0) names a host with its own port, or none.
        if keep_port or owner_pid == 0:
            ab = str(parse_address(endpoint, what="peer address")).encode()
        else:
            ab = str(parse_address(check_endpoint(endpoint)).with_port(None)).encode()
        pid = os.getpid() if owner_pid is None else owner_pid
        pstart = (start_time() or 0) if pid else 0
        with self.registry(timeout_s):
            w = self._watches
            ns = own_pid_namespace() if pid else 0
            mine = np.flatnonzero((w["checksum"] != 0) & (w["owner_pid"] == pid)
                                  & (w["owner_ns"] == ns) & (w["address"] == ab))
            own_fd = self._registry_fd()[0]
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
                        f"board {self.name!r}: all {self.sizes.nwatch} watch rows are in use")
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
            self._head["reg_gen"] = int(self._head["reg_gen"]) + 1

    def _reclaim_watches(self) -> np.ndarray:
        """Free watch rows of processes that are gone (caller holds the registry lock);
        returns the free rows.  Owners in our pid namespace are judged by pid and start
        time; those of another namespace (whose pids mean nothing here) by the row's
        lock, which a live owner holds: without that, their rows stayed forever and the
        table filled for good (WatchTableFull)."""
        w = self._watches
        ns = own_pid_namespace()
        probe = self._registry_fd()[0]
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
        with self.registry(timeout_s):
            before = int(np.count_nonzero(w["checksum"] == 0))
            freed = len(self._reclaim_watches()) - before
            if freed:
                self._head["reg_gen"] = int(self._head["reg_gen"]) + 1
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

    # -- remote hosts (written by this host's pinger) --------------------------------------

    def _agent_ok(self, now: int) -> bool:
        return agent_fresh(self._q[self._agent_hb_i], now, self.thresholds)

    def _peer_row(self, i: int, now: int, agent_ok: bool) -> tuple[str, int, Status, float | None, float | None] | None:
        for _ in range(_RETRIES):
            row = self._peers[i].copy()
            ck = int(row["checksum"])
            if ck == 0:
                return None
            if ck != peer_checksum(row):
                continue
            gen = int(row["gen"])
            j = judge_row(int(row["status"]), gen, agent_ok, now)
            if j is None:
                continue
            st, age = j
            rtt = int(row["rtt"])
            rtt_ms = (rtt & ((1 << 44) - 1)) / 1000.0 if rtt >> 44 == gen & 0xFFFFF and rtt else None
            last = int(row["status"]) & ((1 << 40) - 1)
            addr = stored_address(bytes(row["address"]), "peer row", i)
            if addr is None:
                return None
            return (addr, gen, st, rtt_ms, age * UNIT_S if last else None)
        return None

    def _remote_rows(self, now: int, agent_ok: bool, peer_filter: int | None = None,
                     host_status: dict[int, tuple[int, Status, float | None]] | None = None,
                     ) -> list[tuple[int, SlotStatus]]:
        r = self._remotes.copy()
        out = []
        live = np.flatnonzero(r["checksum"] != 0)
        if peer_filter is not None:
            live = live[r["peer"][live] == peer_filter]
        for i in live:
            row = r[int(i)]
            if int(row["checksum"]) != remote_checksum(row):
                continue
            j = judge_row(int(row["status"]), int(row["gen"]), agent_ok, now)
            if j is None:
                continue
            reported, age = j
            p = int(row["peer"])
            hs = (host_status or {}).get(p)
            if hs is None or hs[0] != int(row["peer_gen"]):
                continue  # the row belongs to a peer row that has since been reused
            st = combine_remote(reported, hs[1])
            key = stored_key(bytes(row["key"]), "remote row", int(i))
            if key is None:
                continue
            eps = stored_endpoints(bytes(row["endpoints"]), "remote row", int(i))
            out.append((p, SlotStatus(key, int(row["pid"]), int(row["incarnation"]), st,
                                      _remote_age(age, hs[2]), eps)))
        return out

    def peers(self) -> list[PeerStatus]:
        """Every remote host this host's pinger follows, with its workers."""
        now = self._now_ns() >> TS_SHIFT
        ok = self._agent_ok(now)
        heads = {}
        for i in np.flatnonzero(self._peers["checksum"] != 0):
            pr = self._peer_row(int(i), now, ok)
            if pr is not None:
                heads[int(i)] = pr
        hosts = {i: (pr[1], pr[2], pr[4]) for i, pr in heads.items()}
        slots: dict[int, list[SlotStatus]] = {i: [] for i in heads}
        for p, s in self._remote_rows(now, ok, host_status=hosts):
            slots[p].append(s)
        return [PeerStatus(pr[0], pr[2], pr[3], pr[4], sorted(slots[i], key=lambda s: s.key))
                for i, pr in sorted(heads.items(), key=lambda kv: kv[1][0])]

    def peer(self, address: str) -> PeerStatus | None:
        """The remote host at ``address`` ("host" or "host:port" of its pinger)."""
        want = parse_address(address)
        for p in self.peers():
            h, pp = parse_address(p.address)  # valid: peers() skips what is not
            if h == want.host and (want.port is None or pp in (want.port, None)):
                return p
        return None

    def remote(self, endpoint: str) -> SlotStatus | None:
        """The remote worker that advertises ``endpoint``, as this host's pinger last
        heard from its host; None if no followed host reports it."""
        now = self._now_ns() >> TS_SHIFT
        c = self._remote_cache.get(endpoint)
        if c is not None:
            # The answer depends on the agent's heartbeat, the row's and its host's status
            # words (each names the record generation it belongs to) and the clock unit:
            # while all four read what they read last time, so does the answer.
            got = c[4].get(now)
            if got is not None:
                return got  # type: ignore[no-any-return]
        ok = self._agent_ok(now)
        if c is not None:
            at = self._remote_at(c[0], c[1], endpoint, now, ok)
            # A dead or left row stays valid until its slot is reused, but another key
            # may serve the endpoint now: look again, once per board change (so such an
            # answer, which depends on changes() too, is never memoised).
            if at is not None and at[1] == c[2]:
                if at[0].status not in (Status.DEAD, Status.LEFT):
                    return c[4].put(now, at[0])  # type: ignore[no-any-return]
                if c[3] == self.changes():
                    return at[0]
        changes = self.changes()
        r = self._remotes
        live = np.flatnonzero(r["checksum"] != 0)
        best: tuple[int, int, int, SlotStatus] | None = None
        for row in live:
            i = int(row)
            gen = int(r[i]["gen"])
            at = self._remote_at(i, gen, endpoint, now, ok)
            if at is not None and (best is None or at[0].incarnation > best[3].incarnation):
                best = (i, gen, at[1], at[0])
        if best is None:
            return None
        ri, gen, p, got = best
        self._remote_cache[endpoint] = (ri, gen, p, changes, self._word_memo(
            self._agent_hb_i, (self.sizes.remote_off + ri * REMOTE_ROW_DTYPE.itemsize) // 8,
            (self.sizes.peer_off + p * PEER_ROW_DTYPE.itemsize) // 8))
        return got

    def _remote_at(self, i: int, gen: int, endpoint: str, now: int, ok: bool
                   ) -> tuple[SlotStatus, int] | None:
        row = self._remotes[i].copy()
        if int(row["gen"]) != gen or int(row["checksum"]) != remote_checksum(row):
            return None
        eps = stored_endpoints(bytes(row["endpoints"]), "remote row", i)
        if endpoint not in eps:
            return None
        j = judge_row(int(row["status"]), gen, ok, now)
        if j is None:
            return None
        p = int(row["peer"])
        pr = self._peer_row(p, now, ok)
        if pr is None or pr[1] != int(row["peer_gen"]):
            return None
        key = stored_key(bytes(row["key"]), "remote row", i)
        if key is None:
            return None
        return SlotStatus(key, int(row["pid"]), int(row["incarnation"]),
                          combine_remote(j[0], pr[2]), _remote_age(j[1], pr[4]), eps), p


def _remote_age(row_age: int, host_age_s: float | None) -> float:
    """A remote worker's age: since the last report that covered it -- the ack or push
    that wrote its row, or any later ack of its host (an ack whose digest did not change
    confirms every row of that host without rewriting them)."""
    age_s = row_age * UNIT_S
    return age_s if host_age_s is None else min(age_s, host_age_s)
