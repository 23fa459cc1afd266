"""A function called every few seconds from one daemon thread: the background half of
``Heartbeat.start`` and ``LinkReaper.start``; and the signal mask every thread shmhb starts
in a host's process sets first."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

#: The faults a thread raises on itself: never blocked (a blocked SIGSEGV kills at once).
_SYNCHRONOUS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
                          signal.SIGTRAP, signal.SIGKILL, signal.SIGSTOP})


def block_host_signals() -> None:
    """Block, in the calling thread, every signal a host process may handle (SIGINT, SIGTERM,
    SIGCHLD, ...).  Python runs signal handlers in the main thread only, and the kernel hands
    a signal sent to the process to any thread that does not block it: one handed to a
    thread of ours leaves a main thread blocked in ``signal.pause()``, ``select`` or a read
    asleep with its handler pending, so a worker's Ctrl-C or ``kill`` went unanswered.
    With every thread we start blocking them, they reach the main thread, as in a process
    without us."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()) - _SYNCHRONOUS)


class Periodic:
    """Calls ``fn`` every ``interval_s`` from one daemon thread until ``stop()``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def start(self, fn: Callable[[], object], interval_s: float) -> bool:
        """Start the thread; False if it runs already."""
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        with self._lock:
            if self._thread is not None:
                return False
            self._stop = stop = threading.Event()  # each run its own: a late stop() of
            t = threading.Thread(target=_run, args=(fn, interval_s, stop),  # one never ends the next
                                 name=self.name, daemon=True)
            self._thread = t
        t.start()
        return True

    def stop(self) -> None:
        """Stop the thread and wait for it (unless called from it)."""
        with self._lock:
            t, self._thread = self._thread, None
            stop = self._stop
        if t is not None:
            stop.set()
            if t is not threading.current_thread():
                t.join()

    def after_fork_in_child(self) -> None:
        """Threads do not survive fork: forget the parent's."""
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()


def _run(fn: Callable[[], object], interval_s: float, stop: threading.Event) -> None:
    block_host_signals()
    wait = stop.wait
    while not wait(interval_s):
        fn()
