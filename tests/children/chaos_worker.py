"""The chaos harness's worker: ``BOARD KEY ENDPOINT BEAT_S GAP_S AGENT(0|1)``.
Registers, beats by hand every BEAT_S and prints ``ready INC INDEX LAST_BEAT_NS
REGISTERED_NS``; ``gap FROM_NS TO_NS`` for every silence over GAP_S (the harness's
ground truth of a stop or a starvation); on SIGTERM closes its slot and prints
``closed NS``."""

import signal, sys, time
import shmhb
name, key, ep, beat_s, gap_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
agent = sys.argv[6] == "1"  # join the election for the agent role (embedded agent)
b = shmhb.Board.attach(name)
t_reg = time.monotonic_ns()  # the slot may read alive from here on, before register returns
try:
    hb = b.register(key, endpoints=(ep,), agent=agent)
except shmhb.KeyInUse:
    print("keyinuse", flush=True)
    sys.exit(3)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
hb.beat()
last = time.monotonic_ns()
print(f"ready {hb.incarnation} {hb.index} {last} {t_reg}", flush=True)
gap_ns = int(gap_s * 1e9)
while not stop:
    time.sleep(beat_s)
    if stop:
        break
    hb.beat()
    t = time.monotonic_ns()
    if t - last > gap_ns:  # stopped, or starved: the harness's ground truth of silence
        print(f"gap {last} {t}", flush=True)
    last = t
hb.close()
print(f"closed {time.monotonic_ns()}", flush=True)
