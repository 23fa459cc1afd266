"""a process holding N registrations of a board, beating them until SIGTERM"""

import signal, sys, time
import shmhb
name, prefix, n, ip, port0 = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
b = shmhb.Board.attach(name)
hbs = [b.register(f"{prefix}{i}", endpoints=(f"{ip}:{port0 + i}",), agent=False) for i in range(n)]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("ready", flush=True)
while not stop:
    for hb in hbs:
        hb.beat()
    time.sleep(0.05)
