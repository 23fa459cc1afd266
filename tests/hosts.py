"""Simulated hosts on one machine, for the pinger tests.

Each :class:`Host` is what a real machine would be: its own board (a unique name), its
own ``shmhb pinger`` subprocess bound to its own loopback address (127.0.0.2,
127.0.0.3, ...; the whole 127/8 is loopback on Linux), its own workers.  A
:class:`Cluster` gives all its hosts one pinger port (the port is one number for the
cluster), chosen free for this run, and removes every process and board afterwards.

:class:`FakePeer` is a hand-driven ROUTER at a watched host's pinger address: the test
decides how (and whether) each ping is answered, and what it pushes.  ``NetNs`` builds
two network namespaces joined by a veth pair for a real partition.

No fixed sleeps anywhere: everything waits on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import zmq

import shmhb
from shmhb import Status
from shmhb.board.core import board_words
from shmhb.net.evidence import passive
from shmhb.testing.loopback import child_env, free_port
from shmhb.net.protocol import (
    Ack, DigestEntry, FrameRejected, Identity, Ping, Push, decode, encode_ack, encode_ping, encode_push,
)

from .children import child
from .conftest import Procs, unlink_quietly, wait_until
from .stopping import kill

#: Local slots and remote hosts both judged on short timeouts, so tests stay quick.
FAST = shmhb.Policy(suspect_after_s=0.5, dead_after_s=1.5,
                    peer_suspect_after_s=0.5, peer_dead_after_s=1.5)
INTERVAL_S = 0.2
MAX_HOSTS = 8  # 127.0.0.2 .. 127.0.0.9 are checked free when the port is chosen



WALL_SHIFTED = child("wall_shifted")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def listening(pid: int, ip: str, port: int) -> bool:
    """Whether process ``pid``'s network namespace has a TCP socket listening on ip:port
    (read from /proc/PID/net/tcp, which shows that process's namespace)."""
    want = "%08X:%04X" % (int.from_bytes(socket.inet_aton(ip), "little"), port)
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            next(f)
            return any(parts[1] == want and parts[3] == "0A"
                       for parts in (line.split() for line in f))
    except OSError:
        return False


class Host:
    """One simulated host: a board and (at most one running) pinger process at a time,
    plus any standby pingers the test starts."""

    def __init__(self, cluster: Cluster, ip: str, *, policy: shmhb.Policy, slots: int,
                 interval_s: float, secret_file: str | None, curve_keys: str | None,
                 netns: str | None, peers: tuple[str, ...] = (),
                 board_peers: int | None = None, remote_slots: int | None = None) -> None:
        self.cluster = cluster
        self.ip = ip
        self.port = cluster.port
        self.listen = f"{ip}:{cluster.port}"
        self.interval_s = interval_s
        self.secret_file = secret_file
        self.curve_keys = curve_keys
        self.netns = netns
        self.peers = peers
        self.name = f"shmhb-test-h{ip.replace('.', '-')}-{uuid.uuid4().hex[:8]}"
        self.board = shmhb.Board.create(self.name, slots=slots, policy=policy, peers=board_peers,
                                        remote_slots=remote_slots)
        cluster._boards.append(self)
        self.pinger: subprocess.Popen[bytes] | None = None
        self._n = 0

    def __repr__(self) -> str:
        return f"<Host {self.listen} board={self.name}>"

    # -- the pinger ---------------------------------------------------------------------

    def pinger_cmd(self, *, configure: bool = True, wall_offset_s: float = 0.0) -> list[str]:
        """``wall_offset_s``: run it with CLOCK_REALTIME shifted by that much, as after
        a wall-clock step (Python's ``time.time``/``time_ns`` of that process; stepping
        the real clock needs root and would move every process of the machine)."""
        run = [WALL_SHIFTED, repr(wall_offset_s)] if wall_offset_s else ["-m", "shmhb"]
        cmd = [sys.executable, *run, "pinger", "--board", self.name, "--tick-s", "0.02"]
        if configure:
            cmd += ["--listen", self.listen, "--interval-s", str(self.interval_s)]
            if self.secret_file:
                cmd += ["--secret-file", self.secret_file]
            if self.curve_keys:
                cmd += ["--curve-keys", self.curve_keys]
            for p in self.peers:
                cmd += ["--peer", p]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        return cmd

    def start_pinger(self, *, configure: bool = True, wait: bool = True,
                     wall_offset_s: float = 0.0) -> subprocess.Popen[bytes]:
        """Start ``shmhb pinger`` for this host.  ``configure=False``: a bare standby that
        applies the settings stored in the board.  ``wait``: until it holds the role and
        listens.  ``wall_offset_s``: see ``pinger_cmd``."""
        self._n += 1
        p = self.cluster.spawn(self.pinger_cmd(configure=configure, wall_offset_s=wall_offset_s),
                               f"{self.name}-pinger{self._n}")
        if wait:
            self.wait_pinger(p)
        if self.pinger is None or self.pinger.poll() is not None:
            self.pinger = p
        return p

    def wait_pinger(self, p: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
        def ready() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"pinger of {self} exited with {p.returncode}:\n"
                                     + self.cluster.log_tail(p))
            a = self.board.agent()
            return (a.pid == p.pid and a.status is Status.ALIVE
                    and listening(p.pid, self.ip, self.port))
        try:
            wait_until(ready, timeout_s=timeout_s, poll_s=0.01, what=f"pinger of {self} ready")
        except AssertionError:
            if "cannot listen" in self.cluster.log_tail(p):
                raise AssertionError(f"{self}: port {self.port} was taken after it was chosen "
                                     "(another program?)") from None
            raise
        self.pinger = p

    def kill_pinger(self) -> None:
        assert self.pinger is not None
        self.pinger.kill()
        self.pinger.wait(10)

    # -- workers and reads ------------------------------------------------------------------

    def endpoint(self, n: int) -> str:
        """A worker endpoint on this host (its port is arbitrary: only the host matters
        to the pinger, which pings the host at the cluster's pinger port)."""
        return f"{self.ip}:{30000 + n}"

    def worker(self, key: str, *endpoints: str, interval_s: float = 0.05) -> subprocess.Popen[str]:
        return self.cluster.procs.worker(self.name, key, interval_s=interval_s,
                                         endpoints=",".join(endpoints))

    def gated_worker(self, key: str, *endpoints: str) -> GatedWorker:
        """A worker process started now that registers only when told (:meth:`GatedWorker.go`),
        so a test can time its registration to the millisecond."""
        p = self.cluster.spawn_text([sys.executable, GATED_WORKER, self.name, key,
                                     ",".join(endpoints)])
        return GatedWorker(p)

    def watch(self, other: Host, n: int = 1) -> None:
        self.board.watch(other.endpoint(n))

    def peer(self, other: Host | str) -> shmhb.PeerStatus | None:
        return self.board.peer(other.ip if isinstance(other, Host) else other)

    def peer_status(self, other: Host | str) -> Status | None:
        p = self.peer(other)
        return None if p is None else p.status

    def remote(self, endpoint: str) -> shmhb.SlotStatus | None:
        return self.board.remote(endpoint)

    def remote_status(self, endpoint: str) -> Status | None:
        r = self.board.remote(endpoint)
        return None if r is None else r.status

    def stats(self) -> dict[str, int]:
        return self.board.stats()


class Cluster:
    """Hosts on 127.0.0.2, 127.0.0.3, ... sharing one pinger port; cleans up everything."""

    def __init__(self, tmp: str, procs: Procs) -> None:
        self.tmp = tmp
        self.procs = procs
        # 127.0.0.1 too: a host there is the one whose pings leave from its own address
        self.port = free_port([f"127.0.0.{1 + i}" for i in range(MAX_HOSTS + 1)])
        self._boards: list[Host] = []
        self._spawned: list[tuple[subprocess.Popen[bytes], str]] = []
        self.hosts: list[Host] = []

    def host(self, *, policy: shmhb.Policy = FAST, slots: int = 64,
             interval_s: float = INTERVAL_S, secret_file: str | None = None,
             curve_keys: str | None = None, ip: str | None = None, netns: str | None = None,
             peers: tuple[str, ...] = (), start: bool = True,
             board_peers: int | None = None, remote_slots: int | None = None) -> Host:
        if ip is None:
            assert len(self.hosts) < MAX_HOSTS - 1, "too many hosts (127.0.0.9 is kept for fakes)"
            ip = f"127.0.0.{2 + len(self.hosts)}"
        h = Host(self, ip, policy=policy, slots=slots, interval_s=interval_s,
                 secret_file=secret_file, curve_keys=curve_keys, netns=netns, peers=peers,
                 board_peers=board_peers, remote_slots=remote_slots)
        self.hosts.append(h)
        if start:
            h.start_pinger()
        return h

    def spare_ip(self) -> str:
        """A loopback address no host of this cluster uses (for a fake peer)."""
        return f"127.0.0.{1 + MAX_HOSTS}"

    def spawn(self, cmd: list[str], label: str, **kw: Any) -> subprocess.Popen[bytes]:
        env = child_env()
        log = open(os.path.join(self.tmp, label + ".log"), "wb")
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, **kw)
        finally:
            log.close()
        self._spawned.append((p, label))
        return p

    def spawn_text(self, cmd: list[str]) -> subprocess.Popen[str]:
        """A helper process with pipes for stdin and stdout, killed at teardown."""
        env = child_env()
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.procs.procs.append(p)  # reaped by Procs.cleanup
        return p

    def log_tail(self, p: subprocess.Popen[bytes], lines: int = 30) -> str:
        for q, label in self._spawned:
            if q is p:
                with open(os.path.join(self.tmp, label + ".log"), "rb") as f:
                    return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        return ""

    def close(self) -> None:
        for p, _ in self._spawned:  # all killed at once, then each reaped
            kill(p)
        for p, _ in self._spawned:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for h in self._boards:
            h.board.close()
            unlink_quietly(h.name)
        for q in self.procs.procs:  # the pipes of spawn_text helpers (already reaped)
            if q.stdin is not None:
                q.stdin.close()

    def dump_logs(self) -> None:
        """Print every pinger log (pytest shows it only when the test fails)."""
        for p, label in self._spawned:
            print(f"----- {label} (pid {p.pid}, rc {p.poll()}) -----")
            print(self.log_tail(p, 60))


C = TypeVar("C", bound="Cluster")


def cluster_fixture(tmp_path: Any, make: Callable[[str, Procs], C] | None = None) -> Iterator[C]:
    """Body of the ``cluster`` fixture of the test modules (``make``: another kind of
    cluster, e.g. ``tests.oldrelease.MixedCluster``); its logs dumped, all removed after."""
    procs = Procs()
    c = make(str(tmp_path), procs) if make is not None else cast(C, Cluster(str(tmp_path), procs))
    try:
        yield c
    finally:
        try:
            c.dump_logs()
        finally:
            procs.cleanup()
            c.close()


def write_secret(path: str, secret: bytes) -> str:
    """A secret file as the pinger wants it: readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return path


# -- a fake peer: a hand-driven ROUTER at a watched address -------------------------------

class FakePeer:
    """A ROUTER bound at ``ip:port`` that stands in for a remote host's pinger.

    Nothing happens by itself: :meth:`next_ping` receives the next ping from the
    watcher, :meth:`ack` answers it, :meth:`send` sends any frame (a push, a replayed
    ack) to the watcher's DEALER.  ``serve_until`` answers every ping with the current
    digest ``self.entries`` while waiting for a condition."""

    def __init__(self, ip: str, port: int, *, secret: bytes | None = None) -> None:
        self.ip, self.port = ip, port
        self.body_age_ms = 0  # what its full acks say of their body's age
        self.address = f"{ip}:{port}"
        self.secret = secret
        self.identity = Identity(os.urandom(16), random.getrandbits(62) | 1)
        self.entries: dict[str, DigestEntry] = {}
        self.gen = 1
        self.ctx = zmq.Context()
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.bind(f"tcp://{ip}:{port}")
        self.sock = s
        self.rid: bytes | None = None
        self.pings: list[Ping] = []
        self.answered = 0

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def set(self, *entries: DigestEntry) -> None:
        """Change the digest this peer reports (a new generation)."""
        for e in entries:
            self.entries[e.key] = e
        self.gen += 1

    def _recv(self, timeout_s: float) -> tuple[bytes, Ping] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        rid, frame = self.sock.recv_multipart()
        msg = decode(frame, self.secret)
        assert isinstance(msg, Ping), msg
        self.rid = rid
        self.pings.append(msg)
        return rid, msg

    def poll_ping(self, timeout_s: float) -> Ping | None:
        """The next ping if one arrives within ``timeout_s``, else None."""
        got = self._recv(timeout_s)
        return None if got is None else got[1]

    def next_ping(self, timeout_s: float = 10.0) -> Ping:
        got = self._recv(timeout_s)
        assert got is not None, f"no ping reached the fake peer at {self.address} in {timeout_s} s"
        return got[1]

    def ack_frame(self, nonce: int, *, identity: Identity | None = None,
                  secret: Any = "same") -> bytes:
        return encode_ack(Ack(nonce, identity or self.identity, self.address, self.gen, True,
                              tuple(self.entries.values()), body_age_ms=self.body_age_ms),
                          self.secret if secret == "same" else secret)

    def ack(self, ping: Ping, **kw: Any) -> bytes:
        frame = self.ack_frame(ping.nonce, **kw)
        self.send(frame)
        self.answered += 1
        return frame

    def send(self, frame: bytes) -> None:
        assert self.rid is not None, "no watcher has connected yet"
        self.sock.send_multipart([self.rid, frame])

    def push_frame(self, seq: int, *entries: DigestEntry, identity: Identity | None = None,
                   secret: Any = "same") -> bytes:
        return encode_push(Push(identity or self.identity, self.address, seq, self.gen, entries),
                           self.secret if secret == "same" else secret)

    def challenge(self) -> int:
        """The newest challenge the watcher sent in its pings (0: none yet)."""
        return next((p.challenge for p in reversed(self.pings) if p.challenge), 0)

    def drain(self, timeout_s: float) -> int:
        """Swallow the pings that arrive within ``timeout_s`` (leave them unanswered)."""
        n = 0
        end = time.monotonic() + timeout_s
        while self._recv(max(0.0, end - time.monotonic())) is not None:
            n += 1
        return n

    def serve_until(self, pred: Any, timeout_s: float = 10.0, what: str = "condition",
                    answer: bool = True) -> Any:
        """Answer (or, ``answer=False``, swallow) every ping until ``pred()`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = pred()
            if v:
                return v
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            got = self._recv(0.005)
            if got is not None and answer:
                self.ack(got[1])


class Dealer:
    """The fake peer's own pinger side: pings the host under test over its listen port."""

    def __init__(self, fake: FakePeer, target: str, source: str | None = None) -> None:
        self.fake = fake
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        # source: the address the connection leaves from (the kernel's choice if None)
        self.s.connect(f"tcp://{source}:0;{target}" if source else f"tcp://{target}")
        self.nonce = time.time_ns()
        self.known: tuple[int, Identity | None] = (0, None)

    def ping(self, *, nonce: int | None = None, gen: int | None = None,
             known: Identity | None | str = "same", identity: Identity | None = None,
             secret: bytes | None | str = "same", echo: int = 0, address: str | None = None,
             my_gen: int = 0) -> bytes:
        """``echo``: the challenge to echo (with one of ours, 1; 0: none);
        ``address``: the one it names (its own, behind a NAT; default the fake's);
        ``my_gen``: the fake's own digest generation (0: none)."""
        if nonce is None:
            self.nonce += 1
            nonce = self.nonce
        frame = encode_ping(Ping(identity or self.fake.identity, address or self.fake.address, nonce,
                                 self.known[0] if gen is None else gen,
                                 self.known[1] if known == "same" else known,  # type: ignore[arg-type]
                                 1 if echo else 0, echo, my_gen),
                            self.fake.secret if secret == "same" else secret)  # type: ignore[arg-type]
        self.s.send(frame)
        return frame

    def sync(self) -> None:
        """One honest ping, to learn the digest generation the host answers with.  Acks
        to earlier pings may wait unread: the one that counts answers this ping, and by
        the time it comes every earlier ping has been handled (they are drained in
        order), so a counter read after it is settled."""
        self.ping()
        while True:
            assert self.s.poll(5000), "no ack from the host under test"
            ack = decode(self.s.recv(), self.fake.secret)
            assert isinstance(ack, Ack)
            if ack.nonce == self.nonce:
                break
        self.known = (ack.gen, ack.identity)

    def close(self) -> None:
        self.s.close(0)
        self.ctx.term()


def followed_fake(cluster: Cluster, fake_peers: list[FakePeer]) -> tuple[Host, FakePeer]:
    """A real host following a fake peer (one live worker), once the
    fake reads ALIVE there and has received a challenge in the host's pings."""
    a = cluster.host()
    fake = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(fake)
    fake.set(entry("dec-0", 7, Status.ALIVE, f"{fake.ip}:30001"))
    a.board.watch(f"{fake.ip}:30001")
    fake.serve_until(lambda: a.peer_status(fake.ip) is Status.ALIVE and fake.challenge(),
                     what="fake ALIVE on a, and challenged")
    return a, fake


def fake_peers_fixture() -> Iterator[list[FakePeer]]:
    """Body of the ``fake_peers`` fixture: every FakePeer appended is closed after."""
    made: list[FakePeer] = []
    yield made
    for f in made:
        f.close()


def entry(key: str, inc: int, status: Status, *endpoints: str, pid: int = 4242) -> DigestEntry:
    return DigestEntry(key, inc, status.code, pid, 0, tuple(endpoints))


# -- a worker that registers on command ----------------------------------------------------

GATED_WORKER = child("gated_worker")


class GatedWorker:
    def __init__(self, p: subprocess.Popen[str]) -> None:
        self.p = p
        self.pid = p.pid
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline()
        assert line.strip() == "started", f"gated worker did not start: {line!r}"

    def go(self) -> int:
        """Register now; returns the incarnation once registered."""
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().split()
        assert line and line[0] == "ready", f"gated worker failed to register: {line!r}"
        return int(line[1])


# -- many workers in one process group -----------------------------------------------------

FORKED_WORKERS = child("forked_workers")


# -- network namespaces ------------------------------------------------------------------

def netns_unavailable() -> str | None:
    """Why a real partition cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"shmhbprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetNs:
    """Two namespaces joined by a veth pair: side a is 10.200.X.1, side b 10.200.X.2."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self.a, self.b = f"shmhbA{tag}", f"shmhbB{tag}"
        self.veth_a, self.veth_b = f"sha{tag}"[:15], f"shb{tag}"[:15]
        x = random.randrange(1, 255)
        self.ip_a, self.ip_b = f"10.200.{x}.1", f"10.200.{x}.2"
        self.made: list[str] = []
        try:
            for ns in (self.a, self.b):
                self._ip("netns", "add", ns)
                self.made.append(ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            # created inside namespace a, its peer moved to b: nothing appears on the host
            self._ip("-n", self.a, "link", "add", self.veth_a, "type", "veth",
                     "peer", "name", self.veth_b, "netns", self.b)
            for ns, dev, ip in ((self.a, self.veth_a, self.ip_a), (self.b, self.veth_b, self.ip_b)):
                self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def link(self, up: bool) -> None:
        self._ip("-n", self.a, "link", "set", self.veth_a, "up" if up else "down")

    def close(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


# -- what several test modules check a host by ---------------------------------------------

#: the invariant: a local SIGKILL is DEAD within this, whatever the network half does
KILL_BOUND_S = 1.0


def mutual_roles(x: Host, y: Host) -> tuple[Host, Host]:
    """(active, passive) of two hosts that follow each other: the passive side is the
    one with the larger board identity (``shmhb.net.evidence.passive``); board
    incarnations are random, so a test asks rather than picks."""
    ix, iy = (Identity(board_words(h.board).boot_id, h.board.board_inc) for h in (x, y))
    return (y, x) if passive(ix, iy) else (x, y)


def status(h: Host | str) -> tuple[int, dict[str, Any]]:
    """``shmhb status --json`` of a host (or a board name): (exit code, the document)."""
    name = h if isinstance(h, str) else h.name
    out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--json", "--board", name],
                         capture_output=True, text=True, timeout=60,
                         env=child_env())
    return out.returncode, json.loads(out.stdout)


def wait_net(h: Host, state: str, reason: str | None = None, timeout_s: float = 20.0
             ) -> shmhb.NetworkStatus:
    def ok() -> shmhb.NetworkStatus | None:
        n = h.board.network()
        return n if n.state == state and (reason is None or n.reason == reason) else None
    return wait_until(ok, timeout_s=timeout_s, poll_s=0.01,
                      what=f"network half of {h} {state} ({reason})")


def wait_held(h: Host, p: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    wait_until(lambda: h.board.agent().pid == p.pid and h.board.agent().status is Status.ALIVE,
               timeout_s=timeout_s, poll_s=0.01, what=f"pid {p.pid} holds the role of {h}")


def kill_is_dead_within_bound(h: Host, key: str) -> float:
    """Start a worker on ``h`` and SIGKILL it once it beats: DEAD within 1 s (whether the
    agent saw it through a pidfd or, killed before, convicts it at its next tick)."""
    w = h.worker(key, h.endpoint(7))
    wait_until(lambda: (s := h.board.slot(key)) is not None and s.status is Status.ALIVE,
               what=f"{key} alive")
    t0 = time.monotonic()
    w.kill()
    wait_until(lambda: (s := h.board.slot(key)) is not None and s.status is Status.DEAD,
               timeout_s=KILL_BOUND_S, poll_s=0.001, what=f"{key} DEAD within {KILL_BOUND_S} s")
    w.wait(10)
    return time.monotonic() - t0


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


FLOODER = child("flooder")




__all__ = [
    "FAST", "FLOODER", "FORKED_WORKERS", "INTERVAL_S", "KILL_BOUND_S", "Cluster", "FakePeer",
    "FrameRejected", "GatedWorker", "Host",
    "NetNs", "cluster_fixture", "entry", "fake_peers_fixture", "kill_is_dead_within_bound",
    "listening", "netns_unavailable", "open_fds", "rss_kb", "status", "wait_held", "wait_net",
    "write_secret",
]
