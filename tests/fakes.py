"""A stand-in for the pinger in tests: writes remote-host rows into a board the way the
agent's network half does, so the monitor's remote display can be tested before (and
independently of) a real second host.  Test-only: it pokes the board's private tables."""

from __future__ import annotations

from shmhb.board.core import board_words

from collections.abc import Sequence

import shmhb
from shmhb import Status
from shmhb.board.layout import (
    TS_SHIFT,
    encode_endpoints,
    pack_row,
    pack_rtt,
    peer_checksum,
    remote_checksum,
)

Worker = tuple[str, int, int, Status, Sequence[str]]  # key, pid, incarnation, status, endpoints


class FakePinger:
    """Writes peer rows (one per remote host) and remote rows (their workers)."""

    def __init__(self, board: shmhb.Board) -> None:
        self.board = board
        self._gens: dict[int, int] = {}
        self._remote_next = 0
        self._remote_rows: dict[int, list[int]] = {}

    def host(self, index: int, address: str, status: Status, rtt_ms: float | None,
             workers: Sequence[Worker] = (), ack_age_s: float = 0.0) -> None:
        b = self.board
        now = (b._now_ns() - int(ack_age_s * 1e9)) >> TS_SHIFT
        gen = self._gens.setdefault(index, len(self._gens) + 1)
        row = board_words(b).peer_table[index]
        row["checksum"] = 0
        row["gen"] = gen
        row["board_inc"] = 12345
        row["boot_id"] = b"b" * 16
        row["address"] = address.encode()
        row["status"] = pack_row(gen, status.code, now)
        row["rtt"] = 0 if rtt_ms is None else pack_rtt(gen, int(rtt_ms * 1000))
        row["checksum"] = peer_checksum(row)
        rows = self._remote_rows.setdefault(index, [])
        for j, (key, pid, inc, st, eps) in enumerate(workers):
            if j >= len(rows):
                rows.append(self._remote_next)
                self._remote_next += 1
            r = board_words(b).remote_table[rows[j]]
            rgen = 1000 + rows[j]
            r["checksum"] = 0
            r["gen"] = rgen
            r["peer"] = index
            r["peer_gen"] = gen
            r["incarnation"] = inc
            r["pid"] = pid
            r["key"] = key.encode()
            r["endpoints"] = encode_endpoints(tuple(eps))
            r["status"] = pack_row(rgen, st.code, now)
            r["checksum"] = remote_checksum(r)
        for extra in rows[len(workers):]:
            board_words(b).remote_table[extra]["checksum"] = 0
        del rows[len(workers):]
