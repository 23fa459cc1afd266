"""The board's hot local reads: ``slot``, ``status``, ``slots``, ``snapshot``, and the
per-key memo behind ``slot``.

A base class of ``Board``, not an object it owns (see ``shmhb.board.core`` for why): it
reads the views that ``BoardCore`` aliases and adds no instance attribute of its own but
those ``_bind_hot_paths`` binds.  Readers take no lock and make no syscall but the
clock: they load single aligned 64-bit words and judge them with ``shmhb.board.judge``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from . import segment
from .core import MEMO_ANSWER, MEMO_EPS, MEMO_INC, MEMO_PID, MEMO_SLOTS, MEMO_TAG, MEMO_WI, BoardCore
from ..clock import MONOTONIC, Clock
from .config import UNIT_S
from .judge import judge_local
from .layout import INC_SHIFT, SLOT_STRIDE, TS_SHIFT, VERDICT_WORD, inc_tag, ts_units, word_tag
from .native import clock_arg, extension
from ..status import SlotStatus, Status

__all__ = ["LocalReads", "MEMO_ANSWER", "MEMO_EPS", "MEMO_INC", "MEMO_PID", "MEMO_SLOTS",
           "MEMO_TAG", "MEMO_WI"]

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
        with the extension, ``slot``, ``status``, ``changes`` and ``BoardWords.oldest_beat_age``
        are its acquire loads and ``remote`` memoises through its ``WordMemo``; without it,
        the methods as written run.  Both judge the same words alike."""
        w = self._w
        self._ext = w.extension = ext
        if ext is None:
            return
        clk = clock_arg(self._now_ns)
        words = ext.Words(self._seg.mm, w.reg_gen_index, w.agent_gen_index, self._hb0,
                          self.sizes.nslots, clk)
        reader = ext.SlotReader(self._seg.mm, self._by_key, self._slot_slow,
                                self.thresholds.suspect, self.thresholds.dead,
                                (None, *(Status.from_code(c) for c in range(1, 6))),
                                SlotStatus, UNIT_S, clk)
        self.slot = reader.slot  # type: ignore[method-assign]
        self.status = reader.status  # type: ignore[method-assign]
        self.changes = words.changes  # type: ignore[method-assign]
        w.oldest_beat_age = words.oldest_age  # type: ignore[method-assign]
        w.word_memo = words.memo  # type: ignore[method-assign]

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
            got = self._w.read_slot(int(i))
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

    def slots(self) -> list[SlotStatus]:
        """Every registered local slot, judged now."""
        hbs = self._hb.copy()
        verdicts = self._verdict.copy()
        now = ts_units(self._now_ns())
        out = []
        for i0 in np.flatnonzero(hbs):
            i = int(i0)
            info = self._w.read_slot(i)
            if info is None:
                continue
            key, pid, inc, eps = info
            hb = int(hbs[i])
            if word_tag(hb) != inc_tag(inc):
                hb = self._q[self._hb0 + i * SLOT_STRIDE]
            st, age = judge_local(hb, int(verdicts[i]), now, self.thresholds)
            out.append(SlotStatus(key, pid, inc, st, age * UNIT_S, eps))
        return out

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.uint64]:
        """Vectorised view of every slot: (hb words, verdict words, now) for
        ``judge.judge_local_array``; the cheap way to scan a large board."""
        return self._hb.copy(), self._verdict.copy(), np.uint64(ts_units(self._now_ns()))
