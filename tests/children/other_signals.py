"""``stop_on_signals`` for SIGTERM only: SIGINT, left out, still raises
KeyboardInterrupt in the main thread.  Prints ``interrupted False stopped True``."""

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
