"""Ending a long-running command on a signal without taking a lock in a signal handler.

Why not ``signal.signal(SIGTERM, lambda *_: stop.set())``: Python runs a signal handler
in the main thread, between two bytecodes of whatever that thread was doing.  When the
main thread is itself in ``stop.wait(timeout)``, it holds the event's internal lock (a
plain, non-reentrant ``Lock``) for a moment each time the wait times out; a handler that
runs in that moment and calls ``stop.set()`` waits for that lock forever, held by the
very frame it interrupted.  The process then ignores every later SIGTERM until SIGKILL.
``shmhb pinger`` hung that way in CI: stopped with SIGSTOP, continued, then sent SIGTERM
-- its half-second wait had timed out while it was stopped, so the signal landed in the
window.

So the Python-level handler here does nothing at all.  The interpreter's C-level handler
writes the signal's number into the wakeup socket (``signal.set_wakeup_fd``, an
async-signal-safe ``write``), and one daemon thread reads it and calls back from an
ordinary thread: setting an event there only waits, briefly, for whoever holds its lock.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

__all__ = ["stop_on_signals"]

_lock = threading.Lock()
_targets: dict[int, Callable[[int], None]] = {}
_reader: socket.socket | None = None


def _ignore(_signum: int, _frame: object) -> None:
    """The Python-level handler: nothing, so that nothing can deadlock.  Installing it
    keeps the signal from killing the process and makes the interpreter write its number
    into the wakeup socket."""


def stop_on_signals(stop: threading.Event, signals: Iterable[int] = (signal.SIGTERM,),
                    on_signal: Callable[[int], None] | None = None) -> None:
    """Set ``stop`` when one of ``signals`` arrives (after calling ``on_signal(signum)``,
    from a helper thread, if given).  Call from the main thread (``set_wakeup_fd`` works
    only there); a later call replaces the earlier targets of the same signals.  Other
    signals keep their handlers: SIGINT left out still raises KeyboardInterrupt."""
    global _reader

    def fire(signum: int) -> None:
        try:
            if on_signal is not None:
                on_signal(signum)
        finally:
            stop.set()  # whatever the callback did

    with _lock:
        if _reader is None:
            r, w = socket.socketpair()
            r.setblocking(True)
            w.setblocking(False)  # the C handler must never block; a full buffer drops bytes
            signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
            _reader = r
            threading.Thread(target=_dispatch, args=(r, w), name="shmhb-signals",
                             daemon=True).start()
        for s in signals:
            _targets[int(s)] = fire
            signal.signal(s, _ignore)


def _dispatch(r: socket.socket, _w: socket.socket) -> None:
    # ``_w`` is held here so that the write end lives as long as the reader.
    while True:
        try:
            data = r.recv(64)
        except InterruptedError:  # pragma: no cover - recv is retried by PEP 475
            continue
        except OSError as e:  # the socket was closed under us: nothing more will come
            log.debug("signal wakeup socket closed: %s", e)
            return
        if not data:
            return
        for signum in data:
            fn = _targets.get(signum)
            if fn is None:
                continue  # a signal with some other Python handler (e.g. SIGINT's default)
            try:
                fn(signum)
            except Exception:
                # A callback that fails must not end the thread: the next SIGTERM would
                # then be ignored for good.
                log.exception("handling signal %d failed", signum)
