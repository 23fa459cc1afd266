"""The board's mapping, its views and the registry lock: what ``Board`` and the objects
it owns share.

``BoardCore`` sets up the segment's views (header, slot words and records, peer, remote
and watch tables), the word indices of the header, the registry lock
(``shmhb.board.registrylock``), the change counter, the agent's header as readers see
it, and the small public surface that this package's writers use (the agent's header
writer, the local watch, the row writer, the settings store) instead of reaching into
private members.

``Board`` (``shmhb.board.handle``) subclasses it, through ``LocalReads``
(``shmhb.board.localreads``, the hot local reads), and adds the lifecycle and
registration.  The hot local reads are a base class of ``Board``, not an object it owns,
on purpose: ``slot()`` and ``status()`` are bound per instance to the C extension's
objects, and a delegating object would add a call to the hot path.  The colder concerns
are objects the board constructs and owns, each with its own state and ``close()``: the
watch table (``shmhb.board.watchtable``) and the remote reads
(``shmhb.board.remotereads``).

Instance attributes are all set here, in ``LocalReads._bind_hot_paths`` and in
``Board.__init__``, in one order: add none lightly.  CPython 3.11 shares an instance
dict's keys only up to 30 of them; a board handle on the C path has 36 (as many as
before the watch table and the remote reads became objects), so attribute loads on the
pure-Python hot path take the slower dict path.
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
from .agentterm import TERM_WORD, term_byte
from ..errors import BoardCorrupt, InvalidConfig
from .judge import Thresholds, agent_fresh, judge_agent
from .layout import (
    HEADER_DTYPE, PEER_ROW_DTYPE, REMOTE_ROW_DTYPE,
    SLOT_RECORD_DTYPE, SLOT_STRIDE, SLOT_WORDS_DTYPE, STAT_NAMES, VERDICT_WORD,
    WATCH_ROW_DTYPE, Sizes, agent_pid, header_index, ts_units, word_index, word_tag,
)
from .native import WordMemo
from .netword import decode_network
from .records import SlotInfo
from .registrylock import RegistryLock, bump_reg_gen
from ..status import AgentStatus, NetworkStatus, Status

class BoardCore:
    """The views of one mapped board; see the module docstring.  Not used alone."""

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
        self._hb0 = word_index(sz.slot_off)
        self._agent_hb_i = header_index("agent_hb")
        self._agent_id_i = header_index("agent_id")
        self._reg_gen_i = header_index("reg_gen")
        self._agent_gen_i = header_index("agent_gen")
        forget_ns = int(h["forget_after_ns"])  # 0: off
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
        self.thresholds = Thresholds(*(ts_units(int(h[f])) for f in (
            "suspect_after_ns", "dead_after_ns", "agent_stale_ns",
            "peer_suspect_after_ns", "peer_dead_after_ns")))
        self.board_inc = int(h["board_inc"])
        # key -> its memo list for the hot path (slots named in localreads: MEMO_*)
        self._by_key: dict[str, list[Any]] = {}
        self._rec_cache: dict[int, tuple[int, SlotInfo]] = {}
        self._closed = False
        self._lock = RegistryLock(self.name, seg.fd, seg.new_fd)
        self._ext: ModuleType | None = None  # set by LocalReads._bind_hot_paths

    @property
    def native(self) -> bool:
        """Whether this handle's hot paths are the C extension's (``shmhb.board.native``)."""
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
    def timens_offset_ns(self) -> int:
        """The creator's CLOCK_MONOTONIC offset (time namespace)."""
        return int(self._head["timens_offset_ns"])


    # -- the surface this package's writers use (one writer per word: see layout.py) -----

    @property
    def words(self) -> memoryview:
        """The whole segment as 64-bit words (``q[i]`` is one aligned 8-byte load or
        store): the raw view for the writers of this package's words."""
        return self._q

    @property
    def header(self) -> np.ndarray:
        """The header as a 0-d structured array (``layout.HEADER_DTYPE``), writable: for
        the holder of the agent role and the settings store, under their rules."""
        return self._head

    @property
    def record_table(self) -> np.ndarray:
        """The slot records (``layout.SLOT_RECORD_DTYPE``), one per slot."""
        return self._records

    @property
    def peer_table(self) -> np.ndarray:
        """The peer rows (``layout.PEER_ROW_DTYPE``): the pinger writes them."""
        return self._peers

    @property
    def remote_table(self) -> np.ndarray:
        """The remote rows (``layout.REMOTE_ROW_DTYPE``): the pinger writes them."""
        return self._remotes

    @property
    def watch_table(self) -> np.ndarray:
        """The watch rows (``layout.WATCH_ROW_DTYPE``), written under the registry lock."""
        return self._watches

    @property
    def hb_words(self) -> np.ndarray:
        """Every slot's heartbeat word (a strided view, one word per 64-byte line)."""
        return self._hb

    @property
    def verdict_words(self) -> np.ndarray:
        """Every slot's verdict word (the agent's), strided like ``hb_words``."""
        return self._verdict

    def hb_index(self, i: int) -> int:
        """The index in ``words`` of slot ``i``'s heartbeat word."""
        return self._hb0 + i * SLOT_STRIDE

    def verdict_index(self, i: int) -> int:
        """The index in ``words`` of slot ``i``'s verdict word (the agent's)."""
        return self._hb0 + i * SLOT_STRIDE + VERDICT_WORD

    @property
    def reg_gen_index(self) -> int:
        """The index in ``words`` of the registry's change counter."""
        return self._reg_gen_i

    @property
    def now_ns(self) -> Callable[[], int]:
        """This handle's clock (CLOCK_MONOTONIC nanoseconds, or the test's fake)."""
        return self._now_ns

    @property
    def mapping(self) -> Any:
        """The segment's mapping (an ``mmap``), for objects that view it themselves."""
        return self._seg.mm

    @property
    def extension(self) -> ModuleType | None:
        """The C extension whose hot paths this handle uses, or None (``shmhb.board.native``)."""
        return self._ext

    def new_fd(self) -> int:
        """A new open file description of this board's segment (for an OFD lock of the
        caller's own); the caller closes it."""
        return self._seg.new_fd()

    def bump_changes(self, timeout_s: float | None = None) -> None:
        """Move the registry's change counter (under the registry lock) so that readers
        memoising on ``changes()`` look again."""
        with self.registry(timeout_s):
            bump_reg_gen(self._head)

    def changes(self) -> int:
        """A counter that moves whenever a registration, a leave, a watch or any verdict
        the agent writes changes: equal values mean nothing changed but time."""
        q = self._q
        return q[self._reg_gen_i] + q[self._agent_gen_i]

    def word_memo(self, i: int, j: int, k: int) -> Any:
        """A memo of an answer judged from words ``i``, ``j``, ``k`` (see native.WordMemo):
        for the readers that memoise on words (``RemoteReads.remote``)."""
        return WordMemo(self._q, i, j, k)

    def __repr__(self) -> str:
        return f"<shmhb.Board {self.name!r} slots={self.sizes.nslots}>"

    def close(self) -> None:
        """Drop the views of the mapping and close the segment (the board stays for
        other processes); a second call does nothing.  ``Board.close`` first closes
        what it owns, ``LocalReads.close`` the hot paths' objects."""
        if self._closed:
            return
        self._closed = True
        self._lock.close()
        for attr in ("_head", "_words", "_records", "_peers", "_remotes", "_watches",
                     "_hb", "_verdict"):
            setattr(self, attr, None)
        self._q.release()
        self._seg.close()

    def registry(self, timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold the board's registry lock (``RegistryLock.hold``): the kernel-released
        OFD lock that orders registrations, watches and settings between processes.
        ``LockTimeout`` after ``timeout_s`` (default ``REGISTRY_TIMEOUT_S``)."""
        return self._lock.hold(timeout_s)

    @property
    def registry_lock(self) -> RegistryLock:
        """The registry lock itself, for the objects that write under it."""
        return self._lock


    # -- the agent, as readers see it -------------------------------------------------------

    def agent_ok_at(self, now: int) -> bool:
        """Whether this host's agent is observing at ``now`` (board time units)."""
        return agent_fresh(self._q[self._agent_hb_i], now, self.thresholds)

    def agent(self) -> AgentStatus:
        """The holder of the host agent role: its pid and whether it is running."""
        q = self._q
        ahb, aid = q[self._agent_hb_i], q[self._agent_id_i]
        now = ts_units(self._now_ns())
        st, age = judge_agent(ahb, now, self.thresholds)
        term = word_tag(ahb)
        pid = agent_pid(aid) if word_tag(aid) == term else 0
        return AgentStatus(pid, st, None if age is None else age * UNIT_S, term)

    def agent_fresh(self) -> bool:
        """Whether this host's agent is observing now (its heartbeat is fresh): when it
        is not, every remote status reads UNKNOWN.  One word and the clock."""
        return self.agent_ok_at(ts_units(self._now_ns()))

    def network(self) -> NetworkStatus:
        """The agent's network half (the pinger): listening or not, on which address,
        degraded and why, as the holder of the agent role recorded it."""
        a = self.agent()
        return decode_network(self._head.copy(), a.term, a.status is Status.ALIVE)

    def agent_held(self) -> bool:
        """Whether a live process holds the agent role (a syscall: not for hot paths)."""
        return locks.is_held(self._seg.fd, term_byte(int(self._q[TERM_WORD])))

    def stats(self) -> dict[str, int]:
        """The agent's counters (pings, acks, bad frames by reason, deaths seen)."""
        vals = self._head["stats"].copy()
        return {n: int(vals[k]) for k, n in enumerate(STAT_NAMES)}

    def lateness_ms(self) -> float:
        return int(self._head["agent_lateness_us"]) / 1000.0
