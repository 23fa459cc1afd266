"""The agent's writes to the board's peer and remote tables.

Only the holder of the agent role calls these.  Each row has a record (several words,
checksummed) and a status word ``gen:20 | code:4 | ts:40`` that names the record
generation it belongs to.  To change a record: zero its checksum, write the fields,
write the new checksum, then the status word with the new generation.  A reader that
catches any intermediate state sees a bad checksum or a generation mismatch and retries
or skips the row; it never combines halves of two records.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ..board.handle import Board
from ..board.core import board_words
from ..board.layout import (
    ENDPOINTS_BYTES, KEY_BYTES, PEER_AUTH_WORD, PEER_CAPPED_WORD, PEER_RTT_WORD, PEER_STRIDE, REMOTE_BEAT_WORD,
    REMOTE_STRIDE,
    encode_endpoints, next_gen, pack_auth, pack_capped, pack_row, pack_rtt, peer_checksum, remote_checksum,
    ts_units, unpack_auth, unpack_capped, unpack_row, word_index,
)
from .protocol import DigestEntry, Identity
from ..status import Status

log = logging.getLogger(__name__)


class RemoteRow(NamedTuple):
    """A remote row this holder wrote for a followed host's slot (``Target.remotes``)."""

    row: int
    gen: int
    incarnation: int


class RowWriter:
    def __init__(self, board: Board) -> None:
        self.b = board
        self.bw = board_words(board)
        self._q = board_words(board).words
        sz = board.sizes
        self._peer0 = word_index(sz.peer_off)
        self._remote0 = word_index(sz.remote_off)

    # -- peers ------------------------------------------------------------------------------

    def adopt_peers(self) -> dict[str, tuple[int, int]]:
        """Valid peer rows left by an earlier holder: address -> (row, gen)."""
        out = {}
        for i in np.flatnonzero(self.bw.peer_table["checksum"] != 0):
            row = self.bw.peer_table[int(i)]
            if int(row["checksum"]) == peer_checksum(row):
                out[bytes(row["address"]).decode()] = (int(i), int(row["gen"]))
            else:
                row["checksum"] = 0
        return out

    def adopt_remotes(self, peer_row: int, peer_gen: int) -> dict[str, RemoteRow]:
        """Valid remote rows of a peer, by key."""
        r = self.bw.remote_table
        out = {}
        for i in np.flatnonzero((r["checksum"] != 0) & (r["peer"] == peer_row)):
            row = r[int(i)]
            if int(row["checksum"]) == remote_checksum(row) and int(row["peer_gen"]) == peer_gen:
                out[bytes(row["key"]).decode()] = RemoteRow(int(i), int(row["gen"]),
                                                            int(row["incarnation"]))
        return out

    def forget_peer_verdicts(self) -> int:
        """At a takeover of the agent role: every peer row reads UNKNOWN (its last-ack
        time kept) until this holder hears from that host itself.  The rows hold the
        previous holder's verdicts, and readers trust rows whenever the agent's own
        heartbeat is fresh, so without this a new holder would vouch for a stale ALIVE
        from the moment it took the role until its first tick rewrote the row -- or
        forever, if it runs without the network half.  Returns the rows reset."""
        n = 0
        for i in np.flatnonzero(self.bw.peer_table["checksum"] != 0):
            wi = self._peer0 + int(i) * PEER_STRIDE
            word = self._q[wi]
            if word:
                gen, _, ts = unpack_row(word)
                self._q[wi] = pack_row(gen, Status.UNKNOWN.code, ts)
                n += 1
        return n

    def new_peer(self, address: str) -> tuple[int, int] | None:
        free = np.flatnonzero(self.bw.peer_table["checksum"] == 0)
        if not len(free):
            log.warning("board %s: peer table full (%d rows); not following %s",
                        self.b.name, self.b.sizes.npeers, address)
            return None
        i = int(free[0])
        row = self.bw.peer_table[i]
        gen = next_gen(int(row["gen"]))
        row["gen"] = gen
        row["address"] = address.encode()
        row["board_inc"] = 0
        row["boot_id"] = bytes(16)
        row["rtt"] = 0
        row["auth"] = 0
        row["checksum"] = peer_checksum(row)
        self._q[self._peer0 + i * PEER_STRIDE] = pack_row(gen, Status.UNKNOWN.code, 0)
        return i, gen

    def peer_identity(self, i: int, identity: Identity) -> None:
        row = self.bw.peer_table[i]
        if int(row["board_inc"]) == identity.board_inc and bytes(row["boot_id"]) == identity.boot_id.rstrip(b"\0"):
            return
        row["checksum"] = 0
        row["board_inc"] = identity.board_inc
        row["boot_id"] = identity.boot_id
        row["checksum"] = peer_checksum(row)

    def peer_status(self, i: int, gen: int, status: Status, last_ack_ns: int) -> None:
        self._q[self._peer0 + i * PEER_STRIDE] = pack_row(gen, status.code, ts_units(last_ack_ns))

    def peer_rtt(self, i: int, gen: int, rtt_ns: int) -> None:
        self._q[self._peer0 + i * PEER_STRIDE + PEER_RTT_WORD] = pack_rtt(gen, max(1, rtt_ns // 1000))

    def clear_rtt(self, i: int) -> None:
        """No round trip measured (yet): readers read rtt None."""
        self._q[self._peer0 + i * PEER_STRIDE + PEER_RTT_WORD] = 0

    def peer_auth(self, i: int, gen: int, failing: bool) -> None:
        """A frame from that host failed authentication (``failing``: count it), or one
        passed (clear the flag, keep the count).  One word, written by the agent only."""
        wi = self._peer0 + i * PEER_STRIDE + PEER_AUTH_WORD
        was_failing, count = unpack_auth(int(self._q[wi]), gen)
        if failing or was_failing:
            self._q[wi] = pack_auth(gen, failing, count + 1 if failing else count)

    def peer_capped(self, i: int, gen: int, count: int) -> None:
        """How many workers that host's last digest listed that are not stored (0:
        all are).  One word, written by the agent only."""
        self._q[self._peer0 + i * PEER_STRIDE + PEER_CAPPED_WORD] = pack_capped(gen, count) if count else 0

    def capped_of(self, i: int, gen: int) -> int:
        """What peer row ``i``'s capped word says (an earlier holder's, at a takeover)."""
        return unpack_capped(int(self._q[self._peer0 + i * PEER_STRIDE + PEER_CAPPED_WORD]), gen)

    def free_peer(self, i: int) -> None:
        self.bw.peer_table[i]["checksum"] = 0
        self._q[self._peer0 + i * PEER_STRIDE] = 0

    # -- remote slots -----------------------------------------------------------------------

    def put_remote(self, peer_row: int, peer_gen: int, held: RemoteRow | None,
                   e: DigestEntry, now_ns: int, beat_ns: int | None = None) -> RemoteRow | None:
        """Write entry ``e`` for a peer; ``held`` is the row it had; ``beat_ns``: the
        worker's own last beat on our clock, if the report tells it.  Returns the row
        it has now, or None if the remote table is full."""
        ts = ts_units(now_ns)
        r = self.bw.remote_table
        eps = _fit_endpoints(e.endpoints)
        if held is not None:
            i, gen = held.row, held.gen
            row = r[i]
            if held.incarnation == e.incarnation and int(row["pid"]) == e.pid and bytes(row["endpoints"]) == eps:
                self._beat(i, gen, beat_ns)
                self._q[self._remote0 + i * REMOTE_STRIDE] = pack_row(gen, e.status, ts)
                return held
        else:
            free = np.flatnonzero(r["checksum"] == 0)
            if not len(free):
                return None  # the caller counts it and says so (reports.Reports.digest)
            i = int(free[0])
            row = r[i]
        gen = next_gen(int(row["gen"]))
        row["checksum"] = 0
        row["gen"] = gen
        row["peer"] = peer_row
        row["peer_gen"] = peer_gen
        row["incarnation"] = e.incarnation
        row["pid"] = e.pid
        row["key"] = e.key.encode()[: KEY_BYTES - 1]
        row["endpoints"] = eps
        row["checksum"] = remote_checksum(row)
        self._beat(i, gen, beat_ns)
        self._q[self._remote0 + i * REMOTE_STRIDE] = pack_row(gen, e.status, ts)
        return RemoteRow(i, gen, e.incarnation)

    def remote_status(self, held: RemoteRow, code: int, now_ns: int,
                      beat_ns: int | None = None) -> None:
        self._beat(held.row, held.gen, beat_ns)
        self._q[self._remote0 + held.row * REMOTE_STRIDE] = pack_row(held.gen, code,
                                                                     ts_units(now_ns))

    def _beat(self, i: int, gen: int, beat_ns: int | None) -> None:
        """The beat word of remote row ``i``: its own word, naming the row generation it
        belongs to, so no order against the status word is needed.  A reader that pairs
        a new status with the beat of the report before sees an older beat, never a
        beat of another incarnation.  A report that does not tell the beat clears it:
        an older one would age a worker that has beaten since."""
        w = pack_row(gen, 0, ts_units(beat_ns)) if beat_ns is not None and beat_ns > 0 else 0
        self._q[self._remote0 + i * REMOTE_STRIDE + REMOTE_BEAT_WORD] = w

    def free_remote(self, i: int) -> None:
        self.bw.remote_table[i]["checksum"] = 0
        self._q[self._remote0 + i * REMOTE_STRIDE] = 0
        self._q[self._remote0 + i * REMOTE_STRIDE + REMOTE_BEAT_WORD] = 0


def _fit_endpoints(endpoints: tuple[str, ...]) -> bytes:
    eps = list(endpoints)
    raw = encode_endpoints(tuple(eps))
    while len(raw) >= ENDPOINTS_BYTES and eps:
        eps.pop()
        raw = encode_endpoints(tuple(eps))
    return raw
