"""The board: one host's liveness table in POSIX shared memory.

``Board`` is one class over two base classes, and owns two objects:

- ``shmhb.board.core`` (base class): the mapping's views, the registry lock, the change
  counter and the agent's header as readers see it;
- ``shmhb.board.localreads`` (base class): the hot local reads (``slot``, ``status``,
  ``slots``, ...), on the board itself so that no delegation call is added to them (see
  ``shmhb.board.core``);
- ``shmhb.board.watchtable`` (an object the board owns): the watch table; ``watch``,
  ``unwatch``, ``watched_hosts``, ... are one-line delegates to it;
- ``shmhb.board.remotereads`` (an object the board owns): the remote reads; ``peers``,
  ``peer`` and ``remote`` are one-line delegates to it.

This module holds the rest: the lifecycle (create, attach, open, close, unlink),
registration, forgetting, and the delegates.  It is storage only: it starts no agent and no thread.
``register`` hands the new ``Heartbeat`` to a hook that the layer above installs
(``set_register_hook``; ``shmhb/__init__`` installs the one that joins the embedded agent),
so that imports only go down: the agent is built on the board, never the reverse.

Readers take no lock and make no syscall but the clock: they load single aligned
64-bit words and judge them with ``shmhb.board.judge``.  Registration and watches take the
kernel-released registry lock, except a registration past a stopped holder of it
(``shmhb.board.registration``).  See ``shmhb.board.layout`` for the byte map and the
one-writer-per-word rules.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import locks, segment
from ..clock import MONOTONIC, Clock
from .config import UNIT_S, Capacity, Policy, board_name, policy_differences
from ..errors import (
    BoardNotFound, InvalidConfig, KeyInUse, KeyNotFound, LockTimeout, PolicyMismatch,
    StaleBoard,
)
from .heartbeat import Heartbeat
from .layout import (
    HEADER_DTYPE, LAYOUT_VERSION, LOCK_SLOT_BASE, MAGIC,
    STATE_READY, Sizes, hb_ts_array, header_index, inc_tag, ts_units,
    word_tag,
)
from .localreads import LocalReads
from ..procinfo import boot_id
from .records import check_key, check_registration
from .registration import Registrar, key_bucket
from .registrylock import REGISTRY_TIMEOUT_S, bump_reg_gen
from .remotereads import RemoteReads
from ..status import PeerStatus, SlotStatus, Status
from ..timens import monotonic_offset_ns
from .watchtable import WatchTable

__all__ = ["Board", "REGISTRY_TIMEOUT_S", "RegisterHook", "UNIT_S", "set_register_hook"]

log = logging.getLogger(__name__)

#: what ``Board.register`` calls with the board and the new heartbeat when the caller
#: asked for the agent (``agent=True``); it may add close hooks to the heartbeat
RegisterHook = Callable[["Board", Heartbeat], None]

_register_hook: RegisterHook | None = None


def set_register_hook(hook: RegisterHook | None) -> RegisterHook | None:
    """Install what ``Board.register(..., agent=True)`` calls after a registration (the
    layer above the board: ``shmhb/__init__`` installs the embedded agent's); returns the
    previous hook.  None: registrations start nothing."""
    global _register_hook
    prev, _register_hook = _register_hook, hook
    return prev


_POLICY_KWARGS = ("policy", "suspect_after_s", "dead_after_s", "forget_after_s")


def _asked_policy(policy: Policy | None, suspect_after_s: float | None,
                  dead_after_s: float | None, forget_after_s: float | None) -> Policy:
    """The policy that ``create``'s (and ``open``'s) arguments ask for."""
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
    return pol


class Board(LocalReads):
    """A handle on one host's board.  Create, attach or open it with the classmethods."""

    # -- construction ---------------------------------------------------------------------

    def __init__(self, seg: segment.Segment, clock: Clock = MONOTONIC) -> None:
        super().__init__(seg, clock)  # the hot paths are bound by now (LocalReads)
        self._registrar = Registrar(self.name, self.record_table, self.hb_words, self.header,
                                    self.registry, self.now_ns)
        self._watchtable = WatchTable(self.name, self.watch_table, self.header,
                                      self.registry_lock)
        self._remotereads = RemoteReads(
            self.peer_table, self.remote_table, self.sizes, now_ns=self.now_ns,
            agent_ok=self.agent_ok_at, changes=self.changes, word_memo=self.word_memo,
            agent_hb_index=header_index("agent_hb"), words=self.words)
        # remote() is a connector's hot path too: bound here, like slot(), so that the
        # delegate below adds no call to it (the method is what the class documents)
        self.remote = self._remotereads.remote  # type: ignore[method-assign]
        # (forget_after in units, 0: off; (slot, hb word) pairs not to try again)
        self._forget: tuple[int, set[tuple[int, int]]] = (
            ts_units(int(self.header["forget_after_ns"])), set())

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
        pol = _asked_policy(policy, suspect_after_s, dead_after_s, forget_after_s)
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
    def open(cls, name: str | None = None, *, strict_policy: bool = False,
             **create_kwargs: Any) -> Board:
        """Attach to the board, creating it if absent.  A board left by an earlier boot or
        by a creator that crashed before finishing it is removed and created anew.

        A policy asked for (``policy=``, ``suspect_after_s=``, ...) applies only to a board
        this call creates; an existing board keeps its own, and one that differs is
        named in a logged warning (``strict_policy=True``: ``PolicyMismatch`` instead)."""
        name = board_name(name)
        clock = create_kwargs.get("clock", MONOTONIC)
        asked = None
        if any(create_kwargs.get(k) is not None for k in _POLICY_KWARGS):
            asked = _asked_policy(*(create_kwargs.get(k) for k in _POLICY_KWARGS))
        for _ in range(5):
            try:
                b = cls.attach(name, clock=clock)
                if asked is not None:
                    try:
                        b.check_policy(asked, strict=strict_policy)
                    except PolicyMismatch:
                        b.close()
                        raise
                return b
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

    def check_policy(self, asked: Policy, *, strict: bool = False) -> list[str]:
        """Compare ``asked`` with this board's policy, which is the one that applies (a
        policy is fixed at creation, invariant 6).  If they differ: ``strict`` raises
        ``PolicyMismatch``, otherwise a warning naming both is logged.  Returns the
        differences (``config.policy_differences``)."""
        diff = policy_differences(self.policy, asked)
        if not diff:
            return diff
        where = ("set the policy where the board is created: `shmhb pinger "
                 "--suspect-after-s/--dead-after-s/...` (the units' settings file, the "
                 "DaemonSet's args), started before the workers")
        if strict:
            raise PolicyMismatch(
                f"board {self.name!r} exists with another policy than asked for "
                f"({'; '.join(diff)}): a board's policy is fixed when it is created. Stop "
                f"every process using it and remove it (`shmhb gc`), or {where}")
        log.warning("board %s exists with another policy than this process asked for; the "
                    "board's applies (%s): %s", self.name, "; ".join(diff), where)
        return diff

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this handle (the board stays for other processes)."""
        self._watchtable.close()
        self._remotereads.close()
        super().close()

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

    # -- delegates: the watch table and the remote reads (objects the board owns) --------

    def watch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        """``WatchTable.watch``: ask this host's pinger to follow ``endpoint``'s host."""
        self._watchtable.watch(endpoint, timeout_s=timeout_s)

    def unwatch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        """``WatchTable.unwatch``: take back one ``watch`` of this process."""
        self._watchtable.unwatch(endpoint, timeout_s=timeout_s)

    def change_watch(self, endpoint: str, delta: int, owner_pid: int | None = None,
                     keep_port: bool = False, timeout_s: float | None = None) -> None:
        """``WatchTable.change_watch``."""
        self._watchtable.change_watch(endpoint, delta, owner_pid, keep_port, timeout_s)

    def reclaim_watches(self, timeout_s: float | None = None) -> int:
        """``WatchTable.reclaim_watches``: drop the watches of dead processes."""
        return self._watchtable.reclaim_watches(timeout_s)

    def watched_hosts(self) -> dict[str, int]:
        """``WatchTable.watched_hosts``: watched hosts and their watcher counts."""
        return self._watchtable.watched_hosts()

    def refused_watches(self) -> list[str]:
        """``WatchTable.refused_watches``: stored watches today's door refuses."""
        return self._watchtable.refused_watches()

    def peers(self) -> list[PeerStatus]:
        """``RemoteReads.peers``: every remote host followed, with its workers."""
        return self._remotereads.peers()

    def peer(self, address: str) -> PeerStatus | None:
        """``RemoteReads.peer``: the remote host at ``address``."""
        return self._remotereads.peer(address)

    def remote(self, endpoint: str) -> SlotStatus | None:
        """``RemoteReads.remote``: the remote worker that advertises ``endpoint``
        (replaced per instance by that bound method itself: see ``__init__``)."""
        return self._remotereads.remote(endpoint)

    # -- registration ---------------------------------------------------------------------

    def register(self, key: str, endpoints: Iterable[str] = (), *, agent: bool = True) -> Heartbeat:
        """Claim a slot for ``key`` in this process and return its ``Heartbeat``.

        The slot of a key whose previous holder died or left is reused with a new
        incarnation.  ``KeyInUse`` if a live process holds the key, ``BoardFull`` if no
        slot is free.  ``agent``: also join the election for the host's agent role, so
        deaths are detected with no separate daemon.
        """
        kb, eb, eps = check_registration(key, endpoints)
        self.check_clock()
        fd = self.new_fd()
        try:
            index, inc, _ = self._registrar.claim(key, kb, eb, fd)
        except BaseException:
            os.close(fd)
            raise
        hb = Heartbeat(self, index, key, inc, eps, fd, self.hb_index(index))
        hook = _register_hook
        if agent and hook is not None:
            try:
                hook(self, hb)
            except BaseException:
                hb.close()  # a registration whose agent could not start is undone
                raise
        return hb

    def check_clock(self) -> None:
        """``InvalidConfig`` if this process's CLOCK_MONOTONIC is not the board's (another
        time namespace): its beats would read ALIVE forever or DEAD at once.  Called by
        ``register``; an agent should call it before taking the role."""
        mine = monotonic_offset_ns()
        board = self.timens_offset_ns
        if mine != board:
            raise InvalidConfig(
                f"this process's monotonic clock is offset by {mine / 1e9:+.3f} s (a time "
                f"namespace) from board {self.name!r}'s ({board / 1e9:+.3f} s): its beats "
                "would be misjudged; run it in the board's time namespace")

    # -- forgetting dead slots ----------------------------------------------------------

    def forget(self, key: str, *, timeout_s: float | None = None) -> SlotStatus:
        """Clear the slot of ``key``, DEAD or LEFT, so it no longer shows (a probe such
        as ``shmhb status`` and its alert recover after a crash without rebuilding the
        board).  Returns what the slot held.  ``KeyInUse`` if a live process holds it
        (ALIVE or SUSPECT, or DEAD by silence while its process lives: kill it first);
        ``KeyNotFound`` (a ``KeyError``) if no slot holds ``key``."""
        check_key(key)
        with self.registry(timeout_s):
            for i in np.flatnonzero(self.record_table["key"] == key.encode()):
                got = self.slot_at(int(i))
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
        hb = self.hb_words.copy()
        now = ts_units(self.now_ns())
        old = np.flatnonzero((hb != 0) & (now - hb_ts_array(hb).astype(np.int64) >= units))
        todo = [int(i) for i in old if (int(i), int(hb[i])) not in refused]
        if not todo:
            return []
        out = []
        try:
            with self.registry(timeout_s):
                for i in todo:
                    got = self.slot_at(i)
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

    def _clear_slot(self, i: int, incarnation: int) -> bool:
        """Empty slot ``i`` if no live process holds it (caller holds the registry lock);
        False if one does.  Holding the slot's lock while clearing makes this process the
        slot's one writer, as a registrant is: its worker is gone, and a new registrant
        must wait for both locks."""
        fd = self.new_fd()
        try:
            # the key's bucket first: registrants of it take it to decide, without the
            # registry lock, whether a live process holds the key (shmhb.board.registration)
            records, q = self.record_table, self.words
            kb = bytes(records[i]["key"])
            if not locks.try_lock(fd, key_bucket(kb)) or not locks.try_lock(fd, LOCK_SLOT_BASE + i):
                return False
            wi = self.hb_index(i)
            if word_tag(q[wi]) != inc_tag(incarnation):
                return False  # not the incarnation judged (cannot happen under the registry lock)
            q[wi] = 0  # readers see an empty slot from here on
            records[i]["checksum"] = 0  # free: a registrant may take it
            self.drop_cached_record(i)
            bump_reg_gen(self.header)
            return True
        finally:
            os.close(fd)  # drops the slot lock
