"""The pinger's listening socket (shmhb.net.listener), with real sockets on loopback: a
holder that replaces a stopped one listens beside it and takes every new connection;
nothing else may join a listener, nor listen beside a stranger."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Iterator

import pytest

from shmhb.net.listener import listeners_on, listens_there, open_listener
from shmhb.testing.loopback import free_port

IP = ipaddress.ip_address("127.0.0.1")


@pytest.fixture
def port() -> int:
    return free_port(["127.0.0.1"])


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def _connect(port: int, n: int, opened: list[socket.socket]) -> None:
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        opened.append(c)  # established by the kernel, whoever accepts it


def _accept_all(s: socket.socket, opened: list[socket.socket]) -> int:
    got = 0
    while True:
        try:
            c, _ = s.accept()
        except BlockingIOError:
            return got
        opened.append(c)
        got += 1


def test_the_holder_beside_a_stopped_one_gets_every_new_connection(
        port: int, opened: list[socket.socket]) -> None:
    stopped = open_listener(IP, port)  # never accepts: a holder stopped as a whole
    opened.append(stopped)
    _connect(port, 3, opened)  # before the new holder: queued at the stopped one
    new = open_listener(IP, port, beside=True)
    opened.append(new)
    assert listeners_on(IP, port) == 2
    _connect(port, 40, opened)  # a plain reuseport group would hash about half away
    assert _accept_all(new, opened) == 40
    assert _accept_all(stopped, opened) == 3


def test_the_kernel_hash_moves_to_the_holder_left_once_the_stopped_one_closes(
        port: int, opened: list[socket.socket]) -> None:
    stopped = open_listener(IP, port)
    new = open_listener(IP, port, beside=True)
    opened.append(new)
    stopped.close()  # it resumed and stood down: the steering index is past the end now
    _connect(port, 10, opened)
    assert _accept_all(new, opened) == 10


def test_a_second_listener_not_told_to_share_is_refused(port: int,
                                                        opened: list[socket.socket]) -> None:
    opened.append(open_listener(IP, port))
    with pytest.raises(OSError) as e:
        open_listener(IP, port)
    assert e.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_no_listening_beside_a_stranger(port: int, opened: list[socket.socket],
                                        host: str) -> None:
    """A listener that is not a shmhb holder (no SO_REUSEPORT), on the address or on a
    wildcard covering it, cannot be joined even when told to: EADDRINUSE, as a bind."""
    other = socket.socket()
    opened.append(other)
    other.bind((host, port))
    other.listen(1)
    for beside in (False, True):
        with pytest.raises(OSError) as e:
            open_listener(IP, port, beside=beside)
        assert e.value.errno == errno.EADDRINUSE
    assert listeners_on(IP, port) == (1 if host == "127.0.0.1" else 0)


def test_an_address_not_on_this_host_is_refused_as_a_bind_would(port: int) -> None:
    with pytest.raises(OSError) as e:
        open_listener(ipaddress.ip_address("192.0.2.1"), port)
    assert e.value.errno == errno.EADDRNOTAVAIL


def test_who_listens_is_told_from_the_processes_descriptors(
        port: int, opened: list[socket.socket]) -> None:
    """What lets a successor join only its stopped predecessor's listener."""
    assert not listens_there(os.getpid(), IP, port)  # nothing listens there yet
    opened.append(open_listener(IP, port))
    assert listens_there(os.getpid(), IP, port)
    assert not listens_there(os.getppid(), IP, port)  # another process: not its listener
    assert not listens_there(0, IP, port)
