"""Forgetting dead slots: clearing the slot of a key that reads DEAD or LEFT, on an
operator's word (``Board.forget``) or once the policy's ``forget_after_s`` has passed
(``ExpiredSlots``, run by the agent's local watch).

A slot is cleared under the registry lock and its key bucket's and slot's locks: the
clearer is then the slot's one writer, as a registrant is (its worker is gone, and a
new registrant must wait for both locks)."""

from __future__ import annotations

import logging
import os

import numpy as np

from . import locks
from .core import BoardWords
from ..errors import KeyInUse, KeyNotFound, LockTimeout
from .layout import LOCK_SLOT_BASE, hb_ts_array, inc_tag, ts_units, word_tag
from .records import check_key
from .registration import key_bucket
from .registrylock import bump_reg_gen
from ..status import SlotStatus, Status

__all__ = ["ExpiredSlots", "clear_slot", "forget"]

log = logging.getLogger(__name__)


def clear_slot(w: BoardWords, i: int, incarnation: int) -> bool:
    """Empty slot ``i`` if no live process holds it (the caller holds the registry
    lock); False if one does."""
    fd = w.new_fd()
    try:
        # the key's bucket first: registrants of it take it to decide, without the
        # registry lock, whether a live process holds the key (shmhb.board.registration)
        records, q = w.record_table, w.words
        kb = bytes(records[i]["key"])
        if not locks.try_lock(fd, key_bucket(kb)) or not locks.try_lock(fd, LOCK_SLOT_BASE + i):
            return False
        wi = w.hb_index(i)
        if word_tag(q[wi]) != inc_tag(incarnation):
            return False  # not the incarnation judged (cannot happen under the registry lock)
        q[wi] = 0  # readers see an empty slot from here on
        records[i]["checksum"] = 0  # free: a registrant may take it
        w.drop_cached_record(i)
        bump_reg_gen(w.header)
        return True
    finally:
        os.close(fd)  # drops the slot lock


def forget(w: BoardWords, key: str, timeout_s: float | None = None) -> SlotStatus:
    """Clear the slot of ``key``, DEAD or LEFT (``Board.forget`` says when)."""
    check_key(key)
    with w.registry(timeout_s):
        for i in np.flatnonzero(w.record_table["key"] == key.encode()):
            got = w.slot_at(int(i))
            if got is None or got.key != key:
                continue
            if got.status not in (Status.DEAD, Status.LEFT):
                raise KeyInUse(f"{key!r} is {got.status.value} (pid {got.pid}): only a "
                               "dead or left slot can be forgotten")
            if not clear_slot(w, int(i), got.incarnation):
                raise KeyInUse(f"{key!r} reads dead but its process (pid {got.pid}) "
                               "still holds the slot (hung or stopped?): kill it first")
            log.info("board %s: forgot %r (slot %d, incarnation %d, %s)", w.name, key,
                     int(i), got.incarnation, got.status.value)
            return got
    raise KeyNotFound(f"no slot of board {w.name!r} holds {key!r}: see `shmhb status`")


class ExpiredSlots:
    """Clears the slots that read DEAD or LEFT for the policy's ``forget_after_s``
    (counted from their last beat); the agent's local watch owns one."""

    def __init__(self, w: BoardWords) -> None:
        self._w = w
        self._units = ts_units(int(w.header["forget_after_ns"]))  # 0: off
        self._refused: set[tuple[int, int]] = set()  # (slot, hb word) pairs not to try again

    def forget_expired(self, timeout_s: float = 0.01) -> list[str]:
        """A no-op (one comparison) when the policy has it off, and one vectorised pass
        over the heartbeat words otherwise; never raises for a busy registry (retried
        at the next call).  Returns the keys forgotten."""
        units, refused, w = self._units, self._refused, self._w
        if not units:
            return []
        hb = w.hb_words.copy()
        now = ts_units(w.now_ns())
        old = np.flatnonzero((hb != 0) & (now - hb_ts_array(hb).astype(np.int64) >= units))
        todo = [int(i) for i in old if (int(i), int(hb[i])) not in refused]
        if not todo:
            return []
        out = []
        try:
            with w.registry(timeout_s):
                for i in todo:
                    got = w.slot_at(i)
                    if got is None or got.status not in (Status.DEAD, Status.LEFT):
                        refused.add((i, int(hb[i])))
                        continue
                    if clear_slot(w, i, got.incarnation):
                        out.append(got.key)
                    else:  # its process lives on (hung): not until it is gone
                        refused.add((i, int(hb[i])))
        except LockTimeout:
            return out
        if out:
            log.info("board %s: forgot %d slot(s) dead or left for %g s: %s", w.name,
                     len(out), w.policy.forget_after_s, ", ".join(map(repr, out)))
        if len(refused) > 4 * w.sizes.nslots:
            refused.clear()
        return out
