"""``BOARD N``: registers ``rank-00`` .. ``rank-NN`` in one process, beating every 50
ms; prints ``ready``; exits on SIGTERM."""

import signal, sys, shmhb
b = shmhb.Board.attach(sys.argv[1])
hbs = [b.register(f"rank-{i:02d}", agent=False).start(0.05) for i in range(int(sys.argv[2]))]
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
signal.pause()
