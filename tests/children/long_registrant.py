"""``BOARD KEY ENDPOINT``: registers KEY with ENDPOINT; prints ``registered`` (and
beats), or ``refused WHY`` and exits 0."""

import signal, sys
import shmhb
b = shmhb.Board.attach(sys.argv[1])
try:
    hb = b.register(sys.argv[2], endpoints=(sys.argv[3],), agent=False)
except shmhb.ShmhbError as e:
    print("refused", e, flush=True)
    sys.exit(0)
hb.start(0.05)
print("registered", flush=True)
signal.pause()
