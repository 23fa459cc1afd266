"""The exporter under slowloris: 125 half-sent requests, re-opened as
fast as the exporter closes them, against a real ``shmhb exporter`` process limited to
128 file descriptors.  Normal scrapes still get through, and the exporter holds a
bounded number of threads.  Before, every half-sent request held a thread and an fd for
as long as its client liked: 123 threads, the fd limit reached, scrapes timed out."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import shmhb
from shmhb.cli.httpserve import MAX_CONNECTIONS
from shmhb.testing.loopback import child_env

from ..conftest import Procs

HALF = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never ends its headers


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


class Slowloris:
    """``n`` connections that each send a request's first bytes, then one more byte now
    and then (never the blank line that ends the headers); a connection the server
    closes is opened again at once."""

    def __init__(self, host: str, port: int, n: int) -> None:
        self.addr = (host, port)
        self.socks: list[socket.socket | None] = [None] * n
        self.reopened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> None:
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(self.addr)
            s.sendall(HALF)
            s.setblocking(False)
        except OSError:
            s.close()
            return
        self.socks[i] = s

    def _run(self) -> None:
        for i in range(len(self.socks)):
            self._open(i)
        while not self.stop.wait(0.05):
            for i, s in enumerate(self.socks):
                if s is None:
                    self._open(i)
                    continue
                try:
                    if s.recv(1024) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    try:
                        s.send(b"x")  # a trickle: a per-byte timeout never fires
                    except OSError:
                        pass
                    continue
                except OSError:
                    pass
                s.close()
                self.socks[i] = None
                self.reopened += 1
                self._open(i)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()


def test_a_scrape_gets_through_125_slow_clients_at_128_fds(board: shmhb.Board, procs: Procs) -> None:
    procs.worker(board.name, "w")
    p = subprocess.Popen([sys.executable, "-m", "shmhb", "exporter", "--board", board.name,
                          "--port", "0", "--addr", "127.0.0.1"], stdout=subprocess.PIPE,
                         text=True, env=child_env(), preexec_fn=_limit_fds)
    attack = None
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert m, line
        url, port = m.group(0), int(m.group(1))
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
        base = _threads(p.pid)  # main, the serve loop and whatever the exporter runs
        attack = Slowloris("127.0.0.1", port, 125)
        attack.thread.start()
        deadline = time.monotonic() + 30
        while sum(s is not None for s in attack.socks) < 125:  # every one connected once
            assert time.monotonic() < deadline, "the slow clients never all connected"
            time.sleep(0.05)
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read().decode()
            took.append(time.monotonic() - t0)
            assert r.status == 200 and 'shmhb_slot_status{key="w"' in body
            threads = _threads(p.pid)
            # a handler per open connection, plus a few closed ones still finishing
            assert threads <= base + MAX_CONNECTIONS + 4, (threads, base)
        deadline = time.monotonic() + 10
        while attack.reopened == 0:  # the server closed slow clients to make room
            assert time.monotonic() < deadline, "no slow client was ever closed"
            time.sleep(0.05)
        assert max(took) < 10, took
        assert p.poll() is None
    finally:
        if attack is not None:
            attack.close()
        p.kill()
        p.wait(10)
        if p.stdout:
            p.stdout.close()
