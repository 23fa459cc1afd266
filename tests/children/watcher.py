"""``BOARD ADDRESS``: watches ADDRESS, prints ``ready`` and waits for a signal."""

import signal, sys
import shmhb
b = shmhb.Board.attach(sys.argv[1])
b.watch(sys.argv[2])
print("ready", flush=True)
signal.pause()
