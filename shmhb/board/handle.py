"""The board: one host's liveness table in POSIX shared memory.

``Board`` is what a worker and a reader use: create, attach or open it; ``register`` a
worker; read ``slot``, ``status``, ``slots``, ``remote``, ``peer``, ``peers`` and the
agent's ``agent``, ``network``, ``stats``; ``watch`` and ``unwatch`` a remote endpoint;
``forget`` a dead slot; ``close`` and ``unlink``.  It is one class over two base
classes, and owns two objects:

- ``shmhb.board.core`` (base class, and ``BoardWords``, the object it owns): the
  mapping's views, the registry lock and the change counter; ``BoardWords`` is the
  surface of the words' writers (``board_words(board)``);
- ``shmhb.board.localreads`` (base class): the hot local reads (``slot``, ``status``,
  ``slots``, ...), on the board itself so that no delegation call is added to them (see
  ``shmhb.board.core``);
- ``shmhb.board.remotereads`` (an object the board owns): the remote reads.

This module holds the rest: the lifecycle (create, attach, open, close, unlink) and
registration.  It is storage only: it starts no agent and no thread.  The ``Board`` of
the package (``shmhb.Board``) is its subclass in ``shmhb.agent.embedded``, whose
``register`` also joins the embedded agent, so that imports only go down: the agent is
built on the board, never the reverse.

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
from collections.abc import Iterable
from typing import Any, Self

import numpy as np

from . import segment
from ..clock import MONOTONIC, Clock
from .config import UNIT_S, Capacity, Policy, board_name, policy_differences
from ..errors import BoardNotFound, InvalidConfig, PolicyMismatch, StaleBoard
from .forgetting import forget
from .heartbeat import Heartbeat
from .layout import HEADER_DTYPE, LAYOUT_VERSION, MAGIC, STATE_READY, Sizes, header_index
from .localreads import LocalReads
from ..procinfo import boot_id
from .records import check_registration
from .registration import Registrar
from .registrylock import REGISTRY_TIMEOUT_S
from .remotereads import RemoteReads
from ..status import PeerStatus, SlotStatus
from ..timens import monotonic_offset_ns

__all__ = ["Board", "REGISTRY_TIMEOUT_S", "UNIT_S"]

log = logging.getLogger(__name__)


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
        w = self._w
        self._registrar = Registrar(self.name, w.record_table, w.hb_words, w.header,
                                    w.registry, w.now_ns)
        self._remotereads = RemoteReads(
            w.peer_table, w.remote_table, self.sizes, now_ns=w.now_ns,
            agent_ok=w.agent_ok_at, changes=self.changes, word_memo=w.word_memo,
            agent_hb_index=header_index("agent_hb"), words=w.words)
        # remote() is a connector's hot path too: bound here, like slot(), so that the
        # method below adds no call to it (the method is what the class documents)
        self.remote = self._remotereads.remote  # type: ignore[method-assign]

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
    ) -> Self:
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
            _write_header(np.ndarray((), HEADER_DTYPE, buffer=seg.mm), sizes, pol, clock)
            seg.finish_create()
            log.info("created board %s: %d slots, %d bytes", name, cap.slots, sizes.total_bytes)
            return cls(seg, clock)
        except BaseException:
            seg.unlink_if_named()
            seg.close()
            raise

    @classmethod
    def attach(cls, name: str | None = None, *, clock: Clock = MONOTONIC) -> Self:
        """Attach to an existing board; ``BoardNotFound`` if there is none."""
        return cls(segment.Segment.attach(board_name(name)), clock)

    @classmethod
    def open(cls, name: str | None = None, *, create: bool | None = None,
             strict_policy: bool = False, **create_kwargs: Any) -> Self:
        """Attach to the board, creating it if absent as ``create`` allows: None (the
        default) only where the host has no other board (a wrong name must not give a
        private, empty board: ``BoardNotFound`` names those that exist), True always
        (the pinger's job), False never.  A board left by an earlier boot or by a
        creator that crashed before finishing it is removed and created anew.

        A policy asked for (``policy=``, ``suspect_after_s=``, ...) applies only to a board
        this call creates; an existing board keeps its own, and one that differs is
        named in a logged warning (``strict_policy=True``: ``PolicyMismatch`` instead)."""
        name = board_name(name)
        clock = create_kwargs.get("clock", MONOTONIC)
        asked = None
        if any(create_kwargs.get(k) is not None for k in _POLICY_KWARGS):
            asked = _asked_policy(*(create_kwargs.get(k) for k in _POLICY_KWARGS))
        stale = False
        for _ in range(5):
            try:
                b = cls.attach(name, clock=clock)
                if asked is not None:
                    try:
                        _check_policy(b, asked, strict=strict_policy)
                    except PolicyMismatch:
                        b.close()
                        raise
                return b
            except BoardNotFound:
                pass
            except StaleBoard as e:
                stale = True  # the name was in use: no wrong name
                # Several processes may find it stale at once: remove_stale removes it
                # only if it is still that stale segment, so all end up on one board.
                if segment.remove_stale(name):
                    log.warning("board %s: %s; recreating it", name, e)
            if create is False or (create is None and not stale and any(
                    n != name for n in segment.board_names())):
                # not ours to create: absent still, BoardNotFound names those that exist
                segment.Segment.attach(name).close()
                continue
            try:
                return cls.create(name, **create_kwargs)
            except segment.BoardExists:
                continue  # another process created it first: attach to theirs
        raise BoardNotFound(f"board {name!r} kept appearing and vanishing; is something removing it?")

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this handle (the board stays for other processes)."""
        self._remotereads.close()
        super().close()

    def unlink(self) -> None:
        """Remove the board's name from the host; processes that have it mapped keep it."""
        try:
            segment.unlink(self.name)
        except BoardNotFound:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<shmhb.Board {self.name!r} slots={self.sizes.nslots}>"

    # -- the watch table and the remote reads (objects the board owns) -------------------

    def watch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        """``WatchTable.watch``: ask this host's pinger to follow ``endpoint``'s host."""
        self._w.watches.watch(endpoint, timeout_s=timeout_s)

    def unwatch(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        """``WatchTable.unwatch``: take back one ``watch`` of this process."""
        self._w.watches.unwatch(endpoint, timeout_s=timeout_s)

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

    def register(self, key: str, endpoints: Iterable[str] = ()) -> Heartbeat:
        """Claim a slot for ``key`` in this process and return its ``Heartbeat``.

        The slot of a key whose previous holder died or left is reused with a new
        incarnation.  ``KeyInUse`` if a live process holds the key, ``BoardFull`` if no
        slot is free.  (``shmhb.Board.register`` also joins the host's agent role.)
        """
        kb, eb, eps = check_registration(key, endpoints)
        w = self._w
        w.check_clock()
        fd = w.new_fd()
        try:
            claim = self._registrar.claim(key, kb, eb, fd)
        except BaseException:
            os.close(fd)
            raise
        return Heartbeat(w, claim.slot, key, claim.incarnation, eps, fd, w.hb_index(claim.slot))

    # -- forgetting dead slots ----------------------------------------------------------

    def forget(self, key: str, *, timeout_s: float | None = None) -> SlotStatus:
        """Clear the slot of ``key``, DEAD or LEFT, so it no longer shows (a probe such
        as ``shmhb status`` and its alert recover after a crash without rebuilding the
        board).  Returns what the slot held.  ``KeyInUse`` if a live process holds it
        (ALIVE or SUSPECT, or DEAD by silence while its process lives: kill it first);
        ``KeyNotFound`` (a ``KeyError``) if no slot holds ``key``."""
        return forget(self._w, key, timeout_s)


def _check_policy(board: Board, asked: Policy, *, strict: bool = False) -> list[str]:
    """Compare ``asked`` with ``board``'s policy, which is the one that applies (a
    policy is fixed at creation, invariant 6).  If they differ: ``strict`` raises
    ``PolicyMismatch``, otherwise a warning naming both is logged.  Returns the
    differences (``config.policy_differences``)."""
    diff = policy_differences(board.policy, asked)
    if not diff:
        return diff
    where = ("set the policy where the board is created: `shmhb pinger "
             "--suspect-after-s/--dead-after-s/...` (the units' settings file, the "
             "DaemonSet's args), started before the workers")
    if strict:
        raise PolicyMismatch(
            f"board {board.name!r} exists with another policy than asked for "
            f"({'; '.join(diff)}): a board's policy is fixed when it is created. Stop "
            f"every process using it and remove it (`shmhb gc`), or {where}")
    log.warning("board %s exists with another policy than this process asked for; the "
                "board's applies (%s): %s", board.name, "; ".join(diff), where)
    return diff


def _write_header(h: np.ndarray, sizes: Sizes, pol: Policy, clock: Clock) -> None:
    """A new board's header, ``state`` last (readers wait for READY)."""
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
