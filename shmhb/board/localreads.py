"""The board's hot local reads: ``slot``, ``status``, ``slots``, ``snapshot``,
``oldest_beat_age``, and the per-key memo behind ``slot``.

A base class of ``Board``, not an object it owns (see ``shmhb.board.core`` for why): it
reads the views that ``BoardCore`` sets up and adds no instance attribute of its own but
those ``_bind_hot_paths`` binds.  Readers take no lock and make no syscall but the
clock: they load single aligned 64-bit words and judge them with ``shmhb.board.judge``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from . import segment
from .core import BoardCore
from ..clock import MONOTONIC, Clock
from .config import UNIT_S
from .judge import judge_local
from .layout import (
    INC_SHIFT, SLOT_STRIDE, TS_SHIFT, VERDICT_WORD, hb_ts_array, inc_tag, record_checksum,
    ts_units, word_tag,
)
from .native import clock_arg, extension
from .records import RETRIES, SlotInfo, stored_endpoints, stored_key
from ..status import SlotStatus, Status

#: The slots of a ``_by_key`` entry, the per-key memo of ``slot()``: a list, not a
#: record, for speed (``slot()`` reads it by position, and so does ``_native.c``, whose
#: ``SHMHB_MEMO_*`` mirror these; tests/board/test_native.py checks that they agree).
MEMO_WI = 0  # the index in the words of the slot's heartbeat word (its verdict follows)
MEMO_TAG = 1  # the incarnation tag the entry was made for
MEMO_PID = 2
MEMO_INC = 3  # the incarnation
MEMO_EPS = 4  # the endpoints
MEMO_ANSWER = 5  # (hb, verdict, now, answer) of the last judgement; native: its Memo
MEMO_SLOTS = 6
_NO_ANSWER = (-1, -1, -1, None)


class LocalReads(BoardCore):
    """The local slots, read lock-free (a base class of ``Board``)."""

    def __init__(self, seg: segment.Segment, clock: Clock = MONOTONIC) -> None:
        super().__init__(seg, clock)
        self._bind_hot_paths(extension())

    def close(self) -> None:
        """Forget the memo and give back the C objects' exports of the mapping, then
        close the core (``BoardCore.close``)."""
        if self._closed:
            return
        self._by_key.clear()
        if self._ext is not None:
            self.slot.__self__.release()  # type: ignore[attr-defined]
            self.changes.__self__.release()  # type: ignore[attr-defined]
        super().close()

    def _bind_hot_paths(self, ext: ModuleType | None) -> None:
        """The one switch between the C and the pure-Python hot paths (``shmhb.board.native``):
        with the extension, ``slot``, ``status``, ``changes`` and ``oldest_beat_age`` are its
        acquire loads and ``remote`` memoises through its ``WordMemo``; without it,
        the methods below run as written.  Both judge the same words alike."""
        self._ext = ext
        if ext is None:
            return
        clk = clock_arg(self._now_ns)
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
        self.word_memo = words.memo  # type: ignore[method-assign]

    def slot(self, key: str) -> SlotStatus | None:
        """The worker registered under ``key`` on this host, judged now; None if absent.

        Hot path: two single-word loads and a clock read.  Judging is a pure function
        of (heartbeat word, verdict word, now in units), so when all three are what the
        previous call saw, the previous answer is returned as it is.
        """
        c = self._by_key.get(key)
        if c is not None:  # by position, as literals (the hot path): MEMO_* name them
            q = self._q
            i = c[0]  # MEMO_WI
            hb = q[i]
            v = q[i + 1]
            now = self._now_ns() >> TS_SHIFT
            m = c[5]  # MEMO_ANSWER, replaced whole: threads may share c
            if hb == m[0] and v == m[1] and now == m[2]:
                return m[3]  # type: ignore[no-any-return]
            if hb >> INC_SHIFT == c[1]:  # MEMO_TAG
                st, age = judge_local(hb, v, now, self.thresholds)
                r = SlotStatus(key, c[2], c[3], st, age * UNIT_S, c[4])  # PID, INC, EPS
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
            got = self.read_slot(int(i))
            if got is not None and got.key == key:
                _, pid, inc, eps = got
                wi = self._hb0 + int(i) * SLOT_STRIDE
                entry: list[Any] = [None] * MEMO_SLOTS
                entry[MEMO_WI], entry[MEMO_TAG], entry[MEMO_PID] = wi, inc_tag(inc), pid
                entry[MEMO_INC], entry[MEMO_EPS], entry[MEMO_ANSWER] = inc, eps, _NO_ANSWER
                self._by_key[key] = entry
                hb = self._q[wi]
                if word_tag(hb) == inc_tag(inc):
                    st, age = judge_local(hb, self._q[wi + VERDICT_WORD], ts_units(self._now_ns()),
                                          self.thresholds)
                    return SlotStatus(key, pid, inc, st, age * UNIT_S, eps)
        self._by_key.pop(key, None)
        return None

    def read_slot(self, i: int) -> SlotInfo | None:
        """The validated record of slot ``i`` that matches its heartbeat word, or None if
        the slot is empty or being rewritten."""
        for _ in range(RETRIES):
            tag = word_tag(self._q[self._hb0 + i * SLOT_STRIDE])
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
                info = SlotInfo(key, int(rec["pid"]), int(rec["incarnation"]),
                                stored_endpoints(bytes(rec["endpoints"]), "slot", i))
                self._rec_cache[i] = (tag, info)
                return info
        return None

    def slots(self) -> list[SlotStatus]:
        """Every registered local slot, judged now."""
        hbs = self._hb.copy()
        verdicts = self._verdict.copy()
        now = ts_units(self._now_ns())
        out = []
        for i0 in np.flatnonzero(hbs):
            i = int(i0)
            info = self.read_slot(i)
            if info is None:
                continue
            key, pid, inc, eps = info
            hb = int(hbs[i])
            if word_tag(hb) != inc_tag(inc):
                hb = self._q[self._hb0 + i * SLOT_STRIDE]
            st, age = judge_local(hb, int(verdicts[i]), now, self.thresholds)
            out.append(SlotStatus(key, pid, inc, st, age * UNIT_S, eps))
        return out

    def cached_index(self, key: str) -> int | None:
        """The slot index of ``key`` as this handle's last ``slot(key)`` found it, or None
        if it has not looked it up (or found nothing)."""
        c = self._by_key.get(key)
        return None if c is None else (c[MEMO_WI] - self._hb0) // SLOT_STRIDE

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.uint64]:
        """Vectorised view of every slot: (hb words, verdict words, now) for
        ``judge.judge_local_array``; the cheap way to scan a large board."""
        return self._hb.copy(), self._verdict.copy(), np.uint64(ts_units(self._now_ns()))

    def oldest_beat_age(self, slots: np.ndarray) -> int | None:
        """Board time units since the oldest last beat among the local slots ``slots``
        (an intp array of slot indices; negative if every beat came after the clock
        read), or None for no slots.  One pass, no Python loop: the LinkReaper's check
        whether a tracked slot may have gone stale."""
        if not len(slots):
            return None
        return ts_units(self._now_ns()) - int(hb_ts_array(self._hb[slots]).min())

    def drop_cached_record(self, i: int) -> None:
        """Forget this handle's copy of slot ``i``'s record (the slot was cleared)."""
        self._rec_cache.pop(i, None)

    def slot_at(self, i: int) -> SlotStatus | None:
        """Slot ``i`` judged now, or None if it is empty or being rewritten."""
        info = self.read_slot(i)
        if info is None:
            return None
        key, pid, inc, eps = info
        wi = self._hb0 + i * SLOT_STRIDE
        hb = self._q[wi]
        if word_tag(hb) != inc_tag(inc):
            return None
        st, age = judge_local(hb, self._q[wi + VERDICT_WORD], ts_units(self._now_ns()),
                              self.thresholds)
        return SlotStatus(key, pid, inc, st, age * UNIT_S, eps)

