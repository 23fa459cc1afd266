"""An engine's drain on SIGTERM (shmhb.board.drain): the pure rule, and a real process
whose instance reads draining at once, which serves what it owes and then runs the
SIGTERM handling it had, within its timeout; a second SIGTERM ends it at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

import shmhb
from shmhb.board.drain import DrainConfig, DrainEnd, SigtermDrain, decide
from shmhb.board.instances import board_instances
from shmhb.errors import InvalidConfig
from shmhb.testing.loopback import child_env
from tests.children import child
from tests.conftest import Procs, wait_until

ENGINE = child("draining_engine")


def test_a_drain_ends_when_nothing_is_owed_or_at_its_deadline() -> None:
    assert decide(0, 5, 10) is DrainEnd.DONE
    assert decide(0, 50, 10) is DrainEnd.DONE
    assert decide(3, 5, 10) is None
    assert decide(3, 10, 10) is DrainEnd.TIMEOUT


def test_drain_settings_are_checked() -> None:
    for bad in (-1.0, 86401.0, True, "5"):
        with pytest.raises(InvalidConfig):
            DrainConfig(timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig):
        DrainConfig(poll_s=0.0)


def test_no_drain_where_it_is_off_or_off_the_main_thread(board: shmhb.Board) -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert not SigtermDrain(board, "e", lambda: 1, DrainConfig(timeout_s=0)).install()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(SigtermDrain(board, "e", lambda: 1).install()))
    t.start()
    t.join()
    assert got == [False]
    assert signal.getsignal(signal.SIGTERM) is before


def engine(procs: Procs, board: shmhb.Board, timeout_s: float, *extra: str
           ) -> subprocess.Popen[str]:
    """The child, ``ready``, owing 1; commands on its stdin."""
    p = subprocess.Popen([sys.executable, ENGINE, board.name, "eng-d", str(timeout_s), *extra],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
    procs.procs.append(p)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def owe(p: subprocess.Popen[str], n: int) -> None:
    assert p.stdin is not None
    p.stdin.write(f"owed {n}\n")
    p.stdin.flush()


def draining(board: shmhb.Board) -> bool:
    (i,) = board_instances(board, remote=False)
    return i.draining


def test_a_sigterm_drains_what_is_owed_then_runs_the_handler_it_had(
        procs: Procs, board: shmhb.Board) -> None:
    p = engine(procs, board, 30.0)
    assert not draining(board)
    p.send_signal(signal.SIGTERM)
    wait_until(lambda: draining(board), timeout_s=5, what="the instance read draining")
    (i,) = board_instances(board, remote=False)
    assert i.status is shmhb.Status.ALIVE  # draining is no death verdict
    time.sleep(0.3)  # a window: a drain that did not wait would have ended the process
    assert p.poll() is None
    t0 = time.monotonic()
    owe(p, 0)
    assert p.stdout is not None and p.stdout.readline() == "stopping\n"
    assert p.wait(10) == 0
    assert time.monotonic() - t0 < 5
    (i,) = board_instances(board, remote=False)
    assert i.status is shmhb.Status.LEFT and not i.draining  # the drain slot left after it


def test_a_drain_ends_at_its_timeout(procs: Procs, board: shmhb.Board) -> None:
    p = engine(procs, board, 0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.stdout is not None and p.stdout.readline() == "stopping\n"
    took = time.monotonic() - t0
    assert 0.45 <= took <= 5, took
    assert p.wait(10) == 0


def test_a_second_sigterm_ends_the_drain_at_once(procs: Procs, board: shmhb.Board) -> None:
    p = engine(procs, board, 60.0)
    p.send_signal(signal.SIGTERM)
    wait_until(lambda: draining(board), timeout_s=5, what="the instance read draining")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.stdout is not None and p.stdout.readline() == "stopping\n"
    assert time.monotonic() - t0 < 5
    assert p.wait(10) == 0


def test_in_front_of_the_default_action_the_process_ends_by_the_signal(
        procs: Procs, board: shmhb.Board) -> None:
    p = engine(procs, board, 30.0, "dfl")
    p.send_signal(signal.SIGTERM)
    wait_until(lambda: draining(board), timeout_s=5, what="the instance read draining")
    assert p.poll() is None
    owe(p, 0)
    assert p.wait(10) == -signal.SIGTERM
