"""``BOARD KEY ENDPOINTS``: prints ``started``; registers KEY on the first stdin line
and prints ``ready INCARNATION``; closes its slot on SIGTERM (``closed``)."""

import signal, sys
import shmhb
name, key, eps = sys.argv[1], sys.argv[2], tuple(e for e in sys.argv[3].split(",") if e)
b = shmhb.Board.attach(name)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("started", flush=True)
sys.stdin.readline()
hb = b.register(key, endpoints=eps, agent=False)
hb.start(0.05)
print(f"ready {hb.incarnation}", flush=True)
while not stop:
    signal.pause()
hb.close()
print("closed", flush=True)
