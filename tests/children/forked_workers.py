"""``BOARD N IP``: forks N workers (``burst-I`` at ``IP:31000+I``) in one process group
led by the first; prints ``ready GROUP`` once all registered, ``reaped`` once the
test killed the group."""

import os, signal, sys
import shmhb
name, n, ip = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r, w = os.pipe()
kids = []
for i in range(n):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        b = shmhb.Board.attach(name)
        hb = b.register(f"burst-{i}", endpoints=(f"{ip}:{31000 + i}",), agent=False)
        hb.start(0.05)
        os.write(w, b"x")
        while True:
            signal.pause()
    kids.append(pid)
    if i == 0:
        os.setpgid(pid, pid)
    else:
        os.setpgid(pid, kids[0])
os.close(w)
got = 0
while got < n:
    got += len(os.read(r, n))
print("ready", kids[0], flush=True)
for _ in kids:  # reap the workers when the test kills their group
    os.wait()
print("reaped", flush=True)
signal.pause()
