"""The board's remote reads: the hosts this host's pinger follows and their workers.

An object that ``Board`` constructs and owns (``Board.peers``, ``peer`` and ``remote``
delegate to it); it is given the tables' views and the board's clock, agent check,
change counter and word memo, and keeps its own memo of ``remote``'s choices.  The
pinger writes the peer and remote rows (``shmhb.net.rowwriter``); these reads take no lock: each
row is copied, its checksum checked, and its status word judged with ``shmhb.board.judge``
together with the agent's freshness, so a stalled or absent agent reads UNKNOWN, never
a stale ALIVE.  ``remote`` memoises its answer on the words it judged
(``native.WordMemo``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .config import UNIT_S, parse_address
from .judge import beat_age, combine_remote, judge_row
from .layout import (
    PEER_ROW_DTYPE, PEER_STRIDE, REMOTE_BEAT_WORD, REMOTE_ROW_DTYPE, REMOTE_STRIDE, Sizes,
    field_word, peer_checksum, remote_checksum, row_ts, rtt_us, ts_units, unpack_auth,
    unpack_capped,
    word_index,
)
from .records import RETRIES, stored_address, stored_endpoints, stored_key
from ..status import PeerStatus, SlotStatus, Status


#: words of a row read alone by ``RemoteReads._rejudge``
REMOTE_GEN_WORD = field_word(REMOTE_ROW_DTYPE, "gen")
REMOTE_CHECKSUM_WORD = field_word(REMOTE_ROW_DTYPE, "checksum")
PEER_CHECKSUM_WORD = field_word(PEER_ROW_DTYPE, "checksum")


class PeerRow(NamedTuple):
    """A peer row as read (``_peer_row``)."""

    address: str
    gen: int
    status: Status
    rtt_ms: float | None
    age_s: float | None  # since its host's last ack; None before the first
    auth: tuple[bool, int]  # (authentication failing, frames that failed it)
    capped: int  # workers its last digest listed that are not stored here
    checksum: int  # of the record fields read (``layout.peer_checksum``)


class RemoteChoice(NamedTuple):
    """What ``RemoteReads.remote`` memoises per endpoint: the remote row it chose, that
    row's generation, its peer row, ``changes()`` when it was chosen, the memo of
    the words judged (``native.WordMemo``), the peer row's generation the remote row
    names, and the answer read whole from that row generation (its record fields, each
    checked by the row's checksum, are what ``RemoteReads._rejudge`` reuses).
    ``remote()`` reads it by position: it is its hot path."""

    row: int
    gen: int
    peer: int
    changes: int
    memo: Any
    read: RowRead


class RowRead(NamedTuple):
    """A remote row read whole (``RemoteReads._remote_at``): what it says, its peer
    row, the peer row's generation, and the checksums of both records as read."""

    status: SlotStatus
    peer: int
    peer_gen: int
    checksum: int
    peer_checksum: int


class RemoteReads:
    """The peer and remote rows of one board handle, read lock-free."""

    def __init__(self, peers: np.ndarray, remotes: np.ndarray, sizes: Sizes, *,
                 now_ns: Callable[[], int], agent_ok: Callable[[int], bool],
                 changes: Callable[[], int], word_memo: Callable[[int, int, int], Any],
                 agent_hb_index: int, words: memoryview) -> None:
        """``peers``, ``remotes``: the board's peer and remote tables; ``now_ns``: its
        clock; ``agent_ok(now in units)``: whether its agent is observing;
        ``changes``: its change counter; ``word_memo(i, j, k)``: a memo of an answer
        judged from words ``i``, ``j``, ``k``; ``agent_hb_index``: the agent's heartbeat
        word, one of the words every answer depends on; ``words``: the board as 64-bit
        words (``Board.words``), for the status words read alone."""
        self._peers = peers
        self._remotes = remotes
        self._now_ns = now_ns
        self._agent_ok = agent_ok
        self._changes = changes
        self._word_memo = word_memo
        self._agent_hb_i = agent_hb_index
        self._q = words
        self._remote_base = word_index(sizes.remote_off)
        self._peer_base = word_index(sizes.peer_off)
        self._cache: dict[str, RemoteChoice] = {}  # endpoint -> its choice

    def clear(self) -> None:
        """Forget the memoised choices (``remote`` looks every endpoint up again)."""
        self._cache.clear()

    def close(self) -> None:
        """Drop the views of the mapping (the board is being closed): from here on the
        tables read empty."""
        self._cache.clear()
        self._peers = np.empty(0, PEER_ROW_DTYPE)
        self._remotes = np.empty(0, REMOTE_ROW_DTYPE)

    def _peer_row(self, i: int, now: int, agent_ok: bool) -> PeerRow | None:
        for _ in range(RETRIES):
            row = self._peers[i].copy()
            ck = int(row["checksum"])
            if ck == 0:
                return None
            if ck != peer_checksum(row):
                continue
            gen = int(row["gen"])
            j = judge_row(int(row["status"]), gen, agent_ok, now)
            if j is None:
                continue
            st, age = j
            us = rtt_us(int(row["rtt"]), gen)
            rtt_ms = None if us is None else us / 1000.0
            last = row_ts(int(row["status"]))
            addr = stored_address(bytes(row["address"]), "peer row", i)
            if addr is None:
                return None
            return PeerRow(addr, gen, st, rtt_ms, age * UNIT_S if last else None,
                           unpack_auth(int(row["auth"]), gen),
                           unpack_capped(int(row["capped"]), gen), ck)
        return None

    def _remote_rows(self, now: int, agent_ok: bool, peer_filter: int | None = None,
                     host_status: dict[int, PeerRow] | None = None,
                     rows: np.ndarray | None = None) -> list[tuple[int, SlotStatus]]:
        """``rows``: a copy of the remote table taken earlier (``peers``)."""
        r = self._remotes.copy() if rows is None else rows
        out = []
        live = np.flatnonzero(r["checksum"] != 0)
        if peer_filter is not None:
            live = live[r["peer"][live] == peer_filter]
        for i in live:
            row = r[int(i)]
            if int(row["checksum"]) != remote_checksum(row):
                continue
            j = judge_row(int(row["status"]), int(row["gen"]), agent_ok, now)
            if j is None:
                continue
            reported, age = j
            p = int(row["peer"])
            hs = (host_status or {}).get(p)
            if hs is None or hs.gen != int(row["peer_gen"]):
                continue  # the row belongs to a peer row that has since been reused
            st = combine_remote(reported, hs.status)
            key = stored_key(bytes(row["key"]), "remote row", int(i))
            if key is None:
                continue
            eps = stored_endpoints(bytes(row["endpoints"]), "remote row", int(i))
            out.append((p, SlotStatus(key, int(row["pid"]), int(row["incarnation"]), st,
                                      _remote_age(age, hs.age_s), eps,
                                      _beat_age_s(row, reported, now))))
        return out

    def peers(self) -> list[PeerStatus]:
        """Every remote host this host's pinger follows, with its workers.

        Each host's capped word (``PeerStatus.rows_capped``: slots it listed that are
        not stored here) is read both before and after the remote rows are copied, and
        counts if either read says so.  Its writer sets it before it gives a row back
        for the host's share of the table and clears it only after every row it counted
        was stored (``shmhb.net.reports.Reports.digest``, each step ``SETTLE_NS`` apart,
        far longer than a store takes to be seen): a row found missing was freed before
        the later read, which then sees the word set, or not yet stored at the earlier
        read, which saw it set.  So a worker without a row here is never read with a
        word that says its host's rows are all stored, whatever order the stores of
        two words reach this reader in and however long this read takes."""
        capped0 = self._peers["capped"].copy()  # before the rows
        rows = self._remotes.copy()
        now = ts_units(self._now_ns())
        ok = self._agent_ok(now)
        heads = {}
        for i in np.flatnonzero(self._peers["checksum"] != 0):
            pr = self._peer_row(int(i), now, ok)
            if pr is not None:
                early = unpack_capped(int(capped0[int(i)]), pr.gen)
                heads[int(i)] = pr._replace(capped=max(pr.capped, early))
        slots: dict[int, list[SlotStatus]] = {i: [] for i in heads}
        for p, s in self._remote_rows(now, ok, host_status=heads, rows=rows):
            slots[p].append(s)
        return [PeerStatus(pr.address, pr.status, pr.rtt_ms, pr.age_s,
                           sorted(slots[i], key=lambda s: s.key), *pr.auth, pr.capped)
                for i, pr in sorted(heads.items(), key=lambda kv: kv[1].address)]

    def peer(self, address: str) -> PeerStatus | None:
        """The remote host at ``address`` ("host" or "host:port" of its pinger)."""
        want = parse_address(address)
        for p in self.peers():
            h, pp = parse_address(p.address)  # valid: peers() skips what is not
            if h == want.host and (want.port is None or pp in (want.port, None)):
                return p
        return None

    def remote(self, endpoint: str) -> SlotStatus | None:
        """The remote worker that advertises ``endpoint``, as this host's pinger last
        heard from its host; None if no followed host reports it."""
        now = ts_units(self._now_ns())
        c = self._cache.get(endpoint)
        if c is not None:
            # The answer depends on the agent's heartbeat, the row's and its host's status
            # words (each names the record generation it belongs to) and the clock unit:
            # while all four read what they read last time, so does the answer.
            # (By position, here and below: this is the hot path of remote().)
            got = c[4].get(now)  # c.memo
            if got is not None:
                return got  # type: ignore[no-any-return]
        ok = self._agent_ok(now)
        if c is not None:
            got = self._rejudge(c, now, ok)
            # A dead or left row stays valid until its slot is reused, but another key
            # may serve the endpoint now: look again, once per board change (so such an
            # answer, which depends on changes() too, is never memoised).
            if got is not None:
                if got.status is not Status.DEAD and got.status is not Status.LEFT:
                    return c[4].put(now, got)  # type: ignore[no-any-return]
                if c[3] == self._changes():  # c.changes
                    return got
        changes = self._changes()
        r = self._remotes
        live = np.flatnonzero(r["checksum"] != 0)
        best: tuple[int, int, RowRead] | None = None
        for row in live:
            i = int(row)
            gen = int(r[i]["gen"])
            at = self._remote_at(i, gen, endpoint, now, ok)
            if at is not None and (best is None or
                                   at.status.incarnation > best[2].status.incarnation):
                best = (i, gen, at)
        if best is None:
            return None
        ri, gen, at = best
        self._cache[endpoint] = RemoteChoice(ri, gen, at.peer, changes, self._word_memo(
            self._agent_hb_i, self._remote_base + ri * REMOTE_STRIDE,
            self._peer_base + at.peer * PEER_STRIDE), at)
        return at.status

    def _rejudge(self, c: RemoteChoice, now: int, ok: bool) -> SlotStatus | None:
        """``c``'s row judged again from its words alone, or None where they no longer
        belong to the row generation ``c`` read whole (then the row is read whole again).

        Why the words suffice: ``c.read`` holds the row's record fields (key, pid,
        incarnation, endpoints, peer) and its peer row's as read whole, each record
        checked by its checksum.  Every writer of a record first zeroes its checksum
        word (a rewrite, a takeover's drop of a torn row: ``rowwriter``), and a
        rewritten record has another checksum, so while both checksum words still read
        what ``c.read`` checked, and the gen word the generation it was read at, the
        records are the ones ``c.read`` holds.  The status and beat words each name
        the generation they belong to (``judge_row``, ``beat_age`` refuse another), the
        peer row's against the peer generation the remote row names.  Each is one
        aligned 64-bit load that needs no order against any other: a rewrite that
        begins after a word was loaded leaves this answer the one the old records gave
        at that moment, never a mix.  The memo missed because the clock moved (or a
        status word changed): a miss's common case, for a few word loads instead of the
        copies and hashes of a whole read."""
        q, rd = self._q, c[5]  # c.read
        base = self._remote_base + c[0] * REMOTE_STRIDE  # c.row
        pbase = self._peer_base + c[2] * PEER_STRIDE  # c.peer
        gen = c[1]
        if (q[base + REMOTE_CHECKSUM_WORD] != rd[3] or q[pbase + PEER_CHECKSUM_WORD] != rd[4]
                or q[base + REMOTE_GEN_WORD] != gen):
            return None
        j = judge_row(q[base], gen, ok, now)
        pw = q[pbase]
        pj = judge_row(pw, rd[2], ok, now)  # rd.peer_gen
        if j is None or pj is None:
            return None
        host_age_s = pj[1] * UNIT_S if row_ts(pw) else None
        units = beat_age(q[base + REMOTE_BEAT_WORD], gen, j[0], now)
        return rd[0]._replace(status=combine_remote(j[0], pj[0]),  # rd.status
                              age_s=_remote_age(j[1], host_age_s),
                              beat_age_s=None if units is None else units * UNIT_S)

    def _remote_at(self, i: int, gen: int, endpoint: str, now: int, ok: bool
                   ) -> RowRead | None:
        """Row ``i`` read whole at generation ``gen``, if it advertises ``endpoint``."""
        row = self._remotes[i].copy()
        if int(row["gen"]) != gen or int(row["checksum"]) != remote_checksum(row):
            return None
        eps = stored_endpoints(bytes(row["endpoints"]), "remote row", i)
        if endpoint not in eps:
            return None
        j = judge_row(int(row["status"]), gen, ok, now)
        if j is None:
            return None
        p = int(row["peer"])
        pr = self._peer_row(p, now, ok)
        if pr is None or pr.gen != int(row["peer_gen"]):
            return None
        key = stored_key(bytes(row["key"]), "remote row", i)
        if key is None:
            return None
        return RowRead(SlotStatus(key, int(row["pid"]), int(row["incarnation"]),
                                  combine_remote(j[0], pr.status), _remote_age(j[1], pr.age_s),
                                  eps, _beat_age_s(row, j[0], now)),
                       p, pr.gen, int(row["checksum"]), pr.checksum)


def _beat_age_s(row: np.void, reported: Status, now: int) -> float | None:
    """The worker's own beat age, where its row's beat word tells it (``judge.beat_age``)."""
    units = beat_age(int(row["beat"]), int(row["gen"]), reported, now)
    return None if units is None else units * UNIT_S


def _remote_age(row_age: int, host_age_s: float | None) -> float:
    """A remote worker's age: since the last report that covered it -- the ack or push
    that wrote its row, or any later ack of its host (an ack whose digest did not change
    confirms every row of that host without rewriting them)."""
    age_s = row_age * UNIT_S
    return age_s if host_age_s is None else min(age_s, host_age_s)
