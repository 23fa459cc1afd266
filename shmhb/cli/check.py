"""One board checker: is every row of a board valid, read as readers read it (no lock)?

``shmhb gc`` names a board whose rows readers would skip, and the chaos harness counts a
row that stays invalid as a breach; both ask this module, so the rules live once.  A row
is valid when (docs in ``shmhb.board.layout``):

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

Pure reads: only the Board's public views (``words``, ``header``, the row tables, the
heartbeat words and ``new_fd`` for asking about slot locks), no lock taken, no word
written, so it can check a board whose registry lock a stopped registrant holds.  Header
validity (magic, version, sizes, policy, boot) is attaching's (``Segment.validate``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from ..board import locks
from ..board.handle import Board
from ..board.core import board_words
from ..board.core import BoardCore
from ..board.layout import (
    LOCK_SLOT_BASE, agent_pid, gen_tag, hb_ts, header_index, inc_tag, peer_checksum,
    record_checksum, remote_checksum, row_code, row_gen, ts_units, verdict_ts, watch_checksum,
    word_tag,
)

RETRIES = 30  # reads of a row that looks invalid: ~0.1 s in all
_CODES = frozenset((1, 2, 3, 4, 5))  # status codes a row may carry
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


def check_rows(board: BoardCore, *, pinger_pids: Collection[int] = ()) -> list[Finding]:
    """Every row of ``board`` that stays invalid while read again for ~0.1 s (see the
    module docstring), in table order.  ``pinger_pids``: the processes that may hold the
    agent role (empty: any)."""
    probe = board_words(board).new_fd()  # an open file description of our own, to ask about slot locks
    try:
        return _check_rows(board, probe, set(pinger_pids))
    finally:
        os.close(probe)


def check_board(name: str, *, pinger_pids: Collection[int] = ()) -> list[Finding]:
    """:func:`check_rows` of the board ``name``, attached for the check and closed after.
    Raises what attaching raises (``BoardNotFound``, ``BoardCorrupt``, ``StaleBoard``, ...)."""
    board = Board.attach(name)
    try:
        return check_rows(board, pinger_pids=pinger_pids)
    finally:
        board.close()


def _status_row(what: str, row: np.void, checksum: Callable[[np.void], int]) -> str | None:
    """The rules peer and remote rows share: a matching checksum (0: a free row), a
    status word of the row's generation, a status code that exists."""
    ck = int(row["checksum"])
    if ck == 0:
        return None
    if ck != checksum(row):
        return f"{what} checksum mismatch"
    gen = gen_tag(int(row["gen"]))
    sw = int(row["status"])
    if row_gen(sw) != gen:
        return f"{what} status word gen {row_gen(sw)} != row gen {gen}"
    code = row_code(sw)
    if code not in _CODES:
        return f"{what} status code {code}"
    return None


def _check_rows(board: BoardCore, probe: int, pinger_pids: set[int]) -> list[Finding]:
    out: list[Finding] = []
    q, head, now_ns = board_words(board).words, board_words(board).header, board_words(board).now_ns
    records = board_words(board).record_table
    agent_hb_i, agent_id_i = header_index("agent_hb"), header_index("agent_id")

    def nowu() -> int:
        return ts_units(now_ns())

    for i in map(int, np.flatnonzero(board_words(board).hb_words.copy())):

        def slot_ok(i: int = i) -> str | None:
            hb = int(q[board_words(board).hb_index(i)])
            tag = word_tag(hb)
            if tag == 0:
                return None
            rec = records[i].copy()
            ck = int(rec["checksum"])
            if not ck:
                return f"hb names incarnation tag {tag} but the record is empty"
            if ck != record_checksum(rec):
                return "record checksum mismatch"
            if inc_tag(int(rec["incarnation"])) != tag:
                return f"hb tag {tag} != record incarnation {int(rec['incarnation'])}"
            if hb_ts(hb) > nowu() + _FUTURE_UNITS:
                return "hb timestamp in the future"
            v = int(q[board_words(board).verdict_index(i)])
            if v and verdict_ts(v) > nowu() + _FUTURE_UNITS:
                return "verdict timestamp in the future"
            return None
        why = _settle(slot_ok)
        if why and locks.is_held(probe, LOCK_SLOT_BASE + i):
            out.append(Finding(f"slot {i}", why))

    def agent_ok() -> str | None:
        ahb, aid = int(q[agent_hb_i]), int(q[agent_id_i])
        if ahb == 0:
            return None
        term = word_tag(ahb)
        if word_tag(aid) != term:
            return f"agent hb term {term} != agent id term {word_tag(aid)}"
        if term > inc_tag(int(head["agent_term"])):
            return f"agent term {term} above the board's counter {int(head['agent_term'])}"
        pid = agent_pid(aid)
        if pinger_pids and pid not in pinger_pids:
            return f"agent pid {pid} is none of this host's pingers {sorted(pinger_pids)}"
        if hb_ts(ahb) > nowu() + _FUTURE_UNITS:
            return "agent timestamp in the future"
        return None
    why = _settle(agent_ok)
    if why:
        out.append(Finding("agent", why))

    peers = board_words(board).peer_table
    for i in map(int, np.flatnonzero(peers["checksum"] != 0)):

        def peer_ok(i: int = i) -> str | None:
            row = peers[i].copy()
            why = _status_row("peer", row, peer_checksum)
            if why or not int(row["checksum"]):
                return why
            gen = gen_tag(int(row["gen"]))
            rtt = int(row["rtt"])
            if rtt and row_gen(rtt) != gen:
                return f"rtt word gen {row_gen(rtt)} != row gen {gen}"
            return None
        why = _settle(peer_ok)
        if why:
            out.append(Finding(f"peer {i}", why))

    rem = board_words(board).remote_table
    for i in map(int, np.flatnonzero(rem["checksum"] != 0)):

        def remote_ok(i: int = i) -> str | None:
            row = rem[i].copy()
            why = _status_row("remote", row, remote_checksum)
            if why or not int(row["checksum"]):
                return why
            p = int(row["peer"])
            if p >= board.sizes.npeers:
                return f"remote row points at peer {p}, beyond the table"
            prow = peers[p].copy()
            if int(prow["checksum"]) == 0 or int(prow["gen"]) != int(row["peer_gen"]):
                return (f"remote row of peer {p} gen {int(row['peer_gen'])}, but that peer row is "
                        + ("empty" if not int(prow["checksum"]) else f"gen {int(prow['gen'])}"))
            return None
        why = _settle(remote_ok)
        if why:
            out.append(Finding(f"remote {i}", why))

    w = board_words(board).watch_table
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


__all__ = ["RETRIES", "Finding", "check_board", "check_rows"]
