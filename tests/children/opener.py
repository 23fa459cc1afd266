"""``BOARD KEY``: prints ``up``; on the first stdin line opens the board (creating or
repairing it), registers KEY and prints ``ok BOARD_INC INDEX`` (or ``error TYPE:
WHY``); keeps the slot until the next line."""

import sys
import shmhb
name, key = sys.argv[1], sys.argv[2]
print("up", flush=True)
sys.stdin.readline()  # all start together
try:
    b = shmhb.Board.open(name, create=True)
    hb = b.register(key, agent=False)
    hb.beat()
    print(f"ok {b.board_inc} {hb.index}", flush=True)
except shmhb.ShmhbError as e:
    print(f"error {type(e).__name__}: {e}", flush=True)
sys.stdin.readline()  # keep the slot until told
