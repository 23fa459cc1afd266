"""systemd's notify protocol: ``shmhb pinger`` under a real AF_UNIX datagram socket as
``$NOTIFY_SOCKET`` says READY=1, feeds the watchdog while its agent makes progress,
and says STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from shmhb.cli import sdnotify
from shmhb.testing.loopback import child_env

from ..conftest import unlink_quietly


@pytest.fixture
def sock(tmp_path: object) -> Iterator[tuple[socket.socket, str]]:
    path = os.path.join(str(tmp_path), "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(20)
    yield s, path
    s.close()


def _recv_until(s: socket.socket, want: str, timeout_s: float = 20.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msg = s.recv(4096).decode()
        except socket.timeout:
            break
        got.append(msg)
        if want in msg.split("\n"):
            return got
    raise AssertionError(f"no {want!r} in {got}")


def test_notify_sends_a_datagram_and_is_a_no_op_without_a_socket(
        sock: tuple[socket.socket, str]) -> None:
    s, path = sock
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": path})
    assert s.recv(100) == b"READY=1"
    assert not sdnotify.notify("READY=1", {})  # outside systemd
    assert not sdnotify.notify("READY=1", {"NOTIFY_SOCKET": path + "-gone"})  # logged, not raised
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "2000000"}) == 2.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval_s({}) is None


def test_an_abstract_notify_socket() -> None:
    name = f"shmhb-test-{uuid.uuid4().hex[:8]}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert sdnotify.notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(100) == b"WATCHDOG=1"


@pytest.mark.system
def test_the_pinger_is_ready_feeds_the_watchdog_and_says_stopping(
        sock: tuple[socket.socket, str]) -> None:
    s, path = sock
    board = f"shmhb-test-nfy-{uuid.uuid4().hex[:8]}"
    env = child_env(NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    p = subprocess.Popen([sys.executable, "-m", "shmhb", "pinger", "--board", board,
                          "--tick-s", "0.02"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        _recv_until(s, "READY=1")
        for _ in range(3):  # fed again and again while its agent makes progress
            _recv_until(s, "WATCHDOG=1", timeout_s=5)
        p.terminate()
        _recv_until(s, "STOPPING=1", timeout_s=10)
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
        unlink_quietly(board)
