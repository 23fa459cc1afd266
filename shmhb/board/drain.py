"""An engine's drain on SIGTERM: out of rotation at once, what it owes served, then the
host's own shutdown.

A scale-down or a rolling restart stops an engine with SIGTERM.  Left alone, the engine
exits at once: a prefill takes with it the KV its decodes have not read yet (they
recompute or fail), a decode the requests it runs.  ``SigtermDrain`` puts itself in
front of the process's SIGTERM handler (the serving stack's own, installed before the
connector is built, as vLLM's engine core does):

1. on the first SIGTERM it marks the engine's instance *draining* on the board
   (``register_drain``: a slot keyed ``drain/...``), so routers fed by ``shmhb feed``
   remove it within a poll and send it nothing new; the process goes on serving;
2. a thread of its own waits until the engine owes nothing (``owed()``: the caller's
   count of requests it runs and transfers it holds for its peers) or until
   ``timeout_s`` ran out;
3. then it hands the signal to the handler it replaced, in the main thread, as if the
   SIGTERM had arrived just now: the stack's own shutdown runs unchanged.

A second SIGTERM during the drain (an operator who will not wait, or the orchestrator's
escalation before its SIGKILL) hands over at once.  The drain slot closes at the
process's exit (``atexit``), after the stack's shutdown closed the engine's own slots,
so the instance never reads routable between the drain and the leave.

Correctness: ``owed()`` is read from the watcher thread while the main thread changes
what it counts.  The count is a snapshot at most one poll old, and only its reaching
zero ends the drain early; work that arrives after a zero was read (a router not yet
updated) is the case the router's removal covers: the drain slot went up first, so such
a request can only be one the router routed before it read the drain (the feeder's
poll, a few ms).  A verdict is never touched: the engine's ranks stay ALIVE while it
drains (it is alive), and leave as LEFT when the stack shuts down.

The pure part, ``decide``, says whether a drain is over; the rest is the signal and
thread plumbing.
"""

from __future__ import annotations

import atexit
import enum
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..errors import InvalidConfig, ShmhbError
from ..periodic import block_host_signals
from .handle import Board
from .heartbeat import Heartbeat
from .instances import board_instances, register_drain

__all__ = ["DrainConfig", "DrainEnd", "SigtermDrain", "decide"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainConfig:
    """``timeout_s``: the longest a drain waits for what the engine owes (0: no drain,
    SIGTERM acts at once as without shmhb); ``poll_s``: how often it looks."""

    timeout_s: float = 30.0
    poll_s: float = 0.01

    def __post_init__(self) -> None:
        for name, v, lo, hi in (("timeout_s", self.timeout_s, 0.0, 86400.0),
                                ("poll_s", self.poll_s, 0.001, 1.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise InvalidConfig(f"drain {name} must be a number of seconds in "
                                    f"[{lo}, {hi}], got {v!r}")


class DrainEnd(enum.Enum):
    """Why a drain ended."""

    DONE = "done"  # the engine owed nothing
    TIMEOUT = "timeout"  # timeout_s ran out first
    AGAIN = "again"  # a second SIGTERM


def decide(owed: int, now_ns: int, deadline_ns: int) -> DrainEnd | None:
    """Whether a drain is over: DONE once nothing is owed, TIMEOUT at the deadline,
    else None (go on serving)."""
    if owed <= 0:
        return DrainEnd.DONE
    if now_ns >= deadline_ns:
        return DrainEnd.TIMEOUT
    return None


_Handler = Callable[[int, FrameType | None], Any] | int | None


class SigtermDrain:
    """The drain of the engine whose ranks' keys carry ``engine_token`` (its instance is
    found on ``board`` by that token when the drain starts), owing ``owed()``.
    ``install()`` from the main thread, after the stack installed its own handler."""

    def __init__(self, board: Board, engine_token: str, owed: Callable[[], int],
                 config: DrainConfig = DrainConfig()) -> None:
        self.board = board
        self.engine_token = engine_token
        self.owed = owed
        self.config = config
        self._previous: _Handler = None
        self._installed = False
        self._started = False
        self._ended: DrainEnd | None = None
        self._handed = False
        self._slots: list[Heartbeat] = []
        self._main = threading.main_thread()

    @property
    def ended(self) -> DrainEnd | None:
        return self._ended

    def install(self) -> bool:
        """Put the drain in front of this process's SIGTERM handler.  False (logged)
        where it cannot: drains off (``timeout_s`` 0), or not called from the main
        thread (Python sets handlers there only)."""
        if self.config.timeout_s == 0:
            return False
        if threading.current_thread() is not self._main:
            log.warning("shmhb: engine %s built off the main thread: no drain on SIGTERM "
                        "(it stops at once, as without shmhb)", self.engine_token)
            return False
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        return True

    # -- in the main thread, from the signal -------------------------------------------------

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._ended is None and self._started:
            self._ended = DrainEnd.AGAIN
            log.warning("shmhb: engine %s: a second SIGTERM, stopping with %d owed",
                        self.engine_token, self.owed())
        if self._ended is not None:
            self._hand_over(signum, frame)
            return
        self._started = True
        self._mark_draining()
        threading.Thread(target=self._watch, name="shmhb-drain", daemon=True).start()

    def _mark_draining(self) -> None:
        try:
            mine = [i for i in board_instances(self.board, remote=False)
                    if i.engine == self.engine_token]
        except ShmhbError as e:
            log.warning("shmhb: engine %s: cannot read its instance off the board (%s): "
                        "draining without telling routers", self.engine_token, e)
            mine = []
        if not mine:
            log.warning("shmhb: engine %s has no instance slot: routers fed by shmhb learn "
                        "of its drain only when it leaves", self.engine_token)
        for inst in mine:
            try:
                self._slots.append(register_drain(self.board, inst.key))
            except (ShmhbError, ValueError) as e:  # KeyInUse: an operator drains it already
                log.info("shmhb: engine %s: no drain slot of its own (%s)", self.engine_token, e)
        if self._slots:
            atexit.register(self._close_slots)
        log.info("shmhb: engine %s draining on SIGTERM: %d owed, at most %.1f s",
                 self.engine_token, self.owed(), self.config.timeout_s)

    def _hand_over(self, signum: int, frame: FrameType | None) -> None:
        """Run what SIGTERM would have run without us, now."""
        self._handed = True
        prev = self._previous
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        elif prev in (signal.SIG_DFL, None):
            signal.raise_signal(signal.SIGTERM)  # the default action: the process ends

    def _close_slots(self) -> None:
        for hb in self._slots:
            hb.close()

    # -- the watcher thread ----------------------------------------------------------------

    def _watch(self) -> None:
        block_host_signals()  # the hand-over's SIGTERM goes to the main thread
        t0 = time.monotonic_ns()
        deadline = t0 + int(self.config.timeout_s * 1e9)
        while True:
            end = decide(self.owed(), time.monotonic_ns(), deadline)
            if end is not None or self._ended is not None:
                break
            time.sleep(self.config.poll_s)
        if self._ended is not None:  # a second SIGTERM handed over already
            return
        assert end is not None
        self._ended = end
        log_fn = log.info if end is DrainEnd.DONE else log.warning
        log_fn("shmhb: engine %s drained (%s) after %.3f s, %d owed: stopping",
               self.engine_token, end.value, (time.monotonic_ns() - t0) / 1e9, self.owed())
        # To the main thread: a signal to the process could be taken by a thread of the
        # stack's that does not block it, leaving a main thread blocked in a read asleep.
        # (Not if a second SIGTERM handed over meanwhile: the stack's handler runs once.)
        if not self._handed:
            signal.pthread_kill(self._main.ident or 0, signal.SIGTERM)
