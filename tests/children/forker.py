"""``BOARD``: registers ``parent`` and forks; the child tries to beat and prints
``child-beat-allowed`` or ``child-beat-refused``; the parent prints ``ready PID``."""

import os, sys, time
import shmhb
b = shmhb.Board.attach(sys.argv[1])
hb = b.register("parent", agent=False)
hb.start(0.02)
pid = os.fork()
if pid == 0:
    try:
        hb.beat()
        os.write(1, b"child-beat-allowed\n")
    except shmhb.HeartbeatClosed:
        os.write(1, b"child-beat-refused\n")
    time.sleep(120)
    os._exit(0)
os.write(1, f"ready {pid}\n".encode())
time.sleep(120)
