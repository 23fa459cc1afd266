"""``BOARD``: registers ``parent``, binds ``hb.beat`` once and forks; the child keeps
calling the bound beat and prints ``ready child-beat-allowed`` or
``ready child-beat-refused``; the parent hangs without beating."""

import os, sys, time
import shmhb
b = shmhb.Board.attach(sys.argv[1])
hb = b.register("parent", agent=False)
beat = hb.beat          # bound once, as a step loop does
beat()
pid = os.fork()
if pid == 0:
    said = False
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        try:
            beat()       # the child keeps calling what its parent bound
            what = b"child-beat-allowed"
        except shmhb.HeartbeatClosed:
            what = b"child-beat-refused"
        if not said:
            os.write(1, b"ready " + what + b"\n")
            said = True
        time.sleep(0.01)
    os._exit(0)
time.sleep(120)          # the parent hangs: it never beats again, but lives on
