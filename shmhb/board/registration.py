"""Registration: how a process claims a slot for a key, without ever depending on a
process that stopped while holding the registry lock.

A process stopped (SIGSTOP, a debugger) or hung while it holds the board's registry
lock keeps it: the kernel frees an OFD lock only when its holder dies.  Were
registration to run entirely under that lock, such a holder would make every new worker
fail -- a restarted vLLM rank could not register.  So the registry lock orders only what
needs one writer among registrants (the incarnation counter and the change counter),
and registration goes on without it when it cannot be had within ``REGISTRY_WAIT_S``.

What orders registrations, then (OFD byte locks on the segment, ``shmhb.board.locks``; each
registration takes them on a description of its own, so threads are excluded as well):

- **The key's bucket** (``LOCK_KEY_BASE + key_bucket(key)``), held for the registration
  only.  Every writer of a record that names key ``k`` holds ``k``'s bucket: a
  registrant of ``k``, a registrant reusing a slot whose valid record names ``k`` (it
  *tries* that second bucket and skips the slot if it is busy, so it never waits while
  holding one), and ``Board.forget`` / ``forget_expired`` clearing a slot of ``k``.  So,
  holding ``k``'s bucket, the valid records naming ``k`` are stable, and "is ``k`` held
  by a live process" is decided without the registry lock.  A process stopped holding
  a bucket delays only the keys of that bucket (1 in ``KEY_BUCKETS``), and the error
  names it.
- **The slot** (``LOCK_SLOT_BASE + i``), held for the heartbeat's life: its holder is the
  one writer of the slot's record and heartbeat word.

Incarnations.  Readers need them distinct for every registration, and growing: per key
and per endpoint a later registration must read as newer (``shmhb.board.reaper`` compares).
Without a shared counter, distinctness comes from the slot: an incarnation issued for
slot ``i`` is congruent to ``i`` modulo the slot count, and slot ``i``'s issues are
serialised by its lock, each above the slot's previous one.  Growth comes from the
floor: a new incarnation exceeds every record's incarnation field (one aligned word
each, read without a lock; a record caught mid-write only raises the floor) and the
counter, so one issued after another registration finished is above it.  Under the
registry lock the counter is then raised to the new value (the floor of registrations
after a forget cleared the record that held the highest); without the lock it is not
written (it has one writer at a time).

The change counter (``reg_gen``) is moved under the registry lock only.  A registration
made without it does not move it; the agent sees the new slot at its next scan of the
slot words (``shmhb.agent.localwatch``, within a quarter of a second) and moves its own half
of the counter, as it does for a leave kept from the lock.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass

import numpy as np

from . import locks
from .registrylock import bump_reg_gen
from ..errors import BoardFull, KeyInUse, LockTimeout
from .layout import (
    LOCK_KEY_BASE, LOCK_SLOT_BASE, hb_left, inc_tag, pack_hb, record_checksum, ts_units,
)
from ..procinfo import own_pid_namespace, start_time

log = logging.getLogger(__name__)

#: key buckets: a registrant stopped mid-registration delays only the keys of its bucket
KEY_BUCKETS = 1 << 16
#: how long a registration waits for the registry lock before it goes on without it
#: (other registrants hold it for a millisecond or so)
REGISTRY_WAIT_S = 1.0
#: after the registry lock could not be had, registrations of this handle try it without
#: waiting for this long (a process registering many keys must not wait for each)
STALL_MEMORY_NS = 10_000_000_000
#: how long it waits for its key's bucket (held by a registrant of a key of that bucket)
BUCKET_WAIT_S = 5.0
#: without the registry lock an incarnation is issued this far above the counter


def key_bucket(kb: bytes) -> int:
    """The bucket lock byte of a key (its stored bytes), ``LOCK_KEY_BASE`` + crc32 mod
    ``KEY_BUCKETS``: the same in every process and version that knows buckets."""
    return LOCK_KEY_BASE + zlib.crc32(kb) % KEY_BUCKETS


def issue_incarnation(floor: int, index: int, nslots: int, prev: int) -> int:
    """The smallest incarnation above ``floor`` that is congruent to slot ``index``
    modulo ``nslots``, whose 24-bit tag is neither 0 (it reads "never registered") nor
    that of ``prev``, the slot's previous incarnation (readers tell registrations of one
    slot apart by the tag)."""
    inc = floor + 1 + (index - (floor + 1)) % nslots
    while inc_tag(inc) == 0 or inc_tag(inc) == inc_tag(prev):
        inc += nslots
    return inc


@dataclass(frozen=True, slots=True)
class Claim:
    """A slot claimed: its index and the incarnation issued."""

    slot: int
    incarnation: int
    #: whether the registry lock was held (the counters moved); False: registered
    #: without it, past a holder stopped or hung
    with_registry: bool


class Registrar:
    """Claims slots of one board.  ``records``, ``hb`` and ``head`` are the board's views
    (the record table, the heartbeat words, the header); ``registry`` opens the registry
    lock with a timeout (``Board.registry``); ``now_ns`` is the board's clock."""

    def __init__(self, name: str, records: np.ndarray, hb: np.ndarray, head: np.ndarray,
                 registry: Callable[[float], AbstractContextManager[None]],
                 now_ns: Callable[[], int]) -> None:
        self.name = name
        self._recs = records
        self._hb = hb
        self._head = head
        self._registry = registry
        self._now_ns = now_ns
        self._nslots = len(records)
        self._stalled_until_ns = 0  # CLOCK_MONOTONIC: the registry lock was out of reach

    def claim(self, key: str, kb: bytes, eb: bytes, fd: int) -> Claim:
        """Claim a slot for ``key`` on ``fd`` (which keeps the slot lock) and write its
        record and heartbeat word.  ``KeyInUse``, ``BoardFull``, or ``LockTimeout`` if
        the key's bucket stays held (a registrant of a key of that bucket stopped
        mid-way: the message names it)."""
        bucket = key_bucket(kb)
        locks.lock(fd, bucket, timeout_s=BUCKET_WAIT_S,
                   what=f"board {self.name!r} registration of {key!r} (its key bucket)")
        try:
            with ExitStack() as stack:
                stalled = time.monotonic_ns() < self._stalled_until_ns
                try:
                    stack.enter_context(self._registry(0.0 if stalled else REGISTRY_WAIT_S))
                except LockTimeout as e:
                    self._stalled_until_ns = time.monotonic_ns() + STALL_MEMORY_NS
                    claim = self._write(key, kb, eb, fd, bucket, with_registry=False)
                    log.warning("board %s: %r registered without the registry lock (%s); "
                                "the agent announces it at its next scan", self.name, key, e)
                    return claim
                self._stalled_until_ns = 0
                return self._write(key, kb, eb, fd, bucket, with_registry=True)
        finally:
            locks.unlock(fd, bucket)

    def _write(self, key: str, kb: bytes, eb: bytes, fd: int, bucket: int, *,
               with_registry: bool) -> Claim:
        index, same_key_inc, other = self._slot_for(key, kb, fd, bucket)
        try:
            recs, head = self._recs, self._head
            counter = int(head["inc_counter"])
            floor = max(counter, int(recs["incarnation"].max()), same_key_inc)
            inc = issue_incarnation(floor, index, self._nslots, int(recs[index]["incarnation"]))
            if with_registry:
                head["inc_counter"] = max(counter, inc)
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
            self._hb[index] = pack_hb(inc, ts_units(now))
        except BaseException:
            locks.unlock(fd, LOCK_SLOT_BASE + index)
            raise
        finally:
            if other is not None:
                locks.unlock(fd, other)
        if with_registry:
            bump_reg_gen(head)
        log.info("board %s: %r registered in slot %d, incarnation %d", self.name, key, index, inc)
        return Claim(slot=index, incarnation=inc, with_registry=with_registry)

    def _key_of(self, i: int) -> bytes | None:
        """The key slot ``i``'s record names if the record is valid (written whole)."""
        rec = self._recs[i]
        ck = int(rec["checksum"])
        return bytes(rec["key"]) if ck != 0 and ck == record_checksum(rec) else None

    def _other_key(self, i: int, kb: bytes) -> bytes | None:
        """The key slot ``i``'s valid record names if it is not ``kb``, else None."""
        k = self._key_of(i)
        return None if k == kb else k

    def _slot_for(self, key: str, kb: bytes, fd: int, bucket: int) -> tuple[int, int, int | None]:
        """The slot to write (its lock taken on ``fd``), the highest incarnation a valid
        record of ``key`` holds (0: none), and the bucket of another key also taken
        (released once the record names ``key``).  Holding ``key``'s bucket, the valid
        records naming it are stable (see the module docstring)."""
        recs = self._recs
        same = [int(j) for j in np.flatnonzero(recs["key"] == kb) if self._key_of(int(j)) == kb]
        top = max((int(recs[i]["incarnation"]) for i in same), default=0)
        for i in same:
            if locks.try_lock(fd, LOCK_SLOT_BASE + i):
                return i, top, None
            raise KeyInUse(f"key {key!r} is registered by live process {int(recs[i]['pid'])}: "
                           "close its heartbeat or choose another key")
        index, other = self._free_slot(kb, fd, bucket)
        return index, top, other

    def _free_slot(self, kb: bytes, fd: int, bucket: int) -> tuple[int, int | None]:
        """A slot nobody holds: never used (or forgotten) first, then left, then the
        longest dead.  Reusing a valid record of another key takes that key's bucket
        first, without waiting (so no registrant of it sees its slot held and reads the
        key as in use), and checks again once the slot is ours."""
        recs, hb = self._recs, self._hb
        ck = recs["checksum"]
        valid = np.flatnonzero(ck != 0)
        order = [int(i) for i in np.flatnonzero(ck == 0)] + sorted(
            (int(i) for i in valid),
            key=lambda i: (not hb_left(int(hb[i])), int(recs[i]["registered_ns"])))
        for i in order:
            other = None
            old = self._other_key(i, kb)  # read unlocked: checked again below
            if old is not None and (b2 := key_bucket(old)) != bucket:
                if not locks.try_lock(fd, b2):
                    continue  # a registrant or a forget of that key is at work
                other = b2
            if locks.try_lock(fd, LOCK_SLOT_BASE + i):
                # ours now: only the holder of the slot lock writes the record
                old = self._other_key(i, kb)
                if old is None or key_bucket(old) in (bucket, other):
                    return i, other
                locks.unlock(fd, LOCK_SLOT_BASE + i)
            if other is not None:
                locks.unlock(fd, other)
        raise BoardFull(
            f"board {self.name!r} is full: all {self._nslots} slots are held by live "
            "processes; create it with more slots: stop its users, remove it (`shmhb gc`) "
            "and start `shmhb pinger --slots N` first (or Board.create(slots=N))")


__all__ = ["BUCKET_WAIT_S", "Claim", "KEY_BUCKETS", "REGISTRY_WAIT_S",
           "Registrar", "issue_incarnation", "key_bucket"]
