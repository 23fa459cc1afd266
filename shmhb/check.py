"""One board checker: is every row of a board valid, read as readers read it (no lock)?

``shmhb gc`` names a board whose rows readers would skip, and the chaos harness counts a
row that stays invalid as a breach; both ask this module, so the rules live once.  A row
is valid when (docs in ``shmhb.layout``):

- slot ``i`` whose heartbeat word names an incarnation: its record has a non-zero,
  matching checksum and that very incarnation, and neither its heartbeat nor its
  verdict timestamp lies in the future;
- the agent's two words name the same term, not above the board's term counter, held by
  one of ``pinger_pids`` when given, with no timestamp in the future;
- a peer row with a non-zero checksum: a matching one, a status word (and an rtt word)
  of the row's generation, a status code that exists;
- a remote row with a non-zero checksum: a matching one, a status word of its
  generation, a code that exists, pointing at a peer row inside the table that is live
  with the generation the remote row names;
- a watch row with a non-zero checksum: a matching one.

Writers rewrite a row as "zero the checksum, write the fields, write the checksum", so a
reader can catch a row mid-write: each row that looks invalid is read again for a while
(about 0.1 s) and reported only if it stays so.  A slot whose lock nobody holds is not
reported: its registrant died while registering, readers skip it (the record does not
match the word) and the next registration rewrites it.

Pure reads: the checker maps the segment read-only (``PROT_READ``), takes no lock and
cannot write a word; it needs no ``Board`` handle, so a board a registrant keeps
locked can still be checked.  Header validity (magic, version, sizes, policy, boot) is
``Segment.validate``'s, which this runs first.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from . import locks
from .clock import MONOTONIC, Clock
from .errors import BoardCorrupt, BoardNotFound, BoardPermissionError
from .layout import (
    CODE_MASK,
    CODE_SHIFT,
    GEN_MASK,
    GEN_SHIFT,
    HEADER_BYTES,
    HEADER_DTYPE,
    INC_MASK,
    INC_SHIFT,
    LOCK_SLOT_BASE,
    PEER_ROW_DTYPE,
    REMOTE_ROW_DTYPE,
    SLOT_RECORD_DTYPE,
    SLOT_WORDS_DTYPE,
    TS39_MASK,
    TS40_MASK,
    TS_SHIFT,
    WATCH_ROW_DTYPE,
    Sizes,
    inc_tag,
    peer_checksum,
    record_checksum,
    remote_checksum,
    watch_checksum,
)
from .segment import Segment

RETRIES = 30  # reads of a row that looks invalid: ~0.1 s in all
_CODES = frozenset((1, 2, 3, 4, 5))  # status codes a row may carry
_PID_MASK = (1 << 40) - 1
_FUTURE_UNITS = 2  # clock units a timestamp may lead ours by (rounding)


@dataclass(frozen=True, slots=True)
class Finding:
    """One row that stayed invalid: ``row`` is ``"slot 3"``, ``"agent"``, ``"peer 0"``,
    ``"remote 7"`` or ``"watch 1"``; ``problem`` says what is wrong with it."""

    row: str
    problem: str

    def __str__(self) -> str:
        return f"{self.row}: {self.problem}"


def _settle(check: Callable[[], str | None]) -> str | None:
    why = None
    for k in range(RETRIES):
        why = check()
        if why is None:
            return None
        time.sleep(0.0002 * (k + 1))
    return why


class _Tables:
    """Read-only views of one mapped board: its header, words and row tables."""

    def __init__(self, seg: Segment) -> None:
        h = np.ndarray((), HEADER_DTYPE, buffer=seg.mm)
        self.head = h
        self.sizes = sz = Sizes(int(h["nslots"]), int(h["npeers"]), int(h["nremote"]),
                                int(h["nwatch"]))
        self.q = memoryview(seg.mm).cast("B").cast("Q")  # q[i]: one aligned 8-byte load
        self.hb = np.ndarray(sz.nslots, SLOT_WORDS_DTYPE, buffer=seg.mm, offset=sz.slot_off)["hb"]
        self.records = np.ndarray(sz.nslots, SLOT_RECORD_DTYPE, buffer=seg.mm, offset=sz.record_off)
        self.peers = np.ndarray(sz.npeers, PEER_ROW_DTYPE, buffer=seg.mm, offset=sz.peer_off)
        self.remotes = np.ndarray(sz.nremote, REMOTE_ROW_DTYPE, buffer=seg.mm, offset=sz.remote_off)
        self.watches = np.ndarray(sz.nwatch, WATCH_ROW_DTYPE, buffer=seg.mm, offset=sz.watch_off)
        fields = HEADER_DTYPE.fields
        assert fields is not None
        self.hb0 = sz.slot_off // 8
        self.agent_hb_i = fields["agent_hb"][1] // 8
        self.agent_id_i = fields["agent_id"][1] // 8

    def release(self) -> None:
        self.q.release()
        del self.head, self.hb, self.records, self.peers, self.remotes, self.watches


def _map_read_only(name: str) -> Segment:
    """The board ``name`` mapped read-only, its header validated."""
    path = os.path.join("/dev/shm", name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BoardNotFound(f"no board {name!r} (nothing at {path})") from None
    except PermissionError:
        raise BoardPermissionError(f"cannot read board {name!r}: run as its owner") from None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise BoardCorrupt(f"{name!r} is {size} bytes, too small for a board: it is not a "
                               "shmhb board, was truncated or was never finished")
        seg = Segment(name, fd, mmap.mmap(fd, size, prot=mmap.PROT_READ))
    except BaseException:
        os.close(fd)
        raise
    try:
        seg.validate()
    except BaseException:
        seg.close()
        raise
    return seg


def check_board(name: str, *, pinger_pids: Collection[int] = (),
                clock: Clock = MONOTONIC) -> list[Finding]:
    """Every row of the board ``name`` that stays invalid while read again for ~0.1 s
    (see the module docstring), in table order.  ``pinger_pids``: the processes that may
    hold the agent role (empty: any).  Raises the header's errors (``BoardNotFound``,
    ``BoardCorrupt``, ``StaleBoard``, ...) as attaching would."""
    seg = _map_read_only(name)
    t = _Tables(seg)
    try:
        return _check_rows(t, seg.fd, set(pinger_pids), clock)
    finally:
        t.release()
        seg.close()


def _status_row(what: str, row: np.void, checksum: Callable[[np.void], int]) -> str | None:
    """The rules peer and remote rows share: a matching checksum (0: a free row), a
    status word of the row's generation, a status code that exists."""
    ck = int(row["checksum"])
    if ck == 0:
        return None
    if ck != checksum(row):
        return f"{what} checksum mismatch"
    gen = int(row["gen"]) & GEN_MASK
    sw = int(row["status"])
    if (sw >> GEN_SHIFT) & GEN_MASK != gen:
        return f"{what} status word gen {(sw >> GEN_SHIFT) & GEN_MASK} != row gen {gen}"
    code = (sw >> CODE_SHIFT) & CODE_MASK
    if code not in _CODES:
        return f"{what} status code {code}"
    return None


def _check_rows(t: _Tables, fd: int, pinger_pids: set[int], clock: Clock) -> list[Finding]:
    out: list[Finding] = []
    q = t.q

    def nowu() -> int:
        return clock.monotonic_ns() >> TS_SHIFT

    for i in map(int, np.flatnonzero(t.hb.copy())):

        def slot_ok(i: int = i) -> str | None:
            hb = int(q[t.hb0 + i * 8])
            tag = hb >> INC_SHIFT
            if tag == 0:
                return None
            rec = t.records[i].copy()
            ck = int(rec["checksum"])
            if not ck:
                return f"hb names incarnation tag {tag} but the record is empty"
            if ck != record_checksum(rec):
                return "record checksum mismatch"
            if inc_tag(int(rec["incarnation"])) != tag:
                return f"hb tag {tag} != record incarnation {int(rec['incarnation'])}"
            if (hb & TS39_MASK) > nowu() + _FUTURE_UNITS:
                return "hb timestamp in the future"
            v = int(q[t.hb0 + i * 8 + 1])
            if v and (v & TS40_MASK) > nowu() + _FUTURE_UNITS:
                return "verdict timestamp in the future"
            return None
        why = _settle(slot_ok)
        if why and locks.is_held(fd, LOCK_SLOT_BASE + i):
            out.append(Finding(f"slot {i}", why))

    def agent_ok() -> str | None:
        ahb, aid = int(q[t.agent_hb_i]), int(q[t.agent_id_i])
        if ahb == 0:
            return None
        term = ahb >> INC_SHIFT
        if aid >> INC_SHIFT != term:
            return f"agent hb term {term} != agent id term {aid >> INC_SHIFT}"
        if term > (int(t.head["agent_term"]) & INC_MASK):
            return f"agent term {term} above the board's counter {int(t.head['agent_term'])}"
        pid = aid & _PID_MASK
        if pinger_pids and pid not in pinger_pids:
            return f"agent pid {pid} is none of this host's pingers {sorted(pinger_pids)}"
        if (ahb & TS39_MASK) > nowu() + _FUTURE_UNITS:
            return "agent timestamp in the future"
        return None
    why = _settle(agent_ok)
    if why:
        out.append(Finding("agent", why))

    peers = t.peers
    for i in map(int, np.flatnonzero(peers["checksum"] != 0)):

        def peer_ok(i: int = i) -> str | None:
            row = peers[i].copy()
            why = _status_row("peer", row, peer_checksum)
            if why or not int(row["checksum"]):
                return why
            gen = int(row["gen"]) & GEN_MASK
            rtt = int(row["rtt"])
            if rtt and rtt >> GEN_SHIFT != gen:
                return f"rtt word gen {rtt >> GEN_SHIFT} != row gen {gen}"
            return None
        why = _settle(peer_ok)
        if why:
            out.append(Finding(f"peer {i}", why))

    rem = t.remotes
    for i in map(int, np.flatnonzero(rem["checksum"] != 0)):

        def remote_ok(i: int = i) -> str | None:
            row = rem[i].copy()
            why = _status_row("remote", row, remote_checksum)
            if why or not int(row["checksum"]):
                return why
            p = int(row["peer"])
            if p >= t.sizes.npeers:
                return f"remote row points at peer {p}, beyond the table"
            prow = peers[p].copy()
            if int(prow["checksum"]) == 0 or int(prow["gen"]) != int(row["peer_gen"]):
                return (f"remote row of peer {p} gen {int(row['peer_gen'])}, but that peer row is "
                        + ("empty" if not int(prow["checksum"]) else f"gen {int(prow['gen'])}"))
            return None
        why = _settle(remote_ok)
        if why:
            out.append(Finding(f"remote {i}", why))

    w = t.watches
    for i in map(int, np.flatnonzero(w["checksum"] != 0)):

        def watch_ok(i: int = i) -> str | None:
            row = w[i].copy()
            ck = int(row["checksum"])
            if ck and ck != watch_checksum(row):
                return "watch checksum mismatch"
            return None
        why = _settle(watch_ok)
        if why:
            out.append(Finding(f"watch {i}", why))
    return out


__all__ = ["RETRIES", "Finding", "check_board"]
