"""``BOARD [KEY]``: registers KEY (``victim``), beats every 50 ms, prints ``ready``
and waits for a signal."""

import signal, sys
import shmhb
b = shmhb.Board.attach(sys.argv[1])
hb = b.register(sys.argv[2] if len(sys.argv) > 2 else "victim", agent=False)
hb.start(0.05)
print("ready", flush=True)
signal.pause()
