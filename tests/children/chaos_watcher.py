"""``BOARD ADDRESS...``: watches every ADDRESS, prints ``watching`` and waits until
killed."""

import signal, sys
import shmhb
b = shmhb.Board.attach(sys.argv[1])
for ep in sys.argv[2:]:
    b.watch(ep)
print("watching", flush=True)
while True:
    signal.pause()
