"""Who sets a board's policy: the pinger's flags create the board with it, and a process
asking an existing board for another policy is told, never silently given the board's.

Real ``shmhb pinger`` processes and real shared memory.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import shmhb
from shmhb import Status
from shmhb.testing.loopback import child_env

from ..conftest import install_args, install_env, unlink_quietly, wait_until


@pytest.fixture
def name() -> Iterator[str]:
    n = f"shmhb-test-set-{uuid.uuid4().hex[:10]}"
    yield n
    unlink_quietly(n)


def _pinger(name: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shmhb", "pinger", "--board", name,
                             "--tick-s", "0.02", *flags], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(p: subprocess.Popen[str]) -> str:
    if p.poll() is None:
        p.terminate()
    out, _ = p.communicate(timeout=20)
    return out


@pytest.mark.system
def test_the_pinger_creates_the_board_with_its_policy_flags(name: str) -> None:
    p = _pinger(name, "--suspect-after-s", "3", "--dead-after-s", "30",
                "--peer-dead-after-s", "8", "--forget-after-s", "600")
    try:
        def up() -> bool:
            assert p.poll() is None, _stop(p)
            try:
                with shmhb.Board.attach(name) as b:
                    return b.agent().status is Status.ALIVE
            except shmhb.BoardNotFound:
                return False
        wait_until(up, timeout_s=20, what="the pinger holds the role")
        with shmhb.Board.attach(name) as b:
            assert b.policy == shmhb.Policy(suspect_after_s=3, dead_after_s=30,
                                            peer_dead_after_s=8, forget_after_s=600)
    finally:
        _stop(p)


@pytest.mark.system
def test_the_pinger_refuses_a_board_with_another_policy_naming_both(name: str) -> None:
    with shmhb.Board.create(name) as b:  # defaults: dead after 10 s
        p = _pinger(name, "--dead-after-s", "30")
        p.wait(30)
        out = p.communicate()[0]
        assert p.returncode == 2, out
        assert "dead_after_s: board 10, asked 30" in out, out
        assert "shmhb gc" in out, out
        # the same flags as the board's: no complaint, it runs
        p = _pinger(name, "--dead-after-s", "10")
        try:
            wait_until(lambda: p.poll() is not None or b.agent().status is Status.ALIVE,
                       timeout_s=20, what="pinger up")
            assert p.poll() is None, _stop(p)
        finally:
            _stop(p)


def test_a_library_open_asking_for_another_policy_is_warned_or_refused(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    with shmhb.Board.create(name) as created:
        asked = shmhb.Policy(dead_after_s=30, suspect_after_s=3)
        with caplog.at_level(logging.WARNING, logger="shmhb.board.handle"):
            with shmhb.Board.open(name, policy=asked) as b:
                assert b.policy == created.policy  # the board's applies
        msgs = [r.getMessage() for r in caplog.records]
        assert any("dead_after_s: board 10, asked 30" in m and "suspect_after_s: board 2, asked 3"
                   in m for m in msgs), msgs
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shmhb.board.handle"):
            shmhb.Board.open(name, dead_after_s=10.0).close()  # the same: silence
            shmhb.Board.open(name).close()  # nothing asked: silence
        assert not caplog.records
        with pytest.raises(shmhb.PolicyMismatch, match="asked 30"):
            shmhb.Board.open(name, policy=asked, strict_policy=True)


@pytest.mark.system
def test_policy_flags_are_checked_before_any_board_is_touched(name: str) -> None:
    out = subprocess.run([sys.executable, "-m", "shmhb", "pinger", "--board", name,
                          "--suspect-after-s", "5", "--dead-after-s", "2"],
                         env=child_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "dead_after_s must be >= suspect_after_s" in out.stderr
    with pytest.raises(shmhb.BoardNotFound):
        shmhb.Board.attach(name)


# -- who else may open the board: --board-mode and --board-group ----------------------------

def _group() -> tuple[str, int]:
    """A group this account may give a file other than its own primary one where it can
    (root: any; others: a supplementary group), so the change is visible."""
    import grp
    import os

    if os.geteuid() == 0:
        others = [g for g in grp.getgrall() if g.gr_gid != 0]
        if others:
            return others[0].gr_name, others[0].gr_gid
    gids = [g for g in os.getgroups() if g != os.getegid()] or [os.getegid()]
    return grp.getgrgid(gids[0]).gr_name, gids[0]


def _wait_held(name: str, p: subprocess.Popen[str]) -> None:
    def up() -> bool:
        assert p.poll() is None, _stop(p)
        try:
            with shmhb.Board.attach(name) as b:
                return b.agent().status is Status.ALIVE
        except shmhb.BoardNotFound:
            return False
    wait_until(up, timeout_s=20, what="the pinger holds the role")


@pytest.mark.system
def test_the_pinger_creates_the_board_for_a_group(name: str) -> None:
    import os
    import stat

    gname, gid = _group()
    p = _pinger(name, "--board-mode", "0660", "--board-group", gname)
    try:
        _wait_held(name, p)
        st = os.stat(f"/dev/shm/{name}")
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    finally:
        _stop(p)


@pytest.mark.system
def test_the_pinger_widens_an_existing_board_and_refuses_bad_modes(name: str) -> None:
    import os
    import stat

    with shmhb.Board.create(name):
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
        p = _pinger(name, "--board-mode", "0640")
        try:
            _wait_held(name, p)
            assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o640
        finally:
            _stop(p)
        for bad in ("0400", "660x", "01660"):
            out = subprocess.run([sys.executable, "-m", "shmhb", "pinger", "--board", name,
                                  "--board-mode", bad], env=child_env(), capture_output=True,
                                 text=True, timeout=30)
            assert out.returncode == 2 and "--board-mode" in out.stderr, (bad, out.stderr)
        out = subprocess.run([sys.executable, "-m", "shmhb", "pinger", "--board", name,
                              "--board-group", "no-such-group-xyz"], env=child_env(),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and "no group 'no-such-group-xyz'" in out.stderr
        import grp
        gid = grp.getgrall()[-1].gr_gid  # a numeric gid, as in a container with no /etc/group
        p = _pinger(name, "--board-group", str(gid))
        try:
            _wait_held(name, p)
            assert os.stat(f"/dev/shm/{name}").st_gid == gid
        finally:
            _stop(p)
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o640  # untouched


@pytest.mark.system
def test_the_units_carry_the_boards_mode_and_group(tmp_path: Any) -> None:
    gname, _ = _group()
    out = subprocess.run([sys.executable, "-m", "shmhb", "units", "--out", str(tmp_path),
                          "--board-mode", "0660", "--board-group", gname, *install_args()],
                         env=install_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    env = (tmp_path / "shmhb.env").read_text()
    assert f"\nSHMHB_PINGER_ARGS=--board-mode 0660 --board-group {gname}\n" in env

