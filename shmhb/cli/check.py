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
from functools import partial

import numpy as np

from ..board import locks
from ..board.handle import Board
from ..board.core import BoardCore, BoardWords, board_words
from ..board.layout import (
    LOCK_SLOT_BASE, agent_pid, gen_tag, hb_ts, inc_tag, peer_checksum,
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


def _in_future(bw: BoardWords, units: int) -> bool:
    return units > ts_units(bw.now_ns()) + _FUTURE_UNITS


def _slot_problem(bw: BoardWords, i: int) -> str | None:
    """Slot ``i``: its record names the incarnation its heartbeat word names, and no
    timestamp lies in the future."""
    hb = int(bw.words[bw.hb_index(i)])
    tag = word_tag(hb)
    if tag == 0:
        return None
    rec = bw.record_table[i].copy()
    ck = int(rec["checksum"])
    if not ck:
        return f"hb names incarnation tag {tag} but the record is empty"
    if ck != record_checksum(rec):
        return "record checksum mismatch"
    if inc_tag(int(rec["incarnation"])) != tag:
        return f"hb tag {tag} != record incarnation {int(rec['incarnation'])}"
    if _in_future(bw, hb_ts(hb)):
        return "hb timestamp in the future"
    v = int(bw.words[bw.verdict_index(i)])
    if v and _in_future(bw, verdict_ts(v)):
        return "verdict timestamp in the future"
    return None


def _agent_problem(bw: BoardWords, pinger_pids: set[int]) -> str | None:
    """The agent's two words: one term, not above the board's counter, held by one of
    ``pinger_pids`` (empty: any), no timestamp in the future."""
    ahb, aid = int(bw.words[bw.agent_hb_index]), int(bw.words[bw.agent_id_index])
    if ahb == 0:
        return None
    term = word_tag(ahb)
    if word_tag(aid) != term:
        return f"agent hb term {term} != agent id term {word_tag(aid)}"
    counter = int(bw.header["agent_term"])
    if term > inc_tag(counter):
        return f"agent term {term} above the board's counter {counter}"
    pid = agent_pid(aid)
    if pinger_pids and pid not in pinger_pids:
        return f"agent pid {pid} is none of this host's pingers {sorted(pinger_pids)}"
    if _in_future(bw, hb_ts(ahb)):
        return "agent timestamp in the future"
    return None


def _peer_problem(bw: BoardWords, i: int) -> str | None:
    """Peer row ``i``: the shared status-row rules, and an rtt word of its generation."""
    row = bw.peer_table[i].copy()
    why = _status_row("peer", row, peer_checksum)
    if why or not int(row["checksum"]):
        return why
    gen = gen_tag(int(row["gen"]))
    rtt = int(row["rtt"])
    if rtt and row_gen(rtt) != gen:
        return f"rtt word gen {row_gen(rtt)} != row gen {gen}"
    return None


def _remote_problem(bw: BoardWords, i: int) -> str | None:
    """Remote row ``i``: the shared status-row rules, pointing at a live peer row of the
    generation it names."""
    row = bw.remote_table[i].copy()
    why = _status_row("remote", row, remote_checksum)
    if why or not int(row["checksum"]):
        return why
    p = int(row["peer"])
    if p >= bw.sizes.npeers:
        return f"remote row points at peer {p}, beyond the table"
    prow = bw.peer_table[p].copy()
    if int(prow["checksum"]) == 0 or int(prow["gen"]) != int(row["peer_gen"]):
        return (f"remote row of peer {p} gen {int(row['peer_gen'])}, but that peer row is "
                + ("empty" if not int(prow["checksum"]) else f"gen {int(prow['gen'])}"))
    return None


def _watch_problem(bw: BoardWords, i: int) -> str | None:
    """Watch row ``i``: a matching checksum (0: a free row)."""
    row = bw.watch_table[i].copy()
    ck = int(row["checksum"])
    if ck and ck != watch_checksum(row):
        return "watch checksum mismatch"
    return None


def _check_rows(board: BoardCore, probe: int, pinger_pids: set[int]) -> list[Finding]:
    bw = board_words(board)
    out: list[Finding] = []
    for i in map(int, np.flatnonzero(bw.hb_words.copy())):
        why = _settle(partial(_slot_problem, bw, i))
        # a slot whose lock nobody holds: its registrant died registering (module text)
        if why and locks.is_held(probe, LOCK_SLOT_BASE + i):
            out.append(Finding(f"slot {i}", why))
    why = _settle(partial(_agent_problem, bw, pinger_pids))
    if why:
        out.append(Finding("agent", why))
    for what, table, problem in (("peer", bw.peer_table, _peer_problem),
                                 ("remote", bw.remote_table, _remote_problem),
                                 ("watch", bw.watch_table, _watch_problem)):
        for i in map(int, np.flatnonzero(table["checksum"] != 0)):
            why = _settle(partial(problem, bw, i))
            if why:
                out.append(Finding(f"{what} {i}", why))
    return out


__all__ = ["RETRIES", "Finding", "check_board", "check_rows"]
