"""A signal ends a long-running command even when it lands while the main thread waits
on the very event it sets (shmhb pinger once hung on SIGTERM that way)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from ..conftest import ROOT

CHILD = textwrap.dedent("""
    import signal, threading
    from shmhb.cli.stopsignal import stop_on_signals

    stop = threading.Event()
    calls = []
    {install}
    print("ready", flush=True)
    n = 0
    while n < 300:
        # a tiny timeout: the main thread holds the event's lock a good part of the time,
        # which is when a handler that called stop.set() itself would deadlock
        if stop.wait(0.0001):
            stop.clear()
            n += 1
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the flood goes on while we exit
    print("done", len(calls) > 0, flush=True)
""")

HELPER = "stop_on_signals(stop, (signal.SIGUSR1,), calls.append)"


def run_child(install: str, deadline_s: float) -> tuple[int | None, str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD.format(install=install)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        end = time.monotonic() + deadline_s
        while p.poll() is None and time.monotonic() < end:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                break
        rc = p.poll()
        if rc is None:
            return None, ""
        return rc, p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_a_flood_of_signals_never_deadlocks_a_main_thread_waiting_on_the_event() -> None:
    rc, out = run_child(HELPER, deadline_s=60)
    assert rc == 0, "the child stopped answering signals: a handler deadlocked"
    assert out.split() == ["done", "True"]  # the callback ran, from the helper's thread


def test_other_signals_keep_their_handlers() -> None:
    # SIGINT left out of the set still raises KeyboardInterrupt in the main thread
    code = textwrap.dedent("""
        import os, signal, threading
        from shmhb.cli.stopsignal import stop_on_signals
        stop = threading.Event()
        stop_on_signals(stop, (signal.SIGTERM,))
        try:
            os.kill(os.getpid(), signal.SIGINT)
            stop.wait(10)
        except KeyboardInterrupt:
            print("interrupted", stop.is_set())
        os.kill(os.getpid(), signal.SIGTERM)
        print("stopped", stop.wait(10))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interrupted", "False", "stopped", "True"]
