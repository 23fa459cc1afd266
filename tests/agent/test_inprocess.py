"""The agent loop and the network half in one process, step by step, on a FakeClock and
the in-process transport (``shmhb.testing.network``): no sleeps, no ports, no real-time
waits.  Time passes when a test advances the clock, frames move when it calls
``deliver()``, and every bound is measured in fake time or in steps.

The workers are real processes on real boards (a kill is a real SIGKILL seen through a
real pidfd); the agents are the production ``Agent`` and ``AgentLoop``, driven through
``Agent.elect`` and ``AgentLoop.step(0)``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import zmq

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.agent.role import Agent
from shmhb.agent.loop import AgentLoop
from shmhb.clock import FakeClock
from shmhb.board.config import AgentConfig, PingerConfig
from shmhb.testing.network import FakeNetwork
from shmhb.net.settings import store_config
from shmhb.net.protocol import Push, decode
from shmhb.net.transport import Transport

from ..conftest import Procs, unlink_quietly


TICK_S = 0.05
INTERVAL_S = 0.1
PEER_SUSPECT_S = 0.3
PEER_DEAD_S = 1.0
PORT = 5000
#: Local slots never go SUSPECT by age here: the workers beat on the real clock, the
#: agents judge on the fake one, which runs ahead (AHEAD_NS).  Deaths come from pidfds.
POLICY = shmhb.Policy(suspect_after_s=600.0, dead_after_s=1200.0,
                      peer_suspect_after_s=PEER_SUSPECT_S, peer_dead_after_s=PEER_DEAD_S)
CONFIG = AgentConfig(tick_s=TICK_S)
AHEAD_NS = 100 * 10**9
#: a verdict read at the tick after it is due: the bounds below allow one tick more
SLACK_S = TICK_S + 1e-6


def _name() -> str:
    return f"shmhb-test-{uuid.uuid4().hex[:12]}"


class Host:
    """One simulated host: its board, its agent holding the role, the agent's loop."""

    def __init__(self, clock: FakeClock, net: FakeNetwork | None, ip: str,
                 peers: tuple[str, ...] = ()) -> None:
        self.ip = ip
        self.address = f"{ip}:{PORT}"
        self.name = _name()
        self.board = shmhb.Board.create(self.name, slots=16, peers=8, remote_slots=64,
                                        watches=16, policy=POLICY, clock=clock)
        if net is not None:
            store_config(self.board, PingerConfig(listen=self.address, peers=peers,
                                                  interval_s=INTERVAL_S))
        self.agent = Agent(self.name, config=CONFIG, clock=clock, network=net is not None,
                           transport=net.transport if net is not None else Transport)
        self.agent_board = shmhb.Board.attach(self.name, clock=clock)
        loop = self.agent.elect(self.agent_board)
        assert loop is not None, "a fresh board's role is free"
        self.loop: AgentLoop = loop

    def peer(self, other: Host) -> Status | None:
        p = self.board.peer(other.address)
        return None if p is None else p.status

    def close(self) -> None:
        try:
            self.agent.resign(self.loop)
        finally:
            self.agent_board.close()
            self.board.close()
            unlink_quietly(self.name)


class World:
    """Hosts on one fake clock and one fake network, stepped together."""

    def __init__(self) -> None:
        # Ahead of the real clock the workers beat on, so that no beat is ever in the
        # fake future (its age would be negative): the board's own processes share
        # one clock, and a reader reads the clock after the word.
        self.clock = FakeClock(time.monotonic_ns() + AHEAD_NS)
        self.net = FakeNetwork()
        self.hosts: list[Host] = []

    def host(self, ip: str, *peers: str, network: bool = True) -> Host:
        h = Host(self.clock, self.net if network else None, ip, tuple(peers))
        self.hosts.append(h)
        return h

    def now_s(self) -> float:
        return self.clock.monotonic_ns() / 1e9

    def round(self, hosts: list[Host] | None = None) -> None:
        """One tick of fake time: every host ticks (pings go out, pings received last
        round are answered), the network carries it all, every host takes what came."""
        hosts = self.hosts if hosts is None else hosts
        self.clock.advance(TICK_S)
        for h in hosts:
            assert h.loop.step(0), "the tick was due"
        self.net.deliver()
        for h in hosts:
            assert not h.loop.step(0), "no second tick at the same time"

    def rounds_until(self, pred: Callable[[], bool], limit: int, what: str) -> int:
        for n in range(1, limit + 1):
            self.round()
            if pred():
                return n
        raise AssertionError(f"{what}: not within {limit} ticks of fake time")

    def close(self) -> None:
        for h in self.hosts:
            h.close()
        self.net.close()


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    t0, fake0 = time.perf_counter(), w.now_s()
    yield w
    print(f"whole test: {1000 * (time.perf_counter() - t0):.1f} ms wall (with process "
          f"start-up), {w.now_s() - fake0:.2f} s fake")
    w.close()


def _local(board: shmhb.Board, key: str) -> Status | None:
    s = board.slot(key)
    return None if s is None else s.status


def _kill(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(10)  # reaped: each pidfd is readable now (a wait for the kernel, not a sleep)


def _settle(w: World, pairs: list[tuple[Host, Host]]) -> int:
    """Rounds until every (observer, observed) pair reads ALIVE."""
    return w.rounds_until(lambda: all(a.peer(b) is Status.ALIVE for a, b in pairs),
                          int(PEER_DEAD_S / TICK_S), "hosts see each other alive")


# -- the local half ---------------------------------------------------------------------


def test_election_handover(world: World, procs: Procs) -> None:
    t0 = time.perf_counter()
    a = world.host("127.0.0.2", network=False)
    standby = Agent(a.name, config=CONFIG, clock=world.clock, network=False)
    sb_board = shmhb.Board.attach(a.name, clock=world.clock)
    try:
        assert standby.elect(sb_board) is None, "the role is held: the standby waits"
        a.loop.step(0)
        held = a.board.agent()
        assert held.status is Status.ALIVE and held.pid == os.getpid()
        worker = procs.worker(a.name, "w0")
        world.round([a])  # the holder's tick starts watching the worker

        a.agent.resign(a.loop)  # the holder stops
        assert a.board.agent().status is Status.LEFT
        loop = standby.elect(sb_board)
        assert loop is not None, "the role is free: the standby takes it at its next election step"
        try:
            assert standby.holding.is_set()
            loop.step(0)  # its first step ticks: its heartbeat, and the worker watched
            now = a.board.agent()
            assert now.status is Status.ALIVE and now.term == held.term + 1
            assert _local(a.board, "w0") is Status.ALIVE
            _kill(worker)
            steps = 0
            while _local(a.board, "w0") is not Status.DEAD:
                steps += 1
                assert steps <= 2, "the new holder did not see the kill"
                loop.step(0)
            assert steps == 1 and a.board.stats()["deaths_seen"] == 1
        finally:
            standby.resign(loop)
        # and a holder that resigned can stand again
        again = a.agent.elect(a.agent_board)
        assert again is not None
        a.loop = again
    finally:
        sb_board.close()
    print(f"election handover: {1000 * (time.perf_counter() - t0):.1f} ms wall")


def test_kill_seen_in_one_step(world: World, procs: Procs) -> None:
    h = world.host("127.0.0.2", network=False)
    workers = [procs.worker(h.name, f"w{i}") for i in range(2)]
    world.round([h])
    assert all(_local(h.board, f"w{i}") is Status.ALIVE for i in range(2))
    t0 = time.perf_counter()
    _kill(workers[0])
    fake0 = world.clock.monotonic_ns()
    assert not h.loop.step(0), "no tick is due: the pidfd woke the loop"
    assert _local(h.board, "w0") is Status.DEAD
    assert _local(h.board, "w1") is Status.ALIVE
    assert world.clock.monotonic_ns() == fake0, "no fake time passed"
    assert h.board.stats()["deaths_seen"] == 1
    print(f"kill seen in 1 step, {1000 * (time.perf_counter() - t0):.2f} ms wall")


def test_loop_lateness_counted(world: World) -> None:
    h = world.host("127.0.0.2", network=False)
    world.round([h])
    assert h.board.stats()["loop_late"] == 0
    world.clock.advance(6 * TICK_S)  # the tick came five ticks late (more than four)
    assert h.loop.step(0)
    assert h.board.stats()["loop_late"] == 1
    world.clock.advance(1.0)
    h.loop.step(0)  # the window closes: its worst lateness is recorded
    assert board_words(h.board).lateness_ms() >= 1000 * 4 * TICK_S
    # a late tick starts the phase again from now: the next is one tick later, not a burst
    assert not h.loop.step(0)
    world.clock.advance(TICK_S)
    assert h.loop.step(0)


# -- the network half -------------------------------------------------------------------


def test_host_suspect_then_dead_within_bounds(world: World) -> None:
    a = world.host("127.0.0.2", "127.0.0.3:5000")
    b = world.host("127.0.0.3", "127.0.0.2:5000")
    _settle(world, [(a, b), (b, a)])
    t0 = time.perf_counter()
    world.net.cut(b.ip)
    cut_s = world.now_s()  # the last frames got through in the round just before
    suspect_s = dead_s = None
    seen = []
    while dead_s is None:
        world.round()
        st = a.peer(b)
        seen.append(st)
        if st is Status.SUSPECT and suspect_s is None:
            suspect_s = world.now_s()
        if st is Status.DEAD:
            dead_s = world.now_s()
        assert world.now_s() - cut_s <= PEER_DEAD_S + INTERVAL_S + SLACK_S, \
            f"no DEAD by peer_dead_after + one interval after the last ack: {seen}"
    assert suspect_s is not None, f"DEAD without SUSPECT first: {seen}"
    assert suspect_s - cut_s >= PEER_SUSPECT_S - SLACK_S
    assert dead_s - cut_s >= PEER_DEAD_S - SLACK_S
    peer = a.board.peer(b.address)
    assert peer is not None and peer.age_s is not None
    assert PEER_DEAD_S - SLACK_S <= peer.age_s <= PEER_DEAD_S + INTERVAL_S + SLACK_S
    assert b.peer(a) is Status.DEAD  # the cut is both ways
    dropped = [f for f in world.net.sent() if f.dropped]
    assert dropped and all(b.ip in (f.src, f.dst) for f in dropped)
    world.net.heal(b.ip)
    n = _settle(world, [(a, b), (b, a)])
    print(f"suspect after {suspect_s - cut_s:.2f} s, dead after {dead_s - cut_s:.2f} s "
          f"(fake), alive again {n} ticks after the heal; "
          f"{1000 * (time.perf_counter() - t0):.1f} ms wall")


def test_pushes_batched(world: World, procs: Procs) -> None:
    a = world.host("127.0.0.2", "127.0.0.3:5000")
    b = world.host("127.0.0.3", "127.0.0.2:5000")
    eps = [f"127.0.0.3:{30001 + i}" for i in range(3)]
    workers = [procs.worker(b.name, f"w{i}", endpoints=ep) for i, ep in enumerate(eps)]

    def remote(ep: str) -> Status | None:
        s = a.board.remote(ep)
        return None if s is None else s.status

    world.rounds_until(lambda: all(remote(ep) is Status.ALIVE for ep in eps),
                       int(PEER_DEAD_S / TICK_S), "remote rows alive")
    for _ in range(4):  # a quiet spell longer than the push gap
        world.round()
    t0 = time.perf_counter()
    before = len(world.net.frames)
    pushes_before = a.board.stats()["pushes_received"]
    _kill(*workers)
    fake0 = world.clock.monotonic_ns()
    assert not b.loop.step(0)  # one step, no tick: three pidfds in one poll
    assert b.board.stats()["deaths_seen"] == 3
    world.net.deliver()
    assert not a.loop.step(0)
    assert world.clock.monotonic_ns() == fake0  # no ack can have done it: no tick ran
    pushes = [f for f in world.net.frames[before:]
              if f.src == b.ip and isinstance(decode(f.parts[-1], None), Push)]
    assert len(pushes) == 1, f"{len(pushes)} push frames for three deaths in one step"
    msg = decode(pushes[0].parts[-1], None)
    assert isinstance(msg, Push)
    assert sorted(e.key for e in msg.entries) == ["w0", "w1", "w2"]
    assert all(e.status == Status.DEAD.code for e in msg.entries)
    assert a.board.stats()["pushes_received"] == pushes_before + 1
    assert [remote(ep) for ep in eps] == [Status.DEAD] * 3
    print(f"3 deaths, 1 push, remote rows dead: {1000 * (time.perf_counter() - t0):.2f} ms wall")


def test_doubt_yourself_when_nobody_answers(world: World) -> None:
    """Cut off from every host it follows, and pinged by none: a host doubts itself and
    stops at SUSPECT, while the hosts that still hear each other convict it."""
    a = world.host("127.0.0.2", "127.0.0.3:5000", "127.0.0.4:5000")
    b = world.host("127.0.0.3", "127.0.0.2:5000", "127.0.0.4:5000")
    c = world.host("127.0.0.4", "127.0.0.2:5000", "127.0.0.3:5000")
    _settle(world, [(x, y) for x in (a, b, c) for y in (a, b, c) if x is not y])
    t0 = time.perf_counter()
    world.net.cut(c.ip)
    for _ in range(int(3 * PEER_DEAD_S / TICK_S)):
        world.round()
        assert c.peer(a) is not Status.DEAD and c.peer(b) is not Status.DEAD, \
            "the isolated host convicted its peers"
        assert a.peer(b) is Status.ALIVE and b.peer(a) is Status.ALIVE
    assert (c.peer(a), c.peer(b)) == (Status.SUSPECT, Status.SUSPECT)
    assert (a.peer(c), b.peer(c)) == (Status.DEAD, Status.DEAD)
    world.net.heal(c.ip)
    n = _settle(world, [(c, a), (c, b), (a, c), (b, c)])
    print(f"isolated host kept its peers SUSPECT for {3 * PEER_DEAD_S:.0f} s (fake), "
          f"all alive {n} ticks after the heal; {1000 * (time.perf_counter() - t0):.1f} ms wall")


def test_doubt_yourself_after_a_late_loop(world: World) -> None:
    """Silence during the host's own pause is not held against a peer, and for
    ``peer_suspect_after`` after a late tick no peer is convicted."""
    a = world.host("127.0.0.2", "127.0.0.3:5000")
    b = world.host("127.0.0.3", "127.0.0.2:5000")
    _settle(world, [(a, b)])
    world.net.cut(b.ip)
    cut_s = world.now_s()
    while world.now_s() - cut_s < PEER_DEAD_S - 3 * TICK_S - 1e-6:
        world.round()
    assert a.peer(b) is Status.SUSPECT
    late_before = a.board.stats()["loop_late"]
    world.clock.advance(1.0)  # both loops held off for a second (a pause, a stopped VM)
    world.round()
    assert a.board.stats()["loop_late"] == late_before + 1
    late_s = world.now_s()
    # Without the rule, three more healthy ticks of silence make it DEAD.
    while world.now_s() - late_s < PEER_SUSPECT_S - SLACK_S:
        assert a.peer(b) is Status.SUSPECT, "convicted while doubting itself"
        world.round()
    n = world.rounds_until(lambda: a.peer(b) is Status.DEAD, 4, "DEAD once the doubt is over")
    print(f"DEAD {world.now_s() - late_s:.2f} s (fake) after the late tick ({n} ticks "
          f"after the doubt ended)")


def test_network_half_restarts_on_new_settings(world: World) -> None:
    """New stored settings replace the network half (new sockets, a new bind); the
    hosts that follow it find it again, and it finds them."""
    a = world.host("127.0.0.2", "127.0.0.3:5000")
    b = world.host("127.0.0.3", "127.0.0.2:5000")
    _settle(world, [(a, b), (b, a)])
    gen = a.board.network().settings_gen
    store_config(a.board, PingerConfig(listen=a.address, peers=(b.address,),
                                       interval_s=2 * INTERVAL_S))
    world.rounds_until(lambda: a.board.network().settings_gen != gen, 2, "new settings applied")
    assert a.board.network().state == "listening"
    # the restarted half starts from UNKNOWN (a new observer), then hears b again
    _settle(world, [(a, b), (b, a)])
    for _ in range(int(2 * PEER_DEAD_S / TICK_S)):
        world.round()
        assert a.peer(b) is Status.ALIVE and b.peer(a) is Status.ALIVE


def test_curve_refused_on_the_fake_transport(world: World, tmp_path: object) -> None:
    """The fake has no CURVE: a half configured for it does not run without it; the
    host reads degraded and the local watch goes on."""
    a = world.host("127.0.0.2", network=True)
    store_config(a.board, PingerConfig(listen=a.address, curve_keys=str(tmp_path)))
    world.round([a])
    net = a.board.network()
    assert net.state == "degraded" and not net.listening and net.reason == "curve", net
    assert a.board.agent().status is Status.ALIVE
    assert not world.net.sent()


class _Recorder:
    """A component over one pipe whose read end is readable: it records each call."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.r, self.w = os.pipe()
        os.write(self.w, b"x")
        self.pollables_gen = 0

    def pollables(self) -> list[zmq.Socket | int]:
        return [self.r]

    def on_ready(self, what: zmq.Socket | int, now_ns: int) -> None:
        assert what == self.r
        self.log.append(f"{self.name}.ready")

    def tick(self, now_ns: int, late_ns: int) -> None:
        self.log.append(f"{self.name}.tick")

    def flush(self, now_ns: int) -> None:
        self.log.append(f"{self.name}.flush")

    def failed(self, e: BaseException) -> None:
        self.log.append(f"{self.name}.failed")

    def close(self) -> None:
        self.log.append(f"{self.name}.close")
        os.close(self.r)
        os.close(self.w)


def test_loop_order_deaths_first_then_flush_then_tick(world: World) -> None:
    """With a local notice and a network frame ready in the same poll: the local watch
    first, then the network half, then a flush of both, then the tick."""
    h = world.host("127.0.0.2", network=False)
    log: list[str] = []
    net, local = _Recorder("net", log), _Recorder("local", log)  # net's fd made first
    loop = AgentLoop(h.loop.w, local, world.clock, int(TICK_S * 1e9), net=net)
    assert loop.step(0)
    assert log == ["local.ready", "net.ready", "local.flush", "net.flush", "local.tick",
                   "net.tick"]
    del log[:]
    os.read(local.r, 1)
    assert not loop.step(0)  # only the network's fd is ready: no flush, no tick
    assert log == ["net.ready"]
    loop.close()
    assert log[-2:] == ["local.close", "net.close"]
