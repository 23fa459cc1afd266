"""Creating, attaching and validating boards; registration rules; bad segments."""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.board import layout as L
from shmhb.testing.loopback import child_env

from ..children import child
from ..conftest import unlink_quietly


def test_create_attach_open_and_unlink(board_name: str) -> None:
    with pytest.raises(shmhb.BoardNotFound) as ei:
        shmhb.Board.attach(board_name)
    assert isinstance(ei.value, FileNotFoundError)
    b = shmhb.Board.create(board_name, slots=8, suspect_after_s=1.0, dead_after_s=4.0)
    with pytest.raises(shmhb.BoardExists):
        shmhb.Board.create(board_name)
    a = shmhb.Board.attach(board_name)
    o = shmhb.Board.open(board_name, slots=99)  # exists: attaches, ignores create kwargs
    for x in (a, o):
        assert x.sizes.nslots == 8
        assert x.policy.suspect_after_s == 1.0 and x.policy.dead_after_s == 4.0
        assert x.board_inc == b.board_inc
    for x in (a, o, b):
        x.close()
    b.unlink()
    with pytest.raises(shmhb.BoardNotFound):
        shmhb.Board.attach(board_name)


def test_default_name_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, board_name: str) -> None:
    monkeypatch.setenv("SHMHB_BOARD", board_name)
    with shmhb.Board.open(create=True) as b:
        assert b.name == board_name


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 300, "..", "white space"])
def test_invalid_names(bad: str) -> None:
    with pytest.raises(shmhb.InvalidName):
        shmhb.Board.create(bad)


def test_invalid_policy(board_name: str) -> None:
    with pytest.raises(shmhb.InvalidConfig):
        shmhb.Board.create(board_name, suspect_after_s=5, dead_after_s=1)
    with pytest.raises(shmhb.InvalidConfig):
        shmhb.Board.create(board_name, slots=0)
    with pytest.raises(shmhb.BoardNotFound):
        shmhb.Board.attach(board_name)  # nothing left behind


def test_mode_is_exact_whatever_the_umask(board_name: str) -> None:
    old = os.umask(0o077)
    try:
        with shmhb.Board.create(board_name, mode=0o660) as b:
            st = os.fstat(b._seg.fd)
            assert stat.S_IMODE(st.st_mode) == 0o660
    finally:
        os.umask(old)
    unlink_quietly(board_name)
    with shmhb.Board.create(board_name) as b:
        assert stat.S_IMODE(os.fstat(b._seg.fd).st_mode) == 0o600


def _raw_segment(name: str, size: int, fill: bytes = b"") -> None:
    shm = posix_ipc.SharedMemory("/" + name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
    if fill:
        with mmap.mmap(shm.fd, size) as m:
            m[: len(fill)] = fill
    os.close(shm.fd)


def test_foreign_and_truncated_segments_are_refused(board_name: str) -> None:
    _raw_segment(board_name, 100)
    with pytest.raises(shmhb.BoardCorrupt, match="too small"):
        shmhb.Board.attach(board_name)
    unlink_quietly(board_name)
    _raw_segment(board_name, 1 << 20, os.urandom(4096))
    with pytest.raises(shmhb.BoardCorrupt, match="magic"):
        shmhb.Board.attach(board_name)


def _poke_header(name: str, field: str, value: object) -> None:
    shm = posix_ipc.SharedMemory("/" + name)
    with mmap.mmap(shm.fd, os.fstat(shm.fd).st_size) as m:
        h = np.ndarray((), L.HEADER_DTYPE, buffer=m)
        h[field] = value
        del h
    os.close(shm.fd)


def test_wrong_version_size_and_policy_are_refused(board_name: str) -> None:
    shmhb.Board.create(board_name).close()
    _poke_header(board_name, "version", 99)
    with pytest.raises(shmhb.BoardVersionMismatch):
        shmhb.Board.attach(board_name)
    _poke_header(board_name, "version", L.LAYOUT_VERSION)
    _poke_header(board_name, "nslots", 65)
    with pytest.raises(shmhb.BoardCorrupt, match="layout"):
        shmhb.Board.attach(board_name)
    _poke_header(board_name, "nslots", 64)
    _poke_header(board_name, "dead_after_ns", 1)
    with pytest.raises(shmhb.BoardCorrupt, match="policy"):
        shmhb.Board.attach(board_name)


def test_a_recreated_board_never_repeats_an_incarnation(board_name: str) -> None:
    with shmhb.Board.create(board_name) as b:
        old = [b.register(f"k{i}", agent=False) for i in range(3)]
        for h in old:
            h.close()
        b.unlink()
    with shmhb.Board.create(board_name) as b2, b2.register("k0", agent=False) as h:
        assert h.incarnation > max(o.incarnation for o in old)


def test_board_from_an_earlier_boot_is_stale_and_open_recovers_it(board_name: str) -> None:
    b = shmhb.Board.create(board_name)
    old_inc = b.board_inc
    b.close()
    _poke_header(board_name, "boot_id", b"\x01" * 16)
    with pytest.raises(shmhb.StaleBoard):
        shmhb.Board.attach(board_name)
    with shmhb.Board.open(board_name) as b2:
        assert b2.board_inc != old_inc


def test_board_of_a_crashed_creator_is_recovered(board_name: str) -> None:
    # A creator that died after allocating but before marking the board READY.
    _raw_segment(board_name, L.Sizes(64, 256, 4096, 512).total_bytes)
    with pytest.raises(shmhb.StaleBoard):
        shmhb.Board.attach(board_name)
    with shmhb.Board.open(board_name) as b:
        assert b.register("k", agent=False).incarnation > 0


@pytest.mark.system
def test_no_permission(board_name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    shmhb.Board.create(board_name, mode=0o600).close()
    out = subprocess.run([sys.executable, child("attach_as_nobody"), board_name], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.stdout.startswith("refused"), out.stderr


@pytest.mark.system
def test_full_shm_fails_up_front_not_with_sigbus(board_name: str) -> None:
    """A real tiny /dev/shm, in a private mount namespace: creation must fail cleanly."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    script = (f"mount -t tmpfs -o size=256k tmpfs /dev/shm && "
              f"{sys.executable} \"$0\" {board_name} 4096")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                          child("shm_full")],
                         capture_output=True, text=True, env=child_env(),
                         timeout=60)
    if "mount" in out.stderr and "nospace" not in out.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {out.stderr.strip()}")
    assert out.stdout.startswith("nospace"), out.stderr
    assert out.returncode == 0


def test_register_rules(board: shmhb.Board) -> None:
    hb = board.register("rank-0", endpoints=("10.0.0.1:30003",), agent=False)
    assert hb.key == "rank-0" and hb.incarnation > 0
    s = board.slot("rank-0")
    assert s is not None and s.status is shmhb.Status.ALIVE and s.pid == os.getpid()
    assert s.endpoints == ("10.0.0.1:30003",) and s.incarnation == hb.incarnation
    with pytest.raises(shmhb.KeyInUse):
        board.register("rank-0", agent=False)  # held by a live holder (this very process)
    hb.close()
    assert board.slot("rank-0").status is shmhb.Status.LEFT
    with pytest.raises(shmhb.HeartbeatClosed):
        hb.beat()
    with board.register("rank-0", agent=False) as hb2:
        assert hb2.incarnation > hb.incarnation and hb2.index == hb.index
        assert board.slot("rank-0").incarnation == hb2.incarnation
    assert board.slot("missing") is None and board.status("missing") is None


@pytest.mark.parametrize("key,eps", [("", ()), ("k" * 64, ()), ("a\0b", ()),
                                     ("k", ("nohostport,x",)), ("k", tuple(f"h:{i}" for i in range(9)))])
def test_invalid_keys(board: shmhb.Board, key: str, eps: tuple[str, ...]) -> None:
    with pytest.raises(shmhb.InvalidKey):
        board.register(key, endpoints=eps, agent=False)


def test_full_board_names_its_size(board_name: str) -> None:
    with shmhb.Board.create(board_name, slots=3) as b:
        hbs = [b.register(f"k{i}", agent=False) for i in range(3)]
        with pytest.raises(shmhb.BoardFull, match="3 slots"):
            b.register("k3", agent=False)
        hbs[1].close()  # a left slot is free again, for any key
        hb = b.register("k3", agent=False)
        assert hb.index == hbs[1].index
        assert b.slot("k1") is None  # its slot now belongs to k3
        for h in (hbs[0], hbs[2], hb):
            h.close()


def test_slots_lists_everything_and_snapshot_agrees(board: shmhb.Board) -> None:
    from shmhb.board.judge import judge_local_array

    hbs = [board.register(f"w{i}", agent=False) for i in range(5)]
    hbs[2].close()
    got = {s.key: s.status for s in board.slots()}
    assert got == {"w0": "alive", "w1": "alive", "w2": "left", "w3": "alive", "w4": "alive"}
    hb, v, now = board.snapshot()
    codes, _ = judge_local_array(hb, v, int(now), board.thresholds)
    assert sorted(codes[codes != 0].tolist()) == [1, 1, 1, 1, 4]
    for h in hbs:
        h.close()


def test_changes_counter_moves_on_registration_and_leave(board: shmhb.Board) -> None:
    c0 = board.changes()
    hb = board.register("x", agent=False)
    c1 = board.changes()
    assert c1 > c0
    hb.beat()
    assert board.changes() == c1  # beats are not changes
    hb.close()
    assert board.changes() > c1


def test_watches_are_counted_per_process(board: shmhb.Board) -> None:
    board.watch("10.0.0.2:30003")
    board.watch("10.0.0.2:30004")
    board.watch("10.0.0.3:1")
    assert board_words(board).watches.watched_hosts() == {"10.0.0.2": 1, "10.0.0.3": 1}
    board.unwatch("10.0.0.2:30003")
    assert board_words(board).watches.watched_hosts() == {"10.0.0.2": 1, "10.0.0.3": 1}
    board.unwatch("10.0.0.2:30004")
    board.unwatch("10.0.0.3:1")
    assert board_words(board).watches.watched_hosts() == {}


@pytest.mark.system
def test_dead_watchers_lose_their_watches_but_other_namespaces_are_left_alone(board: shmhb.Board) -> None:
    """reclaim_watches judges owners by pid and start time, which only mean something in
    our own pid namespace."""
    code = child("watch_and_die")  # exits without unwatching
    env = child_env()
    subprocess.run([sys.executable, code, board.name, "10.1.1.1:1"], check=True, env=env,
                   timeout=60)
    assert board_words(board).watches.watched_hosts() == {"10.1.1.1": 1}
    assert board_words(board).watches.reclaim_watches() == 1
    assert board_words(board).watches.watched_hosts() == {}
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private pid namespace")
    out = subprocess.run(["unshare", "-p", "-f", "--kill-child", sys.executable, code,
                          board.name, "10.1.1.2:1"], env=env, timeout=60, capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot create a pid namespace here: {out.stderr.decode().strip()}")
    assert board_words(board).watches.reclaim_watches() == 0  # pid 1 of another namespace: cannot be judged here
    assert board_words(board).watches.watched_hosts() == {"10.1.1.2": 1}
