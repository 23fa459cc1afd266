"""``shmhb gc``: boards a live process uses are never removed; unused ones are.

Every test names its own boards, so a run never touches another board on the host."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Iterator

import posix_ipc
import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.cli import gc
from shmhb.board import layout as L
from shmhb.testing.loopback import child_env

from ..children import child
from ..conftest import Procs, unlink_quietly, wait_until

HOLDER = child("gc_holder")


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for n in made:
        unlink_quietly(n)


def new_board(names: list[str], tag: str) -> str:
    name = f"shmhb-test-gc-{tag}-{os.urandom(4).hex()}"
    names.append(name)
    shmhb.Board.create(name, slots=8).close()
    return name


def exists(name: str) -> bool:
    return os.path.exists(gc.shm_path(name))


def gc_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmhb", "gc", *args], input=stdin,
                          capture_output=True, text=True, timeout=120,
                          env=child_env())


def test_an_unused_board_is_listed_and_removed(names: list[str]) -> None:
    name = new_board(names, "unused")
    (b,) = gc.list_boards([name])
    assert b.state == "ok" and b.removable and not b.users and not b.locked
    assert b.opened_elsewhere is False  # the kernel agrees: nobody has it open
    assert "8 slots" in b.detail
    # listing attached to it for the details, and let go of it again
    with open("/proc/self/maps") as f:
        assert name not in f.read()
    assert gc.remove(b) and not exists(name)
    assert gc.list_boards([name]) == []


@pytest.mark.parametrize("how", ["attach", "mmap-only", "fd-only"])
def test_a_board_a_live_process_uses_is_never_removed(names: list[str], procs: Procs, how: str) -> None:
    name = new_board(names, how)
    p = procs.program(HOLDER, name, how)
    (b,) = gc.list_boards([name])
    assert not b.removable and p.pid in b.users and b.opened_elsewhere
    assert f"pid {p.pid}" in b.why_kept()
    assert not gc.remove(b) and exists(name)  # even when asked directly
    out = gc_cli("--yes", name)
    assert exists(name), out.stdout
    assert f"used by pid {p.pid}" in out.stdout and "nothing to remove" in out.stdout
    assert out.returncode == 1  # nothing was removed (docs/OPERATIONS.md, "Exit statuses")
    p.kill()
    p.wait()
    (b,) = gc.list_boards([name])
    assert b.removable
    assert gc.remove(b) and not exists(name)


def test_a_board_with_live_workers_is_kept(names: list[str], procs: Procs) -> None:
    name = new_board(names, "worker")
    w = procs.worker(name, "rank-0")
    (b,) = gc.list_boards([name])
    assert b.locked and w.pid in b.users and not b.removable
    assert "1 registered, 1 live" in b.detail
    assert exists(name) and not gc.remove(b)


def test_remove_checks_again_before_unlinking(names: list[str], procs: Procs) -> None:
    name = new_board(names, "race")
    (b,) = gc.list_boards([name])
    assert b.removable
    procs.program(HOLDER, name, "attach")  # came into use after the listing
    assert not gc.remove(b) and exists(name)


def test_a_replaced_board_is_not_removed_by_a_stale_listing(names: list[str]) -> None:
    name = new_board(names, "replaced")
    (b,) = gc.list_boards([name])
    unlink_quietly(name)
    shmhb.Board.create(name, slots=8).close()
    assert not gc.remove(b) and exists(name)


@pytest.mark.system
def test_a_missing_board_is_an_error() -> None:
    out = gc_cli("--yes", "shmhb-test-no-such-board-x")
    assert out.returncode == 2 and "no board 'shmhb-test-no-such-board-x'" in out.stderr


@pytest.mark.system
def test_confirmation_is_asked_unless_yes(names: list[str]) -> None:
    name = new_board(names, "ask")
    out = gc_cli(name, stdin="n\n")
    assert out.returncode == 1 and exists(name)
    assert "[y/N]" in out.stdout and "nothing removed" in out.stdout
    out = gc_cli(name, stdin="")  # no answer at all: keep
    assert out.returncode == 1 and exists(name)
    out = gc_cli(name, stdin="y\n")
    assert out.returncode == 0 and not exists(name), out.stdout + out.stderr
    assert f"removed {name}" in out.stdout


@pytest.mark.system
def test_yes_removes_without_asking(names: list[str]) -> None:
    a, b = new_board(names, "y1"), new_board(names, "y2")
    out = gc_cli("--yes", a, b, stdin="n\n")
    assert out.returncode == 0 and "[y/N]" not in out.stdout
    assert not exists(a) and not exists(b)


@pytest.mark.system
def test_stale_and_foreign_segments(names: list[str]) -> None:
    stale = new_board(names, "stale")
    shm = posix_ipc.SharedMemory("/" + stale)
    with mmap.mmap(shm.fd, os.fstat(shm.fd).st_size) as m:
        off = L.HEADER_DTYPE.fields["boot_id"][1]
        m[off:off + 16] = b"\x01" * 16  # as if left by an earlier boot
    os.close(shm.fd)
    foreign = f"shmhb-test-gc-foreign-{os.urandom(4).hex()}"
    names.append(foreign)
    shm = posix_ipc.SharedMemory("/" + foreign, flags=posix_ipc.O_CREX, mode=0o600, size=8192)
    os.close(shm.fd)
    with open(f"/dev/shm/{foreign}", "r+b") as f:
        f.write(b"not a board at all")
    zeros = f"shmhb-test-gc-zeros-{os.urandom(4).hex()}"
    names.append(zeros)
    shm = posix_ipc.SharedMemory("/" + zeros, flags=posix_ipc.O_CREX, mode=0o600, size=8192)
    os.close(shm.fd)
    got = {b.name: b for b in gc.list_boards([stale, foreign, zeros])}
    assert got[stale].state == "stale" and got[stale].removable
    assert got[foreign].state == "not-a-board" and not got[foreign].removable
    # all zeros: a board whose creator died before writing its header, or anything else
    # freshly made: never removed, and described the way `shmhb status` describes it
    assert got[zeros].state == "unfinished" and not got[zeros].removable
    out = gc_cli("--yes", stale, foreign, zeros)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not exists(stale) and exists(foreign) and exists(zeros)
    assert "unfinished board or not a board" in out.stdout


@pytest.mark.system
def test_gc_and_status_agree_on_a_half_made_board(names: list[str]) -> None:
    """A segment of board size whose header was never written: `status` and `gc` give the
    same advice (recover it by opening it, or rm it when unused) instead of `status`
    sending the user to a `gc` that refuses it."""
    name = f"shmhb-test-gc-half-{os.urandom(4).hex()}"
    names.append(name)
    shm = posix_ipc.SharedMemory("/" + name, flags=posix_ipc.O_CREX, mode=0o600, size=3 * L.HEADER_BYTES)
    os.close(shm.fd)
    st = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", name],
                        capture_output=True, text=True, timeout=60, env=child_env())
    assert st.returncode != 0
    assert "never finished" in st.stderr and "shmhb gc" not in st.stderr
    assert f"shmhb pinger --board {name}" in st.stderr and f"rm /dev/shm/{name}" in st.stderr
    got = gc.list_boards([name])
    assert len(got) == 1 and got[0].state == "unfinished" and not got[0].removable
    why = got[0].why_kept()
    assert f"shmhb pinger --board {name}" in why and f"rm /dev/shm/{name}" in why
    # and the advice works: opening the board recovers it
    shmhb.Board.open(name).close()
    assert gc.list_boards([name])[0].state == "ok"


@pytest.mark.system
def test_scanning_all_of_dev_shm_finds_boards_by_their_magic(names: list[str]) -> None:
    name = new_board(names, "scan")
    foreign = f"shmhb-test-gc-foreign-{os.urandom(4).hex()}"
    names.append(foreign)
    shm = posix_ipc.SharedMemory("/" + foreign, flags=posix_ipc.O_CREX, mode=0o600, size=8192)
    os.close(shm.fd)
    found = {b.name for b in gc.list_boards()}
    assert name in found and foreign not in found
    out = gc_cli(stdin="n\n")  # lists everything, removes nothing when told no
    assert name in out.stdout and exists(name)


def test_a_lock_held_on_the_segment_keeps_it(names: list[str], procs: Procs) -> None:
    name = new_board(names, "lock")
    # the agent role held by a pinger daemon: it holds the board open and locked
    p = procs.spawn([sys.executable, "-m", "shmhb", "pinger", "--board", name, "--tick-s", "0.02"],
                    ready=False)
    with shmhb.Board.attach(name) as b:
        wait_until(lambda: board_words(b).agent_held(), what="the pinger to hold the role")
    (bf,) = gc.list_boards([name])
    assert bf.locked and p.pid in bf.users and not gc.remove(bf)
    fd = os.open(gc.shm_path(name), os.O_RDONLY)
    try:
        assert gc.any_lock_held(fd)
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root to run gc as another account")
@pytest.mark.system  # it starts processes (tests/tiers.py)
def test_gc_run_by_another_account_says_what_it_cannot_read(board_name: str) -> None:
    with shmhb.Board.create(board_name):  # mode 0600, root's
        out = subprocess.run(["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534",
                              "--clear-groups", sys.executable, "-m", "shmhb", "gc"],
                             env=child_env(), capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    assert "cannot read (owner uid 0" in out.stdout and "as their owner" in out.stdout, out.stdout
    assert os.path.exists(f"/dev/shm/{board_name}")
