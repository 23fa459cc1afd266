"""An engine: ``BOARD ENGINE_ID ROLE NRANKS [IP]``.  Its ranks and its instance slot
(``shmhb.board.instances``); prints ``ready INCARNATION``; leaves on SIGTERM."""

import signal, sys
import shmhb
from shmhb.board.instances import register_instance
name, engine, role, nranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ip = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.5"
b = shmhb.Board.attach(name)
hbs = [b.register(f"vllm/{engine}/dp0/tp{i}/pp0", endpoints=(f"{ip}:{31000 + i}",),
                  agent=False).start(0.02) for i in range(nranks)]
inst = register_instance(b, hbs[0], role, engine, serving=f"{ip}:8000",
                         bootstrap=f"{ip}:8998" if role == "prefill" else None,
                         interval_s=0.02)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print(f"ready {inst.incarnation}", flush=True)
while not stop:
    signal.pause()
for hb in hbs:
    hb.close()
