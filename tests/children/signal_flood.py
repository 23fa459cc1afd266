"""Waits on an event that ``stop_on_signals`` sets on SIGUSR1 while the test floods it
with SIGUSR1: prints ``ready``, then ``done True`` once it saw 300 stops (``True``: the
callback ran).  The wait's tiny timeout keeps the event's lock held by the main thread
a good part of the time, which is when a handler that called ``stop.set()`` itself
would deadlock."""

import signal, threading
from shmhb.cli.stopsignal import stop_on_signals

stop = threading.Event()
calls: list[int] = []
stop_on_signals(stop, (signal.SIGUSR1,), calls.append)
print("ready", flush=True)
n = 0
while n < 300:
    if stop.wait(0.0001):
        stop.clear()
        n += 1
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the flood goes on while we exit
print("done", len(calls) > 0, flush=True)
