"""``BOARD ENDPOINTS``: registers 60 slots of the largest size a board holds (63-byte
keys, ENDPOINTS on each), beats each once, prints ``ready`` and sleeps: killed, they
are 60 dead slots."""

import sys, time
import shmhb
b = shmhb.Board.attach(sys.argv[1])
eps = tuple(sys.argv[2].split(","))
hbs = [b.register(f"dead-{i:03d}-" + "k" * 54, endpoints=eps, agent=False) for i in range(60)]
for hb in hbs:
    hb.beat()
print("ready", flush=True)
time.sleep(600)
