"""shmhb.testing.loopback: the addresses, the free-port check and the child environment that the
demo, the example, the tests and the benchmarks share."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import sys

import pytest

from shmhb.errors import InvalidConfig
from shmhb.testing.loopback import (OFFLINE_ENV, PORT_HI, PORT_LO, child_env, free_port,
                                    loopback_addrs)


def test_free_port_gives_a_run_of_ports_free_on_every_host() -> None:
    hosts = ["127.0.0.1", *loopback_addrs(2)]
    port = free_port(hosts, span=3)
    assert PORT_LO <= port and port + 3 <= PORT_HI
    socks = []
    try:
        for h in hosts:
            for p in range(port, port + 3):
                s = socket.socket()
                socks.append(s)
                s.bind((h, p))  # raises if the check lied
    finally:
        for s in socks:
            s.close()


def test_free_port_skips_a_port_taken_on_one_host_and_says_when_none_is_left() -> None:
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]

        class Fixed(random.Random):
            def randrange(self, *_: object, **__: object) -> int:  # type: ignore[override]
                return int(busy)
        with pytest.raises(OSError) as exc:
            free_port(["127.0.0.1"], rng=Fixed(), tries=3)
        assert exc.value.errno == errno.EADDRINUSE
    finally:
        taken.close()
    with pytest.raises(InvalidConfig):
        free_port(["127.0.0.1"], span=0)


def test_free_port_never_gives_an_avoided_port_even_when_it_is_free() -> None:
    """The vLLM stack's bootstrap port sat unbound between a kill and a restart; a
    TCPStore given the same port (bound on every address) then made the restart fail."""
    class Cycle(random.Random):
        def __init__(self, ports: list[int]) -> None:
            super().__init__()
            self.ports = ports

        def randrange(self, *_: object, **__: object) -> int:  # type: ignore[override]
            return self.ports.pop(0)
    lo = free_port(["127.0.0.1"], span=4)
    assert free_port(["127.0.0.1"], rng=Cycle([lo, lo + 1, lo + 2]), avoid={lo, lo + 1}) == lo + 2
    # a run of ports is refused when any port in it is avoided
    assert free_port(["127.0.0.1"], span=2, rng=Cycle([lo, lo + 2]), avoid={lo + 1}) == lo + 2
    with pytest.raises(OSError) as exc:
        free_port(["127.0.0.1"], span=2, rng=Cycle([lo, lo + 1, lo]), avoid={lo + 1}, tries=3)
    assert exc.value.errno == errno.EADDRINUSE


@pytest.mark.system
def test_child_env_puts_this_checkout_first_and_keeps_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(EXTRA="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"] and env["EXTRA"] == "1"
    out = subprocess.run([sys.executable, "-c", "import shmhb, tests; print(shmhb.__file__)"],
                         env=env, cwd="/", capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().startswith(root), out.stderr


def test_child_env_is_offline_for_every_hub_and_the_caller_may_not_undo_it_by_accident(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "https://example.invalid")
    env = child_env()
    assert {k: env[k] for k in OFFLINE_ENV} == OFFLINE_ENV
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_ENDPOINT"].startswith("http://127.")
