"""``BOARD [SLOTS]``: creates a board of SLOTS (1024) slots and prints ``created``,
``nospace WHY`` where /dev/shm is too small, or ``error TYPE WHY``."""

import sys, shmhb
try:
    shmhb.Board.create(sys.argv[1], slots=int(sys.argv[2]) if len(sys.argv) > 2 else 1024)
except shmhb.BoardSpaceError as e:
    print("nospace", e, flush=True)
except BaseException as e:
    print("error", type(e).__name__, e, flush=True)
else:
    print("created", flush=True)
