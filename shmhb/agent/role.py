"""The host agent role: one process per host watches local workers (and, with the
network half, remote hosts) and writes verdicts into the board.

Election (``shmhb.agent.election``): term T of the role is an OFD lock byte on the board; the
kernel drops it when its holder dies, and a standby polling every ``election_poll_s``
takes term T+1, bumping ``agent_term`` (the agent's words name the term that wrote
them).  A holder stalled as a whole -- SIGSTOPped, or a C call holding its GIL, so
neither its loop nor its watchdog runs -- keeps its byte: a standby replaces it once its
heartbeat stood still for 3 x ``agent_stale_s`` (3 s by default; a daemon first, embedded
standbys 1 s later).  The stalled holder, when it resumes, sees the term moved before it
writes and stands down (a standby again, embedded or daemon); once it let its byte go,
the new holder takes a fresh term, which repairs what it may have written.  The
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
import time

from ..board import locks
from .loop import AgentLoop, Component
from .writer import AgentWriter
from ..board.handle import Board
from ..board.core import board_words
from ..clock import MONOTONIC, Clock
from ..board.config import AgentConfig, parse_hostport
from .election import (HB_WORD, StallWatch, check_tick, claim, held_others, max_tick_s,
                       stall_bound_ns)
from ..board.layout import (LOCK_DAEMON, TERM_RING, TERM_WORD, agent_pid, header_index, inc_tag,
                            term_byte, word_tag)
from ..board.netword import decode_network
from ..errors import InvalidConfig
from ..net.listener import listens_there, numeric_ip
from .localwatch import LocalWatch
from ..net.state import NET_OFF
from ..net.supervisor import NetSupervisor
from ..periodic import block_host_signals
from ..procinfo import thread_switches
from ..ratelog import RateLimitedLog
from ..net.rowwriter import RowWriter
from ..net.exchange import COUNTER_WORD
from ..net.transport import Transport, TransportFactory

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log, 30.0)
AGENT_ID_WORD = header_index("agent_id")

__all__ = ["Agent", "AgentLoop", "AgentWriter", "Component", "LocalWatch"]


class _Deposed(Exception):
    """The watchdog gave the role up while the loop was stuck: stop writing at once."""


class _HandOver(Exception):
    """An embedded holder leaves the role to a ``shmhb pinger`` daemon that waits for it."""


class _Superseded(Exception):
    """``agent_term`` moved on: a standby took the role while we were stalled."""


class _Renew(Exception):
    """Every stalled holder we replaced has stopped writing, and we took a fresh term:
    set the components up anew over whatever they may have left (shmhb.agent.election)."""


#: how often an embedded holder looks whether a daemon waits for the role (one fcntl)
HANDOVER_CHECK_NS = 100_000_000
#: how long embedded standbys leave a free role to a waiting daemon before taking it
#: themselves (a daemon that is itself stopped must not leave the host without an agent)
DAEMON_GRACE_NS = 1_000_000_000
#: after taking the role despite a waiting daemon, an embedded holder does not hand it
#: over again for this long (no flapping between a stopped daemon and the workers)
NO_HANDOVER_NS = 60_000_000_000
#: a daemon that waited this long for the role says why (then every 30 s)
WAIT_SAID_NS = 2_000_000_000


def _say_taken_past_daemon(name: str) -> None:
    log.warning("board %s: a shmhb pinger daemon waits for the agent role but left it free "
                "for %.1f s (stopped, or starved of CPU): this worker (pid %d) takes it, and "
                "hands it over no sooner than %.0f s from now", name, DAEMON_GRACE_NS / 1e9,
                os.getpid(), NO_HANDOVER_NS / 1e9)


def _listening_at(board: Board, term: int, pid: int) -> str | None:
    """The address the network half of term ``term`` says it listens on (from the
    board's words, whole and of that term), if process ``pid`` (its holder) is seen to
    hold a listener there; else None."""
    net = decode_network(board_words(board).header.copy(), term, True)
    if not net.listening or net.listen is None:
        return None
    try:
        host, port = parse_hostport(net.listen)
    except InvalidConfig:
        return None
    ip = numeric_ip(host)
    return net.listen if ip is not None and listens_there(pid, ip, port) else None


class Agent:
    """Runs the agent role for one board: wait for the role, then hold it until stopped.

    ``network``: also run the pinger (the network half) with the settings stored in the
    board.  ``run()`` blocks; ``start()`` runs it in a daemon thread.

    A watchdog thread gives the role up when the loop makes no progress for
    ``config.watchdog_s`` (stuck in a call that blocks, e.g. on a hung /proc read): it
    sets ``deposed`` and closes the role's lock fd, so a standby takes over within its
    election poll.  The stuck loop, when it comes back, sees ``deposed`` before it
    writes anything more and leaves without touching the words the new holder owns.
    ``shmhb pinger`` exits non-zero on ``deposed`` (its supervisor restarts it).

    ``clock`` and ``transport`` (what builds the network half's sockets) are for tests:
    ``elect()`` and the ``AgentLoop`` it returns let a test run the role step by step on
    a ``FakeClock`` and ``shmhb.testing.network``.
    """

    def __init__(self, board_name: str, *, config: AgentConfig | None = None,
                 network: bool = True, clock: Clock = MONOTONIC,
                 transport: TransportFactory = Transport, daemon: bool = False) -> None:
        self.board_name = board_name
        if config is not None:  # a tick the board's stall bound cannot tolerate: refused here
            with Board.attach(board_name) as b:
                check_tick(config.tick_s, b.policy)
        self.daemon = daemon
        self._free_since_ns: int | None = None  # embedded: role seen free, a daemon waiting
        self._next_handover_check_ns = 0
        self.config = config or AgentConfig()
        self.network = network
        self.clock = clock
        self.transport = transport
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._fd_lock = threading.Lock()
        self.holding = threading.Event()
        self.deposed = threading.Event()
        self._progress_ns = 0
        self._words: memoryview | None = None  # the board's header words, while holding
        self.term = 0  # the term we hold (0: none)
        self._older: set[int] = set()  # term bytes of stalled holders we replaced
        self._next_older_check_ns = 0
        self._renewed = 0  # the term we renewed to, by _check, for _hold to set up
        self._net: NetSupervisor | None = None
        self._stall = StallWatch()
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

    def last_progress_ns(self) -> int:
        """When the agent's thread last made progress (CLOCK_MONOTONIC ns): a step of
        the loop while it holds the role, an election poll while it waits as a standby;
        0 before the first.  What feeds systemd's watchdog (``shmhb pinger``)."""
        return self._progress_ns

    def is_running(self) -> bool:
        """Whether the agent's thread (started by ``start``) is still running."""
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> None:
        block_host_signals()  # the host's signals go to its main thread (shmhb.periodic)
        board = Board.attach(self.board_name, clock=self.clock)
        waiting_since = time.monotonic_ns()
        try:
            while not self._stop.is_set():
                now = self._progress_ns = time.monotonic_ns()  # a standby's poll is progress too
                loop = self.elect(board)
                if loop is not None:
                    if not self._hold(board, loop):
                        break
                    waiting_since = time.monotonic_ns()
                    continue  # handed over to a daemon: a standby again
                if self.daemon and now - waiting_since > WAIT_SAID_NS:
                    self._say_why_waiting(board, now - waiting_since)
                self._stop.wait(self.config.election_poll_s)
        except _Deposed:
            log.error("board %s: the agent loop was stuck; the role was given up",
                      self.board_name)
        except BaseException:
            # The role is released below, so a standby takes over; say why loudly.
            log.exception("board %s: the agent stopped on an unexpected error", self.board_name)
            raise
        finally:
            self._release()
            self.holding.clear()
            board.close()

    def _say_why_waiting(self, board: Board, waited_ns: int) -> None:
        """A daemon kept from the role says by whom and until when (every 30 s)."""
        a = board.agent()
        _rlog.warn("wait", "board %s: this shmhb pinger (pid %d) has waited %.0f s for the "
                   "agent role, held by pid %d (term %d, %s): a worker holding it embedded "
                   "hands it over within %.1f s, or, if it took the role while this daemon "
                   "did not claim it within %.1f s, %.0f s after it took it; a stalled "
                   "holder is replaced %.1f s after its last beat", board.name, os.getpid(),
                   waited_ns / 1e9, a.pid, a.term, a.status.value, HANDOVER_CHECK_NS / 1e9,
                   DAEMON_GRACE_NS / 1e9, NO_HANDOVER_NS / 1e9,
                   stall_bound_ns(board_words(board).words) / 1e9)

    def elect(self, board: Board) -> AgentLoop | None:
        """One election step: take the role if it is free, or if its holder is stalled
        (shmhb.agent.election), and return the loop that holds it (not started: call its
        ``step``); None while another process holds it."""
        with self._fd_lock:
            if self._fd < 0:
                self._fd = board_words(board).new_fd()
                if self.daemon:  # for the fd's life: embedded holders hand over to us
                    locks.try_lock(self._fd, LOCK_DAEMON, exclusive=False)
            fd = self._fd
        words = board_words(board).words
        now = time.monotonic_ns()
        t = int(words[TERM_WORD])
        daemon_waits = not self.daemon and locks.is_held(fd, LOCK_DAEMON)
        stalled, still = False, 0
        if locks.is_held(fd, term_byte(t)):
            # Held: ours only if its heartbeat stands still past the bound; embedded
            # standbys wait longer, so a waiting daemon wins the role.
            still = self._stall.still_for_ns(t, int(words[HB_WORD]), now)
            if still < stall_bound_ns(words) + (0 if self.daemon else DAEMON_GRACE_NS):
                self._free_since_ns = None  # a spell kept would date the next from then
                return None
            stalled = True
            self._free_since_ns = None
        elif daemon_waits:
            # A daemon runs: the role is its (it runs apart from any worker, so a worker
            # stuck in a long C call or stopped cannot take the host's agent with it).
            # Unless the role stays free for DAEMON_GRACE_NS: that daemon is stuck too.
            if self._free_since_ns is None:
                self._free_since_ns = now
            if now - self._free_since_ns < DAEMON_GRACE_NS:
                return None
        if not claim(fd, words, t):
            if stalled and still >= 2 * stall_bound_ns(words):  # not a passing race
                _rlog.warn("claim", "board %s: the agent role's holder (term %d) is "
                           "stalled, but the lock byte of term %d is held too (a racing "
                           "standby, or a holder of %d terms ago still stopped): "
                           "standing by", board.name, t, t + 1, TERM_RING)
            return None
        self._hold_off_handover(board.name, now, daemon_waits, stalled)
        self._free_since_ns = None
        self._stall.reset()
        if stalled:
            log.info("board %s: the agent role's holder (term %d) made no beat for %.1f s: "
                     "it is stalled; this process (pid %d) takes the role over",
                     board.name, t, still / 1e9, os.getpid())
        try:
            return self._take(board, t + 1)
        except BaseException:
            self._release()
            raise

    def _hold_off_handover(self, name: str, now: int, daemon_waits: bool, stalled: bool) -> None:
        """After taking the role past a waiting daemon, or from a stalled holder: no
        handing it over (no flapping back) for NO_HANDOVER_NS."""
        if daemon_waits or (stalled and not self.daemon):
            self._next_handover_check_ns = now + NO_HANDOVER_NS
            if daemon_waits and not stalled:
                _say_taken_past_daemon(name)

    def _release(self) -> None:
        with self._fd_lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # releases the role

    def _watchdog(self, done: threading.Event, tid: int) -> None:
        """Give the role up when the loop thread is stuck: no progress for the bound
        while it made no context switch either (blocked in one call), or no progress
        for three times the bound whatever it did.  A loop that is merely starved of CPU
        (a loaded host: it is preempted, it waits for the GIL) keeps switching and is
        left alone up to the long bound; so is a process stopped as a whole (SIGSTOP),
        during which the watchdog does not run either."""
        block_host_signals()
        bound_ns = int(self.config.watchdog_s * 1e9)
        period = min(1.0, self.config.watchdog_s / 8)  # 1 s at the default 10 s
        period_ns = int(period * 1e9)
        last = resumed = moved = time.monotonic_ns()
        switches = thread_switches(tid)
        while not done.wait(period):
            now = time.monotonic_ns()
            if now - last > 2 * period_ns + 100_000_000:
                # The watchdog itself did not run: the whole process was stopped
                # (SIGSTOP) or starved (a C call holding the GIL).  That is no sign of a
                # stuck loop: count from now, and let the loop show it is back.
                resumed = now
            last = now
            sw = thread_switches(tid)
            if sw is None or sw != switches:
                # the loop thread ran, or waited for its turn (or, unreadable -- out of
                # fds -- it is given the benefit of the doubt up to the long bound)
                switches, moved = sw, now
            since = max(self._progress_ns, resumed)
            stuck_ns = now - since
            blocked_ns = now - max(since, moved)
            if blocked_ns > bound_ns or stuck_ns > 3 * bound_ns:
                self.deposed.set()
                log.error("board %s: the agent loop made no progress for %.1f s: giving "
                          "the role up so a standby takes over", self.board_name,
                          stuck_ns / 1e9)
                self._release()
                return

    def _check(self) -> None:
        """Before the loop writes: stop at once if the role is no longer ours (the
        watchdog gave it up, or a standby took a new term while we were stalled), hand
        it to a waiting daemon, or renew our term once the holders we replaced are done.
        One load of ``agent_term`` per call; the fcntl checks at most every 100 ms."""
        now = self._progress_ns = time.monotonic_ns()
        if self.deposed.is_set():
            raise _Deposed()
        words = self._words
        if words is not None and int(words[TERM_WORD]) != self.term:
            raise _Superseded()
        fd = self._fd
        if not self.daemon and now >= self._next_handover_check_ns:
            self._next_handover_check_ns = now + HANDOVER_CHECK_NS
            if fd >= 0 and locks.is_held(fd, LOCK_DAEMON):
                raise _HandOver()
        if self._older and now >= self._next_older_check_ns and fd >= 0 and words is not None:
            self._next_older_check_ns = now + HANDOVER_CHECK_NS
            self._older = {b for b in self._older if locks.is_held(fd, b)}
            if not self._older:
                # the replaced holders wrote their last word before letting their byte
                # go: a fresh term now repairs whatever they left (shmhb.agent.election)
                if claim(fd, words, self.term):
                    locks.unlock(fd, term_byte(self.term))
                    self._renewed = self.term = self.term + 1
                    raise _Renew()
                self._older = {term_byte(self.term + 1)}  # held by another: wait for it

    def _take(self, board: Board, term: int) -> AgentLoop:
        """Set the role up, now that ``claim`` made term ``term`` ours (it wrote
        ``agent_term``): our words, the components, and the loop over them."""
        # The term counter has one writer without the registry lock: see shmhb.agent.election.
        # Taking the registry lock here made a takeover wait for as long as some process
        # stayed stopped while holding it (no agent on the host meanwhile), and then
        # killed the new agent with LockTimeout.
        self._words, self.term = board_words(board).words, term
        # Stalled holders we replace may write until they let their byte go: watch them.
        self._older = held_others(self._fd, term_byte(term))
        self._next_older_check_ns = 0
        # ... and the one we replace keeps listening: ours listens beside it (read before
        # our writer overwrites its words; shmhb.net.listener argues the design)
        beside = None
        if self._older:
            aid = int(self._words[AGENT_ID_WORD])
            if word_tag(aid) == inc_tag(term - 1):
                beside = _listening_at(board, term - 1, agent_pid(aid))
        w = AgentWriter(board, term)
        # Before our heartbeat makes readers trust the peer rows again: the previous
        # holder's verdicts on remote hosts are not ours (invariant 5).
        RowWriter(board).forget_peer_verdicts()
        local = LocalWatch(board, w)
        net: NetSupervisor | None = None
        if self.network:
            self._net = net = NetSupervisor(board, w, self.clock, retry_min_s=self.config.net_retry_min_s,
                                retry_max_s=self.config.net_retry_max_s,
                                transport=self.transport, beside=beside)
        else:
            w.network(NET_OFF, 0, "")
        w.alive(self.clock.monotonic_ns())
        log.info("board %s: this process (pid %d) holds the agent role, term %d",
                 board.name, os.getpid(), term)
        self.holding.set()
        self._progress_ns = time.monotonic_ns()
        # the default tick, shortened on a board whose agent_stale_s needs it (a tick
        # given explicitly was checked against it when this agent was made)
        tick_s = min(self.config.tick_s, max_tick_s(board.policy))
        return AgentLoop(w, local, self.clock, int(tick_s * 1e9), net=net, check=self._check)

    def resign(self, loop: AgentLoop, *, deposed: bool = False) -> None:
        """Leave the role: close the loop's components, say so in our heartbeat (unless
        the watchdog gave the role up: then those words are the next holder's), and
        release the lock."""
        try:
            # a stop asked for (SIGTERM, the last heartbeat closed), not a crash or the
            # watchdog: the hosts that watch us are told (a goodbye), not left to guess
            loop.close(leaving=not deposed and self._stop.is_set())
            if not deposed:
                loop.w.left(self.clock.monotonic_ns())
            log.info("board %s: agent role released (pid %d)", self.board_name, os.getpid())
        finally:
            self._words, self.term, self._older, self._net = None, 0, set(), None
            self._release()
            self.holding.clear()

    def _hold(self, board: Board, loop: AgentLoop) -> bool:
        """Run the loop until stopped; True if the role was handed over to a daemon or
        taken by a standby while we were stalled (then this agent stands by again),
        False when it stopped."""
        done = threading.Event()
        threading.Thread(target=self._watchdog, args=(done, threading.get_native_id()),
                         daemon=True, name=f"shmhb-watchdog-{board.name}").start()
        deposed = False
        try:
            while not self._stop.is_set():
                try:
                    loop.step()
                except _Renew:
                    loop = self._renew(board, loop)
        except _HandOver:
            # Not "left": the host keeps an agent; the daemon's term follows at its
            # next election poll.  Like a deposed holder, we write no more words.
            deposed = True
            log.info("board %s: a shmhb pinger daemon runs; the embedded agent (pid %d) "
                     "hands the role over to it", board.name, os.getpid())
            return True
        except _Superseded:
            # Not "left" either, and no word more: they are the new holder's.  A daemon
            # stands by too rather than exit: it was stopped from outside (SIGSTOP, a
            # frozen VM), nothing in it is broken, and it keeps LOCK_DAEMON and its
            # systemd watchdog fed as any standby (a stuck loop still exits: _Deposed).
            deposed = True
            log.info("board %s: this process (pid %d) was stalled and the agent role was "
                     "taken over (term %d, now %d): standing down, a standby again",
                     board.name, os.getpid(), self.term, int(board_words(board).words[TERM_WORD]))
            return True
        except _Deposed:
            deposed = True
            raise
        finally:
            done.set()
            self.resign(loop, deposed=deposed)
        return False

    def _renew(self, board: Board, loop: AgentLoop) -> AgentLoop:
        """Set the role up anew for the fresh term ``_check`` took: the stalled holders
        we replaced are done, and this repairs whatever words they wrote last."""
        reserved = self._net.reserved() if self._net is not None else 0
        loop.close()  # no goodbye and no "left": the host keeps its agent
        words = board_words(board).words
        # a stale writer may have stored a lower reservation: ours stands (exchange.SendCounter)
        words[COUNTER_WORD] = max(int(words[COUNTER_WORD]), reserved)
        log.info("board %s: the stalled holders replaced have stopped; the agent (pid %d) "
                 "sets the role up anew in term %d", board.name, os.getpid(), self._renewed)
        return self._take(board, self._renewed)

    def after_fork_in_child(self) -> None:
        self._thread = None
        self._stop = threading.Event()
        self._fd_lock = threading.Lock()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
