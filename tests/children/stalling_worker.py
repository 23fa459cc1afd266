"""a worker whose embedded agent logs to stderr; "stall" on stdin makes its main thread
block in read(2) called through ctypes.PyDLL, which keeps the GIL held for the call"""

import ctypes, logging, sys
import shmhb
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
b = shmhb.Board.attach(sys.argv[1])
hb = b.register(sys.argv[2], agent=True).start(0.02)
print("ready", flush=True)
libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
for line in sys.stdin:
    if line.strip() == "stall":
        buf = ctypes.create_string_buffer(1)
        libc.read(0, buf, 1)  # until the test writes a byte: GIL held throughout
        print("resumed", flush=True)
