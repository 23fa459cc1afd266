"""A worker: ``BOARD KEY INTERVAL_S AGENT(0|1) [ENDPOINTS,...]``.  Registers KEY,
beats every INTERVAL_S, prints ``ready INCARNATION INDEX`` (``keyinuse`` and exit 3
where the key is held), and closes its slot on SIGTERM (prints ``closed``)."""

import signal, sys
import shmhb
name, key, interval, agent = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
eps = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 and sys.argv[5] else ()
b = shmhb.Board.attach(name)
try:
    hb = b.register(key, endpoints=eps, agent=agent)
except shmhb.KeyInUse:
    print("keyinuse", flush=True)
    sys.exit(3)
hb.start(interval)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print(f"ready {hb.incarnation} {hb.index}", flush=True)
while not stop:
    signal.pause()
hb.close()
print("closed", flush=True)
