"""The board checker (shmhb.cli.check) on a real board: a clean board has no finding, each
kind of invalid row is found with its row named, a half-registered slot nobody holds is
not, and ``shmhb gc`` lists a board with invalid rows as such."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.cli import gc
from shmhb.board import layout as L
from shmhb.cli.check import Finding, check_board
from shmhb.errors import BoardCorrupt, BoardNotFound



class Poke:
    """A writable mapping of the board, standing in for a buggy or torn writer."""

    def __init__(self, b: shmhb.Board) -> None:
        fd = os.open(f"/dev/shm/{b.name}", os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        sz = b.sizes
        self.q = np.ndarray(len(self.mm) // 8, np.uint64, buffer=self.mm)
        self.records = np.ndarray(sz.nslots, L.SLOT_RECORD_DTYPE, buffer=self.mm, offset=sz.record_off)
        self.peers = np.ndarray(sz.npeers, L.PEER_ROW_DTYPE, buffer=self.mm, offset=sz.peer_off)
        self.remotes = np.ndarray(sz.nremote, L.REMOTE_ROW_DTYPE, buffer=self.mm, offset=sz.remote_off)
        self.watches = np.ndarray(sz.nwatch, L.WATCH_ROW_DTYPE, buffer=self.mm, offset=sz.watch_off)
        fields = L.HEADER_DTYPE.fields
        assert fields is not None
        self.agent_hb_i = fields["agent_hb"][1] // 8
        self.agent_id_i = fields["agent_id"][1] // 8
        self.hb0 = sz.slot_off // 8

    def close(self) -> None:
        del self.q, self.records, self.peers, self.remotes, self.watches
        self.mm.close()


@pytest.fixture
def poke(board: shmhb.Board) -> Iterator[Poke]:
    p = Poke(board)
    yield p
    p.close()


def rows(findings: list[Finding]) -> dict[str, str]:
    return {f.row: f.problem for f in findings}


def test_a_clean_board_has_no_finding(board: shmhb.Board) -> None:
    hb = board.register("w0", endpoints=("127.0.0.1:5",), agent=False)
    board.watch("10.0.0.9:1")
    try:
        assert check_board(board.name) == []
    finally:
        hb.close()
    assert check_board(board.name) == []


def test_each_kind_of_invalid_row_is_named(board: shmhb.Board, poke: Poke) -> None:
    hb = board.register("w0", agent=False)
    board.watch("10.0.0.9:1")
    try:
        assert board.slot("w0") is not None
        i = board_words(board).cached_index("w0")
        assert i is not None
        poke.records[i]["checksum"] ^= 1
        w = int(np.flatnonzero(poke.watches["checksum"] != 0)[0])
        poke.watches[w]["checksum"] ^= 1
        poke.peers[2]["checksum"] = 12345
        poke.remotes[3]["checksum"] = 6789
        term = 5
        poke.q[poke.agent_hb_i] = (term << L.INC_SHIFT) | 1
        poke.q[poke.agent_id_i] = L.pack_agent_id(term + 1, os.getpid())
        got = rows(check_board(board.name))
        assert got == {f"slot {i}": "record checksum mismatch",
                       "agent": f"agent hb term {term} != agent id term {term + 1}",
                       "peer 2": "peer checksum mismatch", "remote 3": "remote checksum mismatch",
                       f"watch {w}": "watch checksum mismatch"}, got
        listed = gc.list_boards([board.name])
        assert listed[0].state == "invalid-rows" and "5 invalid row(s)" in listed[0].detail
    finally:
        hb.close()


def test_a_slot_nobody_holds_is_not_reported_but_a_held_one_is(board: shmhb.Board,
                                                                  poke: Poke) -> None:
    """A registrant killed mid-registration leaves a word without its record: readers
    skip it and the next registration rewrites it, so it is not a torn live row."""
    poke.q[poke.hb0 + 7 * 8] = (1 << L.INC_SHIFT) | 1
    assert check_board(board.name) == []
    hb = board.register("w0", agent=False)
    try:
        assert board.slot("w0") is not None
        i = board_words(board).cached_index("w0")
        assert i is not None
        tag = L.inc_tag(int(poke.records[i]["incarnation"]))
        poke.q[poke.hb0 + i * 8] = ((tag % L.INC_MASK + 1) << L.INC_SHIFT) | 1
        assert "!= record incarnation" in rows(check_board(board.name))[f"slot {i}"]
    finally:
        hb.close()


def test_a_stranger_pid_holding_the_agent_role_is_found(board: shmhb.Board, poke: Poke) -> None:
    poke.q[poke.agent_hb_i] = (3 << L.INC_SHIFT) | 1
    poke.q[poke.agent_id_i] = L.pack_agent_id(3, 4242)
    hdr = np.ndarray((), L.HEADER_DTYPE, buffer=poke.mm)
    hdr["agent_term"] = 3
    del hdr
    assert check_board(board.name) == []
    assert rows(check_board(board.name, pinger_pids={1})) == {
        "agent": "agent pid 4242 is none of this host's pingers [1]"}


def test_missing_and_foreign_files_raise_the_attach_errors(board_name: str) -> None:
    with pytest.raises(BoardNotFound):
        check_board(board_name)
    with open(f"/dev/shm/{board_name}", "wb") as f:
        f.write(b"x" * 100)
    with pytest.raises(BoardCorrupt):
        check_board(board_name)
