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
    PEER_ROW_DTYPE, PEER_STRIDE, REMOTE_ROW_DTYPE, REMOTE_STRIDE, Sizes, peer_checksum,
    remote_checksum, row_ts, rtt_us, ts_units, unpack_auth, word_index,
)
from .records import RETRIES, stored_address, stored_endpoints, stored_key
from ..status import PeerStatus, SlotStatus, Status


class PeerRow(NamedTuple):
    """A peer row as read (``_peer_row``)."""

    address: str
    gen: int
    status: Status
    rtt_ms: float | None
    age_s: float | None  # since its host's last ack; None before the first
    auth: tuple[bool, int]  # (authentication failing, frames that failed it)


class RemoteChoice(NamedTuple):
    """What ``RemoteReads.remote`` memoises per endpoint: the remote row it chose, that
    row's generation, its peer row, ``changes()`` when it was chosen, and the memo of
    the words judged (``native.WordMemo``).  ``remote()`` reads it by position: it is
    its hot path."""

    row: int
    gen: int
    peer: int
    changes: int
    memo: Any


class RemoteReads:
    """The peer and remote rows of one board handle, read lock-free."""

    def __init__(self, peers: np.ndarray, remotes: np.ndarray, sizes: Sizes, *,
                 now_ns: Callable[[], int], agent_ok: Callable[[int], bool],
                 changes: Callable[[], int], word_memo: Callable[[int, int, int], Any],
                 agent_hb_index: int) -> None:
        """``peers``, ``remotes``: the board's peer and remote tables; ``now_ns``: its
        clock; ``agent_ok(now in units)``: whether its agent is observing;
        ``changes``: its change counter; ``word_memo(i, j, k)``: a memo of an answer
        judged from words ``i``, ``j``, ``k``; ``agent_hb_index``: the agent's heartbeat
        word, one of the words every answer depends on."""
        self._peers = peers
        self._remotes = remotes
        self._now_ns = now_ns
        self._agent_ok = agent_ok
        self._changes = changes
        self._word_memo = word_memo
        self._agent_hb_i = agent_hb_index
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
                           unpack_auth(int(row["auth"]), gen))
        return None

    def _remote_rows(self, now: int, agent_ok: bool, peer_filter: int | None = None,
                     host_status: dict[int, PeerRow] | None = None,
                     ) -> list[tuple[int, SlotStatus]]:
        r = self._remotes.copy()
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
        """Every remote host this host's pinger follows, with its workers."""
        now = ts_units(self._now_ns())
        ok = self._agent_ok(now)
        heads = {}
        for i in np.flatnonzero(self._peers["checksum"] != 0):
            pr = self._peer_row(int(i), now, ok)
            if pr is not None:
                heads[int(i)] = pr
        slots: dict[int, list[SlotStatus]] = {i: [] for i in heads}
        for p, s in self._remote_rows(now, ok, host_status=heads):
            slots[p].append(s)
        return [PeerStatus(pr.address, pr.status, pr.rtt_ms, pr.age_s,
                           sorted(slots[i], key=lambda s: s.key), *pr.auth)
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
            at = self._remote_at(c[0], c[1], endpoint, now, ok)  # c.row, c.gen
            # A dead or left row stays valid until its slot is reused, but another key
            # may serve the endpoint now: look again, once per board change (so such an
            # answer, which depends on changes() too, is never memoised).
            if at is not None and at[1] == c[2]:  # c.peer
                if at[0].status not in (Status.DEAD, Status.LEFT):
                    return c[4].put(now, at[0])  # type: ignore[no-any-return]
                if c[3] == self._changes():  # c.changes
                    return at[0]
        changes = self._changes()
        r = self._remotes
        live = np.flatnonzero(r["checksum"] != 0)
        best: tuple[int, int, int, SlotStatus] | None = None
        for row in live:
            i = int(row)
            gen = int(r[i]["gen"])
            at = self._remote_at(i, gen, endpoint, now, ok)
            if at is not None and (best is None or at[0].incarnation > best[3].incarnation):
                best = (i, gen, at[1], at[0])
        if best is None:
            return None
        ri, gen, p, got = best
        self._cache[endpoint] = RemoteChoice(ri, gen, p, changes, self._word_memo(
            self._agent_hb_i, self._remote_base + ri * REMOTE_STRIDE,
            self._peer_base + p * PEER_STRIDE))
        return got

    def _remote_at(self, i: int, gen: int, endpoint: str, now: int, ok: bool
                   ) -> tuple[SlotStatus, int] | None:
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
        return SlotStatus(key, int(row["pid"]), int(row["incarnation"]),
                          combine_remote(j[0], pr.status), _remote_age(j[1], pr.age_s), eps,
                          _beat_age_s(row, j[0], now)), p


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
