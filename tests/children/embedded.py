"""``BOARD KEY``: a worker with an embedded agent: registers KEY (``agent=True``),
beats every 50 ms, prints ``ready`` and waits for a signal."""

import signal, sys
import shmhb
b = shmhb.Board.attach(sys.argv[1])
hb = b.register(sys.argv[2], agent=True).start(0.05)
print("ready", flush=True)
signal.pause()
