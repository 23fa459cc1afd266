"""A draining engine: ``BOARD ENGINE_ID TIMEOUT_S [dfl]``.  One rank and its prefill
instance slot; a ``SigtermDrain`` in front of a SIGTERM handler that prints
``stopping``, leaves and exits 0 (with ``dfl``: in front of the default action).  It
owes what its stdin last said (lines ``owed N``; 1 at the start); prints ``ready``."""

import signal, sys
import shmhb
from shmhb.board.drain import DrainConfig, SigtermDrain
from shmhb.board.instances import register_instance

name, engine, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
dfl = sys.argv[4:] == ["dfl"]
b = shmhb.Board.attach(name)
hb = b.register(f"vllm/{engine}/dp0/tp0/pp0", endpoints=("127.0.0.5:31000",),
                agent=False).start(0.02)
register_instance(b, hb, "prefill", engine, serving="127.0.0.5:8000",
                  bootstrap="127.0.0.5:8998", interval_s=0.02)
owed = [1]


def stopping(signum, frame):
    print("stopping", flush=True)
    hb.close()
    raise SystemExit(0)


if not dfl:
    signal.signal(signal.SIGTERM, stopping)
assert SigtermDrain(b, engine, lambda: owed[0], DrainConfig(timeout_s=timeout_s)).install()
print("ready", flush=True)
for line in sys.stdin:  # the main thread blocked in a read, as an idle engine's is
    owed[0] = int(line.split()[1])
