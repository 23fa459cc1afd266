"""The board's doors against real processes: forked children sharing a handle, a stale
board opened by many processes at once, and what /dev/shm may hold under a board's name
instead of a board."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.board import locks, segment
from shmhb.board.layout import (
    HEADER_DTYPE, LOCK_REGISTRY, LOCK_SLOT_BASE, record_checksum, watch_checksum,
)

from shmhb import Status
from shmhb.testing.loopback import child_env, free_port
from shmhb.procinfo import own_pid_namespace, start_time

from ..children import child
from ..conftest import Procs, unlink_quietly, wait_until

ENV = child_env()


def _fork(body: object) -> int:
    """Fork a child that runs ``body()`` and exits with its return value (2 on error)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 2
        try:
            code = body()  # type: ignore[operator]
        except BaseException:  # the child must never return into pytest
            import traceback
            traceback.print_exc()
        os._exit(code)
    return pid


def _exit_code(pid: int, timeout_s: float = 20) -> int:
    def done() -> tuple[int, int] | None:
        got = os.waitpid(pid, os.WNOHANG)
        return got if got[0] else None
    _, status = wait_until(done, timeout_s=timeout_s, what=f"child {pid} to exit")
    return os.waitstatus_to_exitcode(status)


def _held_elsewhere(board: shmhb.Board) -> bool:
    """Whether a description other than a fresh one of ours holds the registry lock."""
    fd = board_words(board).new_fd()
    try:
        return locks.is_held(fd, LOCK_REGISTRY)
    finally:
        os.close(fd)


# -- forked children sharing one handle ------------------------------------------------------

@pytest.mark.system
def test_forked_children_exclude_each_other_and_a_killed_child_frees_the_registry(
        board: shmhb.Board) -> None:
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()

    def hold() -> int:
        with board_words(board).registry():
            os.write(from_child_w, b"L")
            os.read(to_child_r, 1)  # until the parent says so; it SIGKILLs us instead
        return 0

    def try_once() -> int:
        try:
            with board_words(board).registry(timeout_s=0.3):
                return 1  # got it while a sibling held it: no exclusion
        except shmhb.LockTimeout:
            return 0

    holder = _fork(hold)
    try:
        assert os.read(from_child_r, 1) == b"L"
        # The parent, and a second child forked from the same handle, are kept out.
        with pytest.raises(shmhb.LockTimeout):
            with board_words(board).registry(timeout_s=0.3):
                pass
        assert _exit_code(_fork(try_once)) == 0
        assert _held_elsewhere(board)
    finally:
        os.kill(holder, signal.SIGKILL)
    assert _exit_code(holder) == -signal.SIGKILL
    # Killed inside registry(): the kernel released its own description's lock.  Every
    # process gets the registry again, the parent, a new child, and a stranger.
    wait_until(lambda: not _held_elsewhere(board), timeout_s=5, what="the lock released")
    with board_words(board).registry(timeout_s=2):
        pass

    def use() -> int:
        board.watch("10.0.0.9:1", timeout_s=2)
        board.unwatch("10.0.0.9:1", timeout_s=2)
        return 0
    assert _exit_code(_fork(use)) == 0
    out = subprocess.run(
        [sys.executable, "-c", "import shmhb, sys; b = shmhb.Board.attach(sys.argv[1]);"
         "b.watch('10.0.0.9:1', timeout_s=2); print('ok')", board.name],
        env=ENV, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
        os.close(fd)


# -- a stale board opened by 8 processes at once ------------------------------------------

DIE_CREATING = child("die_creating")

OPENER = child("opener")


@pytest.fixture
def openers() -> Iterator[list[subprocess.Popen[str]]]:
    ps: list[subprocess.Popen[str]] = []
    yield ps
    for p in ps:
        if p.poll() is None:
            p.kill()
        p.wait()


def _earlier_boot(name: str) -> None:
    """A finished board whose header says it was made in an earlier boot of the host."""
    b = shmhb.Board.create(name)
    h = np.ndarray((), HEADER_DTYPE, buffer=b._seg.mm)
    h["boot_id"] = b"not-this-boot!!!"
    del h
    b.close()


@pytest.mark.system
@pytest.mark.parametrize("stale", ["creator killed before READY", "earlier boot"])
def test_stale_board_opened_by_eight_processes_at_once_stays_one_board(
        board_name: str, openers: list[subprocess.Popen[str]], stale: str) -> None:
    if stale == "earlier boot":
        _earlier_boot(board_name)
    else:
        r = subprocess.run([sys.executable, DIE_CREATING, board_name], env=ENV, timeout=60,
                           capture_output=True, text=True)
        assert r.returncode == -signal.SIGKILL, r.stderr
    assert os.path.exists(f"/dev/shm/{board_name}")
    with pytest.raises(shmhb.StaleBoard):
        shmhb.Board.attach(board_name)
    for k in range(8):
        openers.append(subprocess.Popen([sys.executable, OPENER, board_name, f"k{k}"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=ENV))
    for p in openers:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
    for p in openers:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    lines = [p.stdout.readline().split() for p in openers if p.stdout is not None]
    assert all(ln and ln[0] == "ok" for ln in lines), lines
    with shmhb.Board.attach(board_name) as b:
        assert {int(ln[1]) for ln in lines} == {b.board_inc}, "the host split between boards"
        idx = sorted(int(ln[2]) for ln in lines)
        assert len(set(idx)) == 8
        assert sorted(s.key for s in b.slots()) == [f"k{k}" for k in range(8)]
        fd = board_words(b).new_fd()
        try:  # every slot lock lies on the board's own inode
            assert all(locks.is_held(fd, LOCK_SLOT_BASE + i) for i in idx)
        finally:
            os.close(fd)
    for p in openers:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=30)


def test_remove_stale_leaves_a_live_board_alone(board: shmhb.Board) -> None:
    assert segment.remove_stale(board.name) is False
    with shmhb.Board.attach(board.name) as b:
        assert b.board_inc == board.board_inc


def test_a_board_created_anew_is_not_locked_through_its_old_handle(board_name: str) -> None:
    old = shmhb.Board.create(board_name)
    try:
        old.unlink()
        with shmhb.Board.create(board_name) as new:
            # the old handle's new descriptors stay on the old segment, not the new name
            fd = board_words(old).new_fd()
            try:
                assert os.fstat(fd).st_ino != os.stat(f"/dev/shm/{board_name}").st_ino
            finally:
                os.close(fd)
            with old.register("k", agent=False) as hb:  # its slot lock: on the old inode
                nfd = board_words(new).new_fd()
                try:
                    assert not locks.is_held(nfd, LOCK_SLOT_BASE + hb.index)
                finally:
                    os.close(nfd)
    finally:
        old.close()


# -- what /dev/shm may hold under a board's name --------------------------------------------

@pytest.mark.system
@pytest.mark.parametrize("kind", ["dir", "symlink", "dangling"])
def test_not_a_board_under_the_name_is_a_clear_error(board_name: str, kind: str) -> None:
    path = f"/dev/shm/{board_name}"
    if kind == "dir":
        os.mkdir(path)
    else:
        os.symlink("/dev/null" if kind == "symlink" else "/nonexistent-shmhb", path)
    try:
        for call in (shmhb.Board.attach, shmhb.Board.open, shmhb.Board.create):
            with pytest.raises(shmhb.ShmhbError, match="not a board|exists already"):
                call(board_name)
        with pytest.raises(shmhb.BoardCorrupt, match="directory" if kind == "dir" else "symbolic"):
            shmhb.Board.open(board_name)
        out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", board_name],
                             env=ENV, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "not a board" in out.stderr
    finally:
        os.rmdir(path) if kind == "dir" else os.unlink(path)
        unlink_quietly(board_name)


# -- what an older version stored that today's doors refuse ---------------------------------

def _plant_record(board: shmhb.Board, index: int, *, key: bytes | None = None,
                  endpoints: bytes | None = None) -> None:
    """Rewrite slot ``index``'s record as a laxer older version could have written it
    (with a valid checksum), as its registrant does: under the registry lock."""
    with board_words(board).registry():
        rec = board._records[index]
        rec["checksum"] = 0
        if key is not None:
            rec["key"] = key
        if endpoints is not None:
            rec["endpoints"] = endpoints
        rec["checksum"] = record_checksum(rec)


def _plant_watch(board: shmhb.Board, address: bytes) -> None:
    with board_words(board).registry():
        w = board_words(board).watch_table
        row = w[int(np.flatnonzero(w["checksum"] == 0)[0])]
        # owned by this (live) process, as a worker's watch: kept by every pinger start
        row["owner_pid"], row["owner_start"] = os.getpid(), start_time() or 0
        row["refs"], row["owner_ns"] = 1, own_pid_namespace()
        row["address"] = address
        row["checksum"] = watch_checksum(row)
        board._head["reg_gen"] = int(board._head["reg_gen"]) + 1


BAD_WATCHES = [b"a b", b"*", "h\u00e9".encode(), b"[a:b]:1", b"-x", b"[h:99999]:1",
               b"host_a, host_b", b"\xff\xfe", b"not an ip"]


def test_readers_skip_rows_an_older_version_stored(board: shmhb.Board,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    good = board.register("good", endpoints=("10.0.0.1:1",), agent=False)
    odd = board.register("odd", endpoints=("10.0.0.1:2",), agent=False)
    bad = board.register("bad-key", agent=False)
    long_ep = b"decode-rank-3.decode-headless.llm-inference-prod.svc.cluster.local:30003"
    _plant_record(board, odd.index, endpoints=b"10.0.0.1:2," + long_ep + b",a b:1,h")
    _plant_record(board, bad.index, key=b"\xff\xfekey")
    for a in BAD_WATCHES:
        _plant_watch(board, a)
    board.watch("10.0.0.3:1")
    with caplog.at_level("WARNING", logger="shmhb"):
        fresh = shmhb.Board.attach(board.name)  # a reader with no cache
        try:
            slots = {s.key: s for s in fresh.slots()}
            assert set(slots) == {"good", "odd"}  # the undecodable key is skipped
            assert slots["odd"].endpoints == ("10.0.0.1:2",)  # only the bad endpoints go
            assert fresh.slot("odd").endpoints == ("10.0.0.1:2",)  # type: ignore[union-attr]
            assert board_words(fresh).watches.watched_hosts() == {"10.0.0.3": 1}
            for _ in range(100):  # again and again: logged once per kind, never raised
                board_words(fresh).watches.watched_hosts()
                fresh.slots()
            assert fresh.remote("a b:1") is None and fresh.peers() == []
        finally:
            fresh.close()
    warned = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert 1 <= len(warned) <= 3, [r.getMessage() for r in warned]
    for hb in (good, odd, bad):
        hb.close()


def test_the_pinger_survives_bad_watch_rows_and_still_sees_a_kill(
        board: shmhb.Board, procs: Procs) -> None:
    for a in BAD_WATCHES:
        _plant_watch(board, a)  # stored by an older version: every holder reads them
    w = procs.worker(board.name, "victim", endpoints="127.0.0.1:31001")
    port = free_port(["127.0.0.1"])
    p = procs.spawn([sys.executable, "-m", "shmhb", "pinger", "--board", board.name,
                     "--listen", f"127.0.0.1:{port}", "--tick-s", "0.02", "--interval-s", "0.05"],
                    ready=False)
    wait_until(lambda: p.poll() is not None or (board.agent().pid == p.pid
                                                and board.agent().status is Status.ALIVE),
               timeout_s=20, what="the pinger holding the role")
    assert p.poll() is None
    board.watch("127.0.0.9:1")  # a good watch among the bad ones: followed
    wait_until(lambda: any(pr.address.startswith("127.0.0.9") for pr in board.peers()),
               timeout_s=10, what="the good watch followed")
    os.kill(w.pid, signal.SIGKILL)
    t = time.monotonic()
    wait_until(lambda: board.status("victim") is Status.DEAD, timeout_s=10, what="DEAD")
    assert time.monotonic() - t < 1.0, "a local kill took over 1 s to read DEAD"
    assert p.poll() is None, "the pinger died on a bad row"


@pytest.mark.system  # it starts processes (tests/tiers.py)
def test_a_wrong_name_creates_no_board_where_one_exists(board_name: str) -> None:
    # A reader or worker with a mistyped name (or no $SHMHB_BOARD beside a pinger that uses
    # --board) must not get a private, empty board that answers None for every peer.
    typo = board_name + "-typo"
    try:
        with shmhb.Board.create(board_name):
            for call in (shmhb.Board.open, shmhb.Board.attach):
                with pytest.raises(shmhb.BoardNotFound, match=f"'{board_name}'"):
                    call(typo)
                assert not os.path.exists(f"/dev/shm/{typo}")
            out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", typo],
                                 env=ENV, capture_output=True, text=True, timeout=60)
            assert out.returncode != 0 and "Traceback" not in out.stderr
            assert f"'{board_name}'" in out.stderr and f"shmhb pinger --board {typo}" in out.stderr
            assert not os.path.exists(f"/dev/shm/{typo}")
            with shmhb.Board.open(typo, create=True) as b:  # the pinger's way: created
                assert b.name == typo
    finally:
        unlink_quietly(typo)
