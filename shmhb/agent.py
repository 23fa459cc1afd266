"""The host agent role: one process per host watches local workers (and, with the
network half, remote hosts) and writes verdicts into the board.

Election: the role is an OFD lock on the board (``LOCK_AGENT``); the kernel drops it
when its holder dies, and a standby polling every ``election_poll_s`` takes over.  Each
takeover bumps ``agent_term``, so the agent's words name the term that wrote them.  The
role never waits for the registry lock (a process stopped while holding it keeps it):
nothing on the agent's path takes it but the periodic reclaim of dead processes'
watches, which gives up at once and tries again later.
The role runs as ``shmhb pinger`` or embedded in a worker (a daemon thread started by
``Board.register``), and behaves the same either way: the pinger's settings come from
the board, not from the command line of whoever holds the role.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Protocol

import numpy as np
import zmq

from . import locks
from .board import Board
from .clock import MONOTONIC, Clock
from .config import AgentConfig
from .layout import (
    HEADER_DTYPE, INC_SHIFT, LEFT_BIT, LOCK_AGENT, LOCK_SLOT_BASE, STAT_NAMES,
    TS_SHIFT, pack_agent_id, pack_hb, pack_verdict,
)
from .procinfo import own_pid_namespace, pidfd_open, start_time
from .rows import RowWriter

log = logging.getLogger(__name__)

_STAT = {n: i for i, n in enumerate(STAT_NAMES)}
_SHIFT39 = np.uint64(39)  # hb >> 39: incarnation tag and left bit


class Component(Protocol):
    """A part of the agent's loop: sockets or fds to poll, and a periodic tick.
    ``pollables_gen`` moves whenever ``pollables()`` would return another set."""

    pollables_gen: int

    def pollables(self) -> list[zmq.Socket | int]: ...
    def on_ready(self, what: zmq.Socket | int, now_ns: int) -> None: ...
    def tick(self, now_ns: int, late_ns: int) -> None: ...
    def flush(self, now_ns: int) -> None:
        """Act at once on what the last readiness events changed."""
    def close(self) -> None: ...


class AgentWriter:
    """What the role holder may write into the header: its words and its counters."""

    def __init__(self, board: Board, term: int) -> None:
        self.board = board
        self.term = term
        q = board._q
        fields = HEADER_DTYPE.fields
        self._q = q
        self._hb_i = fields["agent_hb"][1] // 8
        self._gen_i = fields["agent_gen"][1] // 8
        self._late_i = fields["agent_lateness_us"][1] // 8
        self._stats0 = fields["stats"][1] // 8
        q[fields["agent_id"][1] // 8] = pack_agent_id(term, os.getpid())

    def alive(self, now_ns: int) -> None:
        self._q[self._hb_i] = pack_hb(self.term, now_ns >> TS_SHIFT)

    def left(self, now_ns: int) -> None:
        self._q[self._hb_i] = pack_hb(self.term, now_ns >> TS_SHIFT, left=True)

    def changed(self) -> None:
        """Bump the change counter readers use to skip work when nothing moved."""
        self._q[self._gen_i] = self._q[self._gen_i] + 1

    def count(self, stat: str, n: int = 1) -> None:
        i = self._stats0 + _STAT[stat]
        self._q[i] = self._q[i] + n

    def lateness(self, late_us: int) -> None:
        self._q[self._late_i] = late_us


class _Watched:
    __slots__ = ("tag", "pid", "pidfd", "done")

    def __init__(self, tag: int, pid: int, pidfd: int | None, done: bool) -> None:
        self.tag, self.pid, self.pidfd, self.done = tag, pid, pidfd, done


class LocalWatch:
    """Watches every registered local worker and records its death at once.

    Workers in our pid namespace are watched through a pidfd: the kernel wakes us when
    the process exits.  The pid is verified against the start time the worker recorded
    at registration, so a reused pid is never mistaken for the worker.  Workers in
    another namespace, or where pidfd_open is missing, are checked every tick through
    their slot lock, which the kernel releases when they die.
    """

    def __init__(self, board: Board, writer: AgentWriter) -> None:
        self.board = board
        self.w = writer
        self._watched: dict[int, _Watched] = {}
        self._by_fd: dict[int, int] = {}
        self._lockfd = board._new_fd()
        self._ns = own_pid_namespace()
        self._pidfd_ok = hasattr(os, "pidfd_open")
        self._marks = np.zeros(board.sizes.nslots, np.uint64)  # (incarnation, left) per slot
        self._retry: set[int] = set()
        self._by_lock: set[int] = set()  # slots watched through their lock, not a pidfd
        self.pollables_gen = 0

    def pollables(self) -> list[zmq.Socket | int]:
        return list(self._by_fd)

    def on_ready(self, what: zmq.Socket | int, now_ns: int) -> None:
        i = self._by_fd.pop(what, None)  # type: ignore[arg-type]
        if i is None:
            return
        self.pollables_gen += 1
        wt = self._watched[i]
        os.close(wt.pidfd)  # type: ignore[arg-type]
        wt.pidfd = None
        self._convict(i, wt, now_ns, "exited")

    def _convict(self, i: int, wt: _Watched, now_ns: int, why: str) -> None:
        wt.done = True
        self._by_lock.discard(i)
        hb = self.board._q[self.board._hb0 + i * 8]
        if hb >> INC_SHIFT != wt.tag or hb & LEFT_BIT:
            return  # it left gracefully, or the slot was registered again meanwhile
        self.board._q[self.board._hb0 + i * 8 + 1] = pack_verdict(wt.tag, now_ns >> TS_SHIFT)
        self.w.changed()
        self.w.count("deaths_seen")
        info = self.board._read_slot(i)
        log.info("board %s: worker %r (pid %d) %s: DEAD", self.board.name,
                 info[0] if info else f"slot {i}", wt.pid, why)

    def tick(self, now_ns: int, late_ns: int) -> None:
        """Start watching new registrations, stop watching leaves, and check the slot
        locks of workers that have no pidfd.  Only slots whose (incarnation, left) bits
        changed since the last tick are examined one by one."""
        b = self.board
        hbs = b._hb.copy()
        marks = hbs >> _SHIFT39
        todo = {int(i) for i in np.flatnonzero(marks != self._marks)} | self._retry
        self._marks = marks
        self._retry = set()
        if todo:
            verdicts = b._verdict.copy()
            for i in sorted(todo):
                if hbs[i]:
                    self._examine(i, int(hbs[i]), int(verdicts[i]), now_ns)
        for i in list(self._by_lock):
            if not locks.is_held(self._lockfd, LOCK_SLOT_BASE + i):
                self._convict(i, self._watched[i], now_ns, "released its slot lock")
        b.forget_expired()  # the policy's forget_after_s; one comparison when it is off

    def _examine(self, i: int, hb: int, verdict: int, now_ns: int) -> None:
        tag = hb >> INC_SHIFT
        wt = self._watched.get(i)
        if wt is not None and wt.tag == tag:
            if hb & LEFT_BIT and not wt.done:  # it left gracefully: stop watching
                self._forget(i)
                self._watched[i] = _Watched(tag, wt.pid, None, True)
                # Readers learn of changes from the change counter; the leaver moves the
                # registry's half of it, unless the registry lock was out of its reach
                # (held by a stopped process): ours is always within reach.
                self.w.changed()
            return
        self._forget(i)
        if hb & LEFT_BIT or verdict >> INC_SHIFT == tag:
            self._watched[i] = _Watched(tag, 0, None, True)
            return
        info = self.board._read_slot(i)
        if info is None:
            self._retry.add(i)  # caught mid-registration: look again next tick
            return
        pid = info[1]
        rec = self.board._records[i]
        wt = _Watched(tag, pid, None, False)
        self._watched[i] = wt
        if self._pidfd_ok and int(rec["pid_ns"]) == self._ns:
            try:
                pidfd = pidfd_open(pid)
            except OSError as e:
                log.warning("pidfd_open unavailable (%s): falling back to slot locks", e)
                self._pidfd_ok = False
            else:
                if pidfd is None:
                    self._convict(i, wt, now_ns, "was gone before the agent saw it")
                elif start_time(pid) != int(rec["pid_start"]):
                    os.close(pidfd)
                    self._convict(i, wt, now_ns, "was gone (its pid now names another process)")
                else:
                    wt.pidfd = pidfd
                    self._by_fd[pidfd] = i
                    self.pollables_gen += 1
                return
        # another pid namespace, or no pidfd: the slot lock tells, checked every tick
        self._by_lock.add(i)
        if not locks.is_held(self._lockfd, LOCK_SLOT_BASE + i):
            self._convict(i, wt, now_ns, "released its slot lock")

    def flush(self, now_ns: int) -> None:
        """Nothing to do: verdicts are written as each pidfd fires."""

    def _forget(self, i: int) -> None:
        self._by_lock.discard(i)
        wt = self._watched.pop(i, None)
        if wt is not None and wt.pidfd is not None:
            self._by_fd.pop(wt.pidfd, None)
            os.close(wt.pidfd)
            self.pollables_gen += 1

    def close(self) -> None:
        for i in list(self._watched):
            self._forget(i)
        os.close(self._lockfd)


class Agent:
    """Runs the agent role for one board: wait for the role, then hold it until stopped.

    ``network``: also run the pinger (the network half) with the settings stored in the
    board.  ``run()`` blocks; ``start()`` runs it in a daemon thread.
    """

    def __init__(self, board_name: str, *, config: AgentConfig | None = None,
                 network: bool = True, clock: Clock = MONOTONIC) -> None:
        self.board_name = board_name
        self.config = config or AgentConfig()
        self.network = network
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self.holding = threading.Event()
        locks.on_fork(self)

    def start(self) -> Agent:
        t = threading.Thread(target=self.run, name=f"shmhb-agent-{self.board_name}", daemon=True)
        self._thread = t
        t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def run(self) -> None:
        board = Board.attach(self.board_name, clock=self.clock)
        self._fd = board._new_fd()
        try:
            while not self._stop.is_set():
                if locks.try_lock(self._fd, LOCK_AGENT):
                    self._hold(board)
                    break
                self._stop.wait(self.config.election_poll_s)
        except BaseException:
            # The role is released below, so a standby takes over; say why loudly.
            log.exception("board %s: the agent stopped on an unexpected error", self.board_name)
            raise
        finally:
            if self._fd >= 0:
                os.close(self._fd)  # releases the role
                self._fd = -1
            self.holding.clear()
            board.close()

    def _hold(self, board: Board) -> None:
        # The term counter has one writer at a time without the registry lock: only the
        # holder of the role writes it, and the role lock we hold excludes every other.
        # Taking the registry lock here made a takeover wait for as long as some process
        # stayed stopped while holding it (no agent on the host meanwhile), and then
        # killed the new agent with LockTimeout.
        term = int(board._head["agent_term"]) + 1
        board._head["agent_term"] = term
        now = self.clock.monotonic_ns
        w = AgentWriter(board, term)
        # Before our heartbeat makes readers trust the peer rows again: the previous
        # holder's verdicts on remote hosts are not ours (invariant 5).
        RowWriter(board).forget_peer_verdicts()
        w.alive(now())
        log.info("board %s: this process (pid %d) holds the agent role, term %d",
                 board.name, os.getpid(), term)
        self.holding.set()
        comps: list[Component] = [LocalWatch(board, w)]
        if self.network:
            from .pinger import NetworkHalf
            comps.append(NetworkHalf(board, w, self.clock))
        tick_ns = int(self.config.tick_s * 1e9)
        poller = zmq.Poller()
        registered: dict[object, Component] = {}
        try:
            next_tick = now()
            worst_late = 0
            window_end = next_tick + 1_000_000_000
            seen_gen = -1
            while not self._stop.is_set():
                gen = sum(c.pollables_gen for c in comps)
                if gen != seen_gen:  # the set of fds and sockets changed: sync the poller
                    seen_gen = gen
                    want = {p: c for c in comps for p in c.pollables()}
                    for p in list(registered):
                        if p not in want:
                            poller.unregister(p)
                            del registered[p]
                    for p, c in want.items():
                        if p not in registered:
                            poller.register(p, zmq.POLLIN)
                            registered[p] = c
                t = now()
                # whole milliseconds, rounded up: pyzmq truncates, and a timeout that
                # falls short of the tick makes the loop spin until it comes
                timeout_ms = max(0, -(-(next_tick - t) // 1_000_000))
                events = poller.poll(timeout_ms)
                local_events = False
                for what, _ev in events:
                    c = registered.get(what)
                    if c is not None:
                        c.on_ready(what, now())
                        local_events |= c is comps[0]
                if local_events:
                    # Deaths seen now are pushed now, all of this poll's in one batch.
                    t = now()
                    for c in comps:
                        c.flush(t)
                t = now()
                if t < next_tick:
                    continue
                late = t - next_tick
                worst_late = max(worst_late, late)
                if late > 4 * tick_ns:
                    w.count("loop_late")
                w.alive(t)
                for c in comps:
                    c.tick(t, late)
                next_tick = next_tick + tick_ns if late < tick_ns else t + tick_ns
                if t >= window_end:
                    w.lateness(worst_late // 1000)
                    worst_late, window_end = 0, t + 1_000_000_000
        finally:
            for c in comps:
                c.close()
            w.left(now())
            log.info("board %s: agent role released (pid %d)", board.name, os.getpid())

    def _after_fork_in_child(self) -> None:
        self._thread = None
        self._stop = threading.Event()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- embedded agents: one per process and board, alive while it has heartbeats ------------

_embedded: dict[str, tuple[Agent, set[int]]] = {}
_embedded_lock = threading.Lock()


def embedded_join(board_name: str, hb: object) -> None:
    with _embedded_lock:
        entry = _embedded.get(board_name)
        if entry is None:
            entry = (Agent(board_name).start(), set())
            _embedded[board_name] = entry
        entry[1].add(id(hb))


def embedded_leave(board_name: str, hb: object) -> None:
    with _embedded_lock:
        entry = _embedded.get(board_name)
        if entry is None:
            return
        entry[1].discard(id(hb))
        if entry[1]:
            return
        del _embedded[board_name]
    entry[0].stop()


def _reset_after_fork() -> None:
    global _embedded_lock
    _embedded_lock = threading.Lock()
    _embedded.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
