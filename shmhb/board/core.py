"""The board's mapping, its views and the registry lock.

Two objects share one mapping:

- ``BoardWords``: the words and tables of one mapped board as its writers need them
  (the holder of the agent role, its network half, the settings store, the registrant
  and the forgetting of slots) and the clients of this package that read below the
  public surface (the link reaper, ``shmhb check``, ``shmhb status``).  Writable raw
  views, word indices, the registry lock, the watch table, the validated slot records.
  Its one writer per word rules are ``shmhb.board.layout``'s.  A ``Board`` owns one;
  ``board_words(board)`` hands it to those writers and clients.
- ``BoardCore``: the base of the public ``Board`` (``shmhb.board.handle``), through
  ``LocalReads`` (``shmhb.board.localreads``, the hot local reads): what a reader asks
  of the agent (``agent``, ``agent_fresh``, ``network``, ``stats``), the change counter,
  the capacity.  The hot local reads are a base class of ``Board``, not an object it
  owns, on purpose: ``slot()`` and ``status()`` are bound per instance to the C
  extension's objects, and a delegating object would add a call to the hot path; they
  read the views through private aliases of ``BoardWords``' own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from . import locks, segment
from ..clock import MONOTONIC, Clock
from .config import UNIT_S, Capacity, Policy
from ..errors import BoardCorrupt, InvalidConfig
from .judge import Thresholds, agent_fresh, judge_agent, judge_local
from .layout import (
    HEADER_DTYPE, PEER_ROW_DTYPE, REMOTE_ROW_DTYPE, SLOT_RECORD_DTYPE, SLOT_STRIDE,
    SLOT_WORDS_DTYPE, STAT_NAMES, TERM_WORD, VERDICT_WORD,
    WATCH_ROW_DTYPE, Sizes, agent_pid, hb_ts_array, header_index, inc_tag, record_checksum,
    term_byte, ts_units, word_index, word_tag,
)
from .native import WordMemo
from .netword import decode_network
from .records import RETRIES, SlotInfo, stored_endpoints, stored_key
from .registrylock import RegistryLock, bump_reg_gen
from ..status import AgentStatus, NetworkStatus, SlotStatus, Status
from ..timens import monotonic_offset_ns
from .watchtable import WatchTable

__all__ = ["BoardCore", "BoardWords", "MEMO_ANSWER", "MEMO_EPS", "MEMO_INC", "MEMO_PID",
           "MEMO_SLOTS", "MEMO_TAG", "MEMO_WI", "board_words"]

#: The slots of a ``by_key`` entry, the per-key memo of ``Board.slot()``: a list, not a
#: record, for speed (``slot()`` reads it by position, and so does ``_native.c``, whose
#: ``SHMHB_MEMO_*`` mirror these; tests/board/test_native.py checks that they agree).
MEMO_WI = 0  # the index in the words of the slot's heartbeat word (its verdict follows)
MEMO_TAG = 1  # the incarnation tag the entry was made for
MEMO_PID = 2
MEMO_INC = 3  # the incarnation
MEMO_EPS = 4  # the endpoints
MEMO_ANSWER = 5  # (hb, verdict, now, answer) of the last judgement; native: its Memo
MEMO_SLOTS = 6


class BoardWords:
    """The views of one mapped board, for the writers of its words and this package's
    clients below the public surface (see the module text).  Made by ``BoardCore``."""

    def __init__(self, seg: segment.Segment, clock: Clock = MONOTONIC) -> None:
        self._seg = seg
        self.name = seg.name
        #: this handle's clock (CLOCK_MONOTONIC nanoseconds, or the test's fake)
        self.now_ns: Callable[[], int] = clock.monotonic_ns
        mm = seg.mm
        base = np.frombuffer(mm, dtype=np.uint8, count=1)
        # Alignment is what makes single-word loads and stores atomic: assert it.
        assert base.ctypes.data % 64 == 0, "board mapping is not cache-line aligned"
        #: the segment's mapping (an ``mmap``), for objects that view it themselves
        self.mapping = mm
        #: the header as a 0-d structured array (``layout.HEADER_DTYPE``), writable: for
        #: the holder of the agent role and the settings store, under their rules
        self.header = np.ndarray((), HEADER_DTYPE, buffer=mm)
        h = self.header
        self.sizes = Sizes(int(h["nslots"]), int(h["npeers"]), int(h["nremote"]), int(h["nwatch"]))
        sz = self.sizes
        slot_lines = np.ndarray(sz.nslots, SLOT_WORDS_DTYPE, buffer=mm, offset=sz.slot_off)
        #: the slot records (``layout.SLOT_RECORD_DTYPE``), one per slot
        self.record_table = np.ndarray(sz.nslots, SLOT_RECORD_DTYPE, buffer=mm, offset=sz.record_off)
        #: the peer rows (``layout.PEER_ROW_DTYPE``): the pinger writes them
        self.peer_table = np.ndarray(sz.npeers, PEER_ROW_DTYPE, buffer=mm, offset=sz.peer_off)
        #: the remote rows (``layout.REMOTE_ROW_DTYPE``): the pinger writes them
        self.remote_table = np.ndarray(sz.nremote, REMOTE_ROW_DTYPE, buffer=mm, offset=sz.remote_off)
        #: the watch rows (``layout.WATCH_ROW_DTYPE``), written under the registry lock
        self.watch_table = np.ndarray(sz.nwatch, WATCH_ROW_DTYPE, buffer=mm, offset=sz.watch_off)
        #: every slot's heartbeat word and verdict word (the agent's): strided views,
        #: one word per 64-byte line
        self.hb_words = slot_lines["hb"]
        self.verdict_words = slot_lines["verdict"]
        #: the whole segment as 64-bit words: ``words[i]`` is one aligned 8-byte load or store
        self.words = memoryview(mm).cast("B").cast("Q")
        self.hb0 = word_index(sz.slot_off)  # the index in ``words`` of slot 0's hb word
        self.agent_hb_index = header_index("agent_hb")
        self.agent_id_index = header_index("agent_id")
        #: the indices in ``words`` of the registry's change counter and the agent's
        self.reg_gen_index = header_index("reg_gen")
        self.agent_gen_index = header_index("agent_gen")
        self.policy = _stored_policy(h, self.name)
        self.thresholds = Thresholds(*(ts_units(int(h[f])) for f in (
            "suspect_after_ns", "dead_after_ns", "agent_stale_ns",
            "peer_suspect_after_ns", "peer_dead_after_ns")))
        self.board_inc = int(h["board_inc"])
        #: key -> its memo list for ``Board.slot()`` (slots named MEMO_*)
        self.by_key: dict[str, list[Any]] = {}
        self._rec_cache: dict[int, tuple[int, SlotInfo]] = {}
        self._closed = False
        #: the registry lock itself, for the objects that write under it
        self.registry_lock = RegistryLock(self.name, seg.fd, seg.new_fd)
        #: the C extension whose hot paths this handle uses, or None (set by
        #: ``LocalReads``, which also binds ``word_memo`` and ``oldest_beat_age`` to it)
        self.extension: ModuleType | None = None
        self.watches = WatchTable(self.name, self.watch_table, self.header, self.registry_lock)

    def close(self) -> None:
        """Drop the views of the mapping and close the segment (the board stays for
        other processes); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.watches.close()
        self.registry_lock.close()
        self.by_key.clear()
        for attr in ("header", "record_table", "peer_table", "remote_table", "watch_table",
                     "hb_words", "verdict_words"):
            setattr(self, attr, None)
        self.words.release()
        self._seg.close()

    # -- where the words are ------------------------------------------------------------

    def hb_index(self, i: int) -> int:
        """The index in ``words`` of slot ``i``'s heartbeat word."""
        return self.hb0 + i * SLOT_STRIDE

    def verdict_index(self, i: int) -> int:
        """The index in ``words`` of slot ``i``'s verdict word (the agent's)."""
        return self.hb0 + i * SLOT_STRIDE + VERDICT_WORD

    @property
    def boot_id(self) -> bytes:
        """The boot this board was created in (16 bytes)."""
        return bytes(self.header["boot_id"]).ljust(16, b"\0")

    @property
    def timens_offset_ns(self) -> int:
        """The creator's CLOCK_MONOTONIC offset (time namespace)."""
        return int(self.header["timens_offset_ns"])

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

    # -- locks and the change counter -------------------------------------------------------

    def new_fd(self) -> int:
        """A new open file description of this board's segment (for an OFD lock of the
        caller's own); the caller closes it."""
        return self._seg.new_fd()

    def registry(self, timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold the board's registry lock (``RegistryLock.hold``): the kernel-released
        OFD lock that orders registrations, watches and settings between processes.
        ``LockTimeout`` after ``timeout_s`` (default ``REGISTRY_TIMEOUT_S``)."""
        return self.registry_lock.hold(timeout_s)

    def bump_changes(self, timeout_s: float | None = None) -> None:
        """Move the registry's change counter (under the registry lock) so that readers
        memoising on ``changes()`` look again."""
        with self.registry(timeout_s):
            bump_reg_gen(self.header)

    def word_memo(self, i: int, j: int, k: int) -> Any:
        """A memo of an answer judged from words ``i``, ``j``, ``k`` (see native.WordMemo):
        for the readers that memoise on words (``RemoteReads.remote``)."""
        return WordMemo(self.words, i, j, k)

    # -- the agent ----------------------------------------------------------------------

    def agent_ok_at(self, now: int) -> bool:
        """Whether this host's agent is observing at ``now`` (board time units)."""
        return agent_fresh(self.words[self.agent_hb_index], now, self.thresholds)

    def agent_held(self) -> bool:
        """Whether a live process holds the agent role (a syscall: not for hot paths)."""
        return locks.is_held(self._seg.fd, term_byte(int(self.words[TERM_WORD])))

    def lateness_ms(self) -> float:
        """The role holder's worst loop lateness of the last second."""
        return int(self.header["agent_lateness_us"]) / 1000.0

    # -- slot records ----------------------------------------------------------------------

    def read_slot(self, i: int) -> SlotInfo | None:
        """The validated record of slot ``i`` that matches its heartbeat word, or None if
        the slot is empty or being rewritten."""
        q, recs = self.words, self.record_table
        for _ in range(RETRIES):
            tag = word_tag(q[self.hb0 + i * SLOT_STRIDE])
            if tag == 0:
                return None
            cached = self._rec_cache.get(i)
            if cached is not None and cached[0] == tag:
                return cached[1]
            rec = recs[i].copy()  # one pass over the bytes, then validate the copy
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

    def drop_cached_record(self, i: int) -> None:
        """Forget this handle's copy of slot ``i``'s record (the slot was cleared)."""
        self._rec_cache.pop(i, None)

    def slot_at(self, i: int) -> SlotStatus | None:
        """Slot ``i`` judged now, or None if it is empty or being rewritten."""
        info = self.read_slot(i)
        if info is None:
            return None
        key, pid, inc, eps = info
        wi = self.hb0 + i * SLOT_STRIDE
        hb = self.words[wi]
        if word_tag(hb) != inc_tag(inc):
            return None
        st, age = judge_local(hb, self.words[wi + VERDICT_WORD], ts_units(self.now_ns()),
                              self.thresholds)
        return SlotStatus(key, pid, inc, st, age * UNIT_S, eps)

    def cached_index(self, key: str) -> int | None:
        """The slot index of ``key`` as this handle's last ``slot(key)`` found it, or None
        if it has not looked it up (or found nothing)."""
        c = self.by_key.get(key)
        return None if c is None else (c[MEMO_WI] - self.hb0) // SLOT_STRIDE

    def oldest_beat_age(self, slots: np.ndarray) -> int | None:
        """Board time units since the oldest last beat among the local slots ``slots``
        (an intp array of slot indices; negative if every beat came after the clock
        read), or None for no slots.  One pass, no Python loop: the LinkReaper's check
        whether a tracked slot may have gone stale."""
        if not len(slots):
            return None
        return ts_units(self.now_ns()) - int(hb_ts_array(self.hb_words[slots]).min())


def _stored_policy(h: np.ndarray, name: str) -> Policy:
    """The policy in header ``h`` (invariant 6: the board's, whoever asks)."""
    forget_ns = int(h["forget_after_ns"])  # 0: off
    try:
        return Policy(
            suspect_after_s=int(h["suspect_after_ns"]) / 1e9,
            dead_after_s=int(h["dead_after_ns"]) / 1e9,
            agent_stale_s=int(h["agent_stale_ns"]) / 1e9,
            peer_suspect_after_s=int(h["peer_suspect_after_ns"]) / 1e9,
            peer_dead_after_s=int(h["peer_dead_after_ns"]) / 1e9,
            forget_after_s=forget_ns / 1e9 if forget_ns else None,
        )
    except InvalidConfig as e:
        raise BoardCorrupt(f"board {name!r} holds a policy this shmhb refuses ({e}): "
                           "remove it (`shmhb gc`) and let its users create it again") from None


def board_words(self: BoardCore) -> BoardWords:
    """The ``BoardWords`` of a board: for the writers of its words and this package's
    clients below the public surface, never for workers and readers.  A function of
    ``BoardCore``'s own (hence ``self``), not a method, so that it stays off the public
    ``Board``."""
    return self._w


class BoardCore:
    """The base of ``Board``: the reads of the agent's words and the change counter, and
    the private aliases of the views that the hot local reads load (see the module
    text).  Not used alone."""

    def __init__(self, seg: segment.Segment, clock: Clock = MONOTONIC) -> None:
        w = self._w = BoardWords(seg, clock)
        self.name = w.name
        self.policy = w.policy
        self.thresholds = w.thresholds
        self.sizes = w.sizes
        self.board_inc = w.board_inc
        # the hot paths' aliases of w's views (one attribute load each, no call)
        self._seg = seg
        self._now_ns = w.now_ns
        self._q = w.words
        self._head = w.header
        self._records = w.record_table
        self._hb = w.hb_words
        self._verdict = w.verdict_words
        self._hb0 = w.hb0
        self._by_key = w.by_key
        self._closed = False
        self._ext: ModuleType | None = None  # set by LocalReads._bind_hot_paths

    @property
    def native(self) -> bool:
        """Whether this handle's hot paths are the C extension's (``shmhb.board.native``)."""
        return self._ext is not None

    @property
    def capacity(self) -> Capacity:
        sz = self.sizes
        return Capacity(sz.nslots, sz.npeers, sz.nremote, sz.nwatch)

    def changes(self) -> int:
        """A counter that moves whenever a registration, a leave, a watch or any verdict
        the agent writes changes: equal values mean nothing changed but time."""
        q, w = self._q, self._w
        return q[w.reg_gen_index] + q[w.agent_gen_index]

    def __repr__(self) -> str:
        return f"<shmhb.Board {self.name!r} slots={self.sizes.nslots}>"

    def close(self) -> None:
        """Drop the views of the mapping and close the segment (the board stays for
        other processes); a second call does nothing.  ``Board.close`` first closes
        what it owns, ``LocalReads.close`` the hot paths' objects."""
        if self._closed:
            return
        self._closed = True
        for attr in ("_head", "_records", "_hb", "_verdict"):
            setattr(self, attr, None)
        self._w.close()

    # -- the agent, as readers see it -------------------------------------------------------

    def agent(self) -> AgentStatus:
        """The holder of the host agent role: its pid and whether it is running."""
        q, w = self._q, self._w
        ahb, aid = q[w.agent_hb_index], q[w.agent_id_index]
        now = ts_units(self._now_ns())
        st, age = judge_agent(ahb, now, self.thresholds)
        term = word_tag(ahb)
        pid = agent_pid(aid) if word_tag(aid) == term else 0
        return AgentStatus(pid, st, None if age is None else age * UNIT_S, term)

    def agent_fresh(self) -> bool:
        """Whether this host's agent is observing now (its heartbeat is fresh): when it
        is not, every remote status reads UNKNOWN.  One word and the clock."""
        return self._w.agent_ok_at(ts_units(self._now_ns()))

    def network(self) -> NetworkStatus:
        """The agent's network half (the pinger): listening or not, on which address,
        degraded and why, as the holder of the agent role recorded it."""
        a = self.agent()
        return decode_network(self._head.copy(), a.term, a.status is Status.ALIVE)

    def stats(self) -> dict[str, int]:
        """The agent's counters (pings, acks, bad frames by reason, deaths seen)."""
        vals = self._head["stats"].copy()
        return {n: int(vals[k]) for k, n in enumerate(STAT_NAMES)}
