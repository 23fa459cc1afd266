"""A stray second ``shmhb pinger`` on a board whose pinger runs with other settings: the
stored settings change under a holder only when the operator says so
(``--replace-settings``), and never lose their authentication silently.  A stray with
other flags is refused at once (exit 2, the differences named); one with the board's
settings, or none, is a standby that changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import shmhb
from shmhb.cli.exits import EXIT_ERROR
from shmhb.net.settings import settings_differences, stored_settings
from shmhb.testing.loopback import child_env

from ..conftest import wait_until
from ..hosts import Cluster, Host, cluster_fixture, status, write_secret

SECRET = b"cluster-secret-0123456789abcdef!"


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[Cluster]:
    yield from cluster_fixture(tmp_path)


def _pinger(h: Host, *flags: str) -> subprocess.CompletedProcess[str] | subprocess.Popen[bytes]:
    return h.cluster.spawn([sys.executable, "-m", "shmhb", "pinger", "--board", h.name,
                            "--tick-s", "0.02", *flags], f"{h.name}-stray")


def _run(h: Host, *flags: str) -> subprocess.CompletedProcess[str]:
    """A pinger that is expected to be refused at once: its exit and its stderr."""
    return subprocess.run([sys.executable, "-m", "shmhb", "pinger", "--board", h.name,
                           "--tick-s", "0.02", *flags], capture_output=True, text=True,
                          timeout=60, env=child_env())


def _secret_host(cluster: Cluster, tmp: Any) -> Host:
    secret = write_secret(os.path.join(str(tmp), "secret"), SECRET)
    a = cluster.host(secret_file=secret, peers=("127.0.0.7",))
    wait_until(lambda: a.board.network().auth == "hmac", what="the holder runs with its secret")
    return a


@pytest.mark.system
def test_a_stray_pinger_with_other_flags_is_refused_and_changes_nothing(
        cluster: Cluster, tmp_path: Any) -> None:
    a = _secret_host(cluster, tmp_path)
    gen = a.board.network().settings_gen
    before = stored_settings(a.board)
    stray = _run(a, "--listen", f"127.0.0.8:{cluster.port}", "--peer", "127.0.0.6",
                 "--peer", "127.0.0.5")
    assert stray.returncode == EXIT_ERROR, stray
    err = stray.stderr
    assert "another shmhb pinger runs on this board" in err, err
    assert f"listen: board {a.listen}, asked 127.0.0.8:{cluster.port}" in err, err
    assert "authentication: board secret file" in err and "asked none" in err, err
    assert "--replace-settings" in err, err
    assert stored_settings(a.board) == before
    _, doc = status(a)
    assert doc["network"]["auth"] == "hmac", doc["network"]
    assert doc["network"]["settings_gen"] == gen and doc["network"]["listen"] == a.listen


@pytest.mark.system
def test_a_standby_with_the_boards_settings_or_none_changes_nothing(
        cluster: Cluster, tmp_path: Any) -> None:
    a = _secret_host(cluster, tmp_path)
    gen = a.board.network().settings_gen
    same = a.pinger_cmd()[3:]  # the holder's own flags: pinger --board NAME ...
    for flags in (same, ["pinger", "--board", a.name]):
        p = a.cluster.spawn([sys.executable, "-m", "shmhb", *flags], f"{a.name}-standby")
        wait_until(lambda: "waiting for the agent role" in a.cluster.log_tail(p),
                   timeout_s=20, what="the standby runs")
        assert p.poll() is None
    assert a.board.network().settings_gen == gen  # not stored again: no restart of the half


@pytest.mark.system
def test_replace_settings_changes_them_under_the_holder(cluster: Cluster,
                                                        tmp_path: Any) -> None:
    a = _secret_host(cluster, tmp_path)
    gen = a.board.network().settings_gen
    p = _pinger(a, "--listen", a.listen, "--secret-file", a.secret_file or "",
                "--interval-s", "0.1", "--replace-settings")
    wait_until(lambda: a.board.network().settings_gen == gen + 1, timeout_s=20,
               what="the replaced settings applied by the holder")
    stored = stored_settings(a.board)
    assert stored is not None and stored.interval_s == 0.1 and stored.peers == ()
    assert isinstance(p, subprocess.Popen) and p.poll() is None


@pytest.mark.system
def test_a_restart_with_new_flags_is_stored_but_never_drops_the_secret_silently(
        cluster: Cluster, tmp_path: Any) -> None:
    a = _secret_host(cluster, tmp_path)
    a.kill_pinger()  # the restart: no pinger runs now
    refused = _run(a, "--listen", a.listen)
    assert refused.returncode == EXIT_ERROR, refused
    assert "turn off the authentication" in refused.stderr, refused.stderr
    assert (stored_settings(a.board) or shmhb.PingerConfig()).secret_file == a.secret_file
    p = _pinger(a, "--listen", a.listen, "--secret-file", a.secret_file or "",
                "--peer", "127.0.0.6")
    assert isinstance(p, subprocess.Popen)
    wait_until(lambda: (s := stored_settings(a.board)) is not None and s.peers == ("127.0.0.6",),
               timeout_s=20, what="a restart's new flags stored")
    a.wait_pinger(p)
    wait_until(lambda: a.board.network().state == "listening", what="the restarted half runs")
    assert a.board.network().auth == "hmac"


def test_the_differences_are_named_in_the_boards_units() -> None:
    have = shmhb.PingerConfig(listen="10.0.0.1:45645", peers=("10.0.0.2",), interval_s=0.2,
                              secret_file="/etc/shmhb/secret")
    assert settings_differences(have, have) == []
    # what the board stores reads back the same: 0.2 s as nanoseconds, the budget in
    # thousandths of a ping per second
    assert settings_differences(have, shmhb.PingerConfig(
        listen="10.0.0.1:45645", peers=("10.0.0.2",), interval_s=0.2 + 1e-12,
        secret_file="/etc/shmhb/secret")) == []
    got = settings_differences(have, shmhb.PingerConfig(listen="10.0.0.1:45646",
                                                        interval_s=0.5))
    assert got == ["listen: board 10.0.0.1:45645, asked 10.0.0.1:45646",
                   "authentication: board secret file /etc/shmhb/secret, asked none",
                   "peers: board 10.0.0.2, asked none",
                   "interval_s: board 0.2, asked 0.5"]
